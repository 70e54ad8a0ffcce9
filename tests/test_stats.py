"""Stats payloads summed the way vLLM sums them: over workers, with the scheduler's, and
over a logging interval."""

from __future__ import annotations

from kvoffload.stats import CounterDeltas, KVOffloadStats


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
