"""The typed stubs (python/kvoffload/_native.pyi) match the compiled module."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def test_native_stubs_match_the_extension(tmp_path: Path) -> None:
    pytest.importorskip("mypy.stubtest")
    # Only the stub is checked; following the package's imports would analyze vLLM.
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\nfollow_imports = skip\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy.stubtest",
            "kvoffload._native",
            "--mypy-config-file",
            str(config),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
