"""The figures in README.md, benches/README.md and docs/gpu_check.md are what
scripts/render_docs.py renders from the committed raw results (docs/demo.json,
docs/benchmarks/*), so a number in the docs cannot drift from its source. Fast: no vLLM, no
engine."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import render_data  # noqa: E402
import render_docs  # noqa: E402
import render_gpu  # noqa: E402

#: How the documents name the copy kernel configuration of the GPU check.
KERNEL = "dropped copy kernel (kernel)"


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


# ---- the GPU check (docs/benchmarks/gpu_check.json) ------------------------------------------

GPU_REGIONS = (render_gpu.gpu_results, render_gpu.gpu_summary, render_gpu.gpu_line)

#: The synthetic run's configurations with, per configuration, kvoffload's share of one large
#: pinned copy's bandwidth at each size and the decode proxy's slowdown in percent.
GPU_CONFIGS: dict[tuple[str, str], tuple[dict[int, float], float]] = {
    ("per-layer", "dma"): ({1: 0.3, 16: 0.45, 256: 0.5, 4096: 0.55}, 1.0),
    ("per-layer", "kernel"): ({1: 0.35, 16: 0.8, 256: 0.91, 4096: 0.92}, 5.0),
    ("cross-layer", "dma"): ({1: 0.4, 16: 0.93, 256: 0.97, 4096: 0.98}, 2.0),
}


def _gpu_run() -> dict[str, Any]:
    """A gpu_check.py result with the configurations of ``GPU_CONFIGS`` (one large pinned
    copy at 50 GB/s both ways, so a share is the GB/s / 50)."""
    sizes = [1, 16, 256, 4096]
    data: dict[str, Any] = {
        "ok": True,
        "meta": {
            "date": "2026-01-02 03:04 UTC",
            "gpu": "Test GPU",
            "gpu_memory_gib": 80.0,
            "torch": "2.0",
            "torch_cuda": "12.0",
            "python": "3.12.0",
            "cpu_count": 8,
            "sizes": sizes,
            "reps": 5,
            "seconds": 100.0,
        },
        "layouts": [],
        "rows": [],
        "lanes": [],
        "decode": [],
        "matmul": [],
    }
    for (layout, copy_path), (shares, slowdown) in GPU_CONFIGS.items():
        config = {"layout": layout, "copy": copy_path}
        per_layer = layout == "per-layer"
        data["layouts"].append(
            {
                **config,
                "regions": 64 if per_layer else 1,
                "region_block_bytes": 32768 if per_layer else 2097152,
                "backend_detail": f"cuda (test, {copy_path})",
                "pin_seconds": 1.0,
                "correct": {copy_path: True, "dma loop": True, "kernel": True},
            }
        )
        data["rows"] += [
            {
                **config,
                "blocks": n,
                "mib": 2.0 * n,
                "store_gbps": 50 * shares[n],
                "load_gbps": 50 * shares[n],
                "memcpy_d2h_gbps": 50.0,
                "memcpy_h2d_gbps": 50.0,
                "torch_d2h_gbps": 3.0,
                "torch_h2d_gbps": 3.0,
            }
            for n in sizes
        ]
        data["lanes"].append(
            {
                **config,
                "stores": 12,
                "store_blocks": 256,
                "load_blocks": 16,
                "load_alone_ms": 1.0,
                "load_behind_stores_ms": 20.0 if per_layer else 1.5,
                "stores_done_ms": 140.0,
                "stores_pending_at_load": 11,
                "ok": True,
            }
        )
        data["decode"].append(
            {
                **config,
                "slowdown_pct": slowdown,
                "copy_gbps_during": 40.0,
                "blocks_per_job": 256,
                "step_ms": 4.2,
                "weight_gbps": 3300.0,
            }
        )
        data["matmul"].append(
            {
                **config,
                "iterations": 1400,
                "alone_s": 2.4,
                "slowdown_pct": 0.5,
                "copy_gbps_during": 50.0,
                "blocks_per_job": 4096,
                "matmul_size": 8192,
                "alone_tflops": 660.0,
            }
        )
    return data


@pytest.fixture
def gpu_json(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A synthetic GPU check result (``_gpu_run``) that the GPU regions render from; edit it."""
    data = _gpu_run()
    real = render_gpu.load_json

    def load(name: str) -> dict[str, Any]:
        return data if name == render_gpu.SOURCE else real(name)

    monkeypatch.setattr(render_gpu, "load_json", load)
    return data


def _row(data: dict[str, Any], layout: str, copy_path: str, blocks: int) -> dict[str, Any]:
    return next(
        r
        for r in data["rows"]
        if (r["layout"], r["copy"], r["blocks"]) == (layout, copy_path, blocks)
    )


def _goals() -> str:
    return render_gpu.gpu_results().split("### Goals")[1]


def test_gpu_committed_results_render() -> None:
    """The committed results have every key the regions read."""
    for region in GPU_REGIONS:
        assert region()


def test_gpu_regions_show_every_configuration(gpu_json: dict[str, Any]) -> None:
    text = render_gpu.gpu_results()
    for heading in (
        "### per-layer, copy engines (dma)",
        f"### per-layer, {KERNEL}",
        "### cross-layer, copy engines (dma)",
    ):
        assert heading in text
    assert text.count("| 4,096 | 8,192 |") == 3
    assert "Every round trip matched byte for byte (copy paths: dma, dma loop, kernel)." in text
    assert (
        f"per-layer, {KERNEL}: store 92.0% / load 92.0% at 4,096 blocks; at 16 blocks "
        "80.0% / 80.0% — met"
    ) in text
    summary = render_gpu.gpu_summary()
    assert (
        "16 scattered 16-token blocks at 93.0% / 93.0% of one large pinned copy's bandwidth, "
        "up to 98.0% / 98.0% at 4,096 blocks (goal ≥ 90.0%: met)"
    ) in summary
    assert (
        "on the copy engines (dma), 16 blocks at 45.0% / 45.0%, up to 55.0% / 55.0% at 4,096 "
        "blocks (bandwidth goal not met), decode +1.0% (decode goal met)"
    ) in summary
    assert (
        f"with the {KERNEL}, 16 blocks at 80.0% / 80.0%, up to 92.0% / 92.0% at "
        "4,096 blocks (bandwidth goal met), decode +5.0% (decode goal met)"
    ) in summary
    assert "(per-layer/dma;" in summary
    assert "(cross-layer/dma;" in summary
    assert "per-layer/kernel;" not in summary
    line = render_gpu.gpu_line()
    assert "ran at 93.0% / 93.0% of one large pinned copy's bandwidth, up to 98.0% / 98.0%" in line
    assert (
        "45.0% / 45.0% and +1.0% on the copy engines (dma), 80.0% / 80.0% and +5.0% with the "
        f"{KERNEL}."
    ) in line


@pytest.mark.parametrize(
    ("path", "key", "where"),
    [
        (("meta",), "torch", "meta"),
        (("rows", 2), "memcpy_h2d_gbps", "rows[2]"),
        (("layouts", 0), "region_block_bytes", "layouts[0]"),
        (("layouts", 1), "copy", "layouts[1]"),
        (("lanes", 1), "stores_pending_at_load", "lanes[1]"),
        (("decode", 1), "slowdown_pct", "decode[1]"),
        (("matmul", 2), "alone_tflops", "matmul[2]"),
        ((), "decode", "the top level"),
    ],
)
def test_gpu_missing_key_is_an_error_naming_it(
    gpu_json: dict[str, Any], path: tuple[Any, ...], key: str, where: str
) -> None:
    obj: Any = gpu_json
    for step in path:
        obj = obj[step]
    del obj[key]
    message = rf"gpu_check\.json: {re.escape(where)} has no '{key}'"
    with pytest.raises(render_data.RenderError, match=message):
        render_gpu.gpu_results()


def test_gpu_old_matmul_object_is_an_error(gpu_json: dict[str, Any]) -> None:
    gpu_json["matmul"] = gpu_json["matmul"][0]
    with pytest.raises(render_data.RenderError, match="matmul is not a list"):
        render_gpu.gpu_results()


@pytest.mark.parametrize("region", GPU_REGIONS)
def test_every_gpu_region_names_a_missing_key(gpu_json: dict[str, Any], region: Any) -> None:
    del _row(gpu_json, "per-layer", "dma", 16)["load_gbps"]
    with pytest.raises(render_data.RenderError, match=r"rows\[1\] has no 'load_gbps'"):
        region()


def test_gpu_missing_row_is_an_error(gpu_json: dict[str, Any]) -> None:
    gpu_json["rows"] = [r for r in gpu_json["rows"] if r["blocks"] != 16]
    with pytest.raises(render_data.RenderError, match="no cross-layer/dma row at 16 blocks"):
        render_gpu.gpu_summary()
    gpu_json["rows"] = [r for r in gpu_json["rows"] if r["blocks"] not in (256, 4096)]
    with pytest.raises(render_data.RenderError, match=r"no per-layer/dma row at \(256, 4096\)"):
        render_gpu.gpu_results()


def test_gpu_goals_follow_the_data(gpu_json: dict[str, Any]) -> None:
    goals = _goals()
    assert (
        "per-layer, copy engines (dma): store 55.0% / load 55.0% at 4,096 blocks; at 16 blocks "
        "45.0% / 45.0% — not met"
    ) in goals
    assert f"per-layer, {KERNEL}: +5.0% — met" in goals
    assert goals.count("not met") == 1
    assert (
        "(the block-contiguous layout on the copy engines, cross-layer/dma) meets both goals"
        in (goals)
    )
    # The best of the 256- and 4096-block rows counts: lift per-layer dma's 256-block store.
    _row(gpu_json, "per-layer", "dma", 256)["store_gbps"] = 0.95 * 50
    _row(gpu_json, "per-layer", "dma", 4096)["load_gbps"] = 0.96 * 50
    goals = _goals()
    assert "store 95.0% (at 256 blocks) / load 96.0% (at 4,096 blocks)" in goals
    assert "not met" not in goals
    # The copy kernel slowing decode past the goal is said, in every region.
    gpu_json["decode"][1]["slowdown_pct"] = 57.0
    goals = _goals()
    assert f"per-layer, {KERNEL}: +57.0% — not met" in goals
    assert "meets both goals" in goals
    summary = render_gpu.gpu_summary()
    assert "(bandwidth goal met), decode +57.0% (decode goal not met)" in summary
    assert f"80.0% / 80.0% and +57.0% with the {KERNEL}" in render_gpu.gpu_line()
    # The default missing the bandwidth goal is said, in bold.
    for n in (256, 4096):
        _row(gpu_json, "cross-layer", "dma", n)["store_gbps"] = 0.8 * 50
    goals = _goals()
    assert "cross-layer, copy engines (dma): store 80.0% / load 98.0%" in goals
    assert "meets the decode goal but **not the bandwidth goal**" in goals
    assert "(goal ≥ 90.0%: not met)" in render_gpu.gpu_summary()
    assert "(goal ≥ 90.0%: not met)" in render_gpu.gpu_line()


def test_gpu_unmeasured_parts_and_failures_are_said(gpu_json: dict[str, Any]) -> None:
    gpu_json["decode"], gpu_json["matmul"], gpu_json["lanes"] = [], [], []
    gpu_json["ok"] = False
    gpu_json["layouts"][1]["correct"]["dma loop"] = False
    gpu_json["meta"]["error"] = "RuntimeError: boom"
    text = render_gpu.gpu_results()
    assert text.count("Matmul loop: not measured in this run.") == 3
    assert text.count("Lanes: not measured in this run.") == 3
    assert f"per-layer, {KERNEL}: not measured in this run" in text.split("### Goals")[1]
    assert "its decode slowdown was not measured in this run" in text
    assert "**Not every round trip matched** (per-layer/kernel: dma loop)" in text
    assert "`RuntimeError: boom`" in text
    summary = render_gpu.gpu_summary()
    assert "A 16-block load" not in summary
    assert "(goal ≥ 90.0%: met); its decode slowdown was not measured in this run." in summary
    assert "(bandwidth goal met), decode not measured in this run." in summary
    line = render_gpu.gpu_line()
    assert "(goal ≥ 90.0%: met) (its decode slowdown was not measured in this run)" in line
    assert f"80.0% / 80.0% (decode not measured) with the {KERNEL}" in line
    assert "**Not every round trip matched**" in line


def test_gpu_default_configuration_not_measured_is_said(gpu_json: dict[str, Any]) -> None:
    for key in ("layouts", "lanes", "decode", "matmul"):
        gpu_json[key] = gpu_json[key][:2]
    gpu_json["rows"] = gpu_json["rows"][:8]
    expected = (
        "the block-contiguous layout on the copy engines, cross-layer/dma) was not measured in "
        "this run"
    )
    assert expected in render_gpu.gpu_results()
    assert "cross-layer/dma): not measured in this run." in render_gpu.gpu_summary()
    assert expected in render_gpu.gpu_line()
