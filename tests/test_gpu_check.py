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
