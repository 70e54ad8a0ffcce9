"""Failure paths on a real vLLM engine: injected copy faults, a sticky device error and
forced preemption never hang a request and never change a token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm_harness import (
    counter,
    cpu_hit_tokens,
    engine,
    generate,
    offload_config,
    reset_gpu_prefix_cache,
    scheduler_connector,
    shared_prefix_prompts,
    worker_connector,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

PROMPTS = shared_prefix_prompts(18, 6, system_tokens=900)
ENGINE_ARGS: dict[str, Any] = {"max_num_seqs": 2}
RECOMPUTE: dict[str, Any] = {"kv_load_failure_policy": "recompute"}


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> list[list[int]]:
    with engine(tiny_model, **ENGINE_ARGS) as llm:
        return generate(llm, PROMPTS)


def planner_stats(llm: Any) -> dict[str, int]:
    return dict(scheduler_connector(llm).offload_scheduler.planner.stats())


def faulty(faults: str, **extra: Any) -> dict[str, Any]:
    return {**offload_config(**{"kvoffload.faults": faults, **extra}), **RECOMPUTE}


def run_twice(llm: Any) -> tuple[list[list[int]], list[list[int]]]:
    first = generate(llm, PROMPTS)
    reset_gpu_prefix_cache(llm)
    return first, generate(llm, PROMPTS)


@pytest.mark.parametrize("load_mode", ["sync", "async"])
def test_failed_loads_are_recomputed_with_identical_tokens(
    tiny_model: Path, reference: list[list[int]], load_mode: str
) -> None:
    cfg = faulty("fail_loads_every=2,delay_ms=2", load_mode=load_mode)
    with engine(tiny_model, cfg, **ENGINE_ARGS) as llm:
        first, again = run_twice(llm)
        assert first == reference
        assert again == reference
        stats = planner_stats(llm)
        assert stats["failed_loads"] > 0
        # The loads that did succeed were still served from CPU.
        assert cpu_hit_tokens(llm) > 0


@pytest.mark.timeout(300)
def test_loads_that_always_fail_end_in_recompute_not_a_loop(
    tiny_model: Path, reference: list[list[int]]
) -> None:
    # vLLM asks again for a request whose first asynchronously loaded block failed; the
    # same CPU hit offered again would fail again, forever.
    cfg = faulty("fail_loads_every=1", load_mode="async")
    with engine(tiny_model, cfg, **ENGINE_ARGS) as llm:
        first, again = run_twice(llm)
        assert (first, again) == (reference, reference)
        assert planner_stats(llm)["failed_loads"] > 0


def test_failed_stores_are_never_served(tiny_model: Path, reference: list[list[int]]) -> None:
    with engine(tiny_model, faulty("fail_stores_every=2"), **ENGINE_ARGS) as llm:
        first, again = run_twice(llm)
        assert (first, again) == (reference, reference)
        stats = planner_stats(llm)
        assert stats["failed_stores"] > 0
        assert stats["stored_blocks"] < stats["store_blocks"]


def test_sticky_device_error_degrades_to_recompute(
    tiny_model: Path, reference: list[list[int]]
) -> None:
    with engine(tiny_model, faulty("fatal_after=6"), **ENGINE_ARGS) as llm:
        first, again = run_twice(llm)
        assert (first, again) == (reference, reference)
        engine_ = worker_connector().offload_worker.engine
        stats = dict(engine_.stats())
        assert stats["jobs_failed"] > 0


def test_load_failure_under_fail_policy_ends_requests_without_hanging(
    tiny_model: Path, reference: list[list[int]]
) -> None:
    cfg = offload_config(**{"kvoffload.faults": "fail_loads_every=1"})
    with engine(tiny_model, {**cfg, "kv_load_failure_policy": "fail"}, **ENGINE_ARGS) as llm:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS]
        llm.generate(prompts, params, use_tqdm=False)
        reset_gpu_prefix_cache(llm)
        outs = llm.generate(prompts, params, use_tqdm=False)
        # Every load fails: under "fail" a request whose load failed ends with an error
        # instead of waiting or producing wrong tokens. The failed blocks leave the CPU
        # cache, so requests after it recompute their prefix and finish normally.
        reasons = [o.outputs[0].finish_reason for o in outs]
        assert "error" in reasons
        for out, want in zip(outs, reference, strict=True):
            if out.outputs[0].finish_reason != "error":
                assert list(out.outputs[0].token_ids) == want
        assert planner_stats(llm)["failed_loads"] >= reasons.count("error")


def test_a_sync_load_slower_than_its_timeout_stops_the_engine_and_recomputes(
    tiny_model: Path, reference: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvoffload import worker

    monkeypatch.setattr(worker, "SYNC_LOAD_TIMEOUT_S", 0.05)
    with engine(tiny_model, faulty("delay_ms=400", load_mode="sync"), **ENGINE_ARGS) as llm:
        first, again = run_twice(llm)
        assert (first, again) == (reference, reference)
        engine_ = worker_connector().offload_worker.engine
        assert "timed out" in (engine_.stopped or "")
        assert planner_stats(llm)["failed_loads"] > 0


def test_a_preemption_fence_slower_than_its_timeout_stops_the_engine_and_recomputes(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvoffload import worker

    monkeypatch.setattr(worker, "PREEMPTION_FENCE_TIMEOUT_S", 0.05)
    # Eight 150-token prompts fit the 31-block cache (2 blocks each); decoding to 450 tokens
    # needs 32, so vLLM preempts mid-decode. A request's last store is then at most 128
    # steps old, well inside the 30 s each store takes, so the fence finds it running.
    prompts = shared_prefix_prompts(8, 8, system_tokens=100, tail_tokens=50, seed=3)
    args: dict[str, Any] = {"max_num_seqs": 8}
    with engine(tiny_model, **args) as llm:
        reference = generate(llm, prompts, max_tokens=300)
    # Asynchronous loads keep stores running across steps (with synchronous ones on the
    # CPU backend, each step's store finishes inside the step and no fence is needed).
    with engine(tiny_model, faulty("delay_ms=30000", load_mode="async"), **args) as llm:
        assert generate(llm, prompts, max_tokens=300) == reference
        assert counter(llm, "vllm:num_preemptions") > 0
        engine_ = worker_connector().offload_worker.engine
        assert "timed out" in (engine_.stopped or "")


def test_forced_preemption_keeps_tokens_identical(tiny_model: Path) -> None:
    # Many concurrent long generations in a 31-block cache: vLLM must preempt.
    prompts = shared_prefix_prompts(8, 2, system_tokens=500, tail_tokens=20, seed=3)
    args: dict[str, Any] = {"max_num_seqs": 8}
    with engine(tiny_model, **args) as llm:
        reference = generate(llm, prompts, max_tokens=300)
    with engine(tiny_model, offload_config(), **args) as llm:
        assert generate(llm, prompts, max_tokens=300) == reference
        assert counter(llm, "vllm:num_preemptions") > 0
