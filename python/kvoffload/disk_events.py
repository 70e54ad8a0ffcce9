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
- The CPU tier's reset (``reset_cache``) publishes ``AllBlocksCleared``, an event without
  a medium: a router forgets every block, those on disk too. The disk keeps its blocks
  (lookups still find them), so every block every rank holds is announced again right
  after that event, in the same batch (:meth:`DiskEventLog.cpu_cleared`).
- vLLM's own aggregation of workers' events (``KVConnectorOutput.kv_cache_events``) keeps
  only events every worker reported in the same step; ranks write behind at their own
  pace, so their reports are counted here across steps instead.

Blocks a restart recovered (``disk_persist``) are announced once a read or a write finds
them there and the CPU tier published them (a fetch publishes them on CPU first).
Memory on the scheduler: the snapshot of each block published on CPU until its disk write
is reported (at most ``MAX_PENDING``; a dropped write's snapshot ages out), and per block on
disk which ranks hold it or, once all do, its packed snapshot (:class:`_OnDisk`, to announce
it again after a reset). A disk holds millions of blocks, so the packed snapshot keeps the
hash objects as they are and the tokens as 4-byte integers, and one dict entry per block
serves both (a third of what ``BlockMeta`` snapshots in a second dict cost; see
``tests/test_disk_events.py``).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Any, NamedTuple

from kvoffload._native import tier_block_hash
from kvoffload.vllm_adapter import BlockMeta, EventSpec, block_removed, block_stored

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


class _OnDisk(NamedTuple):
    """An announced block's snapshot, packed: a tuple (no per-object dict), the hashes as
    vLLM publishes them (bytes or int: the same objects, so they round-trip exactly), the
    tokens as native 4-byte integers (a ``tuple`` in the unlikely case one does not fit),
    the rarely set LoRA and extra keys together or ``None``."""

    group: int
    block_hash: Any
    parent_block_hash: Any
    token_ids: bytes | tuple[int, ...]
    lora_extra: tuple[int | None, str | None, tuple[Any, ...] | None] | None

    @classmethod
    def pack(cls, group: int, meta: BlockMeta) -> _OnDisk:
        try:
            tokens: bytes | tuple[int, ...] = array("i", meta.token_ids).tobytes()
        except OverflowError:
            tokens = tuple(meta.token_ids)
        rest = (meta.lora_id, meta.lora_name, meta.extra_keys)
        return cls(
            group,
            meta.block_hash,
            meta.parent_block_hash,
            tokens,
            None if rest == (None, None, None) else rest,
        )

    def meta(self) -> BlockMeta:
        tokens = self.token_ids
        lora_id, lora_name, extra_keys = self.lora_extra or (None, None, None)
        return BlockMeta(
            block_hash=self.block_hash,
            parent_block_hash=self.parent_block_hash,
            token_ids=list(tokens) if isinstance(tokens, tuple) else array("i", tokens).tolist(),
            lora_id=lora_id,
            lora_name=lora_name,
            extra_keys=extra_keys,
        )


class DiskEventLog:
    """The scheduler's side: turns the ranks' reports into ``"STORAGE"`` events."""

    def __init__(self, block_size: int, specs: list[EventSpec], world_size: int) -> None:
        self._block_size = block_size
        self._specs = specs
        self._all_ranks = (1 << world_size) - 1
        # Tier key -> (group, snapshot) of blocks published on CPU, not announced yet.
        self._pending: OrderedDict[bytes, tuple[int, BlockMeta]] = OrderedDict()
        # Tier key -> bit mask of the ranks that reported the block on disk while it is
        # not announced; once announced (every rank holds it: a rank's removal ends the
        # announcement), its packed snapshot instead, moved to the end then so that the
        # announced blocks stay in announcement order (a parent before its children, as
        # they were written). One entry per block on disk: a disk holds millions.
        self._disk: dict[bytes, int | _OnDisk] = {}
        self._num_announced = 0
        self._out: list[Any] = []

    @property
    def num_announced(self) -> int:
        """Blocks announced on disk and not removed (introspection for tests)."""
        return self._num_announced

    def cpu_published(self, group: int, key: bytes, meta: BlockMeta) -> None:
        """The CPU tier published block ``key`` (the planner's key) of ``group``: its
        snapshot waits for the ranks' disk reports."""
        tk = tier_block_hash(group, key)
        if isinstance(self._disk.get(tk), _OnDisk):
            return
        pending = self._pending
        pending[tk] = (group, meta)
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
                if isinstance(held, _OnDisk):
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
                if not isinstance(held, _OnDisk):
                    disk[tk] = held | bit
                    self._announce_if_held(tk)

    def _announce_if_held(self, tk: bytes) -> None:
        if self._disk.get(tk) != self._all_ranks:
            return
        entry = self._pending.pop(tk, None)
        if entry is None:
            return
        del self._disk[tk]
        self._disk[tk] = _OnDisk.pack(*entry)
        self._num_announced += 1
        self._out.append(self._stored(*entry))

    def _stored(self, group: int, meta: BlockMeta) -> Any:
        return block_stored(meta, self._block_size, self._specs[group], group, storage=True)

    def cpu_cleared(self) -> None:
        """The CPU tier was reset and publishes ``AllBlocksCleared`` (no medium) before
        this log's next events: every block still announced on disk is announced again
        after it. Events not taken yet are dropped: their blocks' state is what the
        announcements say (a removed block is no longer announced, a stored one is)."""
        self._out = [
            self._stored(held.group, held.meta())
            for held in self._disk.values()
            if isinstance(held, _OnDisk)
        ]

    def take(self) -> list[Any]:
        out, self._out = self._out, []
        return out
