#!/usr/bin/env python
"""Plots the scheduler and index comparisons (the JSON that benches/compare_*.py write).

    .venv/bin/python scripts/plot_benchmarks.py \
        --index docs/benchmarks/compare_index.json \
        --scheduler docs/benchmarks/compare_scheduler.json \
        --out docs/benchmarks.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "docs" / "benchmarks"

VLLM_COLOR, KVO_COLOR = "#9aa5b1", "#d9480f"
SHORT = {
    "insert": "store 128\n(free space)",
    "evict_insert": "store 128\n(pool full)",
    "find": "find 128",
    "find_pin": "find + pin\n128",
    "unpin": "unpin 128",
    "find_miss": "find, miss\nat block 0",
    "find_pin_repeat": "same request\nasks again",
}


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def machine_line(m: dict[str, Any]) -> str:
    gpu = m.get("gpu") or "no GPU"
    vllm = m.get("versions", {}).get("vllm", "?")
    return f"{m['date']} · {m['cpu']}, {m['cores']} cores, {gpu} · vLLM {vllm}"


def annotate(ax: Any, x: float, y: float, text: str) -> None:
    ax.annotate(
        text,
        (x, y),
        textcoords="offset points",
        xytext=(0, 3),
        ha="center",
        fontsize=8,
        fontweight="bold",
    )


def scheduler_panel(ax: Any, data: dict[str, Any]) -> None:
    by = {(r["connector"], r["mode"]): r for r in data["results"]}
    modes = [m for m in ("eager", "lazy") if ("simple", m) in by and ("kvoffload", m) in by]
    width = 0.38
    for i, mode in enumerate(modes):
        s, k = by[("simple", mode)], by[("kvoffload", mode)]
        sv, kv = s["connector_step"]["mean_us"], k["connector_step"]["mean_us"]
        ax.bar(
            i - width / 2, sv, width, color=VLLM_COLOR, label="SimpleCPUOffload" if i == 0 else None
        )
        ax.bar(i + width / 2, kv, width, color=KVO_COLOR, label="kvoffload" if i == 0 else None)
        annotate(ax, i - width / 2, sv, f"{sv:.0f} µs\n{100 * s['share']:.0f}% of sched.")
        annotate(
            ax, i + width / 2, kv, f"{kv:.0f} µs ({sv / kv:.1f}x less)\n{100 * k['share']:.0f}%"
        )
    ax.set_xticks(range(len(modes)), [f"{m} offload" for m in modes])
    ax.set_ylabel("connector time per scheduler step (µs, mean)")
    t = data["trace"]
    ax.set_title(
        f"Scheduler side: {t['requests']} requests, {t['systems']} shared "
        f"{t['system_tokens']}-token prompts\nvLLM v1 Scheduler, GPU {t['gpu_blocks']} / "
        f"CPU {t['cpu_blocks']:,} blocks\n{machine_line(data['machine'])}",
        fontsize=8,
    )
    ax.set_ylim(0, max(by[("simple", m)]["connector_step"]["mean_us"] for m in modes) * 1.3)
    ax.legend(fontsize=8, loc="upper right")


def index_panel(ax: Any, data: dict[str, Any]) -> None:
    rows = [r for r in data["rows"] if r["vllm_us"] and r["kvoffload_us"]]
    width = 0.38
    for i, r in enumerate(rows):
        ax.bar(
            i - width / 2,
            r["vllm_us"],
            width,
            color=VLLM_COLOR,
            label="vLLM BlockPool" if i == 0 else None,
        )
        ax.bar(
            i + width / 2,
            r["kvoffload_us"],
            width,
            color=KVO_COLOR,
            label="kvoffload" if i == 0 else None,
        )
        annotate(ax, i, max(r["vllm_us"], r["kvoffload_us"]), f"{r['ratio']:.1f}x")
    ax.set_yscale("log")
    top = max(max(r["vllm_us"], r["kvoffload_us"]) for r in rows)
    ax.set_ylim(top=top * 12)  # room for the ratio labels and the legend
    ax.set_xticks(range(len(rows)), [SHORT.get(r["op"], r["op"]) for r in rows], fontsize=8)
    ax.set_ylabel("µs per call, 128 blocks (p50, log)")
    ax.set_title(
        f"Index through Python: pool of {data['params']['blocks']:,} blocks, 128-block "
        f"prefixes\n{machine_line(data['machine'])}",
        fontsize=8,
    )
    ax.legend(fontsize=8, loc="upper right", ncols=2)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--index", type=Path, default=DATA / "compare_index.json")
    ap.add_argument("--scheduler", type=Path, default=DATA / "compare_scheduler.json")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks.png")
    args = ap.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sched, index = load(args.scheduler), load(args.index)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.8))
    scheduler_panel(a, sched)
    index_panel(b, index)
    fig.suptitle("kvoffload vs vLLM", fontsize=10)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
