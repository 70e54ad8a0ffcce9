#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the main job: a multi-user chat workload on
# a real vLLM engine without and with kvoffload, printing what offloading saved, plus a
# no-reuse workload for kvoffload's overhead. vLLM's log goes to a file (--verbose: terminal).
#   scripts/demo.sh                          # a random-weight Llama built locally
#   scripts/demo.sh --model /path/to/model   # your own model (--help: workload, cache sizes)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$REPO/scripts/setup.sh"
exec "$REPO/.venv/bin/python" "$REPO/scripts/demo.py" "$@"
