"""vLLM's sleep mode (0.33 adds ``unregister_kv_caches`` / ``restore_kv_caches`` to the
connector base, and ``supports_sleep_mode`` defaults to True): through the worker-role
connector next to a real vLLM scheduler, blocks stored before a sleep are found and loaded
into the restored KV tensors after it."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch

from sched_harness import Rank, SchedHarness


def test_blocks_stored_before_a_sleep_are_hit_and_loaded_after_the_wake_up(model: Path) -> None:
    h = SchedHarness(model, num_cpu_blocks=8)
    rank = Rank(h.scheduler.vllm_config, 2)
    try:
        original = {name: t.clone() for name, t in rank.kv.items()}
        prompt = h.prompt(3)
        _, steps = h.serve(prompt)
        stored_from: dict[int, int] = {}  # cpu block -> the GPU block its bytes came from
        for s in steps:
            rank.run(s.output.kv_connector_metadata)
            if s.store is not None:
                stored_from.update(zip(s.store.cpu, s.store.gpu, strict=True))
        assert len(stored_from) == 3
        assert all(rank.done.values())

        rank.connector.unregister_kv_caches()
        assert not rank.worker.engine.registered
        # The wake-up brings the KV memory back with anything in it.
        for t in rank.kv.values():
            t.zero_()
        rank.connector.restore_kv_caches()
        assert rank.worker.engine.registered

        h.evict_gpu_prefix_cache()
        req = h.add(prompt)
        s = h.step()
        assert s.lookups[req.request_id][0] == 3 * h.block_size
        (load,) = s.loads
        rank.run(s.output.kv_connector_metadata)
        assert rank.done[load.tid]
        for name, t in rank.kv.items():
            for gpu, cpu in zip(load.gpu, load.cpu, strict=True):
                assert torch.equal(t[gpu], original[name][stored_from[cpu]]), (name, gpu)
        h.run()
    finally:
        rank.shutdown()


def test_the_connector_keeps_vllms_sleep_mode_support() -> None:
    """vLLM refuses sleep mode for a connector whose ``supports_sleep_mode`` is False; the
    hooks above make kvoffload safe under it, so it keeps the base's answer."""
    from kvoffload.connector import KVOffloadConnector

    if not hasattr(KVOffloadConnector, "supports_sleep_mode"):
        pytest.skip("this vLLM (< 0.33) has no sleep mode hooks for connectors")
    assert KVOffloadConnector.supports_sleep_mode(None) is True
