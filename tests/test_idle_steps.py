"""Steps that move nothing: vLLM asks for metadata, stats and events every step, and most
steps have none. Those answers are shared constants (no allocation, so vLLM's garbage
collector does not run inside the connector); a step that moves anything, or that has
preempted requests, gets metadata of its own."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvoffload.metadata import IDLE_STEP, KVOffloadMetadata
from sched_harness import SchedHarness


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_steps_that_move_nothing_share_one_empty_metadata(model: Path, lazy: bool) -> None:
    h = SchedHarness(model, lazy=lazy)
    prompt = h.prompt(2)
    _, steps = h.serve(prompt, max_tokens=6)
    moving = [s for s in steps if s.loads or s.store is not None]
    idle = [s for s in steps if not s.loads and s.store is None]
    assert moving, "the prompt's blocks were stored"
    assert idle, "decode steps store nothing"
    assert all(s.output.kv_connector_metadata is IDLE_STEP for s in idle)
    assert all(s.output.kv_connector_metadata is not IDLE_STEP for s in moving)
    # Served again from CPU: the shared instance never picked up a step's copies.
    h.evict_gpu_prefix_cache()
    _, steps = h.serve(prompt)
    assert any(s.loads for s in steps)
    assert KVOffloadMetadata() == IDLE_STEP
    h.assert_idle()


def test_a_step_with_preempted_requests_gets_its_own_metadata(model: Path) -> None:
    h = SchedHarness(model, lazy=True)
    meta = h.connector.build_connector_meta(SimpleNamespace(preempted_req_ids={"req-7"}))
    assert meta is not IDLE_STEP
    assert meta.preempted_req_ids == ["req-7"]
    assert h.connector.build_connector_meta(SimpleNamespace(preempted_req_ids=set())) is IDLE_STEP


def test_stats_held_back_while_requests_run_all_reach_vllm_when_none_is_left(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM asks for stats after every step; while requests run, the scheduler reports at
    most once per interval, and what it held back arrives in the step that leaves no
    request (vLLM does not step while idle): every count, once."""
    import kvoffload.scheduler

    monkeypatch.setattr(kvoffload.scheduler, "STATS_INTERVAL_S", 3600.0)
    h = SchedHarness(model)
    reports: list[tuple[bool, dict[str, int]]] = []
    ask = h.connector.get_kv_connector_stats

    def recorded() -> Any:
        stats = ask()
        if stats is not None:
            running = h.scheduler.has_unfinished_requests()
            reports.append((running, dict(stats.data["counters"])))
        return stats

    h.connector.get_kv_connector_stats = recorded
    prompts = [h.prompt(2, extra_tokens=i + 1) for i in range(3)]
    for prompt in prompts:
        h.add(prompt, max_tokens=8)
    steps = h.run()
    h.evict_gpu_prefix_cache()
    _, again = h.serve(prompts[0], max_tokens=4)
    assert any(s.store is not None for s in steps)
    assert any(s.loads for s in again)
    # The first report of the planner's life goes out at once; after it, none while a
    # request runs.
    assert [running for running, _ in reports[1:]] == [False] * (len(reports) - 1)
    assert len(reports) < len(steps) + len(again)
    total: dict[str, int] = {}
    for _, counters in reports:
        for name, n in counters.items():
            total[name] = total.get(name, 0) + n
    assert total == {name: n for name, n in h.planner.stats() if n}


def test_stats_of_a_streaming_session_reach_vllm_before_it_waits_for_input(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A streaming session waiting for its next input is no unfinished request to vLLM,
    which goes idle: its counts must not wait for that input."""
    from vllm.v1.request import RequestStatus

    import kvoffload.scheduler

    monkeypatch.setattr(kvoffload.scheduler, "STATS_INTERVAL_S", 3600.0)
    h = SchedHarness(model)
    h.serve(h.prompt(1), max_tokens=2)  # the planner's first report is out
    before = dict(h.planner.stats())
    reported: dict[str, int] = {}
    ask = h.connector.get_kv_connector_stats

    def recorded() -> Any:
        stats = ask()
        if stats is not None:
            for name, n in stats.data["counters"].items():
                reported[name] = reported.get(name, 0) + n
        return stats

    h.connector.get_kv_connector_stats = recorded
    session = h.add(h.prompt(2), max_tokens=4, resumable=True)
    steps = h.run()
    assert session.status == RequestStatus.WAITING_FOR_STREAMING_REQ
    assert any(s.store is not None for s in steps)
    grown = {name: n - before.get(name, 0) for name, n in h.planner.stats()}
    assert reported == {name: n for name, n in grown.items() if n}
    assert reported["store_blocks"] == 2
