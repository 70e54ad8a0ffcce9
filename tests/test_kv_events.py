"""kvoffload's CPU events beyond vLLM's scenarios: what it keeps to build them stays bounded
by the blocks in flight and on CPU, whatever happens to a store, and a lazily stored block
is published under the hash it had when its store was issued."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import (
    get_block_hash,
    make_block_hash_with_group_id,
    maybe_convert_block_hash,
)

from kvoffload import parse_config
from kvoffload.events import CpuEventLog
from kvoffload.metadata import KVOffloadWorkerMetadata
from kvoffload.scheduler import OffloadScheduler
from kvoffload.vllm_adapter import EventSpec
from sched_harness import SchedHarness, full_attention, sliding_window


def cpu_stored(events: list[Any]) -> list[Any]:
    return [e for e in events if type(e).__name__ == "BlockStored"]


def test_failed_store_publishes_nothing_and_drops_its_snapshots(model: Path) -> None:
    h = SchedHarness(model, events=True)
    log = h.connector.offload_scheduler.event_log
    h.hold()
    h.add(h.prompt(2))
    h.run(until=lambda: bool(h.in_flight))
    assert log.num_snapshots == 2
    for tid in h.in_flight:
        h.in_flight[tid] = False
    h.release()
    h.run()
    assert cpu_stored(h.events) == []
    assert log.num_snapshots == 0
    assert log.num_resident == 0


def test_reset_drops_snapshots_and_published_hashes(model: Path) -> None:
    h = SchedHarness(model, events=True)
    log = h.connector.offload_scheduler.event_log
    h.add(h.prompt(2))
    h.run()
    assert log.num_resident == 2
    h.hold()
    h.add(h.prompt(2))
    h.run(until=lambda: bool(h.in_flight))
    assert log.num_snapshots == 2
    assert h.connector.reset_cache()
    h.release()
    h.run()
    assert any(type(e).__name__ == "AllBlocksCleared" for e in h.events)
    assert log.num_snapshots == 0
    assert log.num_resident == 0


def test_blocks_are_matched_to_the_planners_events_by_the_plans_keys() -> None:
    """The log keys a snapshot by what the plan says the planner calls the block, never
    by a key it derives from vLLM's hash: a block whose planner key has nothing to do
    with its hash's bytes is still published, with vLLM's full hash, and removed."""
    log = CpuEventLog(16, [EventSpec("full_attention", None), EventSpec("full_attention", None)])
    vllm_hash = make_block_hash_with_group_id(b"h" * 32, 1)
    key = b"K" * 16
    store = (5, b"", b"", [])
    log.store_issued(store, ([key], [None], [vllm_hash]), {}, [1])
    assert log.num_snapshots == 1
    log.stores_retired([("stored", 1, [key], None, 16)], [5])
    (stored,) = cpu_stored(log.take([]))
    assert stored.block_hashes == [maybe_convert_block_hash(get_block_hash(vllm_hash))]
    assert stored.group_idx == 1
    (removed,) = log.take([("removed", 1, [key])])
    assert removed.block_hashes == stored.block_hashes
    assert log.num_snapshots == log.num_resident == 0


def test_a_lazy_block_freed_again_is_published_under_its_new_hash() -> None:
    """A freed block offered between steps but not stored (its hash is on CPU already) is
    reallocated later under another hash and freed again: the store that takes it then
    publishes the new hash, not the one it had when it was offered."""
    config, _ = parse_config({"cpu_bytes_to_use": 1 << 20, "lazy_offload": True}, 1)
    sched = OffloadScheduler(
        config,
        block_size=16,
        num_cpu_blocks=8,
        events=[EventSpec("full_attention", None)],
        max_num_batched_tokens=1024,  # every freed block is offered between steps
        sync_loads=False,
    )
    pool = BlockPool(8, True, 16)
    sched.bind_gpu_block_pool(pool)
    # A waiting request: vLLM keeps stepping, so freed blocks are offered.
    waiting = SimpleNamespace(
        request_id="w", block_hashes=[], num_tokens=16, skip_reading_prefix_cache=False
    )
    sched.get_num_new_matched_tokens(waiting, 0)
    no_output = SimpleNamespace(
        kv_connector_worker_meta=None, finished_sending=None, finished_recving=None
    )
    hash_a = make_block_hash_with_group_id(b"a" * 32, 0)
    hash_b = make_block_hash_with_group_id(b"b" * 32, 0)
    no_step = SimpleNamespace(preempted_req_ids=None)

    def freed(h: bytes) -> Any:
        (block,) = pool.get_new_blocks(1)
        block.set_block_hash(h)
        pool.free_blocks([block])
        return block

    def retire(store: Any) -> list[Any]:
        done = KVOffloadWorkerMetadata(transfer_ids=[store[0]], ok=[True])
        sched.update_connector_output(
            SimpleNamespace(
                kv_connector_worker_meta=done, finished_sending=None, finished_recving=None
            )
        )
        return sched.take_events()

    # Hash A is stored once, from a first block.
    first = freed(hash_a)
    sched.update_connector_output(no_output)
    retire(sched.build_connector_meta(no_step).store)
    # The block comes back (its store retired): offered again, A is on CPU, not stored,
    # and the next plan has no store.
    sched.update_connector_output(no_output)
    assert sched.build_connector_meta(no_step).store is None
    # vLLM reallocates it (evicting A) and frees it under B before the next plan.
    taken = pool.get_new_blocks(pool.get_num_free_blocks())
    assert first in taken
    first.set_block_hash(hash_b)
    pool.free_blocks([first])
    store = sched.build_connector_meta(no_step).store
    assert store is not None
    stored = cpu_stored(retire(store))
    assert [e.block_hashes for e in stored] == [[maybe_convert_block_hash(get_block_hash(hash_b))]]


def _stored_by_group(events: list[Any]) -> dict[int, list[Any]]:
    by_group: dict[int, list[Any]] = {}
    for e in cpu_stored(events):
        by_group.setdefault(e.group_idx, []).append(e)
    return by_group


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_a_gpu_reset_announces_every_group_on_cpu_again_after_vllms_clear(
    model: Path, lazy: bool
) -> None:
    """A hybrid model (a full-attention and a sliding-window group): after vLLM's GPU pool
    alone is reset, the published batch has vLLM's ``AllBlocksCleared`` first and then
    each block of each group still on CPU, as first announced (group, spec, hash, parent,
    tokens; a lazy store's without tokens)."""
    h = SchedHarness(
        model,
        events=True,
        lazy=lazy,
        num_gpu_blocks=12,
        groups=[
            (["model.layers.0.self_attn.attn"], full_attention()),
            (["model.layers.1.self_attn.attn"], sliding_window(32)),
        ],
    )
    h.serve(h.prompt(3))
    if lazy:
        # Lazy mode stores freed GPU blocks while vLLM steps: a second prompt's steps
        # and allocations walk and evict the first one's.
        h.serve(h.prompt(3))
    first = _stored_by_group(h.events)
    assert set(first) == {0, 1}
    h.batches.clear()
    assert h.scheduler.reset_prefix_cache()
    h.step()
    (batch,) = h.batches
    assert type(batch[0]).__name__ == "AllBlocksCleared"
    again = batch[1:]
    assert [type(e).__name__ for e in again] == ["BlockStored"] * len(again)
    assert {e.medium for e in again} == {"CPU"}
    assert len(again) == h.offload.event_log.num_resident
    by_group = _stored_by_group(again)
    for group, events in by_group.items():
        assert all(e in first[group] for e in events), "as first announced"
    if not lazy:
        assert by_group == first
    h.step()
    assert len(h.batches) == 1, "announced once"


def test_a_gpu_reset_with_a_request_running_announces_the_cpu_blocks_after_vllms_clear(
    model: Path,
) -> None:
    """``reset_prefix_cache(reset_running_requests=True)`` preempts the running requests
    and resets the GPU pool between two steps of theirs: the next batch still starts
    with vLLM's clear, followed by every block on CPU, each once."""
    h = SchedHarness(model, events=True, num_cpu_blocks=16)
    h.serve(h.prompt(2))
    h.add(h.prompt(6))
    h.step()
    assert h.scheduler.running
    h.batches.clear()
    assert h.scheduler.reset_prefix_cache(reset_running_requests=True)
    h.step()
    batch = h.batches[0]
    assert type(batch[0]).__name__ == "AllBlocksCleared"
    # vLLM's own BlockStored (medium GPU) for the step's allocations follow its clear.
    again = [e for e in cpu_stored(batch) if e.medium == "CPU"]
    hashes = [bh for e in again for bh in e.block_hashes]
    assert len(hashes) == len(set(hashes)) == h.offload.event_log.num_resident >= 2
    h.run()
    announced = [
        bh for b in h.batches for e in cpu_stored(b) if e.medium == "CPU" for bh in e.block_hashes
    ]
    assert len(announced) == len(set(announced)), "no block announced twice since the clear"


def test_without_kv_events_a_gpu_reset_is_not_watched(model: Path) -> None:
    h = SchedHarness(model, events=False)
    h.serve(h.prompt(2))
    assert h.offload._gpu_reset is None
    assert h.scheduler.reset_prefix_cache()
    h.step()
    assert h.batches == h.events == []


def test_a_block_on_cpu_is_kept_packed() -> None:
    """What a large CPU tier costs the scheduler with events on: per block on CPU its
    packed snapshot (hashes, tokens as 4-byte integers) in one dict entry, to name it in
    its removal and announce it again after a GPU reset. Bytes traced per 16-token block
    with 32-byte hashes, all of them kept only by the log (the request's tokens and hashes
    were there before); the bound is the disk log's (``test_disk_events.py``)."""
    import tracemalloc

    n = 5000
    req = SimpleNamespace(
        block_hashes=[i.to_bytes(32, "little") for i in range(n)],
        all_token_ids=[1000 + t % 150_000 for t in range(16 * n)],
        lora_request=None,
        mm_features=[],
        cache_salt=None,
        prompt_embeds=None,
    )
    keys = [i.to_bytes(16, "little") for i in range(n)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        log = CpuEventLog(16, [EventSpec("full_attention", None)])
        for i in range(0, n, 100):
            sources = [(0, j) for j in range(i, i + 100)]
            log.store_issued((i, b"", b"", ["r"]), (keys[i : i + 100], sources, []), {"r": req})
            log.stores_retired([("stored", 0, keys[i : i + 100], None, 16)], [i])
            log.take([])
        per_block = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
    assert log.num_resident == n
    assert per_block < 512, f"{per_block:.0f} bytes per block on CPU"
