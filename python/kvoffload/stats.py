"""Connector statistics in vLLM's ``KVConnectorStats`` shape, and what each key means.

The scheduler (planner counters, CPU residency) and every worker (bytes moved, copy
times) each report what changed since their previous report. vLLM sums the workers'
reports and the scheduler's (``aggregate``) and hands the sum to the loggers: the log line
(``reduce``) and ``/metrics`` (:class:`kvoffload.prometheus.KVOffloadPromMetrics`, which
exports the series named here). :class:`kvoffload.stat_deltas.CounterDeltas` builds the
payload from monotonic counters. The payload is plain dicts
and lists, so it crosses vLLM's process boundaries as it is::

    {"counters": {key: delta}, "gauges": {key: value}, "times": {key: [seconds, ...]}}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvoffload.vllm_adapter import KVConnectorStats

COUNTERS = "counters"
GAUGES = "gauges"
TIMES = "times"

#: Counter key -> (Prometheus name, extra label values, help). Planner keys count once
#: per engine; worker keys (bytes) are summed over ranks.
COUNTER_SERIES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "lookups": ("vllm:kv_offload_lookups", (), "Prefix lookups answered by the CPU tier."),
    "hit_tokens": (
        "vllm:kv_offload_hit_tokens",
        (),
        "Prompt tokens the scheduler accepted to load from the CPU tier.",
    ),
    "stored_blocks": (
        "vllm:kv_offload_stored_blocks",
        (),
        "Blocks stored on CPU (published once every rank copied them).",
    ),
    "load_blocks": ("vllm:kv_offload_loaded_blocks", (), "Blocks in loads issued from CPU."),
    "bytes_stored": (
        "vllm:kv_offload_stored_bytes",
        (),
        "Bytes copied into CPU memory by successful stores, summed over ranks.",
    ),
    "bytes_loaded": (
        "vllm:kv_offload_loaded_bytes",
        (),
        "Bytes copied out of CPU memory by successful loads, summed over ranks.",
    ),
    "failed_stores": (
        "vllm:kv_offload_failed_transfers",
        ("store",),
        "Transfers that failed on some rank (their blocks are dropped or recomputed).",
    ),
    "failed_loads": (
        "vllm:kv_offload_failed_transfers",
        ("load",),
        "Transfers that failed on some rank (their blocks are dropped or recomputed).",
    ),
    "dedup_skipped": (
        "vllm:kv_offload_skipped_store_blocks",
        ("already_stored",),
        "Candidate blocks not stored: on CPU or in flight already, or no CPU block free.",
    ),
    "no_space_skipped": (
        "vllm:kv_offload_skipped_store_blocks",
        ("no_space",),
        "Candidate blocks not stored: on CPU or in flight already, or no CPU block free.",
    ),
    "evicted_blocks": (
        "vllm:kv_offload_evicted_blocks",
        (),
        "CPU blocks evicted to make room for new ones.",
    ),
    "remote_hit_tokens": (
        "vllm:kv_offload_remote_hit_tokens",
        (),
        "Prompt tokens offered from blocks fetched from the remote tier.",
    ),
    "remote_fetched_blocks": (
        "vllm:kv_offload_remote_fetched_blocks",
        (),
        "Blocks fetched from the remote tier by every rank and published to the CPU tier.",
    ),
    "remote_failed_fetch_blocks": (
        "vllm:kv_offload_remote_failed_blocks",
        ("fetch",),
        "Remote-tier blocks that failed (missing, corrupt, timed out): fetches recomputed, "
        "writes lost.",
    ),
    "remote_writes_failed": (
        "vllm:kv_offload_remote_failed_blocks",
        ("write",),
        "Remote-tier blocks that failed (missing, corrupt, timed out): fetches recomputed, "
        "writes lost.",
    ),
    "remote_writes_dropped": (
        "vllm:kv_offload_remote_dropped_writes",
        (),
        "Blocks not written to the remote tier because the write-behind queue was full.",
    ),
    "remote_corrupt_values": (
        "vllm:kv_offload_remote_corrupt_values",
        (),
        "Remote values that failed a check (header, layout, checksum): never loaded.",
    ),
    "remote_bytes_read": (
        "vllm:kv_offload_remote_read_bytes",
        (),
        "Bytes fetched from the remote tier and verified, summed over ranks.",
    ),
    "remote_bytes_written": (
        "vllm:kv_offload_remote_written_bytes",
        (),
        "Bytes written to the remote tier, summed over ranks.",
    ),
    "disk_bytes_read": (
        "vllm:kv_offload_disk_read_bytes",
        (),
        "Bytes read from the disk tier's files, summed over ranks.",
    ),
    "disk_bytes_written": (
        "vllm:kv_offload_disk_written_bytes",
        (),
        "Bytes written to the disk tier's files, summed over ranks.",
    ),
    "disk_read_micros": (
        "vllm:kv_offload_disk_read_microseconds",
        (),
        "Time spent in disk-tier read batches, summed over ranks.",
    ),
    "disk_write_micros": (
        "vllm:kv_offload_disk_write_microseconds",
        (),
        "Time spent in disk-tier write batches, summed over ranks.",
    ),
    "disk_checksum_failures": (
        "vllm:kv_offload_disk_checksum_failures",
        (),
        "Disk blocks that failed a check on read: misses, recomputed, slot freed.",
    ),
    "disk_recovered_blocks": (
        "vllm:kv_offload_disk_recovered_blocks",
        (),
        "Blocks found intact on disk at start (disk_persist), summed over ranks.",
    ),
    "disk_evictions": (
        "vllm:kv_offload_disk_evicted_blocks",
        (),
        "Disk blocks evicted (CLOCK, an approximation of LRU) to make room, summed over ranks.",
    ),
    "disk_errors_enospc": (
        "vllm:kv_offload_disk_io_errors",
        ("enospc",),
        "Disk-tier I/Os that failed, by kind: a write is skipped, a read recomputed.",
    ),
    "disk_errors_eio": (
        "vllm:kv_offload_disk_io_errors",
        ("eio",),
        "Disk-tier I/Os that failed, by kind: a write is skipped, a read recomputed.",
    ),
    "disk_errors_einval": (
        "vllm:kv_offload_disk_io_errors",
        ("einval",),
        "Disk-tier I/Os that failed, by kind: a write is skipped, a read recomputed.",
    ),
    "disk_errors_short": (
        "vllm:kv_offload_disk_io_errors",
        ("short",),
        "Disk-tier I/Os that failed, by kind: a write is skipped, a read recomputed.",
    ),
    "disk_errors_other": (
        "vllm:kv_offload_disk_io_errors",
        ("other",),
        "Disk-tier I/Os that failed, by kind: a write is skipped, a read recomputed.",
    ),
    # The tier-level counters of a disk alone below the CPU (see `disk_tier_counters`).
    "disk_hit_tokens": (
        "vllm:kv_offload_disk_hit_tokens",
        (),
        "Prompt tokens offered from blocks read from the disk tier for the request.",
    ),
    "disk_fetched_blocks": (
        "vllm:kv_offload_disk_fetched_blocks",
        (),
        "Blocks read from the disk tier by every rank and published to the CPU tier.",
    ),
    "disk_failed_fetch_blocks": (
        "vllm:kv_offload_disk_failed_blocks",
        ("fetch",),
        "Disk-tier blocks that failed (missing, corrupt, I/O error): reads recomputed, "
        "writes lost.",
    ),
    "disk_writes_failed": (
        "vllm:kv_offload_disk_failed_blocks",
        ("write",),
        "Disk-tier blocks that failed (missing, corrupt, I/O error): reads recomputed, "
        "writes lost.",
    ),
    "disk_writes_dropped": (
        "vllm:kv_offload_disk_dropped_writes",
        (),
        "Blocks not written to the disk tier because the write-behind queue was full.",
    ),
}

#: The core names the counters of the tier path below the CPU for the remote tier; when
#: that tier is the disk alone they are reported as ``disk_*``. The disk's own counters
#: already name its file bytes ``disk_bytes_read``/``_written``: the verified block bytes
#: of the tier path are ``disk_payload_bytes_*``.
_DISK_PAYLOAD = {
    "remote_bytes_read": "disk_payload_bytes_read",
    "remote_bytes_written": "disk_payload_bytes_written",
}


def disk_tier_counters(counters: dict[str, int]) -> dict[str, int]:
    """``counters`` with the lower tier's ``remote_*`` keys named for the disk tier."""
    return {
        _DISK_PAYLOAD.get(k) or ("disk_" + k[7:] if k.startswith("remote_") else k): v
        for k, v in counters.items()
    }


#: Series whose single extra label is named here.
LABEL_OF = {
    "vllm:kv_offload_failed_transfers": "direction",
    "vllm:kv_offload_skipped_store_blocks": "reason",
    "vllm:kv_offload_remote_failed_blocks": "direction",
    "vllm:kv_offload_disk_io_errors": "kind",
    "vllm:kv_offload_disk_failed_blocks": "direction",
}

GAUGE_SERIES = {
    "cpu_blocks_used": (
        "vllm:kv_offload_cpu_blocks_used",
        "CPU blocks holding KV or being written (cached and in-flight), per rank.",
    ),
    "cpu_blocks_capacity": ("vllm:kv_offload_cpu_blocks_capacity", "CPU blocks per rank."),
    "disk_resident_blocks": ("vllm:kv_offload_disk_blocks_used", "Disk blocks held, per rank."),
    "disk_capacity_blocks": ("vllm:kv_offload_disk_blocks_capacity", "Disk blocks per rank."),
    "disk_disabled": (
        "vllm:kv_offload_disk_disabled",
        "1 once repeated I/O errors turned the disk tier off on a rank.",
    ),
}

#: Values of the disk tier's counters that are levels, reported as gauges.
DISK_GAUGES = frozenset(
    ("disk_resident_blocks", "disk_capacity_blocks", "disk_capacity_bytes", "disk_disabled")
)

TIME_SERIES = {
    "store": "vllm:kv_offload_store_seconds",
    "load": "vllm:kv_offload_load_seconds",
}

#: Transfer time buckets, from a sub-millisecond memcpy to a congested multi-second copy.
TIME_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]


def _empty() -> dict[str, Any]:
    return {COUNTERS: {}, GAUGES: {}, TIMES: {}}


@dataclass
class KVOffloadStats(KVConnectorStats):
    """What changed since the previous report (counters summed over steps and ranks,
    gauges the latest value, copy times listed)."""

    def __post_init__(self) -> None:
        data = self.data
        if not data:
            self.data = _empty()
        elif COUNTERS not in data or GAUGES not in data or TIMES not in data:
            # A partial payload; the scheduler builds one per step, complete.
            for part in (COUNTERS, GAUGES, TIMES):
                data.setdefault(part, {})

    @classmethod
    def of(
        cls, counters: dict[str, int], gauges: dict[str, int], times: dict[str, list[float]]
    ) -> KVOffloadStats:
        """A complete payload, without the checks of a partial one (built every step)."""
        stats = cls.__new__(cls)
        stats.data = {COUNTERS: counters, GAUGES: gauges, TIMES: times}
        return stats

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVOffloadStats:
        data = other.data or {}
        counters = self.data[COUNTERS]
        for k, v in data.get(COUNTERS, {}).items():
            counters[k] = counters.get(k, 0) + v
        self.data[GAUGES].update(data.get(GAUGES, {}))
        times = self.data[TIMES]
        for k, v in data.get(TIMES, {}).items():
            times.setdefault(k, []).extend(v)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.data[COUNTERS])
        out.update(self.data[GAUGES])
        for k, v in self.data[TIMES].items():
            if v:
                out[f"{k}_transfers"] = len(v)
                out[f"{k}_avg_ms"] = round(1000 * sum(v) / len(v), 3)
        return out

    def is_empty(self) -> bool:
        data = self.data
        return not (data[COUNTERS] or data[GAUGES] or data[TIMES])
