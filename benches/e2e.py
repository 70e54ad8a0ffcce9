#!/usr/bin/env python
"""End to end: the demo's chat workload on a real vLLM engine, without and with kvoffload,
eager and lazy (and, with ``--with-simple`` on a CUDA machine, vLLM's
SimpleCPUOffloadConnector).

The workload and the engine run are ``scripts/demo.py``'s (``scripts/demo_runner.py``): users
with long system prompts take turns, so a user's prefix has left vLLM's small KV cache by
the time the user asks again. Each run gets a fresh engine (one at a time); configurations
alternate within each repetition. Printed per configuration: time to first token (mean,
p50, p90 over every request of every repetition), output tokens/s, median wall time, and
where the prompt tokens came from.

    .venv/bin/python benches/e2e.py                   # the demo's local Llama, vLLM's CPU backend
    .venv/bin/python benches/e2e.py --model /path/to/model --kv-cache-mib 2048 --cpu-mib 65536
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, add_output_args, describe, machine, write_json

sys.path.insert(0, str(REPO / "scripts"))
from demo import demo_model, quiet
from demo_report import summarize
from demo_runner import EngineSpec, Workload, offload_config, run

#: Configuration -> (connector, lazy); None is plain vLLM.
CONFIGS: dict[str, tuple[str, bool] | None] = {
    "off": None,
    "eager": ("KVOffloadConnector", False),
    "lazy": ("KVOffloadConnector", True),
    "simple-eager": ("SimpleCPUOffloadConnector", False),
    "simple-lazy": ("SimpleCPUOffloadConnector", True),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="HF model dir or name (default: the demo's local Llama)")
    p.add_argument("--users", type=int, default=5)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--question-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=3, help="vLLM max_num_seqs")
    p.add_argument("--kv-cache-mib", type=float, default=72, help="vLLM's own KV cache")
    p.add_argument("--cpu-mib", type=float, default=512, help="the CPU pool")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--threads", type=int, default=1, help="local model: OpenMP threads")
    p.add_argument("--configs", default="off,eager,lazy", help=f"comma list of {list(CONFIGS)}")
    p.add_argument(
        "--with-simple",
        action="store_true",
        help="also run SimpleCPUOffloadConnector eager and lazy (needs CUDA)",
    )
    p.add_argument("--load-mode", help="kvoffload load_mode (default: the connector's auto)")
    p.add_argument("--repeat", type=int, default=1, help="runs per configuration")
    add_output_args(p, "a tiny workload")
    args = p.parse_args()
    if args.with_simple:
        args.configs += ",simple-eager,simple-lazy"
    if args.smoke:
        args.users, args.turns, args.system_tokens, args.output_tokens = 2, 2, 300, 4
    return args


def transfer_config(args: argparse.Namespace, cfg: str) -> dict[str, Any] | None:
    conn = CONFIGS[cfg]
    if conn is None:
        return None
    name, lazy = conn
    kv = offload_config(int(args.cpu_mib * 2**20), lazy=lazy)
    kv["kv_connector"] = name
    if args.load_mode and name == "KVOffloadConnector":
        kv["kv_connector_extra_config"]["load_mode"] = args.load_mode
    return kv


def line(cfg: str, s: dict[str, Any]) -> str:
    return (
        f"{cfg:>13}: TTFT mean {s['ttft_mean_ms']:8.1f} ms (p50 {s['ttft_p50_ms']:.0f}, p90 "
        f"{s['ttft_p90_ms']:.0f}), {s['output_tok_s']:7.1f} output tok/s, wall "
        f"{s['wall_s']:.2f} s; prompt tokens {s['prompt_tokens']:,.0f}: GPU hits "
        f"{s['gpu_hit_tokens']:,.0f}, CPU hits {s['cpu_hit_tokens']:,.0f}, recomputed "
        f"{s['recomputed_tokens']:,.0f}"
    )


def main() -> int:
    args = parse_args()
    if args.model is None:
        os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    with quiet(args.log) as term:
        if args.model is None:
            model, vocab, desc = demo_model()
        else:
            from transformers import AutoConfig

            model, desc = args.model, args.model
            vocab = int(AutoConfig.from_pretrained(model).vocab_size)
        import torch  # noqa: F401
        import vllm  # noqa: F401  (versions in the machine line)

        w = Workload(
            "chat",
            args.users,
            args.turns,
            args.system_tokens,
            args.question_tokens,
            args.output_tokens,
        )
        spec = EngineSpec(
            model, args.model is None, args.max_model_len, args.concurrency,
            int(args.kv_cache_mib * 2**20),
        )  # fmt: skip
        m = machine()
        term.write(f"machine: {describe(m)}\nmodel: {desc}\n")
        cfgs = args.configs.split(",")
        runs: list[dict[str, Any]] = []
        reference: list[list[int]] | None = None
        for rep in range(args.repeat):
            for cfg in cfgs if rep % 2 == 0 else cfgs[::-1]:
                r = run(spec, transfer_config(args, cfg), w, vocab)
                outputs = r.pop("outputs")
                if cfg == "off" and reference is None:
                    reference = outputs
                r.update(workload="chat", config=cfg, rep=rep, outputs=outputs)
                runs.append(r)
                term.write(f"[{rep + 1}/{args.repeat}] {cfg} done in {r['wall_s']:.1f} s\n")
        results = []
        for cfg in cfgs:
            mine = [r for r in runs if r["config"] == cfg]
            for r in mine:
                r["identical"] = reference is None or r.pop("outputs") == reference
            # summarize() compares two configurations; each is summarized as "kvoffload".
            s = summarize({"runs": [{**r, "config": "kvoffload"} for r in mine]}, "chat")
            results.append({"config": cfg, **s["kvoffload"]})
            term.write(line(cfg, s["kvoffload"]) + "\n")
        ok = all(r["identical"] for r in results)
        term.write(f"outputs token-identical to plain vLLM: {'yes' if ok else 'NO'}\n")
        write_json(
            args.json,
            {
                "benchmark": "e2e",
                "machine": m,
                "model_description": desc,
                "params": {k: v for k, v in vars(args).items() if k not in ("json", "log")},
                "results": results,
            },
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
