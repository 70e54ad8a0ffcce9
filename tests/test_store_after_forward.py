"""Stores copied within the step (KV in host memory): the lazy one before the step's loads
and forward pass, the eager one after the forward pass; reported within the step, and never
while they still read GPU blocks."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch

from kvoffload import parse_config
from kvoffload import worker as worker_mod
from kvoffload.metadata import KVOffloadMetadata
from kvoffload.worker import OffloadWorker
from test_worker import drain, ids, make_worker


def test_is_copied_and_reported_before_the_step_ends() -> None:
    # Copies slower than a step: the worker still reports the store with this step.
    w, kv = make_worker(faults="delay_ms=100")
    w.store_after_forward(KVOffloadMetadata(store_after_forward=(1, ids(2, 3), ids(0, 1), ["r"])))
    meta = w.take_worker_meta()
    assert meta is not None
    assert (meta.transfer_ids, meta.ok) == ([1], [True])
    w.submit(KVOffloadMetadata(loads=[(2, "s", ids(6, 7), ids(0, 1), True, False)]))
    assert drain(w, 1) == ([2], [True])
    for t in kv.values():
        assert torch.equal(t[6], t[2])
        assert torch.equal(t[7], t[3])
    w.shutdown()


def test_one_that_outlives_the_wait_stops_the_engine_after_the_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(worker_mod, "STORE_WITHIN_STEP_TIMEOUT_S", 0.01)
    w, _ = make_worker(faults="delay_ms=300")
    w.store_after_forward(KVOffloadMetadata(store_after_forward=(1, ids(1), ids(0), ["r"])))
    # Reported failed (never published) once the copy ended; later copies fail at once.
    meta = w.take_worker_meta()
    assert meta is not None
    assert (meta.transfer_ids, meta.ok) == ([1], [False])
    assert w.engine is not None
    assert w.engine.stopped is not None
    w.shutdown()


def test_without_kv_caches_is_reported_failed() -> None:
    config, _ = parse_config({"cpu_bytes_to_use": 4096}, 1)
    w = OffloadWorker(config, num_gpu_blocks=8)
    w.store_after_forward(KVOffloadMetadata(store_after_forward=(1, ids(1), ids(0), ["r"])))
    meta = w.take_worker_meta()
    assert meta is not None
    assert (meta.transfer_ids, meta.ok) == ([1], [False])


def test_a_step_without_one_reports_nothing() -> None:
    w, _ = make_worker()
    w.store_after_forward(KVOffloadMetadata(store=(1, ids(1), ids(0), ["r"])))
    assert w.take_worker_meta() is None
    w.shutdown()


def test_a_failed_copy_is_reported_failed_within_the_step() -> None:
    w, _ = make_worker(faults="fatal_after=1")
    w.store_after_forward(KVOffloadMetadata(store_after_forward=(1, ids(1), ids(0), ["r"])))
    meta = w.take_worker_meta()
    assert meta is not None
    assert (meta.transfer_ids, meta.ok) == ([1], [False])
    w.shutdown()


def test_a_lazy_store_is_copied_before_the_loads_of_its_step() -> None:
    # Slow copies: a load submitted beside the store would overwrite block 2 first.
    w, kv = make_worker(faults="delay_ms=50")
    before = {name: t[2].clone() for name, t in kv.items()}
    # Block 2 was freed and offered last step, then reallocated to a request loading
    # CPU block 1 into it (filled by an earlier store of block 5).
    w.store_after_forward(KVOffloadMetadata(store_after_forward=(1, ids(5), ids(1), ["r"])))
    w.take_worker_meta()
    w.submit(
        KVOffloadMetadata(
            loads=[(3, "s", ids(2), ids(1), True, True)],
            store_before_forward=(2, ids(2), ids(0), []),
        )
    )
    w.finish_sync_loads()
    meta = w.take_worker_meta()
    assert meta is not None
    assert (meta.transfer_ids, meta.ok) == ([2, 3], [True, True])
    # CPU block 0 holds block 2 as it was before the load; block 2 holds block 5's KV.
    w.submit(KVOffloadMetadata(loads=[(4, "t", ids(6), ids(0), True, True)]))
    w.finish_sync_loads()
    for name, t in kv.items():
        assert torch.equal(t[6], before[name])
        assert torch.equal(t[2], t[5])
    w.shutdown()


def test_a_lazy_store_without_kv_caches_is_reported_failed() -> None:
    config, _ = parse_config({"cpu_bytes_to_use": 4096}, 1)
    w = OffloadWorker(config, num_gpu_blocks=8)
    w.submit(KVOffloadMetadata(store_before_forward=(1, ids(1), ids(0), [])))
    meta = w.take_worker_meta()
    assert meta is not None
    assert (meta.transfer_ids, meta.ok) == ([1], [False])
