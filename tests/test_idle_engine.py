"""Final stores finish before the engine goes idle: vLLM steps only while requests are
unfinished, so after ``LLM.generate`` returns no step may follow. Copies must not hold GPU
blocks then (``reset_prefix_cache`` fails while any block is held), and the last blocks of
every request must be on CPU."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm_harness import (
    BLOCK_TOKENS,
    cpu_hit_tokens,
    distinct_prompts,
    engine,
    generate,
    offload_config,
    planner_stats,
    run_script,
    scheduler_connector,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

#: Every copy takes this long, far longer than a step of the tiny model: stores issued in
#: the last steps are still running when the last request finishes, unless the step
#: waits for them.
SLOW_COPIES = {"kvoffload.faults": "delay_ms=500"}
N_REQUESTS = 4
ENGINE_ARGS: dict[str, Any] = {"max_num_seqs": 2}

# (prompt tokens, max_tokens): the request's last forward pass fills its second block.
CASES = {
    # Decoding fills the block: the last token computed is token 256.
    "last-decode-step": (2 * BLOCK_TOKENS + 1 - 8, 8),
    # A request that finishes in the step that computes its prompt.
    "single-step": (2 * BLOCK_TOKENS, 1),
}


def follow_ups(prompts: list[list[int]], outputs: list[list[int]]) -> list[list[int]]:
    """Each request's prompt and output: its two full blocks, then one token more."""
    return [p + o for p, o in zip(prompts, outputs, strict=True)]


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    """Per case: outputs without the connector, and the follow-ups' outputs."""
    out = {}
    with engine(tiny_model, **ENGINE_ARGS) as llm:
        for name, (tokens, max_tokens) in CASES.items():
            prompts = distinct_prompts(N_REQUESTS, tokens, seed=tokens)
            first = generate(llm, prompts, max_tokens=max_tokens)
            out[name] = (first, generate(llm, follow_ups(prompts, first)))
            assert llm.reset_prefix_cache()
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_eager_final_stores_are_on_cpu_when_generate_returns(
    tiny_model: Path, reference: dict[str, Any], case: str
) -> None:
    tokens, max_tokens = CASES[case]
    prompts = distinct_prompts(N_REQUESTS, tokens, seed=tokens)
    with engine(tiny_model, offload_config(**SLOW_COPIES), **ENGINE_ARGS) as llm:
        first = generate(llm, prompts, max_tokens=max_tokens)
        assert first == reference[case][0]
        assert not scheduler_connector(llm).has_pending_push_work()
        assert llm.reset_prefix_cache(), "a copy still holds GPU blocks"
        # The GPU cache is empty: the follow-ups' two full blocks come from CPU, the last
        # one written by each request's final forward pass.
        assert generate(llm, follow_ups(prompts, first)) == reference[case][1]
        assert cpu_hit_tokens(llm) == N_REQUESTS * 2 * BLOCK_TOKENS


def test_lazy_stores_release_their_blocks_when_generate_returns(
    tiny_model: Path, reference: dict[str, Any]
) -> None:
    tokens, max_tokens = CASES["last-decode-step"]
    prompts = distinct_prompts(N_REQUESTS, tokens, seed=tokens)
    cfg = offload_config(lazy_offload=True, **SLOW_COPIES)
    with engine(tiny_model, cfg, **ENGINE_ARGS) as llm:
        assert generate(llm, prompts, max_tokens=max_tokens) == reference["last-decode-step"][0]
        # The blocks those requests freed are offered to the walker in the next step, here
        # the only step of a one-token request: its lazy store must not outlive it.
        generate(llm, distinct_prompts(1, tokens, seed=-1), max_tokens=1)
        assert not scheduler_connector(llm).has_pending_push_work()
        stats = planner_stats(llm)
        assert stats["stored_blocks"] == stats["store_blocks"] > 0
        assert llm.reset_prefix_cache(), "a lazy store still holds GPU blocks"


MP_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    from vllm_harness import cpu_hit_tokens, engine, generate, offload_config

    if __name__ == "__main__":
        prompts, max_tokens = json.loads({prompts!r}), {max_tokens!r}
        result = {{}}
        for lazy in (False, True):
            cfg = offload_config(lazy_offload=lazy, **json.loads({faults!r}))
            with engine({model!r}, cfg, distributed_executor_backend="mp",
                        max_num_seqs=2) as llm:
                first = generate(llm, prompts, max_tokens=max_tokens)
                reset = [llm.reset_prefix_cache()]
                # Lazy stores of the blocks just freed start in this request's only step.
                generate(llm, [{extra!r}], max_tokens=1)
                reset.append(llm.reset_prefix_cache())
                again = generate(llm, [p + o for p, o in zip(prompts, first)])
                result["lazy" if lazy else "eager"] = {{
                    "first": first, "reset": reset, "again": again,
                    "hits": cpu_hit_tokens(llm),
                }}
        print("RESULT", json.dumps(result))
    """
)


def test_multiprocess_engine_is_idle_with_no_block_held(
    tiny_model: Path, reference: dict[str, Any]
) -> None:
    """Engine core in its own process: it keeps stepping while the connector has work,
    but ``reset_prefix_cache`` right after ``generate`` must not race with that."""
    tokens, max_tokens = CASES["last-decode-step"]
    prompts = distinct_prompts(N_REQUESTS, tokens, seed=tokens)
    script = MP_SCRIPT.format(
        tests=str(Path(__file__).parent),
        prompts=json.dumps(prompts),
        max_tokens=max_tokens,
        extra=distinct_prompts(1, tokens, seed=-1)[0],
        faults=json.dumps(SLOW_COPIES),
        model=str(tiny_model),
    )
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    result = run_script(script, env)
    first, again = reference["last-decode-step"]
    modes = ("eager", "lazy")
    # Whether a copy still held GPU blocks after each `generate`.
    assert {m: result[m]["reset"] for m in modes} == {m: [True, True] for m in modes}
    for mode in modes:
        assert result[mode]["first"] == first, mode
        assert result[mode]["again"] == again, mode
    assert result["eager"]["hits"] == N_REQUESTS * 2 * BLOCK_TOKENS
