"""Steps that move nothing: vLLM asks for metadata, stats and events every step, and most
steps have none. Those answers are shared constants (no allocation, so vLLM's garbage
collector does not run inside the connector); a step that moves anything, or that has
preempted requests, gets metadata of its own."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

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
