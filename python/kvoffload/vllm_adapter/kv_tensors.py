"""vLLM's KV cache tensors on a worker, as block-major regions of memory the copies read
and write."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Region:
    """One block-major span of KV memory: block ``i`` starts at ``base + i * stride``."""

    base: int
    num_blocks: int
    block_bytes: int
    block_stride: int


def kv_regions(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> list[Region]:
    """Block-major regions covering every registered KV tensor, each byte once.

    Handles vLLM's layouts where the block dimension is first (vLLM >= 0.32's
    ``[B, H, N, C]`` views in any of its layouts, the CPU backend, FlashInfer) or second
    after a K/V split (older FlashAttention: ``[2, num_blocks, ...]``). A block whose
    bytes are one dense run, in any axis order, is one region (copies move whole blocks,
    so the order inside does not matter); one whose bytes are spread (layouts with the
    head axis outside the block axis, ``LHBNC``, ``BHLNC``) is split into dense slices.
    With the hybrid allocator, layers of different groups view the same page of a block
    id (a Mamba layer's state tensors are parts of the page an attention layer views
    whole); overlapping views are one region.
    """
    regions: dict[tuple[int, int], Region] = {}
    for name, t in kv_caches.items():
        tensors = t if isinstance(t, (list, tuple)) else [t]
        for tensor in tensors:
            parts = _block_major_parts(name, tensor, num_blocks)
            for part in (dense for p in parts for dense in _dense_slices(p)):
                es = part.element_size()
                block_bytes = part[0].numel() * es
                region = Region(
                    base=part.data_ptr(),
                    num_blocks=int(part.shape[0]),
                    block_bytes=block_bytes,
                    block_stride=part.stride(0) * es,
                )
                regions.setdefault((region.base, region.block_bytes), region)
    return merge_adjacent_regions(list(regions.values()))


def merge_adjacent_regions(regions: list[Region]) -> list[Region]:
    """Joins regions that are one region's consecutive or overlapping slices: where a
    region's block starts inside or right after another's at the same block stride
    (block-outer layouts put one block of every layer side by side; hybrid groups' layers
    view the same page), a block of both is one contiguous run and costs one copy. The
    rest keep their order (a CPU block holds the regions' bytes in this order)."""
    merged: list[tuple[int, Region]] = []
    for order, r in sorted(enumerate(regions), key=lambda e: e[1].base):
        if merged:
            first, last = merged[-1]
            end = max(last.base + last.block_bytes, r.base + r.block_bytes)
            if (
                r.base <= last.base + last.block_bytes
                and r.num_blocks == last.num_blocks
                and r.block_stride == last.block_stride
                and end - last.base <= r.block_stride
            ):
                joined = Region(last.base, last.num_blocks, end - last.base, r.block_stride)
                merged[-1] = (min(first, order), joined)
                continue
        merged.append((order, r))
    return [r for _, r in sorted(merged, key=lambda e: e[0])]


def _is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one gap-free span of memory, whatever the axis order
    (vLLM's ``LBNHC`` layout views a block as ``[H, N, C]`` with N outer in memory)."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _dense_slices(part: torch.Tensor) -> list[torch.Tensor]:
    """``part`` (block axis first) cut along its outermost inner axes until each slice
    holds one dense run per block."""
    if _is_dense(part[0]):
        return [part]
    inner = [d for d in range(1, part.dim()) if part.shape[d] > 1]
    outer = max(inner, key=part.stride)
    return [s for i in range(part.shape[outer]) for s in _dense_slices(part.select(outer, i))]


def _block_major_parts(name: str, t: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
    if t.dim() >= 1 and t.shape[0] == num_blocks:
        return [t]
    if t.dim() >= 2 and t.shape[1] == num_blocks:
        return [t[i] for i in range(t.shape[0])]
    raise ValueError(
        f"kvoffload: cannot find the block dimension ({num_blocks} blocks) of KV tensor "
        f"{name} with shape {tuple(t.shape)}"
    )
