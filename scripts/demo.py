"""The main job: one multi-user workload on a real vLLM engine, without and with kvoffload.

Each user has a long system prompt and asks several questions; users take turns, so by
the time a user comes back, vLLM's small GPU KV cache has evicted that user's prompt.
Without kvoffload vLLM recomputes it; with kvoffload the blocks come back from host memory.

    python scripts/demo.py                       # tiny random-weight Llama built locally
    python scripts/demo.py /path/to/model --kv-cache-gib 4 --cpu-gib 64   # a real model
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent.parent


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model", nargs="?", help="HF model dir or name (default: a tiny local Llama)")
    p.add_argument("--users", type=int, default=8, help="users, one system prompt each")
    p.add_argument("--turns", type=int, default=3, help="questions per user")
    p.add_argument("--system-tokens", type=int, default=900, help="tokens per system prompt")
    p.add_argument("--question-tokens", type=int, default=60)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4, help="vLLM max_num_seqs")
    p.add_argument("--kv-cache-mib", type=float, default=4.0, help="vLLM's own KV cache")
    p.add_argument("--cpu-mib", type=float, default=256.0, help="kvoffload's CPU pool")
    p.add_argument("--lazy", action="store_true", help="lazy_offload: store near eviction")
    p.add_argument("--max-model-len", type=int, default=2048)
    return p.parse_args()


def workload(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    systems = [
        [rng.randrange(3, vocab) for _ in range(args.system_tokens)] for _ in range(args.users)
    ]
    prompts = []
    for _turn in range(args.turns):
        for user in range(args.users):
            question = [rng.randrange(3, vocab) for _ in range(args.question_tokens)]
            prompts.append(systems[user] + question)
    return prompts


def metrics(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if hasattr(m, "value"):
            out[m.name] = out.get(m.name, 0.0) + float(m.value)
        elif hasattr(m, "sum") and hasattr(m, "count"):
            out[m.name + ":sum"] = out.get(m.name + ":sum", 0.0) + float(m.sum)
            out[m.name + ":count"] = out.get(m.name + ":count", 0.0) + float(m.count)
    return out


def offload_config(args: argparse.Namespace, *, lazy: bool) -> dict[str, Any]:
    return {
        "kv_connector": "KVOffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": int(args.cpu_mib * 2**20),
            "lazy_offload": lazy,
        },
    }


def measure(
    model: str,
    prompts: list[list[int]],
    args: argparse.Namespace,
    kv_transfer_config: dict[str, Any] | None,
    *,
    warmup: bool = False,
) -> dict[str, Any]:
    """Runs `prompts` on a fresh engine (shut down afterwards) and returns the outputs and
    what vLLM's own counters say: prompt tokens served from the GPU and CPU caches,
    tokens recomputed, mean time to first token, wall time."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw: dict[str, Any] = {
        "model": model,
        "enforce_eager": True,
        "enable_prefix_caching": True,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.concurrency,
        "kv_cache_memory_bytes": int(args.kv_cache_mib * 2**20),
        "disable_log_stats": False,
        "seed": 0,
    }
    if args.model is None:  # the tiny local model: float32 on vLLM's CPU backend
        kw["dtype"] = "float32"
        kw["distributed_executor_backend"] = "uni"
    if kv_transfer_config is not None:
        kw["kv_transfer_config"] = kv_transfer_config
    llm = LLM(**kw)
    try:
        params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
        if warmup:
            # First forward passes and kernel set-up, on a prompt that shares no block
            # with the workload.
            llm.generate(
                [TokensPrompt(prompt_token_ids=[2] * 8)],
                SamplingParams(max_tokens=2, ignore_eos=True),
                use_tqdm=False,
            )
        before = metrics(llm)
        t0 = time.perf_counter()
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        wall = time.perf_counter() - t0
        after = metrics(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

        ensure_kv_transfer_shutdown()

    def d(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    prompt_tokens = sum(len(p) for p in prompts)
    gpu_hits = d("vllm:prefix_cache_hits")
    cpu_hits = d("vllm:external_prefix_cache_hits")
    ttft_n = d("vllm:time_to_first_token_seconds:count")
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "prompt_tokens": prompt_tokens,
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "gpu_hit_tokens": int(gpu_hits),
        "cpu_hit_tokens": int(cpu_hits),
        "recomputed_tokens": int(prompt_tokens - gpu_hits - cpu_hits),
        "ttft_ms": 1000 * d("vllm:time_to_first_token_seconds:sum") / ttft_n if ttft_n else 0.0,
        "wall_s": wall,
    }


def table(base: dict, off: dict, mode: str) -> str:
    rows = [
        ("prompt tokens", base["prompt_tokens"], off["prompt_tokens"], "{:,.0f}"),
        ("served from GPU prefix cache", base["gpu_hit_tokens"], off["gpu_hit_tokens"], "{:,.0f}"),
        ("served from CPU (kvoffload)", base["cpu_hit_tokens"], off["cpu_hit_tokens"], "{:,.0f}"),
        (
            "prefill tokens recomputed",
            base["recomputed_tokens"],
            off["recomputed_tokens"],
            "{:,.0f}",
        ),
        ("mean time to first token (ms)", base["ttft_ms"], off["ttft_ms"], "{:,.1f}"),
        ("wall time (s)", base["wall_s"], off["wall_s"], "{:,.2f}"),
    ]
    head = f"{'':32}{'vLLM':>14}{'+ kvoffload (' + mode + ')':>24}"
    lines = [head, "-" * len(head)]
    for name, a, b, fmt in rows:
        lines.append(f"{name:32}{fmt.format(a):>14}{fmt.format(b):>24}")
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    if args.model is None:
        sys.path.insert(0, str(REPO / "tests"))
        from tiny_model import build_tiny_llama

        say("building the tiny random-weight Llama (cached under ~/.cache/kvoffload)")
        model = str(build_tiny_llama(Path.home() / ".cache" / "kvoffload" / "tiny_llama"))
        vocab = 1024
    else:
        from transformers import AutoConfig

        model = args.model
        vocab = int(AutoConfig.from_pretrained(model).vocab_size)
    prompts = workload(args, vocab)
    say(
        f"workload: {args.users} users x {args.turns} turns, {args.system_tokens}-token system "
        f"prompts, vLLM KV cache {args.kv_cache_mib:g} MiB, kvoffload CPU pool {args.cpu_mib:g} MiB"
    )
    say("run 1/2: vLLM alone ...")
    base = measure(model, prompts, args, None)
    say(f"run 1/2 done in {base['wall_s']:.1f} s")
    mode = "lazy" if args.lazy else "eager"
    say(f"run 2/2: vLLM + kvoffload ({mode}) ...")
    off = measure(model, prompts, args, offload_config(args, lazy=args.lazy))
    say(f"run 2/2 done in {off['wall_s']:.1f} s")
    print()
    print(table(base, off, mode))
    print()
    same = base["tokens"] == off["tokens"]
    saved = base["recomputed_tokens"] - off["recomputed_tokens"]
    print(f"outputs token-identical: {'yes' if same else 'NO'}")
    if base["recomputed_tokens"]:
        share = 100 * saved / base["recomputed_tokens"]
        print(f"prefill recomputation saved: {saved:,} tokens ({share:.0f}%)")
    print()
    print(
        "On a GPU server: pass your model as the first argument, and size vLLM's cache and the\n"
        "CPU pool with --kv-cache-mib / --cpu-mib (in production: gpu_memory_utilization and\n"
        'kv_connector_extra_config={"cpu_bytes_to_use": ...}).'
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
