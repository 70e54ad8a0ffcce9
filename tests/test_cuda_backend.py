"""The CUDA backend through the Python binding, against the fake driver (no GPU needed).

Points KVOFFLOAD_LIBCUDA at the fake driver (``fake_cuda_lib`` in conftest.py); "device"
memory is a CPU tensor.
"""

from __future__ import annotations

import ctypes
import shutil
import time
from pathlib import Path

import pytest
import torch

from kvoffload import _native
from kvoffload.cuda_events import engine_backend


@pytest.fixture
def fake(fake_cuda_lib: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ctypes.CDLL:
    # A private copy: a dlopen of a distinct file gives each test its own driver state.
    lib = tmp_path / "libfakecuda.so"
    shutil.copy(fake_cuda_lib, lib)
    monkeypatch.setenv("KVOFFLOAD_LIBCUDA", str(lib))
    dll = ctypes.CDLL(str(lib))
    dll.fake_user_event_create.restype = ctypes.c_void_p
    dll.fake_user_event_complete.argtypes = [ctypes.c_void_p]
    dll.fake_user_event_destroy.argtypes = [ctypes.c_void_p]
    return dll


def ids(xs: list[int]) -> bytes:
    return b"".join(x.to_bytes(4, "little") for x in xs)


def test_store_waits_for_its_event_and_round_trips(fake: ctypes.CDLL) -> None:
    kv = torch.randint(0, 255, (16, 4096), dtype=torch.uint8)
    engine = _native.TransferEngine._unchecked(
        [(kv.data_ptr(), 16, 4096, 4096)], 8, backend="cuda", device=0
    )
    assert "cuMemcpyBatchAsync_v2" in engine.backend_detail
    engine.wait_ready(10)
    assert engine.ready
    original = kv.clone()
    event = fake.fake_user_event_create()
    engine.submit(1, True, ids([3, 4]), ids([0, 1]), event)
    time.sleep(0.05)
    assert engine.poll() == []  # the store waits for the compute stream's event
    kv[3] = 7  # the forward pass finishes writing block 3 ...
    fake.fake_user_event_complete(event)  # ... then its event fires
    assert engine.wait_for([1], 10) == [(1, True, None)]
    assert engine.read_cpu_block(0, 0) == bytes([7]) * 4096
    engine.submit(2, False, ids([10, 11]), ids([0, 1]))
    assert engine.wait_for([2], 10) == [(2, True, None)]
    assert torch.equal(kv[11], original[4])
    engine.shutdown()
    fake.fake_user_event_destroy(event)


def test_cuda_errors_are_device_errors(fake: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch) -> None:
    kv = torch.zeros((4, 64), dtype=torch.uint8)
    regions = [(kv.data_ptr(), 4, 64, 64)]
    with pytest.raises(_native.DeviceError, match=r"cuDeviceGet\(ordinal 5\)"):
        _native.TransferEngine._unchecked(regions, 2, backend="cuda", device=5)
    monkeypatch.setenv("KVOFFLOAD_LIBCUDA", "/nonexistent/libcuda.so.1")
    with pytest.raises(_native.DeviceError, match="KVOFFLOAD_LIBCUDA"):
        _native.TransferEngine._unchecked(regions, 2, backend="cuda")
    with pytest.raises(_native.InvalidInputError, match="rocm"):
        _native.TransferEngine._unchecked(regions, 2, backend="rocm")


def test_host_backend_refuses_wait_events_and_cpu_tensors_pick_host() -> None:
    kv = torch.zeros((4, 64), dtype=torch.uint8)
    assert engine_backend({"layer.0": kv}) == ("host", 0)
    engine = _native.TransferEngine._unchecked([(kv.data_ptr(), 4, 64, 64)], 2)
    engine.wait_ready(5)
    engine.submit(1, True, ids([0]), ids([0]), 0x1234)
    [(tid, ok, err)] = engine.wait_for([1], 10)
    assert (tid, ok) == (1, False)
    assert "cannot wait on device event 0x1234" in err
    engine.shutdown()
