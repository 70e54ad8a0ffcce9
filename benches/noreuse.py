#!/usr/bin/env python
"""What kvoffload costs a real vLLM engine when nothing repeats.

Unique prompts (no block is ever served twice) on the demo's local Llama and vLLM's CPU
backend, in process, eager mode: every computed block is copied to the CPU pool and never
read back. Two measurements:

* **Time inside kvoffload**, the direct one. Every connector method vLLM calls, on the
  scheduler and on the worker, is timed (nested calls once) during the measured pass. With
  KV in host memory each step's store runs inside ``wait_for_save`` and the engine waits
  for it, so this is all the time kvoffload adds to the engine's thread: the overhead is
  that time over the rest of the pass (what the engine would have taken without it).
* **Against plain vLLM**: process CPU time and wall time of the same pass without a
  connector, configurations alternating on fresh engines (median per configuration).
  Run-to-run noise on a shared 2-core machine is several percent, so this says little
  below that; it is printed for context.

    .venv/bin/python benches/noreuse.py [--repeat 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    REPO,
    SCHEDULER_METHODS,
    WORKER_METHODS,
    add_output_args,
    describe,
    machine,
    write_json,
)

sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "tests"))
from demo import demo_model, quiet
from demo_runner import EngineSpec, Workload, offload_config, run

#: Every method vLLM calls on either connector role while serving.
CONNECTOR_METHODS = tuple(dict.fromkeys(SCHEDULER_METHODS + WORKER_METHODS))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompts", type=int, default=12, help="unique prompts per pass")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=3, help="vLLM max_num_seqs")
    p.add_argument("--kv-cache-mib", type=float, default=72, help="vLLM's own KV cache")
    p.add_argument("--cpu-mib", type=float, default=512, help="the CPU pool")
    p.add_argument("--threads", type=int, default=1, help="OpenMP threads")
    p.add_argument("--repeat", type=int, default=5, help="passes per configuration")
    add_output_args(p, "a tiny workload")
    args = p.parse_args()
    if args.smoke:
        args.prompts, args.prompt_tokens, args.output_tokens, args.repeat = 2, 300, 4, 1
    return args


def connector_timer(llm: Any) -> Callable[[], dict[str, Any]]:
    """Wraps both connectors' methods of an in-process engine; the returned function undoes
    the wrapping and says how long they ran, per method and in all."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.get_kv_connector()
    worker = get_kv_transfer_group()
    clock = time.perf_counter_ns
    per_method: dict[str, list[int]] = {}
    depth = [0]
    # (object, name, its own binding or None): kvoffload binds per-step methods on the
    # instance, which must come back afterwards.
    replaced: list[tuple[Any, str, Any]] = []

    def wrap(obj: Any, name: str) -> None:
        fn = getattr(obj, name, None)
        if not callable(fn):
            return
        acc = per_method.setdefault(name, [0, 0])

        def timed(*args: Any, **kwargs: Any) -> Any:
            if depth[0]:
                return fn(*args, **kwargs)
            depth[0] = 1
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[0] += clock() - t
                acc[1] += 1
                depth[0] = 0

        replaced.append((obj, name, vars(obj).get(name)))
        setattr(obj, name, timed)

    for obj in (scheduler, worker):
        for name in CONNECTOR_METHODS:
            wrap(obj, name)

    def read() -> dict[str, Any]:
        for obj, name, own in reversed(replaced):
            if own is None:
                delattr(obj, name)
            else:
                setattr(obj, name, own)
        methods = {k: {"calls": v[1], "total_s": v[0] / 1e9} for k, v in per_method.items() if v[1]}
        return {"connector_s": sum(m["total_s"] for m in methods.values()), "methods": methods}

    return read


def main() -> int:
    args = parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    with quiet(args.log) as term:
        model, vocab, desc = demo_model()
        import torch  # noqa: F401
        import vllm  # noqa: F401  (versions in the machine line)

        # One turn per user, each with its own prompt: no block is ever served twice.
        w = Workload("unique", args.prompts, 1, args.prompt_tokens - 16, 16, args.output_tokens)
        spec = EngineSpec(model, True, 4096, args.concurrency, int(args.kv_cache_mib * 2**20))
        m = machine()
        term.write(f"machine: {describe(m)}\nmodel: {desc}\n")
        configs = {"vllm": None, "kvoffload": offload_config(int(args.cpu_mib * 2**20))}
        runs: list[dict[str, Any]] = []
        reference: list[list[int]] | None = None
        for rep in range(args.repeat):
            order = list(configs) if rep % 2 == 0 else list(configs)[::-1]
            for cfg in order:
                kv = configs[cfg]
                r = run(spec, kv, w, vocab, probe=connector_timer if kv else None)
                outputs = r.pop("outputs")
                if reference is None:
                    reference = outputs
                r.update(config=cfg, rep=rep, identical=outputs == reference)
                runs.append(r)
                extra = ""
                if r["probe"] is not None:
                    extra = f", inside kvoffload {r['probe']['connector_s'] * 1e3:.1f} ms"
                term.write(
                    f"  [{rep + 1}/{args.repeat}] {cfg:>9}: wall {r['wall_s']:.2f} s, CPU "
                    f"{r['cpu_s']:.2f} s{extra}, CPU hits {r['cpu_hit_tokens']}\n"
                )
        result = summarize(runs)
        term.write(report(result) + "\n")
        write_json(
            args.json,
            {
                "benchmark": "noreuse",
                "machine": m,
                "model_description": desc,
                "params": vars(args) | {"log": None},
                "runs": runs,
                "summary": result,
            },
        )
        return 0 if result["identical"] else 1


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per configuration, and the overhead measured inside kvoffload: its time over
    the rest of each pass, median over passes."""
    by = {c: [r for r in runs if r["config"] == c] for c in ("vllm", "kvoffload")}
    med = {
        c: {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "cpu_s")}
        for c, rs in by.items()
    }
    inside = [
        r["probe"]["connector_s"] / (r["wall_s"] - r["probe"]["connector_s"])
        for r in by["kvoffload"]
    ]
    per_step = by["kvoffload"][0]["probe"]["methods"]
    return {
        "passes": len(by["kvoffload"]),
        "overhead_inside": statistics.median(inside),
        "overhead_inside_max": max(inside),
        "cpu_ratio": med["kvoffload"]["cpu_s"] / med["vllm"]["cpu_s"],
        "wall_ratio": med["kvoffload"]["wall_s"] / med["vllm"]["wall_s"],
        "median": med,
        "cpu_hit_tokens": sum(r["cpu_hit_tokens"] for r in by["kvoffload"]),
        "identical": all(r["identical"] for r in runs),
        "methods_first_pass": per_step,
    }


def report(s: dict[str, Any]) -> str:
    return (
        f"no reuse, {s['passes']} passes per configuration: time inside kvoffload "
        f"{100 * s['overhead_inside']:.2f}% of the rest of the pass (median; max "
        f"{100 * s['overhead_inside_max']:.2f}%; goal <= 2%); against plain vLLM: process CPU "
        f"{s['cpu_ratio']:.3f}x, wall {s['wall_ratio']:.3f}x (medians); CPU-hit tokens "
        f"{s['cpu_hit_tokens']}; outputs token-identical: {'yes' if s['identical'] else 'NO'}"
    )


if __name__ == "__main__":
    sys.exit(main())
