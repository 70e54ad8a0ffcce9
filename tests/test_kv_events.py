"""kvoffload's CPU events beyond vLLM's scenarios: what it keeps to build them stays bounded
by the blocks in flight and on CPU, whatever happens to a store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sched_harness import SchedHarness, model_config_dir


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_config_dir(tmp_path_factory.mktemp("tiny_llama_config"))


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
