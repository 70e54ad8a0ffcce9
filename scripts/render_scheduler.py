"""The scheduler comparison's regions of benches/README.md (``benches/compare_scheduler.py``'s
results: the shared-trace table, the churn, synchronous-load and AsyncScheduler lines, and
where kvoffload's time goes), rendered by ``scripts/render_docs.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from render_data import (
    GOALS,
    RenderError,
    load_json,
    met,
    pct,
    ratio,
    scheduler_results,
    sig,
    us,
)


def scheduler_table() -> str:
    s = scheduler_results("compare_scheduler")
    modes = ("eager", "lazy")
    reps = {len(r.get("runs_mean_us", [0])) for r in s.values()}
    if len(reps) != 1:
        raise RenderError(f"compare_scheduler.json: configurations ran {reps} times")
    n = reps.pop()
    rows = [
        "| per scheduler step | Simple eager | kvoffload eager | Simple lazy | kvoffload lazy |",
        "|---|---|---|---|---|",
    ]

    def row(label: str, f: Callable[[dict[str, Any], dict[str, Any] | None], str]) -> str:
        cells = []
        for m in modes:
            cells += [f(s["simple", m], None), f(s["kvoffload", m], s["simple", m])]
        return f"| {label} | " + " | ".join(cells) + " |"

    def mean(r: dict[str, Any], base: dict[str, Any] | None) -> str:
        v = r["connector_step"]["mean_us"]
        if base is None:
            return us(v)
        return f"**{us(v)}** ({ratio(base['connector_step']['mean_us'] / v)} less)"

    def p50_99(r: dict[str, Any], base: dict[str, Any] | None) -> str:
        c = r["connector_step"]
        text = f"{sig(c['p50_us'])} / {sig(c['p99_us'])} µs"
        if base is None:
            return text
        return f"{text} ({ratio(base['connector_step']['p50_us'] / c['p50_us'])} at p50)"

    rows += [
        row("connector, mean", mean),
        row("connector, p50 / p99", p50_99),
        row("share of the scheduler's step time", lambda r, _: pct(r["share"])),
        row("per block moved (stored + loaded)", lambda r, _: us(r["us_per_block_moved"])),
        row(
            "blocks stored / loaded",
            lambda r, _: f"{r['stored_blocks']:,} / {r['loaded_blocks']:,}",
        ),
        row("CPU-hit tokens", lambda r, _: f"{r['cpu_hit_tokens']:,}"),
    ]
    d = load_json("benchmarks/compare_scheduler.json")
    t = d["trace"]
    trace = (
        f"The trace: {t['requests']:,} requests, each one of {t['systems']} shared "
        f"{t['system_tokens']:,}-token system prompts plus {t['unique_tokens']} unique tokens, "
        f"{t['output_tokens']} output tokens, Poisson arrivals ({t['arrival_rate']} per step), "
        f"`max_num_seqs` {t['max_num_seqs']}, `max_num_batched_tokens` "
        f"{t['max_num_batched_tokens']:,}, a GPU cache of {t['gpu_blocks']:,} blocks, a CPU pool "
        f"of {t['cpu_blocks']:,} blocks."
    )
    best = (
        f"Best of {n} runs per configuration (the run with the lowest connector mean):"
        if n > 1
        else "One run per configuration:"
    )
    diff = {
        m: s["kvoffload", m]["cpu_hit_tokens"] / s["simple", m]["cpu_hit_tokens"] - 1 for m in modes
    }
    hits = ", ".join(f"{m} {100 * abs(diff[m]):.2f}%" for m in modes)
    duty = (
        "Both connectors reported stats at every step (vLLM asks after every step)."
        if d.get("stats_every_step")
        else "In this run kvoffload reported stats at most once a second while Simple's "
        "stats call ran at every step (the benchmark now makes both report at every step)."
    )
    goals = []
    for m in modes:
        r, r99 = (
            s["simple", m]["connector_step"][q] / s["kvoffload", m]["connector_step"][q]
            for q in ("mean_us", "p99_us")
        )
        sh = s["kvoffload", m]["share"]
        goals.append(
            f"{m}: {ratio(r)} less on the mean ({met(r >= GOALS['scheduler_ratio'])}), "
            f"{ratio(r99)} at p99 ({met(r99 >= GOALS['scheduler_ratio'])}), "
            f"{pct(sh)} ({met(sh < GOALS['scheduler_share'])})"
        )
    goal = (
        f"Goals: {GOALS['scheduler_ratio']:g}x less connector time than Simple on the mean and "
        f"at p99, and under {pct(GOALS['scheduler_share'])} of the scheduler's step time — "
        + "; ".join(goals)
        + "."
    )
    return (
        f"{trace} {best}\n\n"
        + "\n".join(rows)
        + f"\n\nCPU-hit tokens differ by {hits} between the connectors. {duty} {goal}\n\n"
        + churn_line()
        + "\n"
        + sync_line()
        + "\n"
        + async_line()
    )


def async_line() -> str:
    """The same traces under vLLM's ``AsyncScheduler`` (``--async-scheduling``)."""
    runs = (("shared", "compare_scheduler_async"), ("churn", "compare_scheduler_churn_async"))
    reps = {len(r["runs_mean_us"]) for _, name in runs for r in scheduler_results(name).values()}
    if len(reps) != 1:
        raise RenderError(f"async scheduler runs: configurations ran {reps} times")
    n = reps.pop()
    how = "one run per configuration" if n == 1 else f"best of {n} runs per configuration"
    return (
        "Under vLLM's `AsyncScheduler` (`--async-scheduling`, vLLM's default on GPUs: each "
        f"step is scheduled before the previous one's output is processed; {how}, raw "
        "results `docs/benchmarks/compare_scheduler_async.json` and "
        "`compare_scheduler_churn_async.json`), kvoffload vs Simple per step: "
        + per_trace(runs, "kvoffload")
        + ".\n"
    )


def sync_line() -> str:
    """kvoffload with synchronous loads (``kvoffload-sync``), what it runs on vLLM's CPU
    backend: per trace and mode, against Simple in the same runs."""
    runs = (("shared", "compare_scheduler"), ("churn", "compare_scheduler_churn"))
    return (
        "With `load_mode: sync` (the default on vLLM's CPU backend: a hit loads within its "
        "step, and a step's store is copied within it, a lazy one before the forward pass, so "
        "lazy mode holds no GPU block) in the same runs, kvoffload vs Simple per step: "
        + per_trace(runs, "kvoffload-sync")
        + ". The schedule differs from Simple's there (requests with a hit run a step earlier).\n"
    )


def per_trace(runs: tuple[tuple[str, str], ...], connector: str) -> str:
    """``connector`` against Simple (see ``versus``) in each run ``(trace, results name)``
    and mode."""
    return "; ".join(
        f"{trace} {m} " + versus(scheduler_results(name), connector, m)
        for trace, name in runs
        for m in ("eager", "lazy")
    )


def versus(by: dict[tuple[str, str], dict[str, Any]], connector: str, mode: str) -> str:
    """``connector`` against Simple in ``mode``: connector time per step (mean and p99, with
    the ratios) and the prompt tokens each recomputed."""
    si, k = by["simple", mode], by[connector, mode]
    c, ck = si["connector_step"], k["connector_step"]
    return (
        f"{us(ck['mean_us'])} vs {us(c['mean_us'])} "
        f"({ratio(c['mean_us'] / ck['mean_us'])} less; p99 {sig(ck['p99_us'])} vs "
        f"{sig(c['p99_us'])} µs, {ratio(c['p99_us'] / ck['p99_us'])}), prompt tokens "
        f"recomputed {k['recomputed_tokens']:,} vs {si['recomputed_tokens']:,}"
    )


def churn_line() -> str:
    """The churn trace's run (``--trace churn``): per mode, the connector time ratios and the
    prompt tokens each connector recomputed."""
    d = load_json("benchmarks/compare_scheduler_churn.json")
    t = d["trace"]
    by = scheduler_results("compare_scheduler_churn")
    parts = [f"{m} " + versus(by, "kvoffload", m) for m in ("eager", "lazy")]
    return (
        f"The churn trace (`--trace churn`: {t['requests']:,} requests over {t['systems']} "
        f"shared {t['system_tokens']}-token prompts plus {t['unique_tokens']} unique tokens, "
        f"GPU {t['gpu_blocks']:,} / CPU {t['cpu_blocks']:,} blocks; raw results "
        f"`docs/benchmarks/compare_scheduler_churn.json`), kvoffload vs Simple per step: "
        + "; ".join(parts)
        + ".\n"
    )


def scheduler_breakdown() -> str:
    r = scheduler_results("compare_scheduler")["kvoffload", "eager"]
    methods = sorted(r["methods"].items(), key=lambda kv: -kv[1]["total_ms"])
    per_step = [(name, 1000 * m["total_ms"] / r["steps"]) for name, m in methods]
    big = [f"`{name}` {us(v)}" for name, v in per_step if v >= 1.0]
    rest = sum(v for _, v in per_step if v < 1.0)
    return (
        f"Per step, kvoffload eager, from the run above (total time of each method over "
        f"{r['steps']:,} steps): {', '.join(big)}; the other methods together {us(rest)}.\n\n"
        + hooks_line()
        + slowest_steps_line()
    )


def hooks_line() -> str:
    """What lazy mode's free-queue hooks add, as charged in each trace's lazy run."""
    parts = []
    costs: list[float] = []
    for trace, name in (("shared", "compare_scheduler"), ("churn", "compare_scheduler_churn")):
        r = scheduler_results(name)["kvoffload", "lazy"]
        charged = r["methods"].get("free_queue_hooks")
        if charged is None:
            raise RenderError(f"{name}.json: kvoffload lazy charged no free-queue hook call")
        costs += [r["queue_hooks"]["ns_per_call"][k] for k in r["queue_hooks"]["calls"]]
        per_step = 1000 * charged["total_ms"] / r["steps"]
        parts.append(f"{trace} {us(per_step)} for {charged['calls'] / r['steps']:.2g} calls")
    return (
        "In lazy mode the walker follows vLLM's free block queue through its own versions of "
        "the queue's methods, which run inside vLLM's calls; their calls are counted and "
        f"charged at what each adds to vLLM's method ({sig(min(costs))} to {sig(max(costs))} "
        "ns a call, measured on a real `BlockPool` before each run), under "
        f"`free_queue_hooks`: per step, {'; '.join(parts)}.\n\n"
    )


def slowest_steps_line() -> str:
    """What the slowest 1% of steps (the p99) spend their connector time on, per trace and
    mode: kvoffload's three largest calls."""
    parts = []
    for trace, name in (("shared", "compare_scheduler"), ("churn", "compare_scheduler_churn")):
        by = scheduler_results(name)
        for m in ("eager", "lazy"):
            t = by["kvoffload", m]["slowest_steps"]
            # The JSON keeps keys sorted by name.
            top = sorted(t["methods_us"].items(), key=lambda kv: -kv[1])[:3]
            parts.append(
                f"{trace} {m} {us(t['mean_us'])} ("
                + ", ".join(f"`{k}` {us(v)}" for k, v in top)
                + ")"
            )
    return (
        "The slowest 1% of steps (what sets p99), kvoffload, mean connector time and its "
        "largest calls: " + "; ".join(parts) + ".\n"
    )
