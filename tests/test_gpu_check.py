"""``scripts/gpu_check.py`` keeps working between GPU sessions: its helpers' doctests and a
dry run of every stage that needs no GPU, on the fake CUDA driver."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_self_test_passes() -> None:
    done = run("--self-test")
    assert done.returncode == 0, done.stdout + done.stderr


def test_dry_run_round_trips_every_layout_on_the_fake_driver(
    fake_cuda_lib: Path, tmp_path: Path
) -> None:
    out = tmp_path / "dry.json"
    done = run("--skip-build", "--quick", "--fake-driver", str(fake_cuda_lib), "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["ok"], result["meta"].get("error")
    layouts = {(info["layout"], info["copy"]) for info in result["layouts"]}
    assert layouts == {("per-layer", "dma"), ("cross-layer", "dma")}
    for info in result["layouts"]:
        assert info["correct"] == {"dma": True, "dma loop": True}
    assert {(r["layout"], r["blocks"]) for r in result["rows"]} == {
        (layout, n) for layout, _ in layouts for n in result["meta"]["sizes"]
    }
    assert all(lane["stores_pending_at_load"] > 0 for lane in result["lanes"])


def test_dry_run_of_the_ordering_check_alone(fake_cuda_lib: Path, tmp_path: Path) -> None:
    out = tmp_path / "ordering.json"
    done = run(
        "--skip-build", "--ordering-only", "--fake-driver", str(fake_cuda_lib), "--out", str(out)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["ok"], result["meta"].get("error")
    assert result["rows"] == []  # the measurements did not run
    assert [o["layout"] for o in result["ordering"]] == ["per-layer", "cross-layer"]
    for o in result["ordering"]:
        assert o["ok"], o
        assert o["stored_blocks_checked"] > 0
        assert o["loaded_parts_checked"] > 0
        assert o["store_mismatched_blocks"] == o["load_mismatched_parts"] == 0
    # vLLM's BLNHC views, through kvoffload's adapter, are the engine's one region.
    assert result["ordering"][1]["blnhc_regions_via_adapter"] is True


def test_the_ordering_check_sees_a_store_that_missed_the_kernels_bytes() -> None:
    """A store that copied other bytes than the step's write (here: into other CPU blocks,
    as a store racing its kernel copies stale ones) is counted, and fails the check."""
    import struct
    from typing import Any

    import torch

    sys.path.insert(0, str(SCRIPT.parent))
    import gpu_measure as gm
    import gpu_ordering
    from kvoffload._native import TransferEngine

    class MisdirectedStores:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def submit(self, tid: int, store: bool, gpu: bytes, cpu: bytes, event: Any) -> None:
            ids = struct.unpack(f"<{len(cpu) // 4}I", cpu)
            if store and len(ids) == gpu_ordering.BLOCKS_PER_STEP:  # a step's store
                cpu = struct.pack(f"<{len(ids)}I", *(i + len(ids) for i in ids))
            self.inner.submit(tid, store, gpu, cpu, event)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    dry = gm.DRY_RUN
    gm.DRY_RUN = True
    try:
        _, _, num_gpu, num_cpu = gpu_ordering.sizes()
        layout = gm.Layout(torch, "cross-layer", num_gpu, torch.device("cpu"))
        engine = TransferEngine._unchecked(layout.regions, num_cpu)
        result = gpu_ordering.ordering_check(torch, layout, MisdirectedStores(engine), seed=3)
        engine.shutdown()
    finally:
        gm.DRY_RUN = dry
    assert result["store_mismatched_blocks"] > 0
    assert not result["ok"]
