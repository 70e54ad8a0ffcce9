"""The data and number formatting behind ``scripts/render_docs.py``: the committed raw
results under docs/ (JSON, criterion logs), how a figure is written, and the goals the
documents compare it with."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
DATA = DOCS / "benchmarks"


class RenderError(Exception):
    """A document names a region this script does not know, or data is missing."""


# ---- data ----------------------------------------------------------------------------------


@cache
def load_json(name: str) -> dict[str, Any]:
    return json.loads((DOCS / name).read_text())


def scheduler_results(name: str) -> dict[tuple[str, str], dict[str, Any]]:
    """A scheduler comparison's results (``docs/benchmarks/<name>.json``) by
    ``(connector, mode)``."""
    return {(r["connector"], r["mode"]): r for r in load_json(f"benchmarks/{name}.json")["results"]}


_FIELD = re.compile(r"^(?P<label>[a-z ]*?) ?(?P<value>[0-9.]+) (?P<unit>[A-Za-z/ ]+)$")


def parse_bench_summary(text: str) -> dict[str, dict[str, float]]:
    """The summary line each Rust bench prints per case (the median of its samples), e.g.
    ``index/lookup/hit/48505: 6.1 ns/op, 165.0 M ops/s`` -> ``{"ns/op": 6.1, "M ops/s": 165.0}``
    and ``...: round trip 539.0 ns/block, submit 39.7 ns/block`` -> keys ``round trip``,
    ``submit``. Criterion's own lines are skipped."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z_]+/[A-Za-z0-9_/]+): (.+)$", line)
        if not m:
            continue
        fields: dict[str, float] = {}
        for part in m.group(2).split(", "):
            f = _FIELD.match(part)
            if f is None:
                raise RenderError(f"cannot parse the bench line {line!r}")
            fields[f["label"] or f["unit"]] = float(f["value"])
        out[m.group(1)] = fields
    return out


@cache
def bench_lines(name: str) -> dict[str, dict[str, float]]:
    return parse_bench_summary((DATA / f"cargo_bench_{name}.txt").read_text())


def bench(name: str, case: str, key: str) -> float:
    try:
        return bench_lines(name)[case][key]
    except KeyError as e:
        raise RenderError(f"cargo_bench_{name}.txt has no {key!r} for {case!r}") from e


# ---- formatting ----------------------------------------------------------------------------


def sig(x: float, digits: int = 3) -> str:
    """``digits`` significant figures (at least the integer part), thousands separated,
    trailing zeros after the point dropped: 6.1, 0.45, 1,392."""
    if x == 0:
        return "0"
    if abs(x) >= 1:
        decimals = max(0, digits - len(str(int(abs(x)))))
    else:
        decimals = digits + _zeros_after_point(x)
    text = f"{x:,.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _zeros_after_point(x: float) -> int:
    n, x = 0, abs(x)
    while x < 0.1:
        x *= 10
        n += 1
    return n


def us(x: float) -> str:
    return f"{sig(x)} µs"


def ns(x: float) -> str:
    return us(x / 1000) if x >= 1000 else f"{sig(x)} ns"


def ratio(x: float) -> str:
    if x >= 100:
        return f"{x:,.0f}x"
    return f"{x:.1f}x" if x >= 1 else f"{x:.2f}x"


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def machine_line(m: dict[str, Any]) -> str:
    gpu = m.get("gpu") or "no GPU"
    v = m.get("versions", {})
    # Benchmarks that load neither vLLM nor torch (the Rust disk bench) record neither.
    names = {"python": "Python", "vllm": "vLLM", "torch": "torch"}
    versions = ", ".join(f"{label} {v[k]}" for k, label in names.items() if k in v)
    return f"{m['date']}, {m['cpu']} ({m['cores']} cores, {gpu})" + (
        f", {versions}" if versions else ""
    )


#: Targets the project set itself (not measurements); the docs say whether the data meets them.
GOALS = {
    "scheduler_ratio": 10.0,  # Simple's connector time per step / kvoffload's, mean
    "scheduler_share": 0.07,  # kvoffload's share of the scheduler's step time
    "index_ratio": 20.0,  # vLLM BlockPool / kvoffload, find + pin a 128-block prefix
    "find_pin_us": 7.6,  # kvoffload find + pin of a 128-block prefix through Python
    "lookups_m_per_s": 20.0,  # Rust index lookups per second per core, millions
    "noreuse_overhead": 0.02,  # time inside kvoffload / rest of a pass when nothing repeats
    "gpu_copy_share": 0.90,  # kvoffload's GPU<->CPU GB/s / one large pinned copy's, 16-token blocks
    "gpu_decode_slowdown": 0.10,  # a decode step's slowdown while kvoffload copies
}


def met(ok: bool) -> str:
    return "met" if ok else "not met"
