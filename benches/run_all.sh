#!/usr/bin/env bash
# Runs every benchmark and refreshes the figures under docs/ (see benches/README.md).
#   benches/run_all.sh            # full sizes (about 15 minutes on a 2-core machine)
#   benches/run_all.sh --smoke    # tiny sizes: checks that everything runs (about 2 minutes)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
"$REPO/scripts/setup.sh"
PY="$REPO/.venv/bin/python"
OUT="$REPO/docs/benchmarks"
smoke=()
crit=(--warm-up-time 1 --measurement-time 2)
if [[ "${1:-}" == "--smoke" ]]; then
    smoke=(--smoke)
    crit=(--test)
    OUT="$(mktemp -d)"
fi
mkdir -p "$OUT"
step() { echo; echo "=== $* ==="; }

step "cargo bench -p offload-core (index, planner, transfer)"
for b in index planner transfer; do
    cargo bench -p offload-core --bench "$b" -- "${crit[@]}" 2>&1 | tee "$OUT/cargo_bench_$b.txt" |
        grep -E "ns/|us/|thrpt|Testing|Success" || true
done

step "index: vLLM BlockPool vs kvoffload"
"$PY" benches/compare_index.py "${smoke[@]}" --json "$OUT/compare_index.json"
"$PY" benches/compare_index.py "${smoke[@]}" --order grouped --json "$OUT/compare_index_grouped.json"

step "copy runs per step by vLLM KV layout"
"$PY" benches/kv_layouts.py "${smoke[@]}" --json "$OUT/kv_layouts.json"

step "scheduler: SimpleCPUOffloadConnector vs kvoffload"
"$PY" benches/compare_scheduler.py "${smoke[@]}" --quiet --json "$OUT/compare_scheduler.json"
"$PY" benches/compare_scheduler.py "${smoke[@]}" --trace churn --quiet \
    --json "$OUT/compare_scheduler_churn.json"
"$PY" benches/compare_scheduler.py "${smoke[@]}" --async-scheduling --repeat 1 --quiet \
    --json "$OUT/compare_scheduler_async.json"
"$PY" benches/compare_scheduler.py "${smoke[@]}" --trace churn --async-scheduling --repeat 1 \
    --quiet --json "$OUT/compare_scheduler_churn_async.json"

step "end to end: real vLLM engine"
"$PY" benches/e2e.py "${smoke[@]}" --json "$OUT/e2e.json"

step "nothing to reuse: real vLLM engine"
"$PY" benches/noreuse.py "${smoke[@]}" --json "$OUT/noreuse.json"

step "plot"
"$PY" scripts/plot_benchmarks.py --index "$OUT/compare_index.json" \
    --scheduler "$OUT/compare_scheduler.json" \
    --out "$([[ ${#smoke[@]} -gt 0 ]] && echo "$OUT/benchmarks.png" || echo docs/benchmarks.png)"

if [[ ${#smoke[@]} -eq 0 ]]; then
    step "README.md and benches/README.md from the new results"
    "$PY" scripts/render_docs.py
fi
