"""CPU-tier KV events as vLLM publishes them, built from the planner's events.

The planner decides what was stored and evicted and names blocks by its own keys; a router
correlates tiers by vLLM's full hash (converted by ``maybe_convert_block_hash``) and wants
the block's tokens. Those come from the request, which only the scheduler adapter holds,
and only until it finishes (a lazy block's hash comes from vLLM's free queue, handed out
by the planner with the store): so each stored block is snapshotted when its store is
issued, under its KV-cache group and the key the plan names it by (the planner's, never
derived here), and the snapshot is turned into a ``BlockStored`` (with its group's
``group_idx`` and spec) when the planner publishes the block (every rank copied it).
Resident blocks keep their snapshot packed (:class:`kvoffload.block_snapshot.PackedBlock`):
its hash names the block in the ``BlockRemoved`` of its eviction, and the whole snapshot
announces it again after vLLM's GPU pool was reset (:meth:`CpuEventLog.announce_again`):
vLLM's ``AllBlocksCleared`` has no medium, so a router forgets the CPU tier's blocks too.
Memory: one snapshot per block in flight (dropped when its store retires, published or
failed) and one packed snapshot per block on CPU (shared with the disk's event log).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvoffload.block_snapshot import PackedBlock
from kvoffload.vllm_adapter import (
    BlockMeta,
    EventSpec,
    all_blocks_cleared,
    block_removed,
    block_stored,
    gpu_block_meta,
    logger,
    request_block_meta,
)


class CpuEventLog:
    """Snapshots stored blocks at issue time and turns the planner's events into vLLM's."""

    def __init__(
        self,
        block_size: int,
        specs: list[EventSpec],
        on_published: Callable[[bytes, PackedBlock], None] | None = None,
    ) -> None:
        self._block_size = block_size
        #: Told of every block published on CPU, with its snapshot (the disk tier's events).
        self._on_published = on_published
        self._specs = specs
        # Keyed by (KV-cache group, planner key): groups store the same hash separately.
        self._in_flight: dict[tuple[int, bytes], BlockMeta] = {}
        self._by_transfer: dict[int, list[tuple[int, bytes]]] = {}
        self._resident: dict[tuple[int, bytes], PackedBlock] = {}
        # Each group's event block size, as the planner's events give it.
        self._block_sizes: dict[int, int] = {}
        self._out: list[Any] = []

    @property
    def num_snapshots(self) -> int:
        """Blocks snapshotted for stores in flight (introspection for tests)."""
        return len(self._in_flight)

    @property
    def num_resident(self) -> int:
        """Snapshots kept for the blocks published on CPU (introspection for tests)."""
        return len(self._resident)

    def store_issued(
        self,
        store: tuple[Any, ...],
        store_events: tuple[list[bytes], list[tuple[int, int] | None], list[Any]],
        requests: dict[str, Any],
        groups: list[int] | None = None,
    ) -> None:
        """Snapshots the blocks of the store just issued. ``store_events`` (the plan's,
        per block): the planner's key, as its events name the block; the source, its
        request's index in the store's ``req_ids`` and its position (``None``: lazy);
        and for a lazy block, vLLM's hash (``BlockHashWithGroupId``; an empty list when
        no block is lazy). ``requests``: the requests by id; ``groups``: per block, its
        KV-cache group (empty or ``None``: all group 0)."""
        tid, _gpu, _cpu, req_ids = store[:4]
        block_keys, sources, lazy_hashes = store_events
        keys: list[tuple[int, bytes]] = []
        for j, src in enumerate(sources):
            if src is None:
                h = lazy_hashes[j] if lazy_hashes else None
                if h is None:
                    continue
                meta = gpu_block_meta(h)
            else:
                request = requests.get(req_ids[src[0]])
                if request is None or src[1] >= len(request.block_hashes):
                    continue
                meta = request_block_meta(request, src[1], self._block_size)
            key = (groups[j] if groups else 0, block_keys[j])
            self._in_flight[key] = meta
            keys.append(key)
        if len(keys) < len(sources):
            logger.warning(
                "kvoffload: %d stored blocks have no KV-event metadata; no event for them",
                len(sources) - len(keys),
            )
        if keys:
            self._by_transfer[tid] = keys

    def fetch_issued(self, fetches: list[tuple[Any, ...]], requests: dict[str, Any]) -> None:
        """Snapshots the blocks of remote fetches just issued: once every rank fetched
        them they are on CPU like stored blocks, and announced the same way."""
        for tid, req_id, _keys, _cpu, blocks, cpu_keys in fetches:
            request = requests.get(req_id)
            if request is None:
                continue
            keys: list[tuple[int, bytes]] = []
            for (group, i), cpu_key in zip(blocks, cpu_keys, strict=True):
                if i >= len(request.block_hashes):
                    continue
                key = (group, cpu_key)
                self._in_flight[key] = request_block_meta(request, i, self._block_size)
                keys.append(key)
            if keys:
                self._by_transfer[tid] = keys

    def stores_retired(self, planner_events: list[tuple[Any, ...]], tids: list[int]) -> None:
        """Converts ``planner_events`` (taken after the stores or fetches ``tids`` retired,
        so theirs are among them), then drops what was kept for those transfers."""
        self.convert(planner_events)
        for tid in tids:
            for key in self._by_transfer.pop(tid, ()):
                self._in_flight.pop(key, None)

    def convert(self, planner_events: list[tuple[Any, ...]]) -> None:
        """Appends vLLM events for the planner's events, oldest first."""
        out = self._out
        for ev in planner_events:
            kind = ev[0]
            if kind == "stored":
                group = ev[1]
                spec = self._specs[group]
                self._block_sizes[group] = ev[4]
                for key in ev[2]:
                    meta = self._in_flight.pop((group, key), None)
                    if meta is None:
                        continue
                    packed = PackedBlock.pack(group, meta)
                    self._resident[(group, key)] = packed
                    out.append(block_stored(meta, ev[4], spec, group))
                    if self._on_published is not None:
                        self._on_published(key, packed)
            elif kind == "removed":
                group = ev[1]
                gone = []
                for key in ev[2]:
                    held = self._resident.pop((group, key), None)
                    if held is not None:
                        gone.append(held.block_hash)
                if gone:
                    out.append(block_removed(gone, group))
            else:
                self._resident.clear()
                out.append(all_blocks_cleared())

    def take(self, planner_events: list[tuple[Any, ...]]) -> list[Any]:
        """The vLLM events gathered so far, ``planner_events`` included."""
        self.convert(planner_events)
        out, self._out = self._out, []
        return out

    def announce_again(self, planner_events: list[tuple[Any, ...]]) -> None:
        """vLLM's GPU pool was reset and its ``AllBlocksCleared`` (no medium) is published
        before this log's next events: every block on CPU after ``planner_events`` is
        announced again after it, as first announced, oldest first. Events not taken yet
        are dropped: their blocks' state is what the announcements say (an evicted block
        is not announced; the CPU tier's own clear, after a ``reset_cache`` in the same
        reset, is covered by vLLM's)."""
        self.convert(planner_events)
        sizes, specs = self._block_sizes, self._specs
        self._out = [
            block_stored(b.meta(), sizes[b.group], specs[b.group], b.group)
            for b in self._resident.values()
        ]

    def reset(self) -> None:
        """Stores in flight at a reset are released, never published."""
        self._in_flight.clear()
        self._by_transfer.clear()
