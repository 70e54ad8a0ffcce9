"""The worker's side of the tiers below the CPU (disk, remote store): fetches the scheduler
planned into the CPU blocks it reserved, and the blocks of completed stores written
behind. The Rust ``WorkerTier`` does the I/O on its own threads; this keeps what goes
between it and the step's metadata."""

from __future__ import annotations

from typing import Any

from kvoffload._native import KVOffloadError, OffloadConfig, TransferEngine, WorkerTier
from kvoffload.disk_events import DiskReport, DiskReports
from kvoffload.metadata import KVOffloadMetadata
from kvoffload.stats import DISK_GAUGES, disk_tier_counters
from kvoffload.vllm_adapter import logger

#: How long queued remote writes may take to go out at shutdown.
REMOTE_DRAIN_S = 1.0


class LowerTiers:
    """Fetch reports wait here for the next worker metadata, and each store's
    ``(hashes, cpu blocks)`` until its completion, when the blocks are written behind."""

    def __init__(self) -> None:
        self.tier: WorkerTier | None = None
        self._fetched: list[tuple[int, int]] = []
        self._write_back: dict[int, tuple[bytes, bytes]] = {}
        # KV events on with a disk tier: the disk's changes, for the scheduler's events.
        self._disk: DiskReports | None = None
        # The disk alone below the CPU: the lower tier's counters are reported as disk_*.
        self._disk_alone = False

    def start(
        self,
        engine: TransferEngine,
        config: OffloadConfig,
        layout: dict[str, Any],
        events: bool = False,
    ) -> None:
        """Opens the tiers over the engine's host memory. A disk tier that cannot open
        (path, lock, space) is a setup error, raised; a remote store that cannot be
        reached is logged, and fetches planned for this rank report nothing filled.
        ``events``: vLLM publishes KV events, so the disk's changes are reported."""
        events = events and config.disk is not None
        self._disk_alone = config.disk is not None and config.remote is None
        try:
            self.tier = WorkerTier(engine, config, layout, events)
        except KVOffloadError as e:
            if config.disk is not None:
                logger.error("KVOffloadConnector worker: %s", e)
                raise
            logger.error("kvoffload: remote tier unavailable on this rank: %s", e)
            return
        if events:
            self._disk = DiskReports(int(layout["tp_rank"]))

    def submit_fetches(self, metadata: KVOffloadMetadata) -> None:
        for tid, _req_id, hashes, cpu, *_for_events in metadata.fetches:
            if self.tier is None:
                self._fetched.append((tid, 0))
                continue
            try:
                self.tier.fetch(tid, hashes, cpu)
            except KVOffloadError as e:
                logger.warning("kvoffload: remote fetch %d not started: %s", tid, e)
                self._fetched.append((tid, 0))

    def note_store(self, tid: int, metadata: KVOffloadMetadata) -> None:
        """Keeps what the store's completion must write behind."""
        if self.tier is not None and self.tier.writes and metadata.store_hashes is not None:
            self._write_back[tid] = metadata.store_hashes

    def store_ended(self, tid: int, ok: bool) -> None:
        """Called before the completion is reported: until then no copy reuses the
        store's CPU blocks, so they are read while still holding its bytes."""
        write_back = self._write_back.pop(tid, None)
        if ok and write_back is not None and self.tier is not None:
            self.tier.write_stored(*write_back)

    def poll(self) -> None:
        if self.tier is not None:
            self._fetched.extend(self.tier.take_reports())
            if self._disk is not None:
                self._disk.add(*self.tier.take_disk_changes())

    def take_fetched(self) -> list[tuple[int, int]]:
        fetched, self._fetched = self._fetched, []
        return fetched

    def take_disk_reports(self) -> list[DiskReport]:
        return self._disk.take() if self._disk is not None else []

    @property
    def has_reports(self) -> bool:
        """Whether fetches or disk changes wait for the next worker metadata."""
        return bool(self._fetched) or bool(self._disk)

    def stats(self) -> tuple[list[tuple[str, int]], dict[str, int]]:
        """``(counters, gauges)`` of the tiers (the disk's residency is a gauge)."""
        if self.tier is None:
            return [], {}
        both = self.tier.stats()
        gauges = {k: v for k, v in both if k in DISK_GAUGES}
        counters = {k: v for k, v in both if k not in DISK_GAUGES}
        if self._disk_alone:
            counters = disk_tier_counters(counters)
        return list(counters.items()), gauges

    def shutdown(self) -> None:
        if self.tier is not None:
            self.tier.shutdown(REMOTE_DRAIN_S)
            self.tier = None
