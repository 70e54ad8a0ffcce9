"""vLLM's scheduler-side request and block objects: the blocks an allocation hands over,
and vLLM's GPU block pool, whose free queue lazy mode walks, whose blocks a copy holds and
whose resets the KV events follow."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvoffload._native import LazyCandidates, Planner

#: vLLM appends the KV-cache group id (4 bytes, big-endian) to a GPU block's hash.
GROUP_ID_BYTES = 4


def allocated_blocks(blocks: Any) -> tuple[list[Any], ...]:
    """The ``KVCacheBlock`` lists of a ``KVCacheBlocks``, one per KV-cache group, from
    token 0 (vLLM's null block where a group holds none): the planner reads the
    ``block_id`` of the few it loads into (vLLM's own tuple, not copied)."""
    return blocks.blocks


def counts_null_block_refs(gpu_block_pool: Any) -> bool:
    """Whether this vLLM's ``BlockPool.touch`` / ``free_blocks`` count references on the
    null block (vLLM 0.32 does; 0.33 skips it, its ``ref_cnt`` not maintained). Asked of
    the pool itself, not of a version number: ``free_blocks`` of the null block alone
    changes nothing else (it never enters the free queue), and its count is put back."""
    null = gpu_block_pool.null_block
    before = null.ref_cnt
    gpu_block_pool.free_blocks([null])
    counted = null.ref_cnt != before
    null.ref_cnt = before
    return counted


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
        self._counts_null = counts_null_block_refs(gpu_block_pool)

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
            if block.is_null:
                if self._counts_null:
                    block.ref_cnt += 1
                continue
            if block.ref_cnt:
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
        counts_null = self._counts_null
        for i in block_ids:
            block = blocks[i]
            if block.is_null:
                if counts_null:
                    block.ref_cnt -= 1
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
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
    """Offers each cached block of the GPU free queue that the CPU tier lacks once per
    stay in the queue, least recently used first, resuming each step where the previous
    walk stopped. A block a
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

    def candidates(self, limit: int, planner: Planner) -> LazyCandidates | None:
        """Examines up to ``limit`` blocks not examined during their current stay in the
        queue; returns those with a hash that ``planner``'s CPU tier lacks, for
        ``planner.offer_lazy`` or its next ``schedule_lazy``/``schedule_output``, or
        ``None`` when no block joined the queue since the previous walk. The nodes are
        read in Rust (``Planner.walk_free_queue``): a burst of freed blocks is a few
        hundred, most of them in the CPU tier already, and the keys of the others stay
        there (the candidates are a handle; Python never sees their hashes)."""
        if not self._joined:
            # Most calls; no lists are allocated for them (see `metadata.IDLE_STEP`).
            return None
        cursor = self._cursor
        node = self._head.next_free_block if cursor is None else cursor.next_free_block
        tail = self._tail
        if node is tail:
            self._joined = False
            return None
        last, at_tail, found = planner.walk_free_queue(node, tail, limit, GROUP_ID_BYTES)
        if last is not None:
            self._cursor = last
        if at_tail:
            self._joined = False
        return found


class GpuResetWatch:
    """Tells whether vLLM's GPU block pool was reset (``BlockPool.reset_prefix_cache``,
    which publishes ``AllBlocksCleared``) since it last asked, at the cost of one
    identity test: a successful reset replaces the pool's hash-to-block map with a new
    one (vLLM 0.32 and 0.33; nothing else assigns it), a failed one leaves it.

    Why not look for the clear in the pool's event queue when a step is planned: the
    queue then holds the step's allocations' events (a scan per step, or a bet on the
    clear's position), and whether the clear is still there depends on where the reset
    fell between the engine's calls. The map is compared when the connector's events are
    taken, right after vLLM took the pool's into the same batch: whenever a reset's clear
    is in a batch, the connector learns of it for that batch, whatever the scheduling.
    """

    def __init__(self, gpu_block_pool: Any) -> None:
        self._pool = gpu_block_pool
        self._seen = getattr(gpu_block_pool, "cached_block_hash_to_block", None)
        if self._seen is None:
            from kvoffload.vllm_adapter import logger

            logger.warning(
                "kvoffload: vLLM's GPU block pool has no cached_block_hash_to_block: "
                "after a GPU prefix-cache reset, blocks on CPU and disk are not announced "
                "again to KV-event subscribers"
            )

    def was_reset(self) -> bool:
        seen = self._seen
        if seen is None:
            return False
        now = self._pool.cached_block_hash_to_block
        if now is seen:
            return False
        self._seen = now
        return True


def skips_prefix_cache(request: Any) -> bool:
    """Whether vLLM computes every prompt token of ``request`` whatever is cached (requests
    with prompt logprobs, pooling requests, an explicit ``skip_reading_prefix_cache``)."""
    return bool(getattr(request, "skip_reading_prefix_cache", False))
