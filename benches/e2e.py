#!/usr/bin/env python
"""End to end: the demo workload on a real vLLM engine, without and with kvoffload.

The workload is ``scripts/demo.py``'s: users with long system prompts taking turns, so a
user's prompt has left vLLM's small GPU KV cache by the time the user comes back. Each
configuration gets a fresh engine (one at a time): vLLM alone, kvoffload eager, kvoffload
lazy (and, with ``--with-simple`` on a CUDA machine, vLLM's SimpleCPUOffloadConnector).
Printed per configuration: mean time to first token (vLLM's own histogram), output and
total token throughput, wall time, and where the prompt tokens came from.

    .venv/bin/python benches/e2e.py                   # tiny local Llama, vLLM's CPU backend
    .venv/bin/python benches/e2e.py /path/to/model --kv-cache-mib 2048 --cpu-mib 65536
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, describe, machine, ratio, write_json

sys.path.insert(0, str(REPO / "scripts"))
from demo import measure, offload_config, workload

CONFIGS = {
    "off": None,
    "eager": ("KVOffloadConnector", False),
    "lazy": ("KVOffloadConnector", True),
    "simple-eager": ("SimpleCPUOffloadConnector", False),
    "simple-lazy": ("SimpleCPUOffloadConnector", True),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model", nargs="?", help="HF model dir or name (default: a tiny local Llama)")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=900)
    p.add_argument("--question-tokens", type=int, default=60)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4, help="vLLM max_num_seqs")
    p.add_argument("--kv-cache-mib", type=float, default=4.0, help="vLLM's own KV cache")
    p.add_argument("--cpu-mib", type=float, default=256.0, help="the CPU pool")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--configs", default="off,eager,lazy", help=f"comma list of {list(CONFIGS)}")
    p.add_argument(
        "--with-simple",
        action="store_true",
        help="also run SimpleCPUOffloadConnector eager and lazy (needs CUDA)",
    )
    p.add_argument("--load-mode", help="kvoffload load_mode (default: the connector's auto)")
    p.add_argument("--repeat", type=int, default=1, help="runs per configuration (median)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--smoke", action="store_true", help="a tiny workload (CI smoke test)")
    args = p.parse_args()
    if args.with_simple:
        args.configs += ",simple-eager,simple-lazy"
    if args.smoke:
        args.users, args.turns, args.system_tokens, args.output_tokens = 2, 2, 300, 4
    return args


def run(model: str, prompts: list[list[int]], args: argparse.Namespace, cfg: str) -> dict:
    kv_transfer_config = None
    conn = CONFIGS[cfg]
    if conn is not None:
        name, lazy = conn
        kv_transfer_config = offload_config(args, lazy=lazy)
        kv_transfer_config["kv_connector"] = name
        kv_transfer_config["kv_load_failure_policy"] = "recompute"
        if args.load_mode and name == "KVOffloadConnector":
            kv_transfer_config["kv_connector_extra_config"]["load_mode"] = args.load_mode
    r = measure(model, prompts, args, kv_transfer_config, warmup=True)
    tokens = r["prompt_tokens"] + r["output_tokens"]
    return {
        "config": cfg,
        **r,
        "ttft_ms": r["ttft_ms"] or None,
        "output_tok_s": r["output_tokens"] / r["wall_s"],
        "total_tok_s": tokens / r["wall_s"],
    }


def line(r: dict[str, Any]) -> str:
    return (
        f"{r['config']:>13}: TTFT {r['ttft_ms'] or 0:7.1f} ms, {r['output_tok_s']:7.1f} output "
        f"tok/s, {r['total_tok_s']:8.0f} total tok/s, wall {r['wall_s']:.2f} s; prompt tokens "
        f"{r['prompt_tokens']:,}: GPU hits {r['gpu_hit_tokens']:,}, CPU hits "
        f"{r['cpu_hit_tokens']:,}, recomputed {r['recomputed_tokens']:,}"
    )


def main() -> int:
    args = parse_args()
    tiny = args.model is None
    if tiny:
        sys.path.insert(0, str(REPO / "tests"))
        from tiny_model import build_tiny_llama

        model, vocab = str(build_tiny_llama(Path.home() / ".cache/kvoffload/tiny_llama")), 1024
    else:
        from transformers import AutoConfig

        model, vocab = args.model, int(AutoConfig.from_pretrained(args.model).vocab_size)
    import torch  # noqa: F401
    import vllm  # noqa: F401  (versions in the machine line)

    prompts = workload(args, vocab)
    m = machine()
    print(f"machine: {describe(m)}")
    print(
        f"workload: {args.users} users x {args.turns} turns, {args.system_tokens}-token system "
        f"prompts + {args.question_tokens}-token questions, {args.output_tokens} output tokens, "
        f"max_num_seqs {args.concurrency}, vLLM KV cache {args.kv_cache_mib:g} MiB, CPU pool "
        f"{args.cpu_mib:g} MiB\n",
        flush=True,
    )
    cfgs = args.configs.split(",")
    # Configurations alternate within each repetition, so a busy spell on the machine
    # hits all of them; per configuration the run with the median wall time is reported.
    by_cfg: dict[str, list[dict[str, Any]]] = {c: [] for c in cfgs}
    for rep in range(args.repeat):
        for cfg in cfgs:
            r = run(model, prompts, args, cfg)
            by_cfg[cfg].append(r)
            tag = f"[{rep + 1}/{args.repeat}] " if args.repeat > 1 else ""
            print(f"{tag}{line(r)}", flush=True)
    results = []
    for cfg in cfgs:
        runs = sorted(by_cfg[cfg], key=lambda r: r["wall_s"])
        r = runs[len(runs) // 2]
        if len(runs) > 1:
            r["ttft_ms_runs"] = [x["ttft_ms"] for x in runs]
            r["wall_s_runs"] = [x["wall_s"] for x in runs]
        results.append(r)
    if args.repeat > 1:
        print(f"\nmedian of {args.repeat}:")
        for r in results:
            print(line(r))
    base = next((r for r in results if r["config"] == "off"), None)
    ok = True
    if base is not None:
        print()
        for r in results:
            if r is base:
                continue
            same = r["tokens"] == base["tokens"]
            ok &= same
            ttft = ratio(base["ttft_ms"] or 0.0, r["ttft_ms"] or 0.0)
            print(
                f"{r['config']:>13} vs vLLM alone: TTFT {ttft:.2f}x "
                f"lower, throughput {ratio(r['total_tok_s'], base['total_tok_s']):.2f}x, "
                f"outputs token-identical: {'yes' if same else 'NO'}"
            )
    for r in results:
        del r["tokens"]
    write_json(
        args.json,
        {
            "benchmark": "e2e",
            "machine": m,
            "model": model,
            "params": {k: v for k, v in vars(args).items() if k != "json"},
            "results": results,
        },
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
