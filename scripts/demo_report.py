"""The demo's figures, computed from its raw results (``docs/demo.json``): the summary, the
side-by-side table and the TTFT plot. No vLLM needed: ``scripts/render_docs.py`` renders
the README's demo table from the committed JSON with these same functions."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

CONFIGS = ("vllm", "kvoffload")
LABELS = {"vllm": "vLLM", "kvoffload": "vLLM + kvoffload"}


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def _runs(data: dict[str, Any], workload: str, config: str) -> list[dict[str, Any]]:
    return [r for r in data["runs"] if r["workload"] == workload and r["config"] == config]


def summarize(data: dict[str, Any], workload: str) -> dict[str, dict[str, Any]]:
    """Per configuration: token counts (the median over repeats: they are the same in
    every repeat unless the schedule changed), TTFT over all requests of all repeats,
    output tokens/s over all repeats, median wall and process CPU time, whether every
    output matched the workload's first run."""
    out: dict[str, dict[str, Any]] = {}
    for cfg in CONFIGS:
        runs = _runs(data, workload, cfg)
        if not runs:
            continue
        ttft_ms = [1000 * t for r in runs for t in r["ttft_s"]]

        def med(key: str, runs: list[dict[str, Any]] = runs) -> float:
            return statistics.median(r[key] for r in runs)

        out[cfg] = {
            "repeats": len(runs),
            "prompt_tokens": med("prompt_tokens"),
            "gpu_hit_tokens": med("gpu_hit_tokens"),
            "cpu_hit_tokens": med("cpu_hit_tokens"),
            "recomputed_tokens": med("recomputed_tokens"),
            "ttft_mean_ms": statistics.fmean(ttft_ms),
            "ttft_p50_ms": percentile(ttft_ms, 50),
            "ttft_p90_ms": percentile(ttft_ms, 90),
            "output_tok_s": sum(r["output_tokens"] for r in runs) / sum(r["wall_s"] for r in runs),
            "wall_s": med("wall_s"),
            "cpu_s": med("cpu_s"),
            "identical": all(r["identical"] for r in runs),
        }
    return out


def pair_ratios(data: dict[str, Any], workload: str, key: str) -> list[float]:
    """kvoffload / vLLM for ``key`` in each repeat (the two runs of a repeat ran back to
    back, so a busy spell on a shared machine hits both)."""
    by_rep: dict[int, dict[str, float]] = {}
    for r in data["runs"]:
        if r["workload"] == workload:
            by_rep.setdefault(r["rep"], {})[r["config"]] = r[key]
    return [v["kvoffload"] / v["vllm"] for _, v in sorted(by_rep.items()) if len(v) == 2]


def _n(x: float) -> str:
    return f"{x:,.0f}"


def describe_chat(w: dict[str, Any]) -> str:
    return (
        f"{w['users']} users x {w['turns']} turns, {w['system_tokens']:,}-token system prompts, "
        f"{w['question_tokens']}-token questions, {w['output_tokens']}-token answers"
    )


def table(data: dict[str, Any]) -> str:
    """The side-by-side table the demo prints (and the README shows)."""
    s = summarize(data, "chat")
    a, b = s["vllm"], s["kvoffload"]
    eng = data["engine"]
    rows: list[tuple[str, str, str]] = [
        ("prompt tokens", _n(a["prompt_tokens"]), _n(b["prompt_tokens"])),
        ("  served from vLLM's KV cache", _n(a["gpu_hit_tokens"]), _n(b["gpu_hit_tokens"])),
        ("  served from CPU (kvoffload)", _n(a["cpu_hit_tokens"]), _n(b["cpu_hit_tokens"])),
        ("  recomputed (prefill)", _n(a["recomputed_tokens"]), _n(b["recomputed_tokens"])),
        (
            "time to first token, mean",
            f"{a['ttft_mean_ms']:,.0f} ms",
            f"{b['ttft_mean_ms']:,.0f} ms ({b['ttft_mean_ms'] / a['ttft_mean_ms']:.2f}x)",
        ),
        (
            "time to first token, p50 / p90",
            f"{a['ttft_p50_ms']:,.0f} / {a['ttft_p90_ms']:,.0f} ms",
            f"{b['ttft_p50_ms']:,.0f} / {b['ttft_p90_ms']:,.0f} ms",
        ),
        ("output tokens/s", f"{a['output_tok_s']:,.1f}", f"{b['output_tok_s']:,.1f}"),
        ("wall time per run", f"{a['wall_s']:,.1f} s", f"{b['wall_s']:,.1f} s"),
        ("process CPU time per run", f"{a['cpu_s']:,.1f} s", f"{b['cpu_s']:,.1f} s"),
        ("outputs token-identical", "", "yes" if a["identical"] and b["identical"] else "NO"),
    ]
    w0, w1, w2 = 32, 18, 24
    head = f"{'':{w0}}{LABELS['vllm']:>{w1}}{LABELS['kvoffload']:>{w2}}"
    lines = [
        f"chat: {describe_chat(data['workloads']['chat'])}",
        f"vLLM KV cache {eng['kv_cache_mib']:g} MiB ({eng['kv_cache_blocks']} blocks), "
        f"max_num_seqs {eng['concurrency']}; kvoffload {'lazy' if eng['lazy'] else 'eager'}, "
        f"CPU pool {eng['cpu_mib']:g} MiB",
        "",
        head,
        "-" * len(head),
    ]
    lines += [f"{n:{w0}}{x:>{w1}}{y:>{w2}}" for n, x, y in rows]
    n_req = data["workloads"]["chat"]["users"] * data["workloads"]["chat"]["turns"]
    n_threads = eng.get("threads")
    threads = "" if n_threads is None else f" ({n_threads} thread{'s' if n_threads > 1 else ''})"
    lines += [
        "",
        f"measured: TTFT = vLLM's per-request arrival -> first token, all {n_req} requests x "
        f"{a['repeats']} runs;",
        f"wall and CPU time: median run. Each run on a fresh engine{threads}, one at a time,",
        "configurations alternating.",
        "",
        overhead_line(data),
    ]
    return "\n".join(lines)


def overhead(data: dict[str, Any]) -> dict[str, Any]:
    """kvoffload / vLLM when nothing repeats (the ``unique`` workload). With the engine on
    one thread, the process's CPU time is the work done (the copy thread included) and,
    unlike wall time, barely moves when other processes take the cores: its median per
    configuration is the overhead figure. Wall time: the median and range over the
    alternating pairs."""
    s = summarize(data, "unique")
    wall = pair_ratios(data, "unique", "wall_s")
    return {
        "cpu": s["kvoffload"]["cpu_s"] / s["vllm"]["cpu_s"],
        "runs": s["vllm"]["repeats"],
        "wall": statistics.median(wall),
        "pairs": len(wall),
        "wall_min": min(wall),
        "wall_max": max(wall),
        "identical": all(c["identical"] for c in s.values()),
    }


def overhead_line(data: dict[str, Any]) -> str:
    w = data["workloads"]["unique"]
    o = overhead(data)
    return (
        f"no reuse ({w['users']} unique {w['system_tokens'] + w['question_tokens']:,}-token "
        f"prompts, {o['runs']} runs each): kvoffload / vLLM\n"
        f"  process CPU time {o['cpu']:.3f}x (median run), wall time {o['wall']:.2f}x (median "
        f"of {o['pairs']} pairs;\n  single pairs {o['wall_min']:.2f}-{o['wall_max']:.2f}x); "
        f"outputs token-identical: {'yes' if o['identical'] else 'NO'}"
    )


def plot(data: dict[str, Any], out: Path) -> None:
    """TTFT of every chat request, both configurations (median over repeats per request)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = data["workloads"]["chat"]
    s = summarize(data, "chat")
    fig, ax = plt.subplots(figsize=(9, 4.6))
    colors = {"vllm": "#9aa5b1", "kvoffload": "#d9480f"}
    for cfg in CONFIGS:
        runs = _runs(data, "chat", cfg)
        per_req = [statistics.median(x) for x in zip(*(r["ttft_s"] for r in runs), strict=True)]
        xs = range(1, len(per_req) + 1)
        mean = s[cfg]["ttft_mean_ms"]
        ax.plot(
            xs,
            [1000 * t for t in per_req],
            "o-",
            ms=4,
            lw=1,
            color=colors[cfg],
            label=f"{LABELS[cfg]} (mean {mean:,.0f} ms)",
        )
    for u in range(1, w["users"]):
        ax.axvline(u * w["turns"] + 0.5, color="#dddddd", lw=0.8, zorder=0)
    ax.set_xlabel(f"request (grouped by user: {w['users']} users x {w['turns']} turns)")
    ax.set_ylabel("time to first token (ms)")
    m = data["machine"]
    ax.set_title(
        f"Multi-user chat: {describe_chat(w)}\n{data['model']['description']}\n"
        f"{m['cpu']} ({m['cores']} cores), vLLM {m['versions'].get('vllm', '?')} CPU backend; "
        f"each point: median of {s['vllm']['repeats']} runs",
        fontsize=8,
    )
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
