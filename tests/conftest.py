"""Shared fixtures. vLLM reads its environment once per process, so it is set here,
before any test imports vLLM."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from kvoffload._native import Planner

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("model") / "tiny_llama")


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with the tiny model's config only: what the real-``Scheduler`` tests
    (``sched_harness``) need, without building weights."""
    from sched_harness import model_config_dir

    return model_config_dir(tmp_path_factory.mktemp("tiny_llama_config"))


@pytest.fixture
def rank_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker-role connectors built in this process (``sched_harness.Rank``) are tensor
    rank 0: there is no process group to ask."""
    import kvoffload.connector

    monkeypatch.setattr(kvoffload.connector, "tensor_parallel_rank", lambda: 0)


@pytest.fixture
def lazy_planner() -> Planner:
    """A lazy planner with an empty CPU tier: the free-queue walk it does for
    ``FreeQueueWalker.candidates`` drops no block as already stored."""
    from kvoffload._native import Planner

    return Planner(16, 1024, lazy=True)


@pytest.fixture(scope="session")
def fake_cuda_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fake CUDA driver (crates/offload-core/tests/fake_cuda), built with the C compiler."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc}) to build the fake CUDA driver")
    source = Path(__file__).resolve().parent.parent / "crates/offload-core/tests/fake_cuda"
    lib = tmp_path_factory.mktemp("fake_cuda") / "libfakecuda.so"
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(source / "fake_cuda.c"), "-lpthread"],
        check=True,
    )
    return lib
