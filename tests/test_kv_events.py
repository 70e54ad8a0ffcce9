"""kvoffload's CPU events beyond vLLM's scenarios: what it keeps to build them stays bounded
by the blocks in flight and on CPU, whatever happens to a store, and a lazily stored block
is published under the hash it had when its store was issued."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

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
from sched_harness import SchedHarness


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
