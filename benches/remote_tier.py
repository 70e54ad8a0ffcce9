#!/usr/bin/env python
"""Time to first token when a long prompt prefix comes from the shared Redis tier, beside a
local CPU hit and recomputation, on the demo's model (vLLM's CPU backend).

Each user sends one prompt: a long document (``--system-tokens``) and a question, nothing
shared between users. Four runs, each on a fresh engine, one at a time:

- ``recompute``: plain vLLM computes every prompt (also the reference outputs);
- ``local``: kvoffload; the prompts run once, vLLM's own prefix cache is dropped, and the
  second pass is measured (the prefix comes back from this engine's CPU pool);
- ``remote``: a first kvoffload engine with ``remote_url`` computes the prompts and writes
  their blocks to the cluster (written behind, flushed at shutdown); a second, fresh engine
  (an empty CPU pool, as on another replica) is measured: its prefixes come from Redis.

A 3-master Redis Cluster is started on loopback with ``scripts/redis_cluster.sh`` unless
``--redis-url`` names one. Printed: TTFT mean / p50 / p90 per run, tokens served from the
connector, and whether outputs are token-identical to ``recompute``.

    .venv/bin/python benches/remote_tier.py --json docs/benchmarks/remote_tier.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, add_chat_args, chat_workload, describe, machine, write_json

sys.path.insert(0, str(REPO / "scripts"))
from demo import demo_model, quiet
from demo_runner import offload_config, run

CLUSTER = REPO / "scripts" / "redis_cluster.sh"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_chat_args(p, "the CPU pool")
    p.add_argument("--threads", type=int, default=1, help="OpenMP threads")
    p.add_argument("--redis-url", help="an existing cluster (default: start one on loopback)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--log", type=Path, help="vLLM's log (default: the terminal)")
    p.add_argument("--smoke", action="store_true", help="a tiny workload (CI smoke test)")
    args = p.parse_args()
    if args.smoke:
        args.users, args.system_tokens, args.output_tokens = 2, 300, 2
    return args


def start_cluster() -> tuple[str, str]:
    out = subprocess.run(
        ["bash", str(CLUSTER), "start"], check=True, capture_output=True, text=True
    ).stdout
    env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return env["REDIS_CLUSTER_DIR"], env["REDIS_CLUSTER_URL"]


def stop_cluster(directory: str) -> None:
    subprocess.run(["bash", str(CLUSTER), "stop", directory], check=False, capture_output=True)


def remote_config(cpu_bytes: int, url: str, namespace: str) -> dict[str, Any]:
    cfg = offload_config(cpu_bytes)
    cfg["kv_connector_extra_config"].update(remote_url=url, remote_namespace=namespace)
    return cfg


def tier_stats(llm: Any) -> dict[str, Any]:
    """The remote tier's counters on both sides, and a CPU block's bytes (in-process engine:
    the worker's connector lives in this process)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    sched = llm.llm_engine.engine_core.engine_core.scheduler.get_kv_connector()
    worker = get_kv_transfer_group().offload_worker
    tier = worker.tier
    return {
        "planner": dict(sched.offload_scheduler.planner.stats()),
        "worker": dict(tier.stats()) if tier is not None else {},
        "block_bytes": worker.engine.cpu_block_bytes,
    }


def fetch_figures(r: dict[str, Any]) -> dict[str, Any]:
    """What the remote run's fetches moved: bytes, round trips, time waiting, bytes/s."""
    w = r["extra"]["worker"]
    seconds = w.get("remote_get_micros", 0) / 1e6
    return {
        "remote_hit_tokens": r["extra"]["planner"].get("remote_hit_tokens", 0),
        "fetched_blocks": r["extra"]["planner"].get("remote_fetched_blocks", 0),
        "fetch_round_trips": w.get("remote_get_round_trips", 0),
        "fetch_bytes": w.get("remote_bytes_read", 0),
        "fetch_seconds": seconds,
        "fetch_bytes_per_s": w.get("remote_bytes_read", 0) / seconds if seconds else 0.0,
        "kv_bytes_per_token": r["extra"]["block_bytes"] / r["block_size"],
        "block_size": r["block_size"],
    }


def summary(r: dict[str, Any]) -> dict[str, Any]:
    ttft = sorted(r["ttft_s"])
    return {
        "ttft_mean_ms": 1e3 * statistics.fmean(ttft),
        "ttft_p50_ms": 1e3 * ttft[len(ttft) // 2],
        "ttft_p90_ms": 1e3 * ttft[min(len(ttft) - 1, round(0.9 * (len(ttft) - 1)))],
        "prompt_tokens": r["prompt_tokens"],
        "connector_hit_tokens": r["cpu_hit_tokens"],
        "gpu_hit_tokens": r["gpu_hit_tokens"],
        "recomputed_tokens": r["recomputed_tokens"],
        "wall_s": r["wall_s"],
    }


def compared(runs: dict[str, dict[str, Any]], term: Any) -> dict[str, dict[str, Any]]:
    """Each run's :func:`summary`, with whether its outputs equal the ``"recompute"``
    run's, each written as a line to ``term``."""
    reference = runs["recompute"]["outputs"]
    results = {
        name: {**summary(r), "identical": r["outputs"] == reference} for name, r in runs.items()
    }
    for name, s in results.items():
        term.write(
            f"{name:>10}: TTFT mean {s['ttft_mean_ms']:8.1f} ms (p50 "
            f"{s['ttft_p50_ms']:.0f}, p90 {s['ttft_p90_ms']:.0f}); prompt tokens "
            f"{s['prompt_tokens']:,}: from kvoffload {s['connector_hit_tokens']:,}, "
            f"recomputed {s['recomputed_tokens']:,}; identical: "
            f"{'yes' if s['identical'] else 'NO'}\n"
        )
    return results


def main() -> int:
    args = parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    cluster_dir = None
    url = args.redis_url
    if url is None:
        cluster_dir, url = start_cluster()
    try:
        with quiet(args.log) as term:
            model, vocab, desc = demo_model()
            import torch  # noqa: F401
            import vllm  # noqa: F401  (versions in the machine line)

            w, spec = chat_workload(args, model)
            cpu = int(args.cpu_mib * 2**20)
            namespace = f"bench-{os.getpid()}-{time.time_ns()}"
            m = machine()
            term.write(f"machine: {describe(m)}\nmodel: {desc}\n")
            runs = {"recompute": run(spec, None, w, vocab)}
            term.write("recompute done\n")
            runs["local"] = run(spec, offload_config(cpu), w, vocab, warm=True)
            term.write("local done\n")
            run(spec, remote_config(cpu, url, namespace), w, vocab)
            runs["remote"] = run(
                spec, remote_config(cpu, url, namespace), w, vocab, extra=tier_stats
            )
            term.write("remote done\n")
            results = compared(runs, term)
            fetch = fetch_figures(runs["remote"])
            term.write(
                f"remote fetches: {fetch['fetch_bytes']:,} bytes in "
                f"{fetch['fetch_round_trips']} round trips, {fetch['fetch_seconds']:.3f} s "
                f"waiting ({fetch['fetch_bytes_per_s'] / 2**20:.0f} MiB/s); "
                f"{fetch['kv_bytes_per_token']:,.0f} KV bytes per token\n"
            )
            ok = all(s["identical"] for s in results.values())
            hit = results["remote"]["connector_hit_tokens"] > 0 and fetch["remote_hit_tokens"] > 0
            if not hit:
                term.write("the remote run served nothing from the cluster\n")
            write_json(
                args.json,
                {
                    "benchmark": "remote_tier",
                    "machine": m,
                    "model_description": desc,
                    "params": {
                        k: v for k, v in vars(args).items() if k not in ("json", "log", "redis_url")
                    },
                    "results": results,
                    "fetch": fetch,
                },
            )
    finally:
        if cluster_dir is not None:
            stop_cluster(cluster_dir)
    return 0 if ok and hit else 1


if __name__ == "__main__":
    sys.exit(main())
