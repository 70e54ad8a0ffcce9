"""The lazy-mode walker against vLLM's real ``BlockPool``: every cached block in the GPU free
queue is offered exactly once per stay in the queue, whatever vLLM (or the walker's own
holds) did to the queue between walks."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock, make_block_hash_with_group_id

from kvoffload._native import InvalidInputError, Planner
from kvoffload.vllm_adapter import FreeQueueWalker, GpuBlockHolder

NUM_BLOCKS = 24


class Hashes:
    """Fresh block hashes, as vLLM gives a block when it caches it (distinct in their
    first 16 bytes, the planner's key)."""

    def __init__(self) -> None:
        self._n = 0

    def give(self, block: KVCacheBlock) -> None:
        self._n += 1
        block.set_block_hash(make_block_hash_with_group_id(self._n.to_bytes(32, "little"), 0))


def cached_free_blocks(pool: BlockPool) -> list[int]:
    """Ids of the free queue's blocks with a hash, least recently used first."""
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks() if b.block_hash]


def walk(walker: FreeQueueWalker, limit: int, planner: Planner) -> list[int] | None:
    """The GPU block ids a walk offers, ``None`` when it read no node."""
    walked = walker.candidates(limit, planner)
    return walked.gpu_block_ids if walked is not None else None


def offer_all(walker: FreeQueueWalker, planner: Planner) -> list[int]:
    return walk(walker, 10 * NUM_BLOCKS, planner) or []


def freed_cached_blocks(pool: BlockPool, hashes: Hashes, n: int) -> list[KVCacheBlock]:
    blocks = pool.get_new_blocks(n)
    for b in blocks:
        hashes.give(b)
    pool.free_blocks(blocks)
    return blocks


def test_block_held_and_released_before_the_next_walk_skips_nothing(lazy_planner: Planner) -> None:
    pool, hashes = BlockPool(NUM_BLOCKS, True, 16), Hashes()
    walker = FreeQueueWalker(pool)
    first = freed_cached_blocks(pool, hashes, 3)
    assert offer_all(walker, lazy_planner) == [b.block_id for b in first]
    # A lazy store holds the last block offered (the cursor), then more blocks are freed
    # behind it, then the store completes: the block rejoins the queue where it was,
    # examined, and every block freed meanwhile is still offered.
    walker.hold([first[-1].block_id])
    later = freed_cached_blocks(pool, hashes, 4)
    walker.release([first[-1].block_id])
    assert offer_all(walker, lazy_planner) == [b.block_id for b in later]
    assert offer_all(walker, lazy_planner) == []


def test_cursor_taken_by_a_prefix_hit_and_freed_again_skips_nothing(lazy_planner: Planner) -> None:
    pool, hashes = BlockPool(NUM_BLOCKS, True, 16), Hashes()
    walker = FreeQueueWalker(pool)
    first = freed_cached_blocks(pool, hashes, 3)
    assert offer_all(walker, lazy_planner) == [b.block_id for b in first]
    later = freed_cached_blocks(pool, hashes, 2)
    pool.touch([first[-1]])  # another request hits the cursor block...
    pool.free_blocks([first[-1]])  # ...and finishes before the next walk
    assert offer_all(walker, lazy_planner) == [b.block_id for b in later] + [first[-1].block_id]


def test_cursor_reallocated_restarts_from_the_head(lazy_planner: Planner) -> None:
    pool, hashes = BlockPool(NUM_BLOCKS, True, 16), Hashes()
    walker = FreeQueueWalker(pool)
    # Allocation takes never-used blocks first: use them up, then cache three blocks.
    spare = pool.get_new_blocks(pool.get_num_free_blocks() - 3)
    cached = pool.get_new_blocks(3)
    for b in cached:
        hashes.give(b)
    pool.free_blocks(cached)
    assert walk(walker, 2, lazy_planner) == [b.block_id for b in cached[:2]]
    # The cursor (second block) is reallocated, loses its hash, gets a new one and is
    # freed again: the block after it was never offered, the block itself is new.
    taken = pool.get_new_blocks(2)
    assert taken == cached[:2]
    hashes.give(taken[1])
    pool.free_blocks([taken[1]])
    assert offer_all(walker, lazy_planner) == [cached[2].block_id, taken[1].block_id]
    pool.free_blocks([taken[0], *spare])


def test_blocks_joining_one_at_a_time_or_after_a_partial_walk_are_offered(
    lazy_planner: Planner,
) -> None:
    """A walk that reached the tail reads nothing more until a block joins; every way a
    block joins (``append_n`` from ``free_blocks``, ``append``) and a walk cut short by its
    limit still leave the rest to the next walk."""
    pool, hashes = BlockPool(NUM_BLOCKS, True, 16), Hashes()
    walker = FreeQueueWalker(pool)
    # Only cached blocks in the queue: each walk of 2 offers 2.
    spare = pool.get_new_blocks(pool.get_num_free_blocks() - 3)
    first = [b.block_id for b in freed_cached_blocks(pool, hashes, 3)]
    assert walk(walker, 2, lazy_planner) == first[:2]
    assert walk(walker, 2, lazy_planner) == first[2:]
    assert walk(walker, 2, lazy_planner) is None
    single = spare.pop()
    hashes.give(single)
    single.ref_cnt -= 1
    pool.free_block_queue.append(single)
    assert offer_all(walker, lazy_planner) == [single.block_id]
    assert walk(walker, 2, lazy_planner) is None
    pool.free_blocks(spare)


def test_blocks_a_store_held_rejoin_the_queue_examined_before_later_frees(
    lazy_planner: Planner,
) -> None:
    """Released when their store retired, held blocks are not offered again, and are
    evicted before blocks freed after they were offered (where they were, not at the
    tail). Offered again, a block whose CPU copy was evicted meanwhile was stored again,
    evicting another: with a small CPU pool, an engine without requests never stopped."""
    pool, hashes = BlockPool(NUM_BLOCKS, True, 16), Hashes()
    walker = FreeQueueWalker(pool)
    first = [b.block_id for b in freed_cached_blocks(pool, hashes, 3)]
    assert offer_all(walker, lazy_planner) == first
    walker.hold(first[:2])
    later = [b.block_id for b in freed_cached_blocks(pool, hashes, 2)]
    walker.release(first[:2])
    assert cached_free_blocks(pool) == [first[2], first[0], first[1], *later]
    assert offer_all(walker, lazy_planner) == later
    assert offer_all(walker, lazy_planner) == []


def test_blocks_the_cpu_tier_has_are_walked_past_not_offered(lazy_planner: Planner) -> None:
    """A freed block whose key the CPU tier holds or is storing (loaded from it, or
    stored before) is not handed back: the walk moves past it, counts it as a skipped
    duplicate, and offers the rest in queue order."""
    pool, hashes = BlockPool(NUM_BLOCKS, True, 16), Hashes()
    walker = FreeQueueWalker(pool)
    # Only cached blocks in the queue: a walk of 2 finds 2.
    spare = pool.get_new_blocks(pool.get_num_free_blocks() - 4)
    freed = [b.block_id for b in freed_cached_blocks(pool, hashes, 4)]
    # The first two go to the next store.
    first = walker.candidates(2, lazy_planner)
    assert first is not None
    assert lazy_planner.offer_lazy(first) == freed[:2]
    walker.reset()
    assert offer_all(walker, lazy_planner) == freed[2:]
    assert dict(lazy_planner.stats())["dedup_skipped"] == 2
    assert walk(walker, 10 * NUM_BLOCKS, lazy_planner) is None
    pool.free_blocks(spare)


def test_a_free_block_whose_hash_is_not_bytes_is_named(lazy_planner: Planner) -> None:
    pool, hashes = BlockPool(NUM_BLOCKS, True, 16), Hashes()
    walker = FreeQueueWalker(pool)
    bad = freed_cached_blocks(pool, hashes, 2)[1]
    bad._block_hash = "not bytes"
    with pytest.raises(
        InvalidInputError, match=f"GPU block {bad.block_id}: block hash must be bytes"
    ):
        walker.candidates(10 * NUM_BLOCKS, lazy_planner)


def test_random_queue_operations_offer_each_cached_block_once_per_stay(
    lazy_planner: Planner,
) -> None:
    """A randomized model check: after any mix of allocations, prefix hits, frees, walks,
    holds and releases, the offered blocks are exactly a least-recently-used prefix of the
    cached free blocks, none offered twice during one stay in the queue."""
    for seed in range(60):
        rng = random.Random(seed)
        pool, hashes = BlockPool(NUM_BLOCKS, True, 16), Hashes()
        walker = FreeQueueWalker(pool)
        refs: list[KVCacheBlock] = []  # one entry per reference a "request" holds
        held: list[int] = []  # blocks a lazy store holds
        stale: set[int] = set()  # held across a reset
        offered: set[int] = set()  # offered during their current stay in the queue
        for step in range(200):
            op = rng.choice(["alloc", "hit", "free", "walk", "release", "reset"])
            if op == "alloc" and pool.get_num_free_blocks() > 0:
                blocks = pool.get_new_blocks(rng.randint(1, min(4, pool.get_num_free_blocks())))
                for b in blocks:
                    if rng.random() < 0.7:
                        hashes.give(b)
                refs.extend(blocks)
            elif op == "hit":
                cached = [b for b in pool.blocks if b.block_hash is not None]
                if cached:
                    hit = rng.sample(cached, min(len(cached), rng.randint(1, 3)))
                    pool.touch(hit)
                    refs.extend(hit)
            elif op == "free" and refs:
                rng.shuffle(refs)
                n = rng.randint(1, len(refs))
                pool.free_blocks(refs[:n])
                del refs[:n]
            elif op == "walk":
                ids = walk(walker, rng.randint(1, NUM_BLOCKS), lazy_planner) or []
                assert all(pool.blocks[i].block_hash is not None for i in ids)
                assert not offered.intersection(ids), f"seed {seed} step {step}: re-offered"
                offered.update(ids)
                chosen = [i for i in ids if rng.random() < 0.5]
                walker.hold(chosen)
                held.extend(chosen)
            elif op == "release" and held:
                rng.shuffle(held)
                n = rng.randint(1, len(held))
                walker.release(held[:n])
                # Back in the queue, examined: not offered again during this stay, unless
                # a reset came in between (their copies are gone).
                offered.update(
                    i for i in held[:n] if pool.blocks[i].ref_cnt == 0 and i not in stale
                )
                stale.difference_update(held[:n])
                del held[:n]
            elif op == "reset":
                walker.reset()
                offered.clear()
                stale = set(held)
            free = cached_free_blocks(pool)
            offered.intersection_update(free)  # a block that left the queue starts afresh
            assert free[: len(offered)] == [b for b in free if b in offered], (
                f"seed {seed} step {step} ({op}): a cached free block was skipped"
            )
        rest = offer_all(walker, lazy_planner)
        assert not offered.intersection(rest)
        assert sorted(offered.union(rest)) == sorted(cached_free_blocks(pool)), f"seed {seed}"


def free_queue_state(pool: BlockPool) -> tuple[list[int], int, list[int]]:
    """The free queue's order (walked both ways), its length and every block's ref count."""
    queue = pool.free_block_queue
    forward = [b.block_id for b in queue.get_all_free_blocks()]
    backward = []
    node = queue.fake_free_list_tail.prev_free_block
    while node is not queue.fake_free_list_head:
        backward.append(node.block_id)
        node = node.prev_free_block
    assert backward[::-1] == forward
    return forward, queue.num_free_blocks, [b.ref_cnt for b in pool.blocks]


def test_holder_holds_and_releases_as_vllms_touch_and_free_blocks() -> None:
    """The holder's batched hold/release leave the pool exactly as vLLM's own ``touch`` and
    ``free_blocks`` do: same free queue order and length, same reference counts, for
    blocks in the queue or in use, cached or not, held more than once."""
    for seed in range(40):
        rng = random.Random(seed)
        mine, theirs = BlockPool(NUM_BLOCKS, True, 16), BlockPool(NUM_BLOCKS, True, 16)
        holder = GpuBlockHolder(mine)
        hashes = (Hashes(), Hashes())
        refs: list[int] = []  # one entry per reference a "request" holds
        held: list[int] = []  # one entry per hold
        for step in range(150):
            op = rng.choice(["alloc", "free", "hold", "release"])
            if op == "alloc" and mine.get_num_free_blocks() > 0:
                n = rng.randint(1, min(4, mine.get_num_free_blocks()))
                cache = [rng.random() < 0.7 for _ in range(n)]
                for pool, h in zip((mine, theirs), hashes, strict=True):
                    blocks = pool.get_new_blocks(n)
                    for b, c in zip(blocks, cache, strict=True):
                        if c:
                            h.give(b)
                refs.extend(b.block_id for b in blocks)
            elif op in ("free", "release") and (refs if op == "free" else held):
                taken = refs if op == "free" else held
                rng.shuffle(taken)
                n = rng.randint(1, len(taken))
                ids = taken[:n]
                del taken[:n]
                if op == "free":
                    mine.free_blocks([mine.blocks[i] for i in ids])
                else:
                    holder.release(ids)
                theirs.free_blocks([theirs.blocks[i] for i in ids])
            elif op == "hold":
                ids = rng.sample(range(NUM_BLOCKS), rng.randint(1, 6))
                holder.hold(ids)
                theirs.touch([theirs.blocks[i] for i in ids])
                held.extend(ids)
            assert free_queue_state(mine) == free_queue_state(theirs), f"seed {seed} step {step}"
