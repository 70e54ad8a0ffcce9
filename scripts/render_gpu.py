"""The GPU check's regions (``scripts/gpu_check.py --out``'s raw results,
``docs/benchmarks/gpu_check.json``): the full results in docs/gpu_check.md, the summary in
the README's GPU section and the GPU bullet of its performance list, rendered by
``scripts/render_docs.py``.

The check measures configurations, each a KV cache layout and a copy path (``layouts``
holds one entry per configuration, in the order measured; ``rows``, ``lanes``, ``decode``
and ``matmul`` entries carry the ``layout`` and ``copy`` they belong to). Nothing here
lists the configurations: the documents show what the data holds. The one configuration
named here is kvoffload's default, ``DEFAULT``.

A key the data lacks (e.g. a JSON written by an older ``gpu_check.py``) is a
``RenderError`` naming the key and where it was expected."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from render_data import GOALS, RenderError, load_json, met, pct, sig

SOURCE = "benchmarks/gpu_check.json"

#: kvoffload's default configuration: the block-contiguous layout it asks vLLM for
#: (``kv_cache_layout: "auto"``), copied on the GPU's copy engines.
DEFAULT = ("cross-layer", "dma")

#: How the documents name ``DEFAULT``.
DEFAULT_NAME = (
    "the default configuration (the block-contiguous layout on the copy engines, "
    f"{'/'.join(DEFAULT)})"
)

#: What a layout is, beyond what the data says (its regions and their sizes).
KNOWN_LAYOUTS = {
    "cross-layer": "the block-contiguous layout kvoffload asks vLLM for, BLNHC",
    "per-layer": "vLLM's per-layer layout, where a backend cannot take BLNHC",
}

#: What a copy path is: its short name (for headings), the preposition that goes with it in
#: a sentence, and what it does.
KNOWN_COPIES = {
    "dma": (
        "copy engines",
        "on",
        "the GPU's copy engines (`cuMemcpyBatchAsync`, no SMs used: kvoffload's copy path)",
    ),
    "kernel": (
        "dropped copy kernel",
        "with",
        "an SM copy kernel (a few thread blocks stream the job's runs between device memory "
        "and mapped pinned host memory), measured by commit 6a161cc and dropped since: "
        "faster on small jobs, but it took SM time and memory bandwidth from compute",
    ),
}

#: The sizes whose rows the bandwidth goal is judged on (large enough to be bandwidth-bound).
GOAL_SIZES = (256, 4096)

#: The size whose shares are stated beside the goal (a small job, still several blocks).
SMALL_SIZE = 16

Config = tuple[str, str]


class Fields:
    """A JSON object of the GPU check whose missing key is a ``RenderError`` naming the
    file, the path to the object and the key. Nested objects and lists of objects come back
    wrapped the same way."""

    def __init__(self, data: Any, where: str = "") -> None:
        """``where``: the path to ``data`` in the file (``rows[2]``), empty at the top."""
        self._where = where or "the top level"
        if not isinstance(data, dict):
            raise RenderError(
                f"docs/{SOURCE}: {self._where} is {type(data).__name__}, not an object"
            )
        self._data, self._prefix = data, f"{where}." if where else ""

    def __getitem__(self, key: str) -> Any:
        if key not in self._data:
            raise RenderError(
                f"docs/{SOURCE}: {self._where} has no {key!r} (a file written by an older "
                "scripts/gpu_check.py? rerun it)"
            )
        return _wrap(self._data[key], self._prefix + key)

    def get(self, key: str) -> Any:
        """An optional key: None when absent."""
        return _wrap(self._data[key], self._prefix + key) if key in self._data else None

    def items(self) -> list[tuple[str, Any]]:
        return [(k, self[k]) for k in self._data]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __bool__(self) -> bool:
        return bool(self._data)


def _wrap(value: Any, where: str) -> Any:
    if isinstance(value, dict):
        return Fields(value, where)
    if isinstance(value, list):
        return [_wrap(v, f"{where}[{i}]") for i, v in enumerate(value)]
    return value


def gpu_data() -> Fields:
    return Fields(load_json(SOURCE))


# ---- configurations and their entries --------------------------------------------------------


def _config(e: Fields) -> Config:
    return e["layout"], e["copy"]


def _list(d: Fields, key: str) -> list[Fields]:
    """``d[key]``, which must be a list (one entry per configuration measured)."""
    value = d[key]
    if not isinstance(value, list):
        raise RenderError(
            f"docs/{SOURCE}: {key} is not a list (a file written by an older "
            "scripts/gpu_check.py? rerun it)"
        )
    return value


def _entry(d: Fields, key: str, config: Config) -> Fields | None:
    """The ``lanes`` / ``decode`` / ``matmul`` entry of ``config``; None when not measured."""
    return next((e for e in _list(d, key) if _config(e) == config), None)


def _info(d: Fields, config: Config) -> Fields | None:
    """The ``layouts`` entry of ``config``; None when the run did not measure it."""
    return _entry(d, "layouts", config)


def _rows(d: Fields, config: Config) -> list[Fields]:
    return [r for r in _list(d, "rows") if _config(r) == config]


def _row(d: Fields, config: Config, blocks: int) -> Fields:
    for r in _rows(d, config):
        if r["blocks"] == blocks:
            return r
    raise RenderError(f"docs/{SOURCE}: rows has no {_short(config)} row at {blocks} blocks")


# ---- names -----------------------------------------------------------------------------------


def _short(config: Config) -> str:
    """``per-layer/dma``."""
    return "/".join(config)


def _heading(config: Config) -> str:
    """``per-layer, copy engines (dma)``."""
    layout, copy = config
    known = KNOWN_COPIES.get(copy)
    return f"{layout}, {known[0]} ({copy})" if known else f"{layout}, copy path {copy}"


def _copy_phrase(copy: str) -> str:
    """``on the copy engines (dma)``, ``with the copy kernel (kernel)``."""
    known = KNOWN_COPIES.get(copy)
    return f"{known[1]} the {known[0]} ({copy})" if known else f"with copy path {copy}"


def _bytes(n: float) -> str:
    return f"{sig(n / 2**20)} MiB" if n >= 2**20 else f"{sig(n / 2**10)} KiB"


def _change(percent: float) -> str:
    """A slowdown in percent, signed: +0.9%, -0.3%."""
    return f"{percent:+.1f}%"


def _layout_label(info: Fields) -> str:
    """``per-layer (vLLM's per-layer layout, where a backend cannot take BLNHC; 32 KiB per
    copy)``."""
    known = KNOWN_LAYOUTS.get(info["layout"])
    size = f"{_bytes(info['region_block_bytes'])} per copy"
    return f"{info['layout']} ({known}; {size})" if known else f"{info['layout']} ({size})"


# ---- goals -----------------------------------------------------------------------------------


def _shares(r: Fields) -> tuple[float, float]:
    """kvoffload's store and load bandwidth as shares of one large pinned copy's, same row."""
    return r["store_gbps"] / r["memcpy_d2h_gbps"], r["load_gbps"] / r["memcpy_h2d_gbps"]


def _best_shares(d: Fields, config: Config) -> tuple[tuple[float, int], tuple[float, int]]:
    """The best store and load shares (with their sizes) over the ``GOAL_SIZES`` rows."""
    rows = [r for r in _rows(d, config) if r["blocks"] in GOAL_SIZES]
    if not rows:
        raise RenderError(f"docs/{SOURCE}: rows has no {_short(config)} row at {GOAL_SIZES} blocks")
    store = max((_shares(r)[0], r["blocks"]) for r in rows)
    load = max((_shares(r)[1], r["blocks"]) for r in rows)
    return store, load


def _copy_ok(d: Fields, config: Config) -> bool:
    """Whether ``config`` meets the bandwidth goal."""
    (s, _), (lo, _) = _best_shares(d, config)
    return min(s, lo) >= GOALS["gpu_copy_share"]


def _decode_ok(d: Fields, config: Config) -> bool | None:
    """Whether ``config`` meets the decode goal; None when its decode was not measured."""
    e = _entry(d, "decode", config)
    return None if e is None else e["slowdown_pct"] / 100 < GOALS["gpu_decode_slowdown"]


def _bandwidth_verdict(d: Fields, info: Fields) -> str:
    config = _config(info)
    (s, sn), (lo, ln) = _best_shares(d, config)
    best = (
        f"store {pct(s)} / load {pct(lo)} at {sn:,} blocks"
        if sn == ln
        else f"store {pct(s)} (at {sn:,} blocks) / load {pct(lo)} (at {ln:,} blocks)"
    )
    small = _shares(_row(d, config, SMALL_SIZE))
    return (
        f"{_heading(config)}: {best}; at {SMALL_SIZE} blocks {pct(small[0])} / "
        f"{pct(small[1])} — {met(_copy_ok(d, config))}"
    )


def _decode_verdict(d: Fields, info: Fields) -> str:
    config = _config(info)
    e = _entry(d, "decode", config)
    if e is None:
        return f"{_heading(config)}: not measured in this run"
    return f"{_heading(config)}: {_change(e['slowdown_pct'])} — {met(bool(_decode_ok(d, config)))}"


def _default_verdict(d: Fields) -> str:
    """Whether kvoffload's default configuration meets both goals, as a sentence."""
    what = DEFAULT_NAME[0].upper() + DEFAULT_NAME[1:]
    if _info(d, DEFAULT) is None:
        return f"{what} was not measured in this run."
    copy, decode = _copy_ok(d, DEFAULT), _decode_ok(d, DEFAULT)
    if decode is None:
        return (
            f"{what} {'meets' if copy else '**does not meet**'} the bandwidth goal; its decode "
            "slowdown was not measured in this run."
        )
    if copy and decode:
        return f"{what} meets both goals."
    if not copy and not decode:
        return f"{what} **meets neither goal**."
    good, bad = ("bandwidth", "decode") if copy else ("decode", "bandwidth")
    return f"{what} meets the {good} goal but **not the {bad} goal**."


# ---- docs/gpu_check.md -----------------------------------------------------------------------


def _measured(d: Fields) -> str:
    m = d["meta"]
    return (
        f"Measured {m['date']} on {m['gpu']} ({m['gpu_memory_gib']:g} GiB), torch "
        f"{m['torch']} (CUDA {m['torch_cuda']}), Python {m['python']}, {m['cpu_count']} CPU "
        f"cores, in {m['seconds']:.0f} s."
    )


def _copy_paths(d: Fields) -> list[str]:
    """The copy paths the round trips were checked with, in the order first met."""
    return list(dict.fromkeys(p for info in d["layouts"] for p in info["correct"]))


def _failed_paths(d: Fields) -> list[str]:
    """The configurations and copy paths whose round trips did not match byte for byte."""
    return [
        f"{_short(_config(info))}: {path}"
        for info in d["layouts"]
        for path, ok in info["correct"].items()
        if not ok
    ]


def _clean_run(d: Fields) -> bool:
    """Every round trip matched and nothing stopped the run."""
    return bool(d["ok"]) and not _failed_paths(d) and d["meta"].get("error") is None


def _correct(d: Fields) -> str:
    """Whether every round trip matched, and the error that stopped the run, if one did."""
    bad = _failed_paths(d)
    text = (
        "Every round trip matched byte for byte (copy paths: " + ", ".join(_copy_paths(d)) + ")."
        if d["ok"] and not bad
        else "**Not every round trip matched** (" + ("; ".join(bad) or "see the raw results") + ")."
    )
    error = d["meta"].get("error")
    if error is not None:
        text += f" **The run stopped early:** `{error}`."
    return text


def _table(d: Fields, config: Config) -> str:
    rows = [
        "| blocks | MiB | kvoffload store / load GB/s | one large pinned copy D2H / H2D GB/s "
        "| kvoffload / large copy, store / load | torch `copy_` loop D2H / H2D GB/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in _rows(d, config):
        s, lo = _shares(r)
        rows.append(
            f"| {r['blocks']:,} | {sig(r['mib'])} | {sig(r['store_gbps'])} / "
            f"{sig(r['load_gbps'])} | {sig(r['memcpy_d2h_gbps'])} / {sig(r['memcpy_h2d_gbps'])} "
            f"| {pct(s)} / {pct(lo)} | {sig(r['torch_d2h_gbps'])} / {sig(r['torch_h2d_gbps'])} |"
        )
    return "\n".join(rows)


def _lanes_text(e: Fields) -> str:
    return (
        f"a {e['load_blocks']}-block load took {sig(e['load_alone_ms'])} ms alone and "
        f"{sig(e['load_behind_stores_ms'])} ms behind {e['stores']} stores of "
        f"{e['store_blocks']} blocks (all done after {sig(e['stores_done_ms'])} ms); "
        f"{e['stores_pending_at_load']} of the {e['stores']} stores were still pending when it "
        f"completed: {'ok' if e['ok'] else '**NOT ok**'}."
    )


def _decode_text(e: Fields) -> str:
    return (
        f"{sig(e['step_ms'])} ms per step alone ({sig(e['weight_gbps'])} GB/s of weights), "
        f"{_change(e['slowdown_pct'])} while kvoffload stored and loaded "
        f"{e['blocks_per_job']}-block jobs back to back at {sig(e['copy_gbps_during'])} GB/s."
    )


def _matmul_text(e: Fields) -> str:
    return (
        f"{e['alone_s']:.3f} s alone ({e['matmul_size']}³ bf16, {e['iterations']:,} "
        f"iterations on the compute stream, {sig(e['alone_tflops'])} TFLOP/s), "
        f"{_change(e['slowdown_pct'])} while kvoffload stored and loaded "
        f"{e['blocks_per_job']:,}-block jobs at {sig(e['copy_gbps_during'])} GB/s."
    )


#: The per-configuration checks after the table: (JSON key, label, how an entry reads).
CHECK_LINES = (
    ("lanes", "Lanes", _lanes_text),
    ("decode", "Decode proxy", _decode_text),
    ("matmul", "Matmul loop", _matmul_text),
)


def _check_line(d: Fields, config: Config, key: str, label: str, text: Any) -> str:
    e = _entry(d, key, config)
    return f"- {label}: " + ("not measured in this run." if e is None else text(e))


def _copy_description(copy: str) -> str:
    known = KNOWN_COPIES.get(copy)
    return f"copied by {known[2]}" if known else f"copied with copy path {copy}"


def _section(d: Fields, info: Fields) -> str:
    """One configuration: what it is, its bandwidth table, lanes, decode and matmul."""
    config, m = _config(info), d["meta"]
    layout = KNOWN_LAYOUTS.get(config[0])
    return "\n".join(
        [
            f"### {_heading(config)}",
            "",
            f"{info['regions']} region{'s' if info['regions'] != 1 else ''} of "
            f"{_bytes(info['region_block_bytes'])} per block id"
            + (f" ({layout})" if layout else "")
            + f", {_copy_description(config[1])}. The engine reported "
            f"`{info['backend_detail']}`; host memory pinned in {info['pin_seconds']:.2f} s. "
            f"Scattered blocks, median of {m['reps']}:",
            "",
            _table(d, config),
            "",
            *(_check_line(d, config, *check) for check in CHECK_LINES),
        ]
    )


def _ordering_line(o: Fields) -> str:
    adapter = o.get("blnhc_regions_via_adapter")
    blnhc = (
        ""
        if adapter is None
        else "; vLLM's BLNHC views through kvoffload's adapter are the engine's one region: "
        + ("yes" if adapter else "NO")
    )
    return (
        f"- {o['layout']}: {o['steps']} steps of {o['blocks_per_step']} blocks, each written "
        f"by a kernel delayed {o['sleep_cycles']:,} GPU cycles with "
        f"{o['busy_jobs_per_step']} other copies queued: {o['store_mismatched_blocks']} of "
        f"{o['stored_blocks_checked']:,} stored blocks and {o['load_mismatched_parts']} of "
        f"{o['loaded_parts_checked']:,} loaded regions held other bytes than the kernel's / "
        f"the load's, {o['failed_transfers']} transfers failed; the control store without "
        f"its event missed {o['control_mismatched_blocks']} block(s){blnhc}: "
        + ("**ok**" if o["ok"] else "**FAILED**")
    )


def _ordering(d: Fields) -> str:
    """Stage 5, the ordering check, or that the committed results predate it."""
    entries = d.get("ordering")
    text = (
        "### Ordering\n\nStores submitted as the worker submits them (an event recorded on "
        "PyTorch's current stream right after a delayed kernel wrote the blocks) must copy "
        "the kernel's bytes, and a kernel reading loaded blocks right after the load's wait "
        "must see the loaded bytes (`scripts/gpu_ordering.py`).\n\n"
    )
    if not entries:
        return text + (
            "Not yet run on a GPU: the committed results predate this check (run "
            "`scripts/gpu_check.py --ordering-only`). Its dry run on the fake CUDA driver "
            "runs in CI (`tests/test_gpu_check.py`)."
        )
    return text + "\n".join(_ordering_line(o) for o in entries)


def gpu_results() -> str:
    """docs/gpu_check.md's results: per configuration a table, the lane check, the decode
    proxy and the matmul loop; then the goals per configuration and the default's verdict."""
    d = gpu_data()
    layouts = d["layouts"]
    parts = [f"{_measured(d)} {_correct(d)}"]
    parts += [_section(d, info) for info in layouts]
    parts.append(_ordering(d))
    parts.append(
        "### Goals\n\n"
        f"- 16-token blocks at ≥ {pct(GOALS['gpu_copy_share'])} of one large pinned copy's "
        "bandwidth, judged on the best of the "
        + "- and ".join(f"{n:,}" for n in GOAL_SIZES)
        + f"-block rows (each against the large copy of the same bytes); the {SMALL_SIZE}-block "
        "row's store / load shares beside it:\n"
        + "\n".join(f"  - {_bandwidth_verdict(d, info)}" for info in layouts)
        + f"\n- A decode step slowed < {pct(GOALS['gpu_decode_slowdown'])} while kvoffload "
        "copies:\n"
        + "\n".join(f"  - {_decode_verdict(d, info)}" for info in layouts)
        + f"\n\n{_default_verdict(d)}"
    )
    return "\n\n".join(parts) + "\n"


# ---- README.md -------------------------------------------------------------------------------


def _best_text(d: Fields, config: Config) -> str:
    """The shares the bandwidth goal is judged on: ``up to 98.8% / 99.3% at 4,096 blocks``."""
    (s, sn), (lo, ln) = _best_shares(d, config)
    if sn == ln:
        return f"up to {pct(s)} / {pct(lo)} at {sn:,} blocks"
    return f"up to {pct(s)} at {sn:,} / {pct(lo)} at {ln:,} blocks"


def _small_shares(d: Fields, config: Config) -> str:
    s, lo = _shares(_row(d, config, SMALL_SIZE))
    return f"{pct(s)} / {pct(lo)}"


def _decode_part(d: Fields, config: Config, *, verdict: bool) -> str:
    """``decode +1.6%`` (with ``(decode goal met)`` when ``verdict``)."""
    e = _entry(d, "decode", config)
    if e is None:
        return "decode not measured in this run"
    note = f" (decode goal {met(bool(_decode_ok(d, config)))})" if verdict else ""
    return f"decode {_change(e['slowdown_pct'])}{note}"


def _default_summary(d: Fields) -> str:
    """The default configuration's shares at 16 blocks and at its best size, and its decode
    slowdown, against the goals."""
    info = _info(d, DEFAULT)
    what = DEFAULT_NAME[0].upper() + DEFAULT_NAME[1:]
    if info is None:
        return f"{what}: not measured in this run."
    e = _entry(d, "decode", DEFAULT)
    decode = (
        "its decode slowdown was not measured in this run"
        if e is None
        else f"a memory-bound decode proxy slowed {_change(e['slowdown_pct'])} while kvoffload "
        f"copied back to back (goal < {pct(GOALS['gpu_decode_slowdown'])}: "
        f"{met(bool(_decode_ok(d, DEFAULT)))})"
    )
    return (
        f"{what[:-1]}; {_bytes(info['region_block_bytes'])} per copy): stores / loads of "
        f"{SMALL_SIZE} scattered 16-token blocks at {_small_shares(d, DEFAULT)} of one large "
        f"pinned copy's bandwidth, {_best_text(d, DEFAULT)} (goal ≥ "
        f"{pct(GOALS['gpu_copy_share'])}: {met(_copy_ok(d, DEFAULT))}); {decode}."
    )


def _others(d: Fields, layout: str) -> list[Fields]:
    """The configurations of ``layout`` other than the default."""
    return [info for info in d["layouts"] if info["layout"] == layout and _config(info) != DEFAULT]


def _tradeoff(d: Fields) -> str | None:
    """The per-layer layout's configurations side by side, against the goals; None when
    none was measured."""
    infos = _others(d, "per-layer")
    if not infos:
        return None
    label = _layout_label(infos[0])
    parts = [
        f"{_copy_phrase(info['copy'])}, {SMALL_SIZE} blocks at {_small_shares(d, _config(info))}, "
        f"{_best_text(d, _config(info))} (bandwidth goal {met(_copy_ok(d, _config(info)))}), "
        f"{_decode_part(d, _config(info), verdict=True)}"
        for info in infos
    ]
    return f"{label[0].upper()}{label[1:]}: {'; '.join(parts)}."


def _lanes_summary(d: Fields) -> str | None:
    """The lane check of the configurations on the default copy path."""
    lanes = [e for e in _list(d, "lanes") if e["copy"] == DEFAULT[1]]
    if not lanes:
        return None
    times = " / ".join(
        f"{sig(e['load_behind_stores_ms'])} ms ({_short(_config(e))}; "
        f"{sig(e['load_alone_ms'])} ms alone, {e['stores_pending_at_load']} of {e['stores']} "
        "stores still pending)"
        for e in lanes
    )
    verdict = (
        "a load does not wait for the store backlog to drain, though with many small copies "
        "it waits for the copy thread to enqueue the stores ahead of it"
        if all(e["ok"] for e in lanes)
        else "**the lane check failed**"
    )
    return (
        f"A {lanes[0]['load_blocks']}-block load queued behind {lanes[0]['stores']} stores of "
        f"{lanes[0]['store_blocks']} blocks completed in {times}: {verdict}."
    )


def gpu_summary() -> str:
    """The README's GPU section: when and where it was measured, the default configuration
    against the goals, the per-layer layout's copy paths side by side, the lane check, and
    where the rest is."""
    d = gpu_data()
    m = d["meta"]
    lines = [
        f"Measured {m['date']} on {m['gpu']} (torch {m['torch']}). {_correct(d)}",
        "",
        f"- {_default_summary(d)}",
    ]
    lines += [f"- {text}" for text in (_tradeoff(d), _lanes_summary(d)) if text]
    lines += [
        "",
        "Tables per configuration (layout and copy path) and size, the matmul check and the "
        "goals: [`docs/gpu_check.md`](docs/gpu_check.md#results).",
    ]
    return "\n".join(lines) + "\n"


def _line_figures(d: Fields, config: Config) -> str:
    """``39.2% / 38.8% and +1.6% on the copy engines (dma)``."""
    e = _entry(d, "decode", config)
    decode = "(decode not measured)" if e is None else f"and {_change(e['slowdown_pct'])}"
    return f"{_small_shares(d, config)} {decode} {_copy_phrase(config[1])}"


def gpu_line() -> str:
    """The GPU bullet of the README's performance list."""
    d = gpu_data()
    m = d["meta"]
    head = (
        f"- **GPU** (`scripts/gpu_check.py`, {m['gpu']}, {m['date'].split()[0]}; details in "
        "[`docs/gpu_check.md`](docs/gpu_check.md#results)): "
    )
    if _info(d, DEFAULT) is None:
        text = f"{DEFAULT_NAME} was not measured in this run"
    else:
        e = _entry(d, "decode", DEFAULT)
        decode = (
            " (its decode slowdown was not measured in this run)"
            if e is None
            else f", and a memory-bound decode proxy slowed {_change(e['slowdown_pct'])} "
            f"meanwhile (goal < {pct(GOALS['gpu_decode_slowdown'])}: "
            f"{met(bool(_decode_ok(d, DEFAULT)))})"
        )
        text = (
            f"in {DEFAULT_NAME}, kvoffload's CUDA stores / loads of {SMALL_SIZE} scattered "
            f"16-token blocks ran at {_small_shares(d, DEFAULT)} of one large pinned copy's "
            f"bandwidth, {_best_text(d, DEFAULT)} (goal ≥ {pct(GOALS['gpu_copy_share'])}: "
            f"{met(_copy_ok(d, DEFAULT))}){decode}"
        )
    others = _others(d, "per-layer")
    if others:
        text += (
            f"; with vLLM's per-layer layout, {SMALL_SIZE}-block stores / loads and the decode "
            "slowdown are " + ", ".join(_line_figures(d, _config(info)) for info in others)
        )
    return head + text + "." + ("" if _clean_run(d) else f" {_correct(d)}")
