"""KV tensors as vLLM's GPU worker lays them out, on the CPU: one allocation viewed per
layer by vLLM's own ``create_kv_cache_views``, in any of its layouts
(``vllm.v1.kv_cache_layout.KVCacheLayout``). Shared by tests and benchmarks."""

from __future__ import annotations

import torch


def vllm_kv_caches(
    layout_name: str,
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int = 16,
    num_kv_heads: int = 2,
    head_size: int = 32,
    dtype: torch.dtype = torch.float16,
) -> tuple[dict[str, torch.Tensor], torch.Tensor, int]:
    """Per-layer views of one allocation, named like vLLM's attention layers; the raw
    buffer; the bytes of one layer's block."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[layout_name]
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype
    )
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, num_layers, layout)
    size = spec.page_size_bytes * num_layers * num_blocks
    tensor = KVCacheTensor(
        size=size,
        layers=[f"model.layers.{i}.self_attn.attn" for i in range(num_layers)],
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    raw = torch.zeros(size, dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, num_blocks, layout, tensor)
    return dict(zip(tensor.layers, views, strict=True)), raw, spec.page_size_bytes
