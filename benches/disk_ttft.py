#!/usr/bin/env python
"""Time to first token when a long prompt prefix comes from the disk tier, beside a local
CPU hit and recomputation, on the demo's model (vLLM's CPU backend).

Each user sends one prompt: a long document and a question, nothing shared between
users. Runs, each on a fresh engine, one at a time:

- ``recompute``: plain vLLM computes every prompt (also the reference outputs);
- ``cpu``: kvoffload; the prompts run once, vLLM's own prefix cache is dropped, and the
  second pass is measured (the prefix comes back from the CPU pool);
- ``disk``: Simple's disk config (``kv_offload_backend: "disk"``, no CPU budget: host
  memory only stages) with ``disk_persist``: a first engine computes the prompts and
  writes their blocks to disk; a second, fresh engine is measured: its prefixes come from
  the files the first one left (``O_DIRECT`` reads into staging CPU blocks, then loads).

    .venv/bin/python benches/disk_ttft.py --dir /path/on/the/disk \\
        --json docs/benchmarks/disk_ttft.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, add_chat_args, chat_workload, describe, machine, write_json
from remote_tier import compared, tier_stats

sys.path.insert(0, str(REPO / "scripts"))
from demo import demo_model, quiet
from demo_runner import offload_config, run


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_chat_args(p, "the CPU pool of the cpu run")
    p.add_argument("--disk-mib", type=float, default=512, help="disk_capacity_bytes")
    p.add_argument("--threads", type=int, default=1, help="OpenMP threads")
    p.add_argument("--dir", help="where the disk files go (default: a temp dir)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--log", type=Path, help="vLLM's log (default: the terminal)")
    return p.parse_args()


def disk_config(path: Path, capacity: int) -> dict[str, Any]:
    cfg = offload_config(0)
    cfg["kv_connector_extra_config"] = {
        "kv_offload_backend": "disk",
        "disk_path": str(path / "kv"),
        "disk_capacity_bytes": capacity,
        "disk_persist": True,
    }
    return cfg


def main() -> int:
    args = parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    directory = Path(tempfile.mkdtemp(prefix="kvoffload-disk-ttft-", dir=args.dir))
    try:
        with quiet(args.log) as term:
            model, vocab, desc = demo_model()
            import torch  # noqa: F401
            import vllm  # noqa: F401  (versions in the machine line)

            w, spec = chat_workload(args, model)
            m = machine()
            term.write(f"machine: {describe(m)}\nmodel: {desc}\n")
            runs = {"recompute": run(spec, None, w, vocab)}
            runs["cpu"] = run(spec, offload_config(int(args.cpu_mib * 2**20)), w, vocab, warm=True)
            cfg = disk_config(directory, int(args.disk_mib * 2**20))
            run(spec, cfg, w, vocab)
            runs["disk"] = run(spec, cfg, w, vocab, extra=tier_stats)
            results = compared(runs, term)
            worker = runs["disk"]["extra"]["worker"]
            disk = {k: v for k, v in worker.items() if k.startswith("disk_")}
            ok = all(s["identical"] for s in results.values())
            hit = disk.get("disk_reads", 0) > 0
            write_json(
                args.json,
                {
                    "benchmark": "disk_ttft",
                    "machine": m,
                    "model_description": desc,
                    "params": {k: v for k, v in vars(args).items() if k not in ("json", "log")},
                    "results": results,
                    "disk": disk,
                },
            )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return 0 if ok and hit else 1


if __name__ == "__main__":
    sys.exit(main())
