#!/usr/bin/env python
"""Renders every figure in README.md, benches/README.md and docs/gpu_check.md from the
committed raw results.

Each generated part of a document sits between

    <!-- BEGIN GENERATED: name -->
    <!-- END GENERATED: name -->

and is rewritten from the data under docs/ (the demo's docs/demo.json, the Python
benchmarks' docs/benchmarks/*.json, the criterion logs docs/benchmarks/cargo_bench_*.txt,
the GPU check's docs/benchmarks/gpu_check.json).
Text outside the markers is left alone. tests/test_docs.py checks that the committed
documents equal what this script renders, so a figure cannot drift from its source.

    .venv/bin/python scripts/render_docs.py           # rewrite the documents
    .venv/bin/python scripts/render_docs.py --check   # exit 1 if a document is stale
    .venv/bin/python scripts/render_docs.py --plots   # also redraw docs/*.png
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

DOCUMENTS = ("README.md", "benches/README.md", "docs/gpu_check.md")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_report import overhead, summarize, table  # noqa: E402
from render_data import (  # noqa: E402
    DOCS,
    GOALS,
    REPO,
    RenderError,
    bench,
    bench_lines,
    load_json,
    machine_line,
    met,
    ns,
    pct,
    ratio,
    scheduler_results,
    sig,
    us,
)
from render_gpu import gpu_line, gpu_results, gpu_summary  # noqa: E402
from render_scheduler import scheduler_breakdown, scheduler_table  # noqa: E402

MARKER = re.compile(
    r"(<!-- BEGIN GENERATED: (?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)"
    r"(<!-- END GENERATED: (?P=name) -->)",
    re.S,
)


# ---- regions -------------------------------------------------------------------------------

Region = Callable[[], str]
REGIONS: dict[str, Region] = {}


def region(name: str) -> Callable[[Region], Region]:
    def add(f: Region) -> Region:
        REGIONS[name] = f
        return f

    return add


def _index(name: str = "compare_index") -> dict[str, dict[str, Any]]:
    return {r["op"]: r for r in load_json(f"benchmarks/{name}.json")["rows"]}


@region("demo")
def demo_table() -> str:
    data = load_json("demo.json")
    return f"```text\n{table(data)}\n```\n\n{demo_caption(data)}\n"


def demo_caption(data: dict[str, Any]) -> str:
    m = data["machine"]
    return (
        f"Measured {m['date']} on {m['cpu']} ({m['cores']} cores, {m.get('gpu') or 'no GPU'}) "
        f"with vLLM {m['versions'].get('vllm', '?')}; the model is a "
        f"{data['model']['description']}. Raw results: `docs/demo.json`."
    )


@region("performance")
def performance() -> str:
    s = scheduler_results("compare_scheduler")
    d = load_json("demo.json")
    chat = summarize(d, "chat")
    a, b = chat["vllm"], chat["kvoffload"]
    ov = overhead(d)
    trace = load_json("benchmarks/compare_scheduler.json")["trace"]
    ix = _index()
    total = load_json("benchmarks/compare_index.json")["total_ms"]
    se, ke, sl, kl = (
        s["simple", "eager"],
        s["kvoffload", "eager"],
        s["simple", "lazy"],
        s["kvoffload", "lazy"],
    )
    h, evict = "index/lookup/hit/48505", "cache/evict_insert/reserve_publish/48505"
    return (
        "\n".join(
            [
                f"- **End to end** (`scripts/demo.py`, the table above): mean time to first token "
                f"{a['ttft_mean_ms']:,.0f} → {b['ttft_mean_ms']:,.0f} ms "
                f"({ratio(b['ttft_mean_ms'] / a['ttft_mean_ms'])}), "
                f"{a['recomputed_tokens'] - b['recomputed_tokens']:,.0f} of "
                f"{a['recomputed_tokens']:,.0f} prefill tokens not recomputed, token-identical "
                f"outputs. With nothing to reuse, kvoffload's process CPU time was "
                f"{ov['cpu']:.3f}x vLLM's (median of {ov['runs']} runs each).",
                noreuse_line(),
                f"- **Scheduler side** (`benches/compare_scheduler.py`: "
                f"{trace['requests']}-request "
                f"trace, {trace['systems']} shared {trace['system_tokens']}-token prompts, vLLM's "
                f"real v1 `Scheduler`, GPU {trace['gpu_blocks']:,} / CPU {trace['cpu_blocks']:,} "
                f"blocks): kvoffload's scheduler-side work (its methods, and in lazy mode what it "
                f"adds to vLLM's free-queue calls) takes "
                f"{us(ke['connector_step']['mean_us'])} per step (eager) and "
                f"{us(kl['connector_step']['mean_us'])} (lazy) against "
                f"`SimpleCPUOffloadConnector`'s {us(se['connector_step']['mean_us'])} and "
                f"{us(sl['connector_step']['mean_us'])} in the same run — "
                f"**{ratio(se['connector_step']['mean_us'] / ke['connector_step']['mean_us'])} and "
                f"{ratio(sl['connector_step']['mean_us'] / kl['connector_step']['mean_us'])} "
                "less**, "
                f"{pct(ke['share'])} / {pct(kl['share'])} of the scheduler's step time instead of "
                f"{pct(se['share'])} / {pct(sl['share'])}, with CPU-hit tokens "
                f"{se['cpu_hit_tokens']:,} / {ke['cpu_hit_tokens']:,} (eager) and "
                f"{sl['cpu_hit_tokens']:,} / {kl['cpu_hit_tokens']:,} (lazy).",
                "- **Index through Python** (`benches/compare_index.py`, 128-block prefixes): "
                "find "
                f"+ pin {us(ix['find_pin']['kvoffload_us'])} vs vLLM `BlockPool` "
                f"{us(ix['find_pin']['vllm_us'])} ({ratio(ix['find_pin']['ratio'])}), unpin "
                f"{ratio(ix['unpin']['ratio'])}, a waiting request asking again "
                f"{ratio(ix['find_pin_repeat']['ratio'])}, the whole key stream "
                f"{ratio(total['vllm'] / total['kvoffload'])}.",
                f"- **Rust** (`cargo bench -p offload-core --bench index`, 48,505-block pool, per "
                f"core): lookup hit {sig(bench('index', h, 'M ops/s'))} M/s, miss "
                f"{sig(bench('index', 'index/lookup/miss/48505', 'M ops/s'))} M/s, insert "
                f"{sig(bench('index', 'index/insert/fill/48505', 'M ops/s'))} M/s, pin + unpin "
                f"{sig(bench('index', 'cache/pin_unpin/block/48505', 'M ops/s'))} M/s, evict + "
                f"insert {sig(bench('index', evict, 'M ops/s'))} M/s.",
                gpu_line(),
            ]
        )
        + "\n"
    )


def noreuse_line() -> str:
    d = load_json("benchmarks/noreuse.json")
    s, p = d["summary"], d["params"]
    return (
        f"- **Nothing to reuse** (`benches/noreuse.py`: {p['prompts']} unique "
        f"{p['prompt_tokens']:,}-token prompts on the demo's model, every block offloaded and "
        f"never read back, {s['passes']} passes each): time inside kvoffload's methods "
        f"(scheduler and worker, the step's copy included) was "
        f"{pct(s['overhead_inside'])} of the rest of the pass (median; at most "
        f"{pct(s['overhead_inside_max'])}; goal ≤ {pct(GOALS['noreuse_overhead'])}: "
        f"{met(s['overhead_inside_max'] <= GOALS['noreuse_overhead'])}). Against plain vLLM "
        "on fresh engines, "
        f"medians: process CPU {s['cpu_ratio']:.3f}x, wall {s['wall_ratio']:.3f}x, within this "
        "machine's run-to-run noise; outputs token-identical "
        f"{'in every pass' if s['identical'] else 'NOT in every pass'}."
    )


@region("noreuse")
def noreuse_table() -> str:
    d = load_json("benchmarks/noreuse.json")
    s, p = d["summary"], d["params"]
    methods = sorted(s["methods_first_pass"].items(), key=lambda kv: -kv[1]["total_s"])
    top = ", ".join(f"`{k}` {v['total_s'] * 1e3:.2f} ms" for k, v in methods[:4])

    def spread(cfg: str) -> str:
        walls = [r["wall_s"] for r in d["runs"] if r["config"] == cfg]
        return f"{min(walls):.2f} to {max(walls):.2f} s"

    return (
        f"{p['prompts']} unique {p['prompt_tokens']:,}-token prompts, {p['output_tokens']}-token "
        f"answers, `max_num_seqs` {p['concurrency']}, {s['passes']} passes per configuration "
        f"({machine_line(d['machine'])}):\n\n"
        "| | vLLM alone | + kvoffload eager |\n|---|---|---|\n"
        f"| pass wall time, median | {s['median']['vllm']['wall_s']:.2f} s | "
        f"{s['median']['kvoffload']['wall_s']:.2f} s ({s['wall_ratio']:.3f}x) |\n"
        f"| pass wall time, range | {spread('vllm')} | {spread('kvoffload')} |\n"
        f"| process CPU time, median | {s['median']['vllm']['cpu_s']:.2f} s | "
        f"{s['median']['kvoffload']['cpu_s']:.2f} s ({s['cpu_ratio']:.3f}x) |\n"
        f"| time inside kvoffload / rest of the pass | — | {pct(s['overhead_inside'])} "
        f"(median; max {pct(s['overhead_inside_max'])}) |\n"
        f"| outputs token-identical | — | {'yes' if s['identical'] else 'NO'} |\n\n"
        f"Largest parts in the first pass: {top}.\n"
    )


@region("bench-machine")
def bench_machine() -> str:
    rows = ["| raw results | measured on |", "|---|---|"]
    for name in ("compare_scheduler", "compare_index", "compare_index_grouped", "e2e"):
        m = load_json(f"benchmarks/{name}.json")["machine"]
        rows.append(f"| `docs/benchmarks/{name}.json` | {machine_line(m)} |")
    rows.append(
        "| `docs/benchmarks/cargo_bench_*.txt` | criterion's logs, which record no machine or "
        "date |"
    )
    return "\n".join(rows) + "\n"


region("scheduler")(scheduler_table)
region("scheduler-breakdown")(scheduler_breakdown)
region("gpu")(gpu_results)
region("gpu-summary")(gpu_summary)


@region("index")
def index_table() -> str:
    inter, grouped = _index(), _index("compare_index_grouped")
    pi = load_json("benchmarks/compare_index.json")["params"]
    pg = load_json("benchmarks/compare_index_grouped.json")["params"]
    ops = [
        ("insert", "store, free space"),
        ("evict_insert", "store, pool full (evicts)"),
        ("find", "find a prefix (vLLM: no pin)"),
        ("find_pin", "find + pin a prefix"),
        ("unpin", "unpin"),
        ("find_miss", "find, first block missing"),
        ("find_pin_repeat", "the same waiting request asks again"),
    ]
    rows = [
        "| per call (128 blocks) | vLLM | kvoffload | ratio | kvoffload, grouped order |",
        "|---|---|---|---|---|",
    ]
    for op, label in ops:
        r, g = inter[op], grouped[op]
        if r["kvoffload_us"] is None:
            rows.append(f"| {label} | {us(r['vllm_us'])} | — | — | — |")
            continue
        rows.append(
            f"| {label} | {us(r['vllm_us'])} | {us(r['kvoffload_us'])} | {ratio(r['ratio'])} "
            f"| {us(g['kvoffload_us'])} ({ratio(g['ratio'])}) |"
        )
    ti = load_json("benchmarks/compare_index.json")["total_ms"]
    tg = load_json("benchmarks/compare_index_grouped.json")["total_ms"]
    rows.append(
        f"| whole stream | {sig(ti['vllm'])} ms | {sig(ti['kvoffload'])} ms | "
        f"**{ratio(ti['vllm'] / ti['kvoffload'])}** | {sig(tg['kvoffload'])} ms "
        f"({ratio(tg['vllm'] / tg['kvoffload'])}) |"
    )
    head = (
        f"Pool of {pi['blocks']:,} blocks; p50 per call, the best of {pi['repeat']} whole runs "
        f"(grouped order: of {pg['repeat']}):"
    )
    hit, miss, fp = inter["get_hit"], inter["get_miss"], inter["find_pin"]
    tail = (
        f"vLLM's own per-key call (`get_cached_block`): {us(hit['vllm_us'])} hit, "
        f"{us(miss['vllm_us'])} miss. Goals: find + pin {GOALS['index_ratio']:g}x faster than "
        f"vLLM ({ratio(fp['ratio'])}: {met(fp['ratio'] >= GOALS['index_ratio'])}) and in "
        f"at most {us(GOALS['find_pin_us'])} ({us(fp['kvoffload_us'])}: "
        f"{met(fp['kvoffload_us'] <= GOALS['find_pin_us'])})."
    )
    return f"{head}\n\n" + "\n".join(rows) + f"\n\n{tail}\n"


def _ix(case: str) -> str:
    v, r = bench("index", case, "ns/op"), bench("index", case, "M ops/s")
    return f"{ns(v)} ({sig(r)} M/s)"


@region("rust-index")
def rust_index() -> str:
    small, big = "48505", "1048576"

    def both(prefix: str, fmt: Callable[[str], str] = _ix) -> str:
        return f"{fmt(f'{prefix}/{small}')} | {fmt(f'{prefix}/{big}')}"

    def plain(case: str) -> str:
        return ns(bench("index", case, "ns/op"))

    rows = [
        "| index (`--bench index`), median per operation | 48,505 blocks | 1 Mi blocks |",
        "|---|---|---|",
        f"| lookup hit, cold | {both('index/lookup/hit')} |",
        f"| lookup hit, hot | {both('index/lookup/hit_hot')} |",
        f"| lookup miss | {both('index/lookup/miss')} |",
        "| 128-block prefix (`ready_prefix`), per block | "
        f"{both('cache/ready_prefix/hit128', plain)} |",
        f"| insert (fill an empty index) | {both('index/insert/fill', plain)} |",
        f"| store into free space (reserve + publish) | "
        f"{plain('cache/store/reserve_publish_free/4096')} | — |",
        "| evict + insert (full pool: reserve + publish) | "
        f"{both('cache/evict_insert/reserve_publish')} |",
        f"| pin + unpin, one block | {both('cache/pin_unpin/block', plain)} |",
        "| pin + unpin, a 128-block prefix, per block | "
        f"{both('cache/pin_unpin/prefix128', plain)} |",
        f"| LRU move-to-back | — | {plain('lru/touch/remove_insert/1048576')} |",
    ]
    small_hit = bench("index", f"index/lookup/hit/{small}", "M ops/s")
    big_hit = bench("index", f"index/lookup/hit/{big}", "M ops/s")
    goal = GOALS["lookups_m_per_s"]
    return (
        "\n".join(rows)
        + f"\n\nGoal: {goal:g} M lookups/s per core — {met(small_hit >= goal)} at 48,505 blocks "
        f"({sig(small_hit)} M/s), {met(big_hit >= goal)} at 1 Mi blocks ({sig(big_hit)} M/s, "
        "cold).\n"
    )


@region("rust-planner")
def rust_planner() -> str:
    steps = [(n, bench("planner", f"planner/decode_step/{n}", "us/step")) for n in (64, 256, 1024)]
    sizes = " / ".join(str(n) for n, _ in steps)
    times = " / ".join(sig(v) for _, v in steps)
    per = " / ".join(f"{1000 * v / n:.0f}" for n, v in steps)
    rows = [
        "| planner (`--bench planner`), 16-token blocks, eager, pool full | median |",
        "|---|---|",
        f"| one decode step, {sizes} running requests | {times} µs ({per} ns per request) |",
        f"| per stored block: select + reserve (evicting) + hand out + complete, eager / lazy | "
        f"{sig(bench('planner', 'planner/store/128', 'ns/block'))} / "
        f"{sig(bench('planner', 'planner/store_lazy/128', 'ns/block'))} ns |",
        f"| per loaded block: lookup + `on_alloc` + hand out + complete | "
        f"{ns(bench('planner', 'planner/load/128', 'ns/block'))} |",
        f"| a waiting request asks again (cached answer) | "
        f"{ns(bench('planner', 'planner/lookup_repeat/128', 'ns/call'))} |",
        f"| per block of a first lookup (+ release), 300 prefixes in turn, stored by lazy "
        f"stores in prefix order / in vLLM's free order (last block first) | "
        f"{sig(bench('planner', 'planner/lookup_fresh/128', 'ns/block'))} / "
        f"{sig(bench('planner', 'planner/lookup_fresh_reversed/128', 'ns/block'))} ns |",
    ]
    return "\n".join(rows) + "\n"


@region("rust-transfer")
def rust_transfer() -> str:
    def cell(kind: str, order: str, n: int, key: str) -> str:
        case = f"transfer_{kind}/{order}/{n}"
        if case not in bench_lines("transfer"):
            return "—"
        return ns(bench("transfer", case, key))

    sizes = (1, 16, 256, 4096)
    head = " | ".join(f"{n} block{'s' if n > 1 else ''}" for n in sizes)
    rows = [
        "| transfer (`--bench transfer`), host backend, 2 regions of 4 KiB blocks, per block "
        f"| {head} |",
        "|---|" + "---|" * len(sizes),
    ]
    for label, kind, order, key in (
        (
            "submit (what the worker's Python step pays), scattered ids",
            "host",
            "scattered",
            "submit",
        ),
        ("submit, consecutive ids", "host", "consecutive", "submit"),
        (
            "round trip (submit → copied → completion seen), scattered ids",
            "host",
            "scattered",
            "round trip",
        ),
        ("round trip, consecutive ids (coalesced)", "host", "consecutive", "round trip"),
        (
            "engine overhead only (a backend that copies nothing), round trip, scattered",
            "overhead",
            "scattered",
            "round trip",
        ),
        ("engine overhead only, consecutive", "overhead", "consecutive", "round trip"),
    ):
        rows.append(f"| {label} | " + " | ".join(cell(kind, order, n, key) for n in sizes) + " |")
    co = bench("transfer", "coalesce/consecutive/4096", "ns/pair")
    cs = bench("transfer", "coalesce/scattered/4096", "ns/pair")
    return (
        "\n".join(rows)
        + f"\n\nCoalescing alone: {ns(co)} per pair of consecutive ids, {ns(cs)} per pair of "
        "scattered ones.\n"
    )


@region("kv-layouts")
def kv_layouts_table() -> str:
    d = load_json("benchmarks/kv_layouts.json")
    p = d["params"]
    first = d["rows"][0]
    rows = [
        "| vLLM KV layout | regions | copy runs per step | bytes per run |",
        "|---|---|---|---|",
    ]
    for r in d["rows"]:
        rows.append(
            f"| `{r['layout']}` | {r['regions']} | {sig(r['runs_per_step'])} "
            f"| {sig(r['bytes_per_run'] / 1024)} KiB |"
        )
    return (
        f"{p['layers']} layers, {p['kv_heads']} KV heads of {p['head_size']}, fp16, 16-token "
        f"blocks ({sig(first['block_bytes'] / 2**20)} MiB per block); "
        f"{first['blocks_per_step']} blocks stored per step ({p['requests']} requests x "
        f"{p['blocks_per_request']} consecutive blocks at random GPU ids), mean of "
        f"{p['steps']} steps ({machine_line(d['machine'])}):\n\n"
        + "\n".join(rows)
        + f"\n\nThe block-outer layout needs {ratio(d['fewer_runs'])} fewer copy runs per step.\n"
    )


Cells = Callable[[Callable[[dict[str, Any]], str]], str]


def ttft_rows(cells: Cells, base: dict[str, Any]) -> list[str]:
    """Mean TTFT (with how much lower than ``base``) and p50 / p90 rows of a TTFT table."""

    def lower(r: dict[str, Any]) -> str:
        return "" if r is base else f" ({ratio(base['ttft_mean_ms'] / r['ttft_mean_ms'])} lower)"

    return [
        "| mean time to first token | "
        + cells(lambda r: f"{r['ttft_mean_ms']:,.0f} ms{lower(r)}")
        + " |",
        "| time to first token, p50 / p90 | "
        + cells(lambda r: f"{r['ttft_p50_ms']:,.0f} / {r['ttft_p90_ms']:,.0f} ms")
        + " |",
    ]


def identical_row(cells: Cells, base: dict[str, Any]) -> str:
    return (
        "| outputs token-identical to vLLM alone | "
        + cells(lambda r: "—" if r is base else ("yes" if r["identical"] else "NO"))
        + " |"
    )


@region("e2e")
def e2e_table() -> str:
    d = load_json("benchmarks/e2e.json")
    p = d["params"]
    res = {r["config"]: r for r in d["results"]}
    cfgs = [c for c in ("off", "eager", "lazy", "simple-eager", "simple-lazy") if c in res]
    names = {
        "off": "vLLM alone",
        "eager": "+ kvoffload eager",
        "lazy": "+ kvoffload lazy",
        "simple-eager": "+ Simple eager",
        "simple-lazy": "+ Simple lazy",
    }
    base = res["off"]
    rows = ["| | " + " | ".join(names[c] for c in cfgs) + " |", "|---|" + "---|" * len(cfgs)]

    def cells(f: Callable[[dict[str, Any]], str]) -> str:
        return " | ".join(f(res[c]) for c in cfgs)

    def speedup(r: dict[str, Any]) -> str:
        return "" if r is base else f" ({ratio(r['output_tok_s'] / base['output_tok_s'])})"

    rows += ttft_rows(cells, base)
    rows += [
        "| output tokens/s | " + cells(lambda r: f"{r['output_tok_s']:,.1f}{speedup(r)}") + " |",
        "| wall time | " + cells(lambda r: f"{r['wall_s']:.1f} s") + " |",
        "| prompt tokens from CPU / recomputed | "
        + cells(lambda r: f"{r['cpu_hit_tokens']:,.0f} / {r['recomputed_tokens']:,.0f}")
        + " |",
        identical_row(cells, base),
    ]
    n = p["repeat"]
    how = (
        "one run per configuration"
        if n == 1
        else f"{n} runs per configuration, alternating (TTFT over all requests of all runs, "
        "median wall time)"
    )
    head = (
        f"{d['model_description']}; {describe_workload(p)}; vLLM KV cache "
        f"{p['kv_cache_mib']:g} MiB, "
        f"CPU pool {p['cpu_mib']:g} MiB, `max_num_seqs` {p['concurrency']}. {how.capitalize()} "
        f"({machine_line(d['machine'])}):"
    )
    return f"{head}\n\n" + "\n".join(rows) + "\n"


def tier_ttft_rows(res: dict[str, dict[str, Any]], cols: list[tuple[str, str]]) -> list[str]:
    """A tier TTFT table's rows: one column per run in ``cols`` (key, heading), compared
    with the ``"recompute"`` run."""
    rows = ["| | " + " | ".join(n for _, n in cols) + " |", "|---|" + "---|" * len(cols)]
    base = res["recompute"]

    def cells(fmt: Callable[[dict[str, Any]], str]) -> str:
        return " | ".join(fmt(res[k]) for k, _ in cols)

    rows += ttft_rows(cells, base)
    rows += [
        "| prompt tokens from kvoffload / recomputed | "
        + cells(lambda r: f"{r['connector_hit_tokens']:,} / {r['recomputed_tokens']:,}")
        + " |",
        identical_row(cells, base),
    ]
    return rows


@region("disk-ttft")
def disk_ttft_table() -> str:
    d = load_json("benchmarks/disk_ttft.json")
    p, res, disk = d["params"], d["results"], d["disk"]
    cols = [("recompute", "recompute (vLLM alone)"), ("cpu", "CPU hit"),
            ("disk", "disk hit (after a restart)")]  # fmt: skip
    rows = tier_ttft_rows(res, cols)
    head = (
        f"{d['model_description']}; {p['users']} users, each a "
        f"{p['system_tokens']:,}-token document + a {p['question_tokens']}-token question, "
        f"{p['output_tokens']}-token answers; vLLM KV cache {p['kv_cache_mib']:g} MiB; CPU "
        f"run: a {p['cpu_mib']:g} MiB pool; disk run: Simple's disk keys with `disk_persist`, "
        f"no CPU budget, a fresh engine reading what the previous one wrote "
        f"({disk.get('disk_reads', 0):,} blocks read, "
        f"{disk.get('disk_bytes_read', 0) / 2**20:,.1f} MiB) ({machine_line(d['machine'])}):"
    )
    return f"{head}\n\n" + "\n".join(rows) + "\n"


def _checksum_share(c: dict[str, Any], ck: dict[str, Any]) -> float:
    """The time verification adds to a read of configuration `c`, against the read's own
    time: with `O_DIRECT`, the copy out of the I/O buffer verifying as it goes against the
    plain copy; with the page cache, summing the value the kernel's copy left in cache."""
    read = c["medians"]["tier_read_seq_gbps"]
    if c["mode"] == "direct":
        return read * (1 / ck["copy_verified_gbps"] - 1 / ck["copy_gbps"])
    return read / ck["checksum_in_cache_gbps"]


def _size(block_bytes: float) -> str:
    return f"{block_bytes / 2**20:g} MiB" if block_bytes >= 2**20 else f"{block_bytes / 1024:g} KiB"


def _io(c: dict[str, Any]) -> str:
    return "O_DIRECT" if c["mode"] == "direct" else "page cache"


def _sizes(configs: list[dict[str, Any]]) -> str:
    return ", ".join(f"{_size(c['block_bytes'])} {_io(c)}" for c in configs)


@region("disk-tier")
def disk_tier_table() -> str:
    d = load_json("benchmarks/disk_tier.json")
    configs, ck = d["configs"], d["checksum"]
    rows = [
        "| block | I/O | raw sequential read | tier read, in order | "
        "raw, in order as the tier reads | shuffled | raw, shuffled as the tier reads | "
        "Simple's loop (Python) | tier vs Simple's loop | "
        "checksum share of a read | raw write | tier write |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in configs:
        m, r = c["medians"], c["ratios"]
        rows.append(
            f"| {_size(c['block_bytes'])} | {_io(c)} | "
            f"{m['raw_read_gbps']:.2f} | {m['tier_read_seq_gbps']:.2f} "
            f"({r['read_seq_vs_raw']:.2f}x) | "
            f"{m['raw_read_runs_gbps']:.2f} ({r['read_seq_vs_raw_runs']:.2f}x) | "
            f"{m['tier_read_shuffled_gbps']:.2f} ({r['read_shuffled_vs_raw']:.2f}x) | "
            f"{m['raw_read_slots_gbps']:.2f} ({r['read_shuffled_vs_raw_slots']:.2f}x) | "
            f"{m['python_simple_read_gbps']:.2f} | "
            f"**{r['read_vs_python_simple']:.2f}x** | "
            f"{_checksum_share(c, ck):.0%} | "
            f"{m['raw_write_gbps']:.2f} | {m['tier_write_gbps']:.2f} ({r['write_vs_raw']:.2f}x) |"
        )
    direct = [c for c in configs if c["mode"] == "direct"]

    def meets(pick: Any) -> list[dict[str, Any]]:
        return [c for c in direct if pick(c)]

    seq = meets(lambda c: c["ratios"]["read_seq_vs_raw"] >= 0.9)
    shuf = meets(lambda c: c["ratios"]["read_shuffled_vs_raw"] >= 0.8)
    wr = meets(lambda c: c["ratios"]["write_vs_raw"] >= 0.85)
    fast = [c for c in configs if c["ratios"]["read_vs_python_simple"] >= 1.5]
    # Where 1.5x Simple's loop is faster than every raw read of the same file (sequential,
    # and the tier's two patterns), no reader measured reaches it: the device (or the
    # page cache's copy) is the limit.
    capped = [
        c
        for c in configs
        if c not in fast and 1.5 * c["medians"]["python_simple_read_gbps"] > max(_raw_reads(c))
    ]
    short = [c for c in configs if c not in fast and c not in capped]
    ck_ok = [c for c in configs if _checksum_share(c, ck) <= 0.10]
    head = (
        f"Disk tier bandwidth in GB/s, `benches/disk_tier.py` ({d['bytes_per_run'] / 2**20:g} MiB "
        f"per run and block size, batches of {d['batch']} blocks, medians of {d['runs']} "
        f"interleaved runs, {d['filesystem']}; {machine_line(d['machine'])}; a virtual disk "
        f"whose series' runs differ by up to {_spread(configs):.1f}x: every run is in the "
        "JSON). Ratios in parentheses are against the raw sequential figure of the same row "
        "unless said otherwise:"
    )
    goals = [
        f"- Reads >= 0.90x raw sequential (`O_DIRECT`): met for {len(seq)} of {len(direct)} "
        f"block sizes ({_sizes(seq) or 'none'}); shuffled >= 0.80x: {len(shuf)} of "
        f"{len(direct)}; writes >= 0.85x raw: {len(wr)} of {len(direct)}. "
        "A batch's blocks go to consecutive slots, so blocks read in the order they were "
        "stored move in runs of consecutive slots, one I/O a run (at most 4 MiB, and short "
        f"enough to keep {d['io_threads']:.0f} in flight, as many as the tier's I/O "
        "threads); blocks asked for in another order, one slot per I/O. The columns "
        '"raw, in order as the tier reads" and "raw, shuffled as the tier reads" make the '
        "same I/Os with nothing else (in parentheses: the tier's read against them). Where "
        "they are below the sequential read (one 4 MiB read at a time), the device, not "
        "the tier, takes the difference. The CPU blocks the tier reads into and writes "
        "from are on huge pages (the CPU pool asks for them by default), so a layer slice "
        "of a page or more is one segment of a device request; the raw reads' buffers are "
        "on ordinary pages, as `dd`'s are, which is how the tier can beat them."
        + _page_cache_width(configs),
        f"- Reads >= 1.5x Simple's one-I/O-at-a-time loop: met for {_sizes(fast) or 'none'}. "
        f"Out of reach on this device for {_sizes(capped) or 'none'}: there 1.5x Simple's loop "
        "is more than every raw read of the same file measured (the loop already reads near "
        "the device's or the page cache copy's speed). Below the goal: "
        + (
            ", ".join(
                f"{_size(c['block_bytes'])} {_io(c)} ({c['ratios']['read_vs_python_simple']:.2f}x)"
                for c in short
            )
            or "none"
        )
        + ". Through the page cache Simple's loop reads every block into one reused buffer "
        "that stays in the core's cache, and checks nothing; the tier's kernel copy goes "
        "into the CPU blocks the scheduler reserved, and it sums every byte it reads.",
        f"- Checksum <= 10% of a read's time: met for {len(ck_ok)} of {len(configs)} "
        f"({_sizes(ck_ok) or 'none'}). With `O_DIRECT` the tier sums a block in the "
        f"copy out of its I/O buffer ({ck['copy_verified_gbps']:.1f} GB/s against "
        f"{ck['copy_gbps']:.1f} GB/s for the copy alone, one core, blocks not in cache; "
        f"a separate pass would run at {ck['checksum_pass_gbps']:.1f} GB/s, "
        f"{_disk_pass_share(configs, ck):.0%} of the largest `O_DIRECT` block's read); "
        "with the page cache it sums each ~256 KiB the kernel's copy just put in the CPU "
        f"block ({ck['checksum_in_cache_gbps']:.1f} GB/s in cache). The sums run on the I/O "
        "threads, beside other blocks' I/O, so a read's wall time pays less than this "
        "share where a core is free; the column is the share if none were. The sums are "
        "this x86_64 machine's (the SSE2/AVX2 kernels); aarch64 runs a NEON kernel, checked "
        "to give the same sums under qemu (`scripts/check_value_sum_aarch64.sh`) but never "
        "timed on ARM hardware.",
    ]
    ix = d.get("index")
    if ix:
        best = max(ix["batched_hit_lookups_per_s"], ix["hit_lookups_per_s"])
        # `benches/disk_tier.py --only-index` re-measures the index alone, on its own date.
        when = f" (measured {ix['machine']['date']})" if "machine" in ix else ""
        goals.append(
            f"- Scale{when}: the in-memory index of {ix['entries']:,.0f} slots (a 10 TB tier of "
            f"2 MiB blocks) takes **{ix['host_bytes_per_block']:.0f} bytes per block** "
            "(goal <= 64; every array's allocated capacity: 1.5 index entries a slot, each a "
            "16-bit tag, a 16-byte digest and a 16-byte record of slot, recency and state, "
            "and a 4-byte owner per slot; tags and digests, what a lookup reads, are arrays "
            "of their own). "
            f"Lookups per CPU second, one core: hits "
            f"{ix['hit_lookups_per_s'] / 1e6:.1f} M, misses {ix['miss_lookups_per_s'] / 1e6:.1f} M "
            f"one at a time; in batches of 64 with sets and digests prefetched ahead (as "
            f"the tier's `exists` asks), hits {ix['batched_hit_lookups_per_s'] / 1e6:.1f} M, "
            f"misses {ix['batched_miss_lookups_per_s'] / 1e6:.1f} M. "
            + (
                "Goal >= 50 M/s met for batched lookups"
                + (
                    "."
                    if ix["hit_lookups_per_s"] >= 50e6
                    else "; a lone hit waits for its set and then its digest, two memory "
                    "latencies, so one at a time stays below it."
                )
                if best >= 50e6
                else "Goal >= 50 M/s **not met**: at this size every lookup is a random "
                "access to a set's tags in memory, and a hit one more to its digest; the "
                "figure is this VM's memory latency divided by the misses a core overlaps."
            )
        )
    rb = d.get("rebuild")
    if rb:
        per = rb["open_seconds"] / max(rb["blocks"], 1)
        # The index file is a 4 KiB header and its entries.
        entry_bytes = int(rb["entry_bytes"])
        entries_per_slot = (rb["index_file_bytes"] - 4096) / entry_bytes / max(rb["slots"], 1)
        goals.append(
            f"- Restart: {rb['blocks']:,.0f} blocks recovered in {rb['open_seconds']:.2f} s "
            f"(index file {rb['index_file_bytes'] / 2**20:,.0f} MiB, dropped from the page cache "
            f"first; {rb['seconds_per_100k']:.3f} s per 100k blocks, goal <= 1 s). 5 M blocks "
            f"did not fit this disk (a slot takes at least 4 KiB: {5e6 * 4096 / 1e9:.0f} GB); the "
            f"rebuild reads "
            f"the index file once and decodes each {entry_bytes}-byte entry "
            f"({entries_per_slot:.2f} a slot), so its time grows linearly: "
            f"about {per * 5e6:.1f} s for 5 M blocks."
        )
    return f"{head}\n\n" + "\n".join(rows) + "\n\n" + "\n".join(goals) + "\n"


def _page_cache_width(configs: list[dict[str, Any]]) -> str:
    """What the page cache rows ran on, where the run recorded each row's I/O threads."""
    widths = {int(c["io_threads"]) for c in configs if c["mode"] != "direct" and "io_threads" in c}
    if len(widths) != 1:
        return ""
    (w,) = widths
    return (
        f" Through the page cache a batch's I/Os run on {w} threads, no more than the "
        "machine's cores (each is the kernel copying on a core), and so do the raw reads "
        "as the tier reads them."
    )


def _raw_reads(c: dict[str, Any]) -> list[float]:
    """Every raw read of configuration `c`: sequential, and at the tier's two patterns."""
    m = c["medians"]
    return [m["raw_read_gbps"], m["raw_read_runs_gbps"], m["raw_read_slots_gbps"]]


def _spread(configs: list[dict[str, Any]]) -> float:
    """The largest max/min of one series' runs."""
    return max(max(v) / min(v) for c in configs for v in c["runs_gbps"].values())


def _disk_pass_share(configs: list[dict[str, Any]], ck: dict[str, Any]) -> float:
    """A separate checksum pass's time against a 2 MiB O_DIRECT read (the old cost)."""
    big = max((c for c in configs if c["mode"] == "direct"), key=lambda c: c["block_bytes"])
    return big["medians"]["tier_read_seq_gbps"] / ck["checksum_pass_gbps"]


@region("remote-tier")
def remote_tier_table() -> str:
    d = load_json("benchmarks/remote_tier.json")
    p, res, f = d["params"], d["results"], d["fetch"]
    cols = [("recompute", "recompute (vLLM alone)"), ("local", "local CPU hit"),
            ("remote", "remote hit (Redis Cluster)")]  # fmt: skip
    rows = tier_ttft_rows(res, cols)
    prompt = p["system_tokens"] + p["question_tokens"]
    # Recomputation's cost per prompt token, and the bandwidth a fetch needs to beat it.
    recompute_s_per_token = res["recompute"]["ttft_mean_ms"] / 1e3 / prompt
    need = f["kv_bytes_per_token"] / recompute_s_per_token
    got = f["fetch_bytes_per_s"]
    per_fetch = f["fetch_bytes"] / max(f["fetch_round_trips"], 1)
    prefix_mib = f["kv_bytes_per_token"] * p["system_tokens"] / 2**20
    head = (
        f"{d['model_description']}; {p['users']} users, each a "
        f"{p['system_tokens']:,}-token document + a {p['question_tokens']}-token question, "
        f"{p['output_tokens']}-token answers; vLLM KV cache {p['kv_cache_mib']:g} MiB, CPU pool "
        f"{p['cpu_mib']:g} MiB, a 3-master Redis Cluster on loopback "
        f"({machine_line(d['machine'])}):"
    )
    tail = (
        f"The remote run fetched {f['fetch_bytes'] / 2**20:,.1f} MiB in "
        f"{f['fetch_round_trips']} round trips ({per_fetch / 2**20:,.2f} MiB each), waiting "
        f"{f['fetch_seconds'] * 1e3:,.0f} ms in all: **{got / 2**20:,.0f} MiB/s per fetch**. "
        f"This model's KV is {f['kv_bytes_per_token']:,.0f} bytes per token "
        f"({prefix_mib:,.1f} MiB per {p['system_tokens']:,}-token prefix), and recomputing "
        f"cost {recompute_s_per_token * 1e3:,.2f} ms per prompt token here, so a remote hit "
        f"beats recomputation while the tier delivers more than "
        f"**{need / 2**20:,.1f} MiB/s** ({need * 8 / 1e9:,.2f} Gbit/s) to the engine."
    )
    return f"{head}\n\n" + "\n".join(rows) + f"\n\n{tail}\n"


def describe_workload(p: dict[str, Any]) -> str:
    return (
        f"{p['users']} users x {p['turns']} turns, {p['system_tokens']:,}-token system prompts + "
        f"{p['question_tokens']}-token questions, {p['output_tokens']}-token answers"
    )


# ---- documents -----------------------------------------------------------------------------


def render(text: str) -> str:
    """``text`` with every generated region rewritten from the data."""

    def sub(m: re.Match[str]) -> str:
        name = m["name"]
        if name not in REGIONS:
            raise RenderError(f"unknown generated region {name!r}")
        return m.group(1) + REGIONS[name]() + m.group(4)

    return MARKER.sub(sub, text)


def render_all(*, write: bool) -> list[str]:
    """Renders every document; returns those whose text changed (written when ``write``)."""
    load_json.cache_clear()
    bench_lines.cache_clear()
    changed = []
    for rel in DOCUMENTS:
        path = REPO / rel
        old = path.read_text()
        new = render(old)
        if new != old:
            changed.append(rel)
            if write:
                path.write_text(new)
    return changed


def plots() -> None:
    from demo_report import plot
    from plot_benchmarks import main as plot_benchmarks

    plot(load_json("demo.json"), DOCS / "demo.png")
    plot_benchmarks([])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    ap.add_argument(
        "--plots", action="store_true", help="also redraw docs/demo.png, docs/benchmarks.png"
    )
    args = ap.parse_args()
    changed = render_all(write=not args.check)
    if args.plots and not args.check:
        plots()
    for rel in changed:
        print(f"{'stale' if args.check else 'rewrote'}: {rel}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
