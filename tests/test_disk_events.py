"""KV events of medium ``"STORAGE"`` for the disk tier, without an engine.

A real vLLM ``Scheduler`` with kvoffload (``sched_harness``) and one real worker-role
connector whose disk tier writes real files (:class:`sched_harness.Rank`): the worker's
disk reports reach the scheduler with the step's worker metadata, as in an engine. The
rank rules (a block is announced once every rank holds it, removed when the first one
drops it) are checked on :class:`kvoffload.disk_events.DiskEventLog` directly.
"""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from sched_harness import SchedHarness

#: Four 4 KiB slots of the harness's 1 KiB blocks, with their six index entries (one set).
FOUR_SLOTS = 4096 + 4 * 4096 + 6 * 128


def _disk(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {
        "kv_offload_backend": "disk",
        "disk_path": str(tmp_path / "kv"),
        "disk_capacity_bytes": FOUR_SLOTS,
        **extra,
    }


def _serve(h: SchedHarness, rank: Any, prompt: list[int]) -> None:
    """Serves ``prompt``, running every step's copies on ``rank`` and reporting its disk
    writes with the next step, until they all reached the scheduler."""
    h.add(prompt)
    while h.scheduler.has_requests() or h.connector.has_pending_push_work():
        s = h.step()
        rank.run(s.output.kv_connector_metadata)
        h.report_disk(rank.disk)
        rank.disk.clear()
    # Stores are written behind on the worker's thread: wait until every queued write
    # landed, then report what the disk says.
    deadline = time.monotonic() + 10
    worker = rank.worker
    while True:
        st = dict(worker.tier.stats())
        if st["remote_writes_done"] + st["remote_writes_failed"] >= st["remote_writes_queued"]:
            break
        assert time.monotonic() < deadline, st
        time.sleep(0.01)
    worker.poll()
    report = worker.take_worker_meta()
    if report is not None:
        assert not report.transfer_ids
        h.report_disk(report.disk)
        h.step()


def _medium(events: list[Any], kind: str, medium: str) -> list[Any]:
    return [e for e in events if type(e).__name__ == kind and e.medium == medium]


def _hashes(events: list[Any]) -> list[Any]:
    return [h for e in events for h in e.block_hashes]


def test_disk_writes_are_announced_as_storage_with_vllms_hashes_and_removed_on_eviction(
    model: Path, tmp_path: Path, rank_zero: None
) -> None:
    """A CPU tier in front of the disk: each block the worker wrote is announced with
    medium STORAGE, with the hash, tokens and group vLLM gave it on the GPU; a block the
    disk evicts is removed with medium STORAGE."""
    from sched_harness import Rank

    h = SchedHarness(model, events=True, num_cpu_blocks=8, extra=_disk(tmp_path))
    rank = Rank(h.scheduler.vllm_config, 1)
    try:
        first = h.prompt(3)
        _serve(h, rank, first)
        gpu = {
            bh for e in h.gpu_events if type(e).__name__ == "BlockStored" for bh in e.block_hashes
        }
        cpu = _medium(h.events, "BlockStored", "CPU")
        disk = _medium(h.events, "BlockStored", "STORAGE")
        assert len(_hashes(cpu)) == 3
        assert _hashes(disk) == _hashes(cpu), "the disk holds what the CPU tier stored"
        for e in disk:
            (bh,) = e.block_hashes
            assert bh in gpu, "the hash vLLM published for the block on the GPU"
            assert e.group_idx == 0
            assert e.block_size == h.block_size
        assert [list(e.token_ids) for e in disk] == [
            first[i * h.block_size : (i + 1) * h.block_size] for i in range(3)
        ]
        # A second prompt's three blocks evict the first prompt's two least recently
        # used from the disk's four slots.
        _serve(h, rank, h.prompt(3))
        removed = _medium(h.events, "BlockRemoved", "STORAGE")
        assert len(_hashes(removed)) == 2, removed
        assert set(_hashes(removed)) <= set(_hashes(disk))
        assert h.offload._disk_events.num_announced == 4
    finally:
        rank.shutdown()


def test_simples_disk_mode_publishes_the_disk_not_the_staging_memory(
    model: Path, tmp_path: Path, rank_zero: None
) -> None:
    """Simple's disk config (no CPU budget): host memory only stages the disk, so only
    STORAGE events are published, as Simple publishes its disk pool."""
    from sched_harness import Rank

    extra = _disk(tmp_path, cpu_bytes_to_use=None, disk_capacity_bytes=64 * 5000)
    h = SchedHarness(model, events=True, extra=extra)
    rank = Rank(h.scheduler.vllm_config, 1)
    try:
        prompt = h.prompt(3)
        _serve(h, rank, prompt)
        assert [e for e in h.events if getattr(e, "medium", None) == "CPU"] == []
        disk = _medium(h.events, "BlockStored", "STORAGE")
        assert [list(e.token_ids) for e in disk] == [
            prompt[i * h.block_size : (i + 1) * h.block_size] for i in range(3)
        ]
    finally:
        rank.shutdown()


def test_a_cpu_reset_announces_the_blocks_still_on_disk_again_after_its_clear(
    model: Path, tmp_path: Path, rank_zero: None
) -> None:
    """``reset_prefix_cache(reset_connector=True)`` resets vLLM's GPU pool and empties the
    CPU tier: the batch starts with ``AllBlocksCleared`` (no medium), which has a router
    forget the disk's blocks too; the disk keeps them, so they are announced again
    (STORAGE) after it, in the same batch, once, with their first announcement's hashes
    and tokens; nothing is announced on CPU."""
    from sched_harness import Rank

    h = SchedHarness(model, events=True, num_cpu_blocks=8, extra=_disk(tmp_path))
    rank = Rank(h.scheduler.vllm_config, 1)
    try:
        _serve(h, rank, h.prompt(3))
        disk = _medium(h.events, "BlockStored", "STORAGE")
        assert len(disk) == 3
        h.batches.clear()
        assert h.scheduler.reset_prefix_cache(reset_connector=True)
        h.step()
        (batch,) = h.batches
        names = [type(e).__name__ for e in batch]
        assert names[0] == "AllBlocksCleared"
        first_stored = names.index("BlockStored")
        assert set(names[:first_stored]) == {"AllBlocksCleared"}
        again = batch[first_stored:]
        assert [e.medium for e in again] == ["STORAGE"] * 3
        assert _hashes(again) == _hashes(disk)
        assert [list(e.token_ids) for e in again] == [list(e.token_ids) for e in disk]
        assert [e.parent_block_hash for e in again] == [e.parent_block_hash for e in disk]
        assert again == disk, "field by field"
        assert h.offload._disk_events.num_announced == 3
        h.step()
        assert len(h.batches) == 1, "announced once after the clear"
    finally:
        rank.shutdown()


def test_a_gpu_reset_announces_the_blocks_on_cpu_and_disk_again_after_vllms_clear(
    model: Path, tmp_path: Path, rank_zero: None
) -> None:
    """``reset_prefix_cache()`` (the GPU pool only, as ``/reset_prefix_cache`` does):
    vLLM publishes ``AllBlocksCleared`` (no medium) and a router forgets the blocks the
    CPU tier and the disk still hold and serve. The next batch has vLLM's clear first,
    then every CPU block (medium CPU) and every disk block (STORAGE) announced again as
    first announced; later batches announce nothing again."""
    from sched_harness import Rank

    h = SchedHarness(model, events=True, num_cpu_blocks=8, extra=_disk(tmp_path))
    rank = Rank(h.scheduler.vllm_config, 1)
    try:
        prompt = h.prompt(3)
        _serve(h, rank, prompt)
        cpu = _medium(h.events, "BlockStored", "CPU")
        disk = _medium(h.events, "BlockStored", "STORAGE")
        assert len(cpu) == len(disk) == 3
        h.batches.clear()
        assert h.scheduler.reset_prefix_cache()
        h.step()
        (batch,) = h.batches
        assert [type(e).__name__ for e in batch] == ["AllBlocksCleared"] + ["BlockStored"] * 6
        again = batch[1:]
        assert _medium(again, "BlockStored", "CPU") == cpu, "field by field"
        assert _medium(again, "BlockStored", "STORAGE") == disk
        assert [list(e.token_ids) for e in again[:3]] == [
            prompt[i * h.block_size : (i + 1) * h.block_size] for i in range(3)
        ]
        assert [e.parent_block_hash for e in again[:3]] == [None, *_hashes(cpu)[:2]]
        h.step()
        assert len(h.batches) == 1, "announced once after the clear"
        # The blocks are still served from CPU after the GPU reset.
        assert h.cpu_hit_tokens(prompt) == 3 * h.block_size
    finally:
        rank.shutdown()


def _block(i: int, group: int = 0) -> Any:
    """Block ``i``'s snapshot, as the CPU event log hands it over when it publishes it."""
    from kvoffload.block_snapshot import PackedBlock
    from kvoffload.vllm_adapter import BlockMeta

    meta = BlockMeta(
        block_hash=bytes([i]) * 32,
        parent_block_hash=None,
        token_ids=[i] * 4,
        lora_id=None,
        lora_name=None,
        extra_keys=None,
    )
    return PackedBlock.pack(group, meta)


def test_a_block_is_announced_once_every_rank_holds_it_and_removed_when_one_drops_it() -> None:
    from kvoffload._native import tier_block_hash
    from kvoffload.disk_events import DiskEventLog
    from kvoffload.vllm_adapter import EventSpec

    log = DiskEventLog(4, [EventSpec("full_attention", None), EventSpec("sliding_window", 8)], 2)
    key = [tier_block_hash(g, bytes([i]) * 16) for i, g in ((1, 0), (2, 1))]
    # Rank 0 writes before the CPU tier published the block (another rank was slower to
    # report its copy): nothing until every rank holds it and its snapshot is known.
    log.reports([(0, key[0], b"")])
    log.cpu_published(bytes([1]) * 16, _block(1))
    log.cpu_published(bytes([2]) * 16, _block(2, 1))
    assert log.take() == []
    log.reports([(1, key[0] + key[1], b""), (0, key[1], b"")])
    stored = log.take()
    assert [(e.medium, e.block_hashes, e.group_idx) for e in stored] == [
        ("STORAGE", [bytes([1]) * 32], 0),
        ("STORAGE", [bytes([2]) * 32], 1),
    ]
    assert stored[1].kv_cache_spec_kind == "sliding_window"
    # Rank 1 evicts block 1: gone from "every rank"; rank 0 evicting it too says nothing
    # more. Rank 1 drops block 2 and writes it again (in one report: removal first).
    log.reports([(1, key[1], key[0] + key[1])])
    log.reports([(0, b"", key[0])])
    removed = log.take()
    assert [(type(e).__name__, e.medium, e.block_hashes) for e in removed] == [
        ("BlockRemoved", "STORAGE", [bytes([1]) * 32]),
        ("BlockRemoved", "STORAGE", [bytes([2]) * 32]),
    ]
    assert log.num_announced == 0
    # A block is written again only after the CPU tier stored (and published) it again:
    # then it is announced again, every rank holding it.
    log.cpu_published(bytes([2]) * 16, _block(2, 1))
    assert [e.block_hashes for e in log.take()] == [[bytes([2]) * 32]]
    assert log.num_announced == 1


def test_events_not_taken_before_a_cpu_reset_are_replaced_by_what_the_disk_holds() -> None:
    """A STORAGE event still buffered at the reset would follow the clear: a block
    stored then is announced once, a block removed then not at all."""
    from kvoffload._native import tier_block_hash
    from kvoffload.disk_events import DiskEventLog
    from kvoffload.vllm_adapter import EventSpec

    log = DiskEventLog(4, [EventSpec("full_attention", None)], 1)
    keys = [tier_block_hash(0, bytes([i]) * 16) for i in (1, 2, 3)]
    for i in (1, 2, 3):
        log.cpu_published(bytes([i]) * 16, _block(i))
    log.reports([(0, keys[0] + keys[1], b"")])
    assert len(log.take()) == 2
    log.reports([(0, keys[2], keys[1])])
    log.announce_again()
    again = log.take()
    assert [(e.medium, e.block_hashes) for e in again] == [
        ("STORAGE", [bytes([1]) * 32]),
        ("STORAGE", [bytes([3]) * 32]),
    ]
    assert again[0].token_ids == [1] * 4
    assert log.take() == []


def test_after_a_clear_only_blocks_every_rank_holds_are_announced_again_and_once() -> None:
    """Tensor parallel: a block only one rank wrote was never announced, and is not after
    a clear either. A reset of the GPU pool together with the CPU tier asks twice (once
    per reset) before the events are taken: each block is still announced once."""
    from kvoffload._native import tier_block_hash
    from kvoffload.disk_events import DiskEventLog
    from kvoffload.vllm_adapter import EventSpec

    log = DiskEventLog(4, [EventSpec("full_attention", None)], 2)
    keys = [tier_block_hash(0, bytes([i]) * 16) for i in (1, 2)]
    for i in (1, 2):
        log.cpu_published(bytes([i]) * 16, _block(i))
    log.reports([(0, keys[0] + keys[1], b""), (1, keys[0], b"")])
    assert [e.block_hashes for e in log.take()] == [[bytes([1]) * 32]]
    log.announce_again()
    log.announce_again()
    assert [e.block_hashes for e in log.take()] == [[bytes([1]) * 32]]
    # Rank 1 writes block 2 later: announced then, as usual.
    log.reports([(1, keys[1], b"")])
    assert [e.block_hashes for e in log.take()] == [[bytes([2]) * 32]]


@pytest.mark.parametrize("hash_kind", ["bytes", "int"])
def test_a_block_announced_again_after_a_reset_equals_its_first_announcement(
    hash_kind: str,
) -> None:
    """The packed snapshot gives back every field: vLLM's hashes as bytes or as ints
    (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), token ids past 256 and past 32 bits, LoRA
    and extra keys, a lazy store's block without tokens or parent."""
    from kvoffload._native import tier_block_hash
    from kvoffload.block_snapshot import PackedBlock
    from kvoffload.disk_events import DiskEventLog
    from kvoffload.vllm_adapter import BlockMeta, EventSpec

    def block_hash(i: int) -> Any:
        raw = bytes([i, 0xFF]) * 16
        return raw if hash_kind == "bytes" else int.from_bytes(raw[:8], "big")

    metas = [
        BlockMeta(block_hash(1), None, [0, 255, 256, 151_000], None, None, None),
        BlockMeta(
            block_hash(2),
            block_hash(1),
            [2**31 - 1, -(2**31), 7, 2**40],
            3,
            "adapter",
            (("lora", "adapter"), ("mm", "img-0", 5), ("salt", "s")),
        ),
        BlockMeta(block_hash(3), None, [], None, None, None),
    ]
    log = DiskEventLog(4, [EventSpec("full_attention", None), EventSpec("sliding_window", 8)], 1)
    keys = b""
    for i, meta in enumerate(metas):
        group = i % 2
        log.cpu_published(bytes([i]) * 16, PackedBlock.pack(group, meta))
        keys += tier_block_hash(group, bytes([i]) * 16)
    log.reports([(0, keys, b"")])
    first = log.take()
    assert len(first) == 3
    log.announce_again()
    again = log.take()
    assert again == first
    for a, b in zip(again, first, strict=True):
        assert [type(h) for h in a.block_hashes] == [type(h) for h in b.block_hashes]
        assert type(a.parent_block_hash) is type(b.parent_block_hash)
    assert again[1].extra_keys == [("adapter", ("img-0", 5), "s")]


def test_an_announced_block_is_kept_packed() -> None:
    """What a million-block disk costs the scheduler: per announced block one entry with
    the hashes, the tokens packed as 4-byte integers (no ``BlockMeta``, no list of ints).
    The bound (bytes traced per 16-token block with 32-byte hashes, all of them kept only
    by the log) is generous: a ``BlockMeta`` kept as published costs about 1 KB."""
    from kvoffload._native import tier_block_hash
    from kvoffload.block_snapshot import PackedBlock
    from kvoffload.disk_events import DiskEventLog
    from kvoffload.vllm_adapter import BlockMeta, EventSpec

    n = 5000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        log = DiskEventLog(16, [EventSpec("full_attention", None)], 1)
        parent = None
        for i in range(n):
            block = i.to_bytes(32, "little")
            tokens = [1000 + (i * 16 + t) % 150_000 for t in range(16)]
            meta = BlockMeta(block, parent, tokens, None, None, None)
            log.cpu_published(block[:16], PackedBlock.pack(0, meta))
            log.reports([(0, tier_block_hash(0, block[:16]), b"")])
            log.take()
            parent = block
        del block, parent, tokens, meta
        per_block = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
    assert log.num_announced == n
    assert per_block < 512, f"{per_block:.0f} bytes per announced block"
    held = list(log._disk.values())
    assert len(held) == n
    assert all(type(h.token_ids) is bytes and len(h.token_ids) == 64 for h in held)
