#!/usr/bin/env python
"""Copy runs per step in vLLM's default GPU KV layout and in the block-outer layout
kvoffload asks vLLM for (``kv_cache_layout``, default ``"auto"``).

vLLM >= 0.32 lays every layer's KV cache out in one allocation; the layout names its axes
(L layer, B block, H head, N token, C content). FlashAttention's default, ``LBNHC``, puts
each layer's blocks together, so one block of a 32-layer model is 32 separate byte runs;
``BLNHC`` puts a block of every layer side by side, one run. Each run is one copy
descriptor (one ``cuMemcpyBatchAsync`` entry on a GPU). The tensors here are built by vLLM's
own ``create_kv_cache_views`` in host memory, and each step stores the new blocks of eight
requests (two consecutive blocks each, at random GPU block ids) through kvoffload's worker.
Printed per layout: regions, copy runs per step, bytes per run, and the wall time of the
host-memory copies (on this machine a memcpy; on a GPU the runs become DMA descriptors).

    .venv/bin/python benches/kv_layouts.py --json docs/benchmarks/kv_layouts.json
"""

from __future__ import annotations

import argparse
import os
import random
import struct
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, describe, machine, summary_ns, write_json

sys.path.insert(0, str(REPO / "tests"))
from layout_views import vllm_kv_caches

LAYOUTS = ("LBNHC", "BLNHC")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--gpu-blocks", type=int, default=64)
    p.add_argument("--requests", type=int, default=8, help="requests storing per step")
    p.add_argument("--blocks-per-request", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CI smoke test)")
    args = p.parse_args()
    if args.smoke:
        args.layers, args.kv_heads, args.head_size, args.steps = 4, 2, 32, 3
    return args


def ids(xs: list[int]) -> bytes:
    return struct.pack(f"<{len(xs)}I", *xs)


def step_gpu_blocks(rng: random.Random, args: argparse.Namespace) -> list[int]:
    """The step's new blocks: each request's run of consecutive ids, at random places."""
    per = args.blocks_per_request
    starts = rng.sample(range(0, args.gpu_blocks - per, per), args.requests)
    return sorted(b for s in starts for b in range(s, s + per))


def run_layout(layout: str, args: argparse.Namespace) -> dict[str, Any]:
    from kvoffload import parse_config
    from kvoffload.metadata import KVOffloadMetadata
    from kvoffload.worker import OffloadWorker

    kv, raw, page = vllm_kv_caches(
        layout,
        num_layers=args.layers,
        num_blocks=args.gpu_blocks,
        num_kv_heads=args.kv_heads,
        head_size=args.head_size,
    )
    per_step = args.requests * args.blocks_per_request
    block_bytes = args.layers * page
    config, _ = parse_config({"cpu_bytes_to_use": per_step * block_bytes}, 1)
    worker = OffloadWorker(config, num_gpu_blocks=args.gpu_blocks)
    worker.register_kv_caches(kv)
    engine = worker.engine
    assert engine is not None
    rng = random.Random(args.seed)
    runs: list[int] = []
    times: list[int] = []
    try:
        for tid in range(1, args.steps + 1):
            before = dict(engine.stats())["runs_submitted"]
            gpu = step_gpu_blocks(rng, args)
            t0 = time.perf_counter_ns()
            worker.submit(KVOffloadMetadata(store=(tid, ids(gpu), ids(list(range(per_step))), [])))
            while True:
                worker.poll()
                meta = worker.take_worker_meta()
                if meta is not None:
                    assert meta.ok == [True], meta
                    break
            times.append(time.perf_counter_ns() - t0)
            runs.append(dict(engine.stats())["runs_submitted"] - before)
    finally:
        worker.shutdown()
    del raw
    mean_runs = sum(runs) / len(runs)
    return {
        "layout": layout,
        "regions": len(engine_regions(kv, args.gpu_blocks)),
        "blocks_per_step": per_step,
        "block_bytes": block_bytes,
        "runs_per_step": mean_runs,
        "bytes_per_run": per_step * block_bytes / mean_runs,
        "step": summary_ns(times),
    }


def engine_regions(kv: dict[str, Any], num_blocks: int) -> list[Any]:
    from kvoffload.vllm_adapter import kv_regions

    return kv_regions(kv, num_blocks)


def main() -> None:
    args = parse_args()
    import torch  # noqa: F401  (recorded in the machine description)
    import vllm  # noqa: F401

    rows = [run_layout(layout, args) for layout in LAYOUTS]
    m = machine()
    print(f"machine: {describe(m)}")
    print(
        f"model: {args.layers} layers, {args.kv_heads} KV heads of {args.head_size}, "
        f"fp16, 16-token blocks ({rows[0]['block_bytes'] / 2**20:.2f} MiB per block); "
        f"{rows[0]['blocks_per_step']} blocks stored per step, {args.steps} steps"
    )
    print(f"{'layout':<8} {'regions':>8} {'runs/step':>10} {'KiB/run':>9} {'step ms':>9}")
    for r in rows:
        print(
            f"{r['layout']:<8} {r['regions']:>8} {r['runs_per_step']:>10.1f} "
            f"{r['bytes_per_run'] / 1024:>9.0f} {r['step']['mean_us'] / 1e3:>9.2f}"
        )
    fewer = rows[0]["runs_per_step"] / rows[1]["runs_per_step"]
    print(f"block-outer layout: {fewer:.1f}x fewer copy runs per step")
    write_json(
        args.json,
        {
            "benchmark": "kv_layouts",
            "machine": m,
            "params": {k: v for k, v in vars(args).items() if k != "json"},
            "rows": rows,
            "fewer_runs": fewer,
        },
    )


if __name__ == "__main__":
    main()
