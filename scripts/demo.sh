#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the main job: the same multi-user workload
# on a real vLLM engine without and with kvoffload, printing what offloading saved.
#   scripts/demo.sh                      # tiny random-weight Llama built locally
#   scripts/demo.sh /path/to/hf-model    # your own model (see --help for pool size etc.)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$REPO/scripts/setup.sh"
exec "$REPO/.venv/bin/python" "$REPO/scripts/demo.py" "$@"
