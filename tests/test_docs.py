"""The figures in README.md and benches/README.md are what scripts/render_docs.py renders
from the committed raw results (docs/demo.json, docs/benchmarks/*), so a number in the docs
cannot drift from its source. Fast: no vLLM, no engine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import render_data  # noqa: E402
import render_docs  # noqa: E402


@pytest.mark.parametrize("doc", render_docs.DOCUMENTS)
def test_committed_doc_equals_rendering_of_committed_data(doc: str) -> None:
    text = (REPO / doc).read_text()
    assert render_docs.MARKER.search(text), f"{doc} has no generated region"
    rendered = render_docs.render(text)
    assert rendered == text, (
        f"{doc} differs from what scripts/render_docs.py renders from docs/; run "
        "`.venv/bin/python scripts/render_docs.py` and commit the result"
    )


def test_every_region_is_used() -> None:
    used = {
        m["name"]
        for doc in render_docs.DOCUMENTS
        for m in render_docs.MARKER.finditer((REPO / doc).read_text())
    }
    assert used == set(render_docs.REGIONS)


def test_an_edited_figure_is_caught() -> None:
    text = (REPO / "README.md").read_text()
    m = render_docs.MARKER.search(text)
    assert m is not None
    body = m["body"]
    digit = next(i for i, c in enumerate(body) if c.isdigit())
    edited = body[:digit] + str((int(body[digit]) + 1) % 10) + body[digit + 1 :]
    doctored = text[: m.start("body")] + edited + text[m.end("body") :]
    assert render_docs.render(doctored) == text


def test_unknown_region_is_an_error() -> None:
    with pytest.raises(render_docs.RenderError, match="nope"):
        render_docs.render("<!-- BEGIN GENERATED: nope -->\nx\n<!-- END GENERATED: nope -->")


def test_bench_summary_lines_are_parsed() -> None:
    text = """Benchmarking index/lookup/hit/48505: Analyzing
index/lookup/hit/48505  time:   [23.124 µs 24.260 µs 25.605 µs]
index/lookup/hit/48505: 6.1 ns/op, 165.0 M ops/s
planner/decode_step/64: 4.511 us/step
planner/decode_step/64 stored: 4.000 blocks/step
transfer_host/consecutive/256: round trip 539.0 ns/block, submit 39.7 ns/block
"""
    assert render_data.parse_bench_summary(text) == {
        "index/lookup/hit/48505": {"ns/op": 6.1, "M ops/s": 165.0},
        "planner/decode_step/64": {"us/step": 4.511},
        "transfer_host/consecutive/256": {"round trip": 539.0, "submit": 39.7},
    }
