"""CPU-tier KV events as vLLM publishes them, built from the planner's events.

The planner decides what was stored and evicted and keys blocks by the first 128 bits of
vLLM's hash; a router correlates tiers by vLLM's full hash (converted by
``maybe_convert_block_hash``) and wants the block's tokens. Those come from the request,
which only the scheduler adapter holds, and only until it finishes: so each stored block
is snapshotted when its store is issued, keyed by its KV-cache group and the planner's key,
and the snapshot is turned into a ``BlockStored`` (with its group's ``group_idx`` and spec)
when the planner publishes the block (every rank copied it).
Resident blocks keep only their published hash, for the ``BlockRemoved`` of their eviction.
Memory: one snapshot per block in flight (dropped when its store retires, published or
failed) and one hash per block on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvoffload.vllm_adapter import (
    GROUP_ID_BYTES,
    BlockMeta,
    EventSpec,
    all_blocks_cleared,
    block_removed,
    block_stored,
    gpu_block_meta,
    logger,
    request_block_meta,
)

#: The planner's key is the first 16 bytes of vLLM's hash (shorter hashes zero-extended).
KEY_BYTES = 16


def planner_key(block_hash: bytes) -> bytes:
    """The planner's key of a vLLM block hash, as its events spell it."""
    return bytes(block_hash[:KEY_BYTES]).ljust(KEY_BYTES, b"\0")


class CpuEventLog:
    """Snapshots stored blocks at issue time and turns the planner's events into vLLM's."""

    def __init__(
        self,
        block_size: int,
        specs: list[EventSpec],
        on_published: Callable[[int, bytes, BlockMeta], None] | None = None,
    ) -> None:
        self._block_size = block_size
        #: Told of every block published on CPU, with its snapshot (the disk tier's events).
        self._on_published = on_published
        self._specs = specs
        # Keyed by (KV-cache group, planner key): groups store the same hash separately.
        self._in_flight: dict[tuple[int, bytes], BlockMeta] = {}
        self._by_transfer: dict[int, list[tuple[int, bytes]]] = {}
        self._resident: dict[tuple[int, bytes], Any] = {}
        self._out: list[Any] = []

    @property
    def num_snapshots(self) -> int:
        """Blocks snapshotted for stores in flight (introspection for tests)."""
        return len(self._in_flight)

    @property
    def num_resident(self) -> int:
        """Published hashes kept for the blocks' removal (introspection for tests)."""
        return len(self._resident)

    def store_issued(
        self,
        store: tuple[Any, ...],
        sources: list[tuple[int, int] | None],
        requests: dict[str, Any],
        lazy_hashes: dict[int, bytes],
        groups: list[int] | None = None,
    ) -> None:
        """Snapshots the blocks of the store just issued. ``sources``: per block, its
        request's index in the store's ``req_ids`` and its position (``None``: lazy);
        ``requests``: the requests by id; ``lazy_hashes``: lazy candidates' hashes (with
        vLLM's group id) by GPU block id; ``groups``: per block, its KV-cache group
        (empty or ``None``: all group 0)."""
        tid, gpu_blocks, _cpu, req_ids = store[:4]
        gpu = memoryview(gpu_blocks).cast("I")
        keys: list[tuple[int, bytes]] = []
        for j, src in enumerate(sources):
            group = groups[j] if groups else 0
            if src is None:
                h = lazy_hashes.get(gpu[j])
                if h is None:
                    continue
                raw, meta = h[:-GROUP_ID_BYTES], gpu_block_meta(h)
                group = int.from_bytes(h[-GROUP_ID_BYTES:], "big")
            else:
                request = requests.get(req_ids[src[0]])
                if request is None or src[1] >= len(request.block_hashes):
                    continue
                raw = request.block_hashes[src[1]]
                meta = request_block_meta(request, src[1], self._block_size)
            key = (group, planner_key(raw))
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
        for tid, req_id, _keys, _cpu, blocks in fetches:
            request = requests.get(req_id)
            if request is None:
                continue
            keys: list[tuple[int, bytes]] = []
            for group, i in blocks:
                if i >= len(request.block_hashes):
                    continue
                key = (group, planner_key(request.block_hashes[i]))
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
                for key in ev[2]:
                    meta = self._in_flight.pop((group, key), None)
                    if meta is None:
                        continue
                    self._resident[(group, key)] = meta.block_hash
                    out.append(block_stored(meta, ev[4], spec, group))
                    if self._on_published is not None:
                        self._on_published(group, key, meta)
            elif kind == "removed":
                group = ev[1]
                gone = []
                for key in ev[2]:
                    h = self._resident.pop((group, key), None)
                    if h is not None:
                        gone.append(h)
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

    def reset(self) -> None:
        """Stores in flight at a reset are released, never published."""
        self._in_flight.clear()
        self._by_transfer.clear()
