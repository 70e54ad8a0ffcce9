"""The vLLM adapter against vLLM's real objects: the GPU block pool's free queue (lazy
mode) and KV tensor layouts (worker regions)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from kvoffload._native import Planner
from kvoffload.vllm_adapter import FreeQueueWalker, kv_regions


def pool_with_freed_blocks(n_hashed: int) -> tuple[BlockPool, list[bytes]]:
    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=16)
    blocks = pool.get_new_blocks(n_hashed + 2)
    hashes = [make_block_hash_with_group_id(bytes([i + 1]) * 32, 0) for i in range(n_hashed)]
    for block, h in zip(blocks, hashes, strict=False):
        block.set_block_hash(h)
    # Freed in order: hashed blocks go to the tail in this order, unhashed to the head.
    pool.free_blocks(blocks)
    return pool, hashes


def walked_hashes(pool: BlockPool, walked: Any) -> list[Any]:
    return [pool.blocks[i].block_hash for i in walked.gpu_block_ids]


def test_walker_offers_hashed_free_blocks_oldest_first_and_resumes(lazy_planner: Planner) -> None:
    pool, hashes = pool_with_freed_blocks(4)
    walker = FreeQueueWalker(pool)
    assert walked_hashes(pool, walker.candidates(100, lazy_planner)) == hashes  # LRU order
    # Nothing new since: the cursor resumes after the last block seen.
    assert walker.candidates(100, lazy_planner) is None
    walker.reset()
    assert walked_hashes(pool, walker.candidates(100, lazy_planner)) == hashes


def test_walker_limit_and_hold_release(lazy_planner: Planner) -> None:
    pool, hashes = pool_with_freed_blocks(4)
    walker = FreeQueueWalker(pool)
    walked = walker.candidates(13, lazy_planner)  # 11 never-used blocks, then two hashed ones
    assert walked_hashes(pool, walked) == hashes[:2]
    ids = walked.gpu_block_ids
    free_before = pool.get_num_free_blocks()
    walker.hold(ids)
    assert pool.get_num_free_blocks() == free_before - 2
    walker.release(ids)
    assert pool.get_num_free_blocks() == free_before


@pytest.mark.parametrize(
    ("shape", "split"),
    [((8, 2, 16, 64), False), ((2, 8, 16, 4, 32), True)],
    ids=["block-major (CPU, FlashInfer)", "K/V split (FlashAttention)"],
)
def test_kv_regions_cover_each_block_once(shape: tuple[int, ...], split: bool) -> None:
    layers = {f"layer{i}": torch.zeros(shape) for i in range(2)}
    regions = kv_regions(layers, num_blocks=8)
    assert len(regions) == (4 if split else 2)
    per_block = sum(r.block_bytes for r in regions)
    assert per_block == sum(t.numel() * t.element_size() for t in layers.values()) // 8
    assert len({r.base for r in regions}) == len(regions)
    for r in regions:
        assert r.num_blocks == 8
        assert r.block_stride >= r.block_bytes


@pytest.mark.parametrize("mamba_first", [False, True])
def test_kv_regions_count_overlapping_group_views_once(mamba_first: bool) -> None:
    """With the hybrid allocator an attention layer views a block id's whole page and a
    Mamba layer's state tensors view parts of the same page: one region, the page."""
    pages = torch.zeros(8, 1024)  # 4 KiB pages
    states = [pages[:, :64], pages[:, 64:1000]]  # conv and SSM state views
    layers: dict[str, Any] = {"attn": pages, "mamba": states}
    if mamba_first:
        layers = {"mamba": states, "attn": pages}
    (region,) = kv_regions(layers, num_blocks=8)
    assert (region.base, region.block_bytes, region.block_stride) == (
        pages.data_ptr(),
        4096,
        4096,
    )


def test_kv_regions_reject_tensors_without_a_block_dimension() -> None:
    with pytest.raises(ValueError, match="block dimension"):
        kv_regions({"l": torch.zeros(3, 5)}, num_blocks=8)


PAGE = 4096


def kv_config(tensors: list[tuple[list[str], int, int, int]], groups: list[list[str]]) -> object:
    """A ``KVCacheConfig`` of 8 blocks: ``tensors`` as ``(layers, layer_stride,
    block_stride, offset)`` in one allocation, ``groups`` of full-attention layers with
    ``PAGE``-byte pages."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=16, dtype=torch.float16)
    assert spec.page_size_bytes == PAGE
    return KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[
            KVCacheTensor(
                size=8 * 2 * PAGE, layers=ls, layer_stride=lst, block_stride=bst, offset=off
            )
            for ls, lst, bst, off in tensors
        ],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=g, kv_cache_spec=spec) for g in groups],
    )


@pytest.mark.parametrize(
    ("tensors", "groups", "pages"),
    [
        # Hybrid allocator: each group's layer overlays the same bytes (a block id belongs
        # to one group at a time), so a block id is one page, not one per group.
        pytest.param(
            [(["a"], 8 * PAGE, PAGE, 0), (["b"], 8 * PAGE, PAGE, 0)], [["a"], ["b"]], 1, id="hma"
        ),
        # Layer-outer: each layer its own region.
        pytest.param([(["a", "b"], 8 * PAGE, PAGE, 0)], [["a", "b"]], 2, id="layer-outer"),
        # Block-outer: one block of both layers' pages side by side.
        pytest.param([(["a", "b"], PAGE, 2 * PAGE, 0)], [["a", "b"]], 2, id="block-outer"),
        # Two groups of two layers, packed block-outer and overlaid.
        pytest.param(
            [(["a", "b"], PAGE, 2 * PAGE, 0), (["c", "d"], PAGE, 2 * PAGE, 0)],
            [["a", "b"], ["c", "d"]],
            2,
            id="hma-packed",
        ),
    ],
)
def test_bytes_per_block_counts_each_byte_of_a_block_id_once(
    tensors: list[tuple[list[str], int, int, int]], groups: list[list[str]], pages: int
) -> None:
    from kvoffload.vllm_adapter import bytes_per_block

    assert bytes_per_block(kv_config(tensors, groups)) == pages * PAGE


def test_an_untested_vllm_gets_one_warning_naming_the_tested_versions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import logging

    import vllm

    from kvoffload.vllm_adapter import version

    assert version.untested_vllm_message("0.32.0") is None
    assert version.untested_vllm_message("0.33.1rc1+cu130") is None
    for untested in ("0.31.2", "0.34.0", "1.0.0", "unknown"):
        message = version.untested_vllm_message(untested)
        assert message is not None
        assert f"vLLM {untested}" in message
        assert "tested: 0.32.x, 0.33.x" in message

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    log = logging.getLogger("kvoffload-version-test")
    log.addHandler(Keep())
    monkeypatch.setattr(version, "_checked", [])
    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    assert version.warn_if_untested_vllm(log)
    assert not version.warn_if_untested_vllm(log)  # once per process
    assert len(records) == 1
    assert "vLLM 0.35.0" in records[0]
    monkeypatch.setattr(version, "_checked", [])
    monkeypatch.setattr(vllm, "__version__", "0.32.0")
    assert not version.warn_if_untested_vllm(log)
    assert len(records) == 1


def test_the_running_vllm_is_a_tested_one() -> None:
    """CI runs these suites on each tested release: the running one must be among them."""
    import vllm

    from kvoffload.vllm_adapter.version import untested_vllm_message

    assert untested_vllm_message(vllm.__version__) is None
