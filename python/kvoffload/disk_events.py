"""KV events of medium ``"STORAGE"`` for the disk tier, as vLLM's Simple connector
publishes its disk pool's.

Who knows what: the workers own the disk files, so only they know which blocks a
write-behind batch really put on disk (a full queue drops writes, a busy set skips them,
a write can fail) and which ones a write evicted, a read found corrupt, or the tier
dropped when it turned itself off. Each rank reports those changes by the tiers' 16-byte
key with the step's worker metadata (:class:`DiskReports`). The scheduler knows what a
router wants to read: vLLM's full hash (``maybe_convert_block_hash``), the block's tokens,
its group; the CPU event log hands over each block's snapshot when it publishes the block
on CPU, which is before any rank writes it behind (:class:`DiskEventLog`).

- A block is announced (``BlockStored``, medium ``"STORAGE"``) once every rank reported
  it on disk; its group's ``group_idx`` and spec as on CPU.
- It is removed (``BlockRemoved``, ``"STORAGE"``) when the first rank reports it gone:
  evicted, failed a check, or the tier turned itself off after repeated I/O errors (then
  every block it announced is removed, one event per group).
- A reset of vLLM's GPU pool (``reset_prefix_cache``) or of the CPU tier
  (``reset_cache``) publishes ``AllBlocksCleared``, an event without a medium: a router
  forgets every block, those on disk too. The disk keeps its blocks (lookups still find
  them), so every block every rank holds is announced again after that event, in the
  same batch (:meth:`DiskEventLog.announce_again`).
- vLLM's own aggregation of workers' events (``KVConnectorOutput.kv_cache_events``) keeps
  only events every worker reported in the same step; ranks write behind at their own
  pace, so their reports are counted here across steps instead.

Blocks a restart recovered (``disk_persist``) are announced once a read or a write finds
them there and the CPU tier published them (a fetch publishes them on CPU first).
Memory on the scheduler: the snapshot of each block published on CPU until its disk write
is reported (at most ``MAX_PENDING``; a dropped write's snapshot ages out), and per block on
disk which ranks hold it or, once all do, its packed snapshot
(:class:`kvoffload.block_snapshot.PackedBlock`, to announce it again after a reset; the
CPU log's own while the block is on CPU too). A disk holds millions of blocks: one dict
entry per block serves both (see ``tests/test_disk_events.py``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from kvoffload._native import tier_block_hash
from kvoffload.block_snapshot import PackedBlock
from kvoffload.vllm_adapter import EventSpec, block_removed, block_stored

#: Bytes of the tiers' block keys in the workers' reports.
KEY_BYTES = 16
#: Most snapshots kept for blocks published on CPU whose disk writes were not reported
#: yet. A write-behind reaches the disk within a few steps or is dropped; the oldest
#: snapshots go first.
MAX_PENDING = 65536

#: One rank's report: ``(rank, stored keys, removed keys)``, keys concatenated.
DiskReport = tuple[int, bytes, bytes]


def _keys(raw: bytes) -> list[bytes]:
    return [raw[i : i + KEY_BYTES] for i in range(0, len(raw) - KEY_BYTES + 1, KEY_BYTES)]


class DiskReports:
    """A worker rank's side: the disk's changes since the last worker metadata."""

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._reports: list[DiskReport] = []

    def add(self, stored: bytes, removed: bytes) -> None:
        if stored or removed:
            self._reports.append((self._rank, stored, removed))

    def take(self) -> list[DiskReport]:
        reports, self._reports = self._reports, []
        return reports

    def __bool__(self) -> bool:
        return bool(self._reports)


class DiskEventLog:
    """The scheduler's side: turns the ranks' reports into ``"STORAGE"`` events."""

    def __init__(self, block_size: int, specs: list[EventSpec], world_size: int) -> None:
        self._block_size = block_size
        self._specs = specs
        self._all_ranks = (1 << world_size) - 1
        # Tier key -> snapshot of blocks published on CPU, not announced yet.
        self._pending: OrderedDict[bytes, PackedBlock] = OrderedDict()
        # Tier key -> bit mask of the ranks that reported the block on disk while it is
        # not announced; once announced (every rank holds it: a rank's removal ends the
        # announcement), its packed snapshot instead, moved to the end then so that the
        # announced blocks stay in announcement order (a parent before its children, as
        # they were written). One entry per block on disk: a disk holds millions.
        self._disk: dict[bytes, int | PackedBlock] = {}
        self._num_announced = 0
        self._out: list[Any] = []

    @property
    def num_announced(self) -> int:
        """Blocks announced on disk and not removed (introspection for tests)."""
        return self._num_announced

    def cpu_published(self, key: bytes, block: PackedBlock) -> None:
        """The CPU tier published block ``key`` (the planner's key) of ``block.group``:
        its snapshot waits for the ranks' disk reports."""
        tk = tier_block_hash(block.group, key)
        if isinstance(self._disk.get(tk), PackedBlock):
            return
        pending = self._pending
        pending[tk] = block
        pending.move_to_end(tk)
        if len(pending) > MAX_PENDING:
            pending.popitem(last=False)
        self._announce_if_held(tk)

    def reports(self, reports: list[DiskReport]) -> None:
        """Applies the ranks' reports in the order they came; within one, its removals
        before its stores (see ``DiskChanges`` in the core)."""
        disk = self._disk
        for rank, stored, gone in reports:
            bit = 1 << rank
            removed: dict[int, list[Any]] = {}
            for tk in _keys(gone):
                held = disk.get(tk, 0)
                if isinstance(held, PackedBlock):
                    self._num_announced -= 1
                    removed.setdefault(held.group, []).append(held.block_hash)
                    held = self._all_ranks
                left = held & ~bit
                if left:
                    disk[tk] = left
                else:
                    disk.pop(tk, None)
            for group, hashes in removed.items():
                self._out.append(block_removed(hashes, group, storage=True))
            for tk in _keys(stored):
                held = disk.get(tk, 0)
                if not isinstance(held, PackedBlock):
                    disk[tk] = held | bit
                    self._announce_if_held(tk)

    def _announce_if_held(self, tk: bytes) -> None:
        if self._disk.get(tk) != self._all_ranks:
            return
        block = self._pending.pop(tk, None)
        if block is None:
            return
        del self._disk[tk]
        self._disk[tk] = block
        self._num_announced += 1
        self._out.append(self._stored(block))

    def _stored(self, block: PackedBlock) -> Any:
        group = block.group
        return block_stored(block.meta(), self._block_size, self._specs[group], group, storage=True)

    def announce_again(self) -> None:
        """An ``AllBlocksCleared`` (no medium: vLLM's GPU pool or the CPU tier was reset)
        is published before this log's next events: every block still announced on disk
        is announced again after it. Events not taken yet are dropped: their blocks'
        state is what the announcements say (a removed block is no longer announced, a
        stored one is). Asked twice before a take, it announces each block once."""
        self._out = [
            self._stored(held) for held in self._disk.values() if isinstance(held, PackedBlock)
        ]

    def take(self) -> list[Any]:
        out, self._out = self._out, []
        return out
