"""kvoffload offloads full-attention KV only and refuses any other KV-cache group at
construction, naming the group kind and the model: a group that frees blocks from a
running request's table (sliding window, chunked local attention, Mamba) would otherwise
be stored from blocks vLLM already gave away."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvoffload import ConfigError
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


def mamba() -> Any:
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(
        block_size=BLOCK_SIZE,
        shapes=((1, HEAD_SIZE, HEAD_SIZE),),
        dtypes=(torch.float16,),
        mamba_cache_mode="align",
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
        pytest.param(
            lambda: [([LAYER], sliding_window(2 * BLOCK_SIZE))], "sliding_window", id="sw"
        ),
        pytest.param(lambda: [([LAYER], chunked_local())], "chunked_local_attention", id="chunked"),
        pytest.param(
            lambda: [([LAYER], full_attention()), (["model.layers.1.mixer"], mamba())],
            "group 1: mamba",
            id="full+mamba",
        ),
        pytest.param(
            lambda: [
                ([LAYER], full_attention()),
                (["model.layers.1.self_attn.attn"], sliding_window(2 * BLOCK_SIZE)),
            ],
            "group 1: sliding_window",
            id="full+sw",
        ),
    ],
)
def test_group_kind_other_than_full_attention_refused(model: Path, groups: Any, kind: str) -> None:
    with pytest.raises(ConfigError, match=kind) as info:
        SchedHarness(model, groups=groups())
    assert str(model) in str(info.value)


@pytest.mark.parametrize("spec", [full_attention, mla], ids=["full", "mla"])
def test_full_attention_kinds_accepted(model: Path, spec: Any) -> None:
    h = SchedHarness(model, groups=[([LAYER], spec())])
    assert h.offload is not None
    prompt = h.prompt(2)
    h.serve(prompt)
    h.evict_gpu_prefix_cache()
    assert h.cpu_hit_tokens(prompt) == 2 * h.block_size


def sliding_window_llama(tiny: Path, path: Path, layer_types: list[str] | None = None) -> Path:
    """The tiny Llama (same weights) with 256-token sliding-window layers: every layer by
    default, for which vLLM keeps its only KV-cache group a sliding window even with the
    hybrid manager off."""
    import json
    import shutil

    shutil.copytree(tiny, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["layer_types"] = layer_types or ["sliding_attention"] * cfg["num_hidden_layers"]
    cfg["sliding_window"] = 256
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_sliding_window_model_refused_by_the_engine(tiny_model: Path, tmp_path: Path) -> None:
    from vllm_harness import engine, offload_config

    model = sliding_window_llama(tiny_model, tmp_path / "sliding_llama")
    with (
        pytest.raises(ConfigError, match="group 0: sliding_window") as info,
        engine(model, offload_config()),
    ):
        pass
    assert str(model) in str(info.value)


def test_sliding_and_full_layers_offloaded_as_full_attention(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Sliding-window and full-attention layers: with kvoffload vLLM turns its hybrid
    manager off and keeps full KV for every layer, one full-attention group, which is
    offloaded; outputs equal the engine without kvoffload (hybrid manager on)."""
    from vllm_harness import (
        cpu_hit_tokens,
        distinct_prompts,
        engine,
        generate,
        offload_config,
        reset_gpu_prefix_cache,
    )

    model = sliding_window_llama(
        tiny_model, tmp_path / "mixed_llama", ["sliding_attention", "full_attention"]
    )
    prompts = distinct_prompts(4, 600)
    with engine(model) as llm:
        reference = generate(llm, prompts)
    with engine(model, offload_config()) as llm:
        groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
        assert [type(g.kv_cache_spec).__name__ for g in groups] == ["FullAttentionSpec"]
        first = generate(llm, prompts)
        reset_gpu_prefix_cache(llm)
        again = generate(llm, prompts)
        hits = cpu_hit_tokens(llm)
    assert first == reference
    assert again == reference
    assert hits > 0
