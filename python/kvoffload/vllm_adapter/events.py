"""vLLM's KV cache events: what a CPU event says about a block and its group, built as
vLLM's own block pool publishes them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EventSpec:
    """What a CPU ``BlockStored`` says about the KV-cache group (vLLM's own spec fields)."""

    kind: str
    sliding_window: int | None


def event_specs(kv_cache_config: Any) -> list[EventSpec]:
    """The event fields of each KV-cache group, as vLLM's block pool publishes them."""
    from vllm.v1.kv_cache_interface import (
        get_kv_cache_spec_kind,
        get_kv_cache_spec_sliding_window,
    )

    return [
        EventSpec(
            get_kv_cache_spec_kind(g.kv_cache_spec).value,
            get_kv_cache_spec_sliding_window(g.kv_cache_spec),
        )
        for g in kv_cache_config.kv_cache_groups
    ]


@dataclass(frozen=True)
class BlockMeta:
    """What a CPU event needs about one stored block, taken while its request was at hand
    (vLLM's ``BlockStoreMeta``); hashes are already as vLLM publishes them."""

    block_hash: Any
    parent_block_hash: Any
    token_ids: list[int]
    lora_id: int | None
    lora_name: str | None
    extra_keys: tuple[Any, ...] | None


def request_block_meta(request: Any, index: int, block_size: int) -> BlockMeta:
    """Block ``index`` of ``request`` as vLLM's Simple connector snapshots it at store time."""
    from vllm.v1.core.kv_cache_utils import (
        generate_block_hash_extra_keys,
        maybe_convert_block_hash,
    )

    hashes = request.block_hashes
    start = index * block_size
    end = start + block_size
    lora = request.lora_request
    extra_keys, _ = generate_block_hash_extra_keys(request, start, end, 0)
    return BlockMeta(
        block_hash=maybe_convert_block_hash(hashes[index]),
        parent_block_hash=maybe_convert_block_hash(hashes[index - 1]) if index else None,
        token_ids=list(request.all_token_ids[start:end]),
        lora_id=lora.adapter_id if lora else None,
        lora_name=lora.name if lora else None,
        extra_keys=extra_keys,
    )


def gpu_block_meta(hash_with_group_id: bytes) -> BlockMeta:
    """A lazy store's block: a free GPU block whose request is gone. Like vLLM's Simple
    connector in lazy mode, only its hash is known (no tokens, parent or LoRA)."""
    from vllm.v1.core.kv_cache_utils import (
        BlockHashWithGroupId,
        get_block_hash,
        maybe_convert_block_hash,
    )

    return BlockMeta(
        block_hash=maybe_convert_block_hash(
            get_block_hash(BlockHashWithGroupId(hash_with_group_id))
        ),
        parent_block_hash=None,
        token_ids=[],
        lora_id=None,
        lora_name=None,
        extra_keys=None,
    )


def block_stored(
    meta: BlockMeta, block_size: int, spec: EventSpec, group_idx: int, *, storage: bool = False
) -> Any:
    """A CPU ``BlockStored`` for one block, field for field as vLLM's Simple connector
    (medium ``"STORAGE"`` with ``storage``: the disk tier, as Simple's disk mode)."""
    from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockStored
    from vllm.v1.core.kv_cache_utils import to_event_extra_keys

    keys = meta.extra_keys
    return BlockStored(
        block_hashes=[meta.block_hash],
        parent_block_hash=meta.parent_block_hash,
        token_ids=meta.token_ids,
        block_size=block_size,
        lora_id=meta.lora_id,
        medium=MEDIUM_STORAGE if storage else MEDIUM_CPU,
        lora_name=meta.lora_name,
        extra_keys=to_event_extra_keys(keys and [keys]),
        group_idx=group_idx,
        kv_cache_spec_kind=spec.kind,
        kv_cache_spec_sliding_window=spec.sliding_window,
        locality="LOCAL",
    )


def block_removed(block_hashes: list[Any], group_idx: int, *, storage: bool = False) -> Any:
    from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved

    return BlockRemoved(
        block_hashes=block_hashes,
        medium=MEDIUM_STORAGE if storage else MEDIUM_CPU,
        group_idx=group_idx,
        locality="LOCAL",
    )


def all_blocks_cleared() -> Any:
    from vllm.distributed.kv_events import AllBlocksCleared

    return AllBlocksCleared()
