"""Stats payloads summed the way vLLM sums them: over workers, with the scheduler's, and
over a logging interval."""

from __future__ import annotations

from typing import Any

from kvoffload.stat_deltas import CounterDeltas
from kvoffload.stats import KVOffloadStats


def test_counters_sum_gauges_keep_the_latest_times_concatenate() -> None:
    rank0 = CounterDeltas().delta([("bytes_stored", 100)], times={"store": [0.1]})
    rank1 = CounterDeltas().delta([("bytes_stored", 50)], times={"store": [0.2, 0.3]})
    sched = CounterDeltas().delta([("stored_blocks", 3)], {"cpu_blocks_used": 7})
    assert rank0 is not None
    assert rank1 is not None
    assert sched is not None
    total = rank0.aggregate(rank1).aggregate(sched)
    later = KVOffloadStats(
        data={"gauges": {"cpu_blocks_used": 5}, "counters": {"stored_blocks": 1}}
    )
    total = total.aggregate(later)
    assert total.data == {
        "counters": {"bytes_stored": 150, "stored_blocks": 4},
        "gauges": {"cpu_blocks_used": 5},
        "times": {"store": [0.1, 0.2, 0.3]},
    }
    summary = total.reduce()
    assert summary["bytes_stored"] == 150
    assert summary["store_transfers"] == 3


def test_deltas_report_only_what_changed() -> None:
    d = CounterDeltas()
    first = d.delta([("lookups", 2), ("hit_tokens", 0)], {"cpu_blocks_capacity": 9})
    assert first is not None
    assert first.data["counters"] == {"lookups": 2}
    assert first.data["gauges"] == {"cpu_blocks_capacity": 9}
    assert d.delta([("lookups", 2)], {"cpu_blocks_capacity": 9}) is None
    again = d.delta([("lookups", 5)], {"cpu_blocks_capacity": 9})
    assert again is not None
    assert again.data == {"counters": {"lookups": 3}, "gauges": {}, "times": {}}
    assert KVOffloadStats().is_empty()


def test_remote_tier_counters_reach_their_prometheus_series() -> None:
    from functools import partial
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvoffload.prometheus import KVOffloadPromMetrics

    reg = CollectorRegistry()
    types: dict[type, Any] = {
        cls: partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)
    }
    metrics = KVOffloadPromMetrics(
        SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], {0: ["m", "0"]}
    )
    labels = {"model_name": "m", "engine": "0"}
    assert reg.get_sample_value("vllm:kv_offload_remote_hit_tokens_total", labels) == 0
    metrics.observe(
        {
            "counters": {
                "remote_hit_tokens": 256,
                "remote_fetched_blocks": 2,
                "remote_bytes_read": 4096,
                "remote_bytes_written": 8192,
                "remote_writes_dropped": 3,
                "remote_corrupt_values": 1,
                "remote_failed_fetch_blocks": 4,
                "remote_writes_failed": 5,
            }
        }
    )
    expected = {
        ("vllm:kv_offload_remote_hit_tokens_total", ()): 256,
        ("vllm:kv_offload_remote_fetched_blocks_total", ()): 2,
        ("vllm:kv_offload_remote_read_bytes_total", ()): 4096,
        ("vllm:kv_offload_remote_written_bytes_total", ()): 8192,
        ("vllm:kv_offload_remote_dropped_writes_total", ()): 3,
        ("vllm:kv_offload_remote_corrupt_values_total", ()): 1,
        ("vllm:kv_offload_remote_failed_blocks_total", ("fetch",)): 4,
        ("vllm:kv_offload_remote_failed_blocks_total", ("write",)): 5,
    }
    for (name, extra), value in expected.items():
        got = reg.get_sample_value(name, {**labels, **({"direction": extra[0]} if extra else {})})
        assert got == value, name


def test_the_disk_alone_reports_the_lower_tiers_counters_as_the_disks() -> None:
    """With the disk the only tier below the CPU, the tier path's counters (named for the
    remote tier by the core) are reported and exported under ``disk_*`` names; the disk's
    own file-byte counters keep theirs."""
    from functools import partial
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvoffload.prometheus import KVOffloadPromMetrics
    from kvoffload.stats import disk_tier_counters

    renamed = disk_tier_counters(
        {
            "remote_hit_tokens": 256,
            "remote_fetched_blocks": 2,
            "remote_bytes_read": 4096,
            "remote_writes_failed": 5,
            "remote_failed_fetch_blocks": 4,
            "remote_writes_dropped": 3,
            "disk_bytes_read": 8192,
            "lookups": 7,
        }
    )
    assert renamed == {
        "disk_hit_tokens": 256,
        "disk_fetched_blocks": 2,
        "disk_payload_bytes_read": 4096,
        "disk_writes_failed": 5,
        "disk_failed_fetch_blocks": 4,
        "disk_writes_dropped": 3,
        "disk_bytes_read": 8192,
        "lookups": 7,
    }
    reg = CollectorRegistry()
    types: dict[type, Any] = {
        cls: partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)
    }
    metrics = KVOffloadPromMetrics(
        SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], {0: ["m", "0"]}
    )
    metrics.observe({"counters": renamed})
    labels = {"model_name": "m", "engine": "0"}
    expected = {
        ("vllm:kv_offload_disk_hit_tokens_total", ()): 256,
        ("vllm:kv_offload_disk_fetched_blocks_total", ()): 2,
        ("vllm:kv_offload_disk_read_bytes_total", ()): 8192,
        ("vllm:kv_offload_disk_dropped_writes_total", ()): 3,
        ("vllm:kv_offload_disk_failed_blocks_total", ("fetch",)): 4,
        ("vllm:kv_offload_disk_failed_blocks_total", ("write",)): 5,
        ("vllm:kv_offload_remote_hit_tokens_total", ()): 0,
    }
    for (name, extra), value in expected.items():
        got = reg.get_sample_value(name, {**labels, **({"direction": extra[0]} if extra else {})})
        assert got == value, name
