"""The worker adapter with real CPU KV tensors: preemption fences and failure reporting."""

from __future__ import annotations

import struct
import time

import pytest

pytest.importorskip("vllm")

import torch

from kvoffload import HostMemoryError, parse_config
from kvoffload import worker as worker_mod
from kvoffload.metadata import KVOffloadMetadata
from kvoffload.worker import OffloadWorker


def ids(*xs: int) -> bytes:
    return struct.pack(f"<{len(xs)}I", *xs)


def make_worker(
    faults: str | None = None, *, cpu_bytes: int | None = None, head_size: int = 8
) -> tuple[OffloadWorker, dict[str, torch.Tensor]]:
    """A worker over two float32 layers of 8 GPU blocks (``2 x 16 x head_size`` values
    each), with a pool of 4 blocks unless ``cpu_bytes`` says otherwise."""
    kv = {f"layer{i}": torch.randn(8, 2, 16, head_size) for i in range(2)}
    per_block = sum(t[0].numel() * t.element_size() for t in kv.values())
    budget = 4 * per_block if cpu_bytes is None else cpu_bytes
    extra: dict[str, object] = {"cpu_bytes_to_use": budget}
    if faults:
        extra["kvoffload.faults"] = faults
    config, _ = parse_config(extra, 1)
    w = OffloadWorker(config, num_gpu_blocks=8)
    w.register_kv_caches(kv)
    return w, kv


def drain(w: OffloadWorker, expect: int) -> tuple[list[int], list[bool]]:
    got_ids: list[int] = []
    got_ok: list[bool] = []
    deadline = time.monotonic() + 10
    while len(got_ids) < expect and time.monotonic() < deadline:
        w.poll()
        meta = w.take_worker_meta()
        if meta is not None:
            got_ids += meta.transfer_ids
            got_ok += meta.ok
        time.sleep(0.01)
    return got_ids, got_ok


def wait_on_device(w: OffloadWorker, runs: int) -> None:
    """Waits until the engine handed `runs` copy runs to its backend (the job is running)."""
    assert w.engine is not None
    deadline = time.monotonic() + 10
    while dict(w.engine.stats())["runs_submitted"] < runs:
        assert time.monotonic() < deadline, "the copy never started"
        time.sleep(0.001)


def test_a_pool_the_machine_cannot_map_fails_naming_the_budget() -> None:
    # 128 KiB blocks, as many as block ids allow (2^32 - 2): 512 TiB, past the address
    # space a process gets, whatever the machine's memory and overcommit policy.
    budget = 2**62
    with pytest.raises(HostMemoryError, match="lower cpu_bytes_to_use") as e:
        make_worker(cpu_bytes=budget, head_size=512)
    assert f"cpu_bytes_to_use: {budget} bytes per rank" in str(e.value)


def test_a_pool_larger_than_the_available_memory_is_warned_about(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    total, available = worker_mod.host_memory() or (0, 0)
    assert total >= available > 0
    warnings: list[str] = []
    monkeypatch.setattr(worker_mod, "host_memory", lambda: (2**30, 1024))
    monkeypatch.setattr(worker_mod.logger, "warning", lambda msg, *a: warnings.append(msg % a))
    w, _ = make_worker()
    w.shutdown()
    assert len(warnings) == 1
    assert "larger than the memory available" in warnings[0]
    assert "lower cpu_bytes_to_use" in warnings[0]


def test_store_then_load_round_trips_and_reports_both() -> None:
    w, kv = make_worker()
    before = {k: t.clone() for k, t in kv.items()}
    w.submit(KVOffloadMetadata(store=(1, ids(2, 3), ids(0, 1), ["r"])))
    assert drain(w, 1) == ([1], [True])
    w.submit(KVOffloadMetadata(loads=[(2, "s", ids(6, 7), ids(0, 1), True, False)]))
    assert drain(w, 1) == ([2], [True])
    for k in kv:
        assert torch.equal(kv[k][6], before[k][2])
        assert torch.equal(kv[k][7], before[k][3])
    w.shutdown()


def test_invalid_load_is_reported_failed_with_its_gpu_blocks() -> None:
    w, _ = make_worker()
    w.submit(KVOffloadMetadata(loads=[(5, "r", ids(4, 5), b"", False, False)]))
    assert w.take_load_errors() == {4, 5}
    meta = w.take_worker_meta()
    assert meta is not None
    assert (meta.transfer_ids, meta.ok) == ([5], [False])
    w.shutdown()


def test_preemption_fence_waits_for_that_requests_stores_only() -> None:
    w, _ = make_worker(faults="delay_ms=200")
    w.submit(KVOffloadMetadata(store=(1, ids(1), ids(0), ["preempted"])))
    w.submit(KVOffloadMetadata(store=(2, ids(2), ids(1), ["other"])))
    w.handle_preemptions(KVOffloadMetadata(preempted_req_ids=["preempted"]))
    # Store 1 completed before the fence returned; store 2 was not waited for here.
    meta = w.take_worker_meta()
    assert meta is not None
    assert (meta.transfer_ids, meta.ok) == ([1], [True])
    assert drain(w, 1) == ([2], [True])
    w.shutdown()


def test_a_fence_that_times_out_reports_the_store_only_after_its_copy_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(worker_mod, "PREEMPTION_FENCE_TIMEOUT_S", 0.01)
    w, kv = make_worker(faults="delay_ms=300")
    source = {k: t[1].clone() for k, t in kv.items()}
    w.submit(KVOffloadMetadata(store=(1, ids(1), ids(0), ["preempted"])))
    wait_on_device(w, 2)  # one run per layer
    w.handle_preemptions(KVOffloadMetadata(preempted_req_ids=["preempted"]))
    meta = w.take_worker_meta()
    assert meta is not None
    assert (meta.transfer_ids, meta.ok) == ([1], [False])
    # The forward pass may now overwrite the preempted request's block: the store already
    # read it (the CPU block is readable because no copy is in flight any more).
    engine = w.engine
    assert engine is not None
    for t in kv.values():
        t[1].fill_(7.0)
    at_report = engine.read_cpu_block(0, 0)
    assert at_report == source["layer0"].numpy().tobytes()
    time.sleep(0.4)
    w.poll()
    assert w.take_worker_meta() is None  # reported exactly once
    assert engine.read_cpu_block(0, 0) == at_report
    # The engine stopped: the next step's copies fail at once, so requests recompute.
    w.submit(KVOffloadMetadata(loads=[(2, "r", ids(5), ids(0), True, False)]))
    assert w.take_load_errors() == {5}
    w.shutdown()


def test_a_sync_load_that_times_out_reports_only_after_its_copy_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(worker_mod, "SYNC_LOAD_TIMEOUT_S", 0.01)
    # Stand in for CUDA's compute event, to check the event lives until the copy is done.
    monkeypatch.setattr(worker_mod, "record_compute_event", lambda: (object(), None))
    w, kv = make_worker(faults="delay_ms=300")
    w._cuda = True
    w.submit(KVOffloadMetadata(store=(1, ids(2), ids(0), ["r"])))
    assert drain(w, 1) == ([1], [True])
    w.submit(KVOffloadMetadata(loads=[(2, "s", ids(6), ids(0), True, True)]))
    assert set(w._events) == {2}
    wait_on_device(w, 4)
    w.finish_sync_loads()
    # Reported failed (vLLM recomputes block 6), and only once the copy has ended: block 6
    # no longer changes, and the event was released with the report, not before or never.
    assert w.take_load_errors() == {6}
    meta = w.take_worker_meta()
    assert meta is not None
    assert (meta.transfer_ids, meta.ok) == ([2], [False])
    assert w._events == {}
    at_report = {k: t[6].clone() for k, t in kv.items()}
    time.sleep(0.4)
    for k, t in kv.items():
        assert torch.equal(t[6], at_report[k]), k
    w.shutdown()


def test_shutdown_that_times_out_leaks_the_tensors_instead_of_freeing_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(worker_mod, "SHUTDOWN_TIMEOUT_S", 0.01)
    monkeypatch.setattr(worker_mod, "_LEAKED_ON_SHUTDOWN", [])
    w, kv = make_worker(faults="delay_ms=300")
    w.submit(KVOffloadMetadata(store=(1, ids(1), ids(0), ["r"])))
    wait_on_device(w, 2)
    w.shutdown()
    (leaked,) = worker_mod._LEAKED_ON_SHUTDOWN
    assert all(any(t is held for held in leaked[1].values()) for t in kv.values())


def test_sleep_mode_waits_for_running_copies_refuses_new_ones_and_resumes_on_restore() -> None:
    """vLLM's sleep mode: ``unregister_kv_caches`` returns only once the copy running on
    the KV memory ended; until ``restore_kv_caches`` every copy fails without touching the
    tensors (their memory is released); afterwards copies run again."""
    w, kv = make_worker(faults="delay_ms=300")
    engine = w.engine
    assert engine is not None
    source = {k: t[1].clone() for k, t in kv.items()}
    w.submit(KVOffloadMetadata(store=(1, ids(1), ids(0), ["r"])))
    wait_on_device(w, 2)  # running: one run per layer
    w.unregister_kv_caches()
    # The running store ended before the call returned, and succeeded.
    meta = w.take_worker_meta()
    assert meta is not None
    assert (meta.transfer_ids, meta.ok) == ([1], [True])
    assert not engine.registered
    asleep = {k: t.clone() for k, t in kv.items()}
    w.submit(KVOffloadMetadata(loads=[(2, "s", ids(5), ids(0), True, False)]))
    w.submit(KVOffloadMetadata(store=(3, ids(2), ids(1), ["r"])))
    assert w.take_load_errors() == {5}
    meta = w.take_worker_meta()
    assert meta is not None
    assert (meta.transfer_ids, meta.ok) == ([2, 3], [False, False])
    time.sleep(0.4)  # longer than any copy the faults delay
    w.poll()
    assert w.take_worker_meta() is None
    for k, t in kv.items():
        assert torch.equal(t, asleep[k]), f"{k} written while unregistered"
    w.unregister_kv_caches()  # idempotent
    # Woken up: the memory is back with anything in it; loads fill it again.
    for t in kv.values():
        t.zero_()
    w.restore_kv_caches()
    w.restore_kv_caches()  # idempotent
    assert engine.registered
    w.submit(KVOffloadMetadata(loads=[(4, "s", ids(6), ids(0), True, False)]))
    assert drain(w, 1) == ([4], [True])
    for k, t in kv.items():
        assert torch.equal(t[6], source[k])
    w.shutdown()


def test_sleep_mode_that_outwaits_its_timeout_stops_copying(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A copy still running after the bounded wait stops the engine for good (logged), so
    nothing new is submitted against the released memory, even after a wake-up."""
    monkeypatch.setattr(worker_mod, "SHUTDOWN_TIMEOUT_S", 0.01)
    errors: list[str] = []
    monkeypatch.setattr(worker_mod.logger, "error", lambda msg, *a: errors.append(msg % a))
    w, _ = make_worker(faults="delay_ms=300")
    w.submit(KVOffloadMetadata(store=(1, ids(1), ids(0), ["r"])))
    wait_on_device(w, 2)
    w.unregister_kv_caches()
    assert len(errors) == 1
    assert "still running" in errors[0]
    w.restore_kv_caches()
    assert "stopped" in errors[-1]
    w.submit(KVOffloadMetadata(loads=[(2, "s", ids(5), ids(0), True, False)]))
    assert w.take_load_errors() == {5}
    w.shutdown()
