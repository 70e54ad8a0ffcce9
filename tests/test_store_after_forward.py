"""The worker's after-forward store (KV in host memory): copied and reported within the
step, and never reported while it still reads GPU blocks."""

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
    monkeypatch.setattr(worker_mod, "STORE_AFTER_FORWARD_TIMEOUT_S", 0.01)
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
