"""vLLM's scheduler scenarios for SimpleCPUOffloadConnector, run against kvoffload.

One test per scenario of vLLM's ``tests/v1/simple_kv_offload/test_scheduler.py``
(commit 017e9f44), named after it. vLLM drives Simple's scheduler object with hand-made
scheduler outputs; here the same situations are produced by vLLM's real ``Scheduler``
(see ``sched_harness``), and the assertions are on what reaches the workers (the copies in
kvoffload's metadata) and on what kvoffload then serves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sched_harness import BLOCK_SIZE, SchedHarness, Step

BS = BLOCK_SIZE


def stores(steps: list[Step]) -> list:
    return [s.store for s in steps if s.store is not None]


def store_prompt(h: SchedHarness, num_blocks: int, extra_tokens: int = 1) -> tuple[list[int], list]:
    """Computes a fresh prompt to completion (copies included); its prompt and stores."""
    prompt = h.prompt(num_blocks, extra_tokens)
    _, steps = h.serve(prompt)
    return prompt, stores(steps)


# ---- round trips --------------------------------------------------------------------------


@pytest.mark.parametrize("load_mode", ["async", "sync"])
def test_eager_store_and_load_roundtrip(model: Path, load_mode: str) -> None:
    # Upstream asserts an asynchronous load (Simple always loads asynchronously). kvoffload
    # loads synchronously where KV lives in host memory (`load_mode` sync, the default on
    # vLLM's CPU backend): the request then runs in the step of its load instead of
    # waiting one step. Both modes are checked.
    h = SchedHarness(model, load_mode=load_mode)
    prompt, (store,) = store_prompt(h, 2)
    assert len(store.gpu) == 2
    assert len(store.cpu) == 2

    h.evict_gpu_prefix_cache()
    req = h.add(prompt)
    s = h.step()
    rid = req.request_id
    assert s.lookups[rid] == (2 * BS, load_mode == "async")
    assert s.accepted[rid] == 2 * BS
    (load,) = s.loads
    assert load.req_id == rid
    assert load.valid
    assert load.sync == (load_mode == "sync")
    assert load.gpu == h.gpu_blocks(rid)[:2]
    assert load.cpu == store.cpu
    # Async: the request waits for its KV; sync: it computes its last token right away.
    assert s.scheduled.get(rid) == (None if load_mode == "async" else 1)
    h.run()
    h.assert_idle()


def test_max_hit_len_cap_drops_last_full_block(model: Path) -> None:
    h = SchedHarness(model)
    prompt, (store,) = store_prompt(h, 2, extra_tokens=0)
    assert len(store.gpu) == 2
    h.evict_gpu_prefix_cache()
    # The last prompt token is always recomputed: its block cannot be a hit.
    assert h.cpu_hit_tokens(prompt) == BS


def test_lazy_store_and_load_roundtrip(model: Path) -> None:
    # Upstream pushes the freed blocks to the LRU end of the free queue with filler
    # allocations; kvoffload walks twice a step's token budget (8 blocks) from that end,
    # which covers the whole 7-block pool, so no fillers are needed.
    h = SchedHarness(model, num_gpu_blocks=8, lazy=True)
    prompt = h.prompt(2)
    req, steps = h.serve(prompt)
    (store,) = stores(steps)
    # Lazy mode stores nothing while the request runs, only its freed cached blocks.
    assert all(s.store is None for s in steps if s.scheduled)
    assert len(store.gpu) == 2

    h.evict_gpu_prefix_cache()
    req2 = h.add(prompt)
    s = h.step()
    assert s.lookups[req2.request_id] == (2 * BS, True)
    (load,) = s.loads
    # The walk stores blocks in free-queue order; each block comes back where it was.
    cpu_of = dict(zip(store.gpu, store.cpu, strict=True))
    assert load.cpu == [cpu_of[b] for b in h.gpu_blocks(req.request_id)[:2]]
    assert load.gpu == h.gpu_blocks(req2.request_id)[:2]
    h.run()
    h.assert_idle()


def test_a_request_that_skips_the_prefix_cache_is_not_offered_a_hit(model: Path) -> None:
    # Not an upstream scenario: Simple returns no hit for such requests (prompt logprobs
    # need every prompt token computed) and vLLM discards one anyway; kvoffload must not
    # even pin blocks for it.
    h = SchedHarness(model)
    prompt, _ = store_prompt(h, 2)
    h.evict_gpu_prefix_cache()
    lookups = dict(h.planner.stats())["lookups"]
    req = h.request(prompt, max_tokens=2)
    req.skip_reading_prefix_cache = True
    h.scheduler.add_request(req)
    s = h.step()
    assert s.lookups[req.request_id] == (0, False)
    assert dict(h.planner.stats())["lookups"] == lookups
    assert s.loads == []
    h.run()
    h.assert_idle()


# ---- de-duplication ---------------------------------------------------------------------------


def test_eager_duplicate_store_skipped(model: Path) -> None:
    h = SchedHarness(model)
    prompt, (_,) = store_prompt(h, 2)
    free = h.planner.num_free_blocks
    # The same prompt again, computed on new GPU blocks (vLLM's prefix cache dropped):
    # the CPU copy is loaded, and nothing is stored a second time.
    h.evict_gpu_prefix_cache()
    _, steps = h.serve(prompt)
    assert sum(len(s.loaded_gpu) for s in steps) == 2
    assert stores(steps) == []
    # ... nor when vLLM's GPU prefix cache serves it.
    _, steps = h.serve(prompt)
    assert stores(steps) == []
    assert h.planner.num_free_blocks == free
    h.assert_idle()


def test_eager_in_flight_store_dedup_across_steps(model: Path) -> None:
    h = SchedHarness(model)
    h.hold()
    prompt = h.prompt(2)
    first = h.add(prompt, max_tokens=3)
    h.step()  # prefill
    s = h.step()  # the two computed blocks are stored; the copy stays in flight
    assert s.store is not None
    assert s.store.gpu == h.gpu_blocks(first.request_id)[:2]
    free = h.planner.num_free_blocks

    # A second request with the same prefix hits vLLM's GPU prefix cache on the very
    # blocks being copied: they must not be offloaded again.
    copied = s.store.gpu
    second = h.add(prompt, max_tokens=3)
    steps = [h.step() for _ in range(3)]
    assert h.gpu_blocks(second.request_id)[:2] == copied
    assert all(s.store is None for s in steps)
    assert h.planner.num_free_blocks == free
    assert h.planner.has_work_in_flight()

    h.release()
    h.run()
    assert not h.planner.has_work_in_flight()
    h.assert_idle()


def test_lazy_duplicate_store_skipped(model: Path) -> None:
    h = SchedHarness(model, num_gpu_blocks=8, lazy=True)
    prompt = h.prompt(2)
    _, steps = h.serve(prompt)
    assert len(stores(steps)) == 1
    free = h.planner.num_free_blocks
    # The same hashes on fresh GPU blocks (loaded from CPU, then freed again): the free
    # queue walk must see they are on CPU already.
    h.evict_gpu_prefix_cache()
    _, steps = h.serve(prompt)
    assert any(s.loads for s in steps)
    assert stores(steps) == []
    for _ in range(3):
        assert h.step().store is None
    assert h.planner.num_free_blocks == free
    h.assert_idle()


# ---- eviction ---------------------------------------------------------------------------------


def test_lru_eviction_order(model: Path) -> None:
    # Upstream's CPU pool of 5 blocks holds 4 (one is Simple's null block); kvoffload has
    # no null block. kvoffload evicts with CLOCK (see test_touched_blocks_survive_eviction):
    # blocks used in the order they were stored go in that order, as with LRU.
    h = SchedHarness(model, num_cpu_blocks=4)
    a, _ = store_prompt(h, 2)
    b, _ = store_prompt(h, 2)
    assert h.stored_blocks(a) == [True, True]
    assert h.stored_blocks(b) == [True, True]
    c, (store,) = store_prompt(h, 2)
    assert len(store.cpu) == 2
    assert h.stored_blocks(a) == [False, False]
    assert h.stored_blocks(b) == [True, True]
    assert h.stored_blocks(c) == [True, True]


def test_touched_blocks_survive_eviction(model: Path) -> None:
    # Intended difference: kvoffload evicts with CLOCK (second chance), not an exact LRU
    # list. A block used since the clock hand last passed it is spared; blocks stored and
    # never used since are taken in hand order. Upstream touches a's blocks right after
    # a and b are stored, before any eviction: every block is then "used since the hand
    # passed" and CLOCK takes a first, where LRU takes b. Here an eviction first moves
    # the hand past the blocks (clearing their use bits), then b is touched: CLOCK and
    # LRU agree that the untouched e goes before the touched b.
    h = SchedHarness(model, num_cpu_blocks=6)
    a, _ = store_prompt(h, 2)
    b, _ = store_prompt(h, 2)
    e, _ = store_prompt(h, 2)
    c, _ = store_prompt(h, 1)  # one eviction: the oldest block, a[0]
    assert h.stored_blocks(c) == [True]

    # Touch b: a new request hits b's blocks on CPU and loads them.
    h.evict_gpu_prefix_cache()
    _, steps = h.serve(b)
    assert sum(len(s.loaded_gpu) for s in steps) == 2

    d, (store,) = store_prompt(h, 2)  # two more evictions
    assert len(store.cpu) == 2
    assert h.stored_blocks(b) == [True, True], "the touched blocks must survive"
    assert h.stored_blocks(a) == [False, False]
    assert h.stored_blocks(e)[0] is False, "the untouched block goes first"
    assert h.stored_blocks(d) == [True, True]


# ---- finishing while copies are in flight ----------------------------------------------------


def test_preemption_no_cpu_block_leak(model: Path) -> None:
    h = SchedHarness(model, num_cpu_blocks=4)
    prompt, (store,) = store_prompt(h, 2)
    h.evict_gpu_prefix_cache()
    h.hold()
    req = h.add(prompt)
    s = h.step()
    (load,) = s.loads
    assert load.cpu == store.cpu
    # The request goes away while its load is in flight: vLLM keeps its GPU blocks until
    # the load is reported, kvoffload keeps its CPU blocks pinned until then.
    h.abort(req.request_id)
    assert all(h.gpu_pool.blocks[b].ref_cnt > 0 for b in load.gpu)
    h.step()
    assert h.planner.num_requests == 1
    h.release()
    h.run()
    h.assert_idle()
    # No CPU block stayed pinned: a reset frees every unpinned block at once (a pinned
    # one would wait for its pin), so the whole pool is free again. (Upstream fills the
    # pool with new prompts instead; kvoffload's segmented LRU keeps the loaded prompt
    # over blocks never used again, which would not prove the same thing.)
    assert h.connector.reset_cache() is True
    assert h.planner.num_free_blocks == h.planner.num_cpu_blocks
    x, _ = store_prompt(h, 2)
    y, _ = store_prompt(h, 2)
    assert h.stored_blocks(x) == [True, True]
    assert h.stored_blocks(y) == [True, True]


def test_eager_store_preemption_cleanup(model: Path) -> None:
    h = SchedHarness(model)
    h.hold()
    prompt = h.prompt(2)
    req = h.add(prompt)
    s = h.step()  # prefill; the request finishes and its blocks are flushed
    assert req.request_id in s.finished
    s = h.step()
    assert s.store is not None
    assert s.store.req_ids == [req.request_id]
    gpu = s.store.gpu
    # Finished while the store is in flight: both sides keep their state until it is done.
    assert h.planner.num_requests == 1
    assert all(h.gpu_pool.blocks[b].ref_cnt > 0 for b in gpu)
    assert req.request_id in h.scheduler.requests
    h.release()
    h.step()
    assert h.planner.num_requests == 0
    assert req.request_id not in h.scheduler.requests
    h.run()
    h.assert_idle()


def test_inflight_finish_deferred_cleanup(model: Path) -> None:
    h = SchedHarness(model)
    prompt, _ = store_prompt(h, 2)
    h.evict_gpu_prefix_cache()
    h.hold()
    req = h.add(prompt)
    (load,) = h.step().loads
    assert load.valid
    h.abort(req.request_id)
    # Clean-up waits for the load: the request is still known to both sides.
    for _ in range(2):
        h.step()
        assert h.planner.num_requests == 1
        assert req.request_id in h.scheduler.requests
    h.release()
    s = h.step()
    assert h.planner.num_requests == 0
    assert req.request_id not in h.scheduler.requests
    assert s.loads == []
    h.run()
    h.assert_idle()


# ---- block tables -----------------------------------------------------------------------------


def test_multi_group_null_blocks_skipped(model: Path) -> None:
    # Null GPU blocks appear in real block tables only in sliding-window groups: blocks
    # that left the window are freed and replaced by vLLM's null block. Upstream puts a
    # null block into a full-attention table by hand, which a real scheduler never does;
    # here a model whose only KV-cache group is a 32-token sliding window (as with all
    # layers windowed) is prefilled in 64-token chunks, so the first chunk's first two
    # blocks leave the window before they are confirmed.
    from sched_harness import sliding_window

    h = SchedHarness(
        model,
        num_gpu_blocks=32,
        groups=[(["model.layers.0.self_attn.attn"], sliding_window(2 * BS))],
    )
    null = h.gpu_pool.null_block.block_id
    req = h.add(h.prompt(6), max_tokens=2)
    # The request's table as vLLM holds it when the step's stores are chosen (after the
    # step's allocation freed what left the window).
    tables: list[list[int]] = []
    build = h.connector.build_connector_meta

    def snapshot(scheduler_output: Any) -> Any:
        tables.append(list(h.scheduler.kv_cache_manager.get_block_ids(req.request_id)[0]))
        return build(scheduler_output)

    h.connector.build_connector_meta = snapshot
    stored = []
    while h.scheduler.has_requests():
        s = h.step()
        assert null not in s.stored_gpu
        assert null not in s.loaded_gpu
        # Every block a store reads is still the request's when the store is chosen.
        stale = [b for b in s.stored_gpu if b not in tables[-1]]
        assert stale == [], f"stores blocks vLLM freed from the window: {stale}, {tables[-1]}"
        stored += s.stored_gpu
    # Blocks 2..5 were in the window when confirmed (0 and 1 left it in the chunk that
    # confirmed them).
    assert len(stored) == 4


def test_chunked_prefill_reads_live_block_ids(model: Path) -> None:
    h = SchedHarness(model, max_num_batched_tokens=2 * BS)
    req = h.add(h.prompt(4))
    rid = req.request_id
    h.step()  # tokens 0..31
    s2 = h.step()  # tokens 32..63; blocks 0 and 1 are confirmed
    table = h.gpu_blocks(rid)
    assert s2.store is not None
    assert s2.store.gpu == table[:2]
    s3 = h.step()  # the last token; blocks 2 and 3 are confirmed
    assert s3.store is not None
    assert s3.store.gpu == table[2:4]
    h.run()
    h.assert_idle()


def test_partial_gpu_prefix_plus_cpu_load(model: Path) -> None:
    h = SchedHarness(model)
    prompt, chunks = store_prompt(h, 6)
    stored_cpu = [b for st in chunks for b in st.cpu]
    assert len(stored_cpu) == 6
    # Leave only blocks 0 and 1 in vLLM's GPU prefix cache: a 2-block prompt with the
    # same start loads them, then stays cached.
    h.evict_gpu_prefix_cache()
    h.serve(prompt[: 2 * BS + 1])

    req = h.add(prompt)
    rid = req.request_id
    s = h.step()
    # GPU hit: blocks 0-1; CPU hit: blocks 2-5 (the last token is recomputed).
    assert s.lookups[rid] == (4 * BS, True)
    assert s.accepted[rid] == 4 * BS
    (load,) = s.loads
    table = h.gpu_blocks(rid)
    # Upstream accepts only half of the CPU hit by hand; vLLM's scheduler accepts all of
    # it, so the load covers table positions 2-5, never the GPU-cached 0-1.
    assert load.gpu == table[2:6]
    assert load.cpu == stored_cpu[2:6]
    h.run()
    h.assert_idle()


def test_toctou_cpu_hit_evicted_between_phases_no_crash(model: Path) -> None:
    # The hit found for b while it waits for GPU memory must survive the stores of c and
    # d that run meanwhile and need the whole 4-block CPU pool.
    h = SchedHarness(model, num_cpu_blocks=4, num_gpu_blocks=8, max_num_batched_tokens=128)
    a, (store_a,) = store_prompt(h, 2)
    h.evict_gpu_prefix_cache()
    c = h.add(h.prompt(2), max_tokens=4)
    d = h.add(h.prompt(2), max_tokens=4)
    b = h.add(a)
    s = h.step()
    assert set(s.scheduled) == {c.request_id, d.request_id}
    assert s.lookups[b.request_id] == (2 * BS, True)
    assert b.request_id not in s.accepted  # no GPU room yet: b waits, its hit pinned
    s = h.step()
    # c's and d's 4 blocks want the pool; a's 2 are pinned by b's hit.
    assert s.store is not None
    assert len(s.store.cpu) == 2
    assert not set(s.store.cpu) & set(store_a.cpu)
    steps = h.run(until=lambda: b.request_id in h.steps[-1].accepted)
    (load,) = steps[-1].loads
    assert load.req_id == b.request_id
    assert load.valid
    assert load.cpu == store_a.cpu
    assert len(load.gpu) == 2
    h.run()
    h.assert_idle()


# ---- reset ------------------------------------------------------------------------------------


def reset(h: SchedHarness) -> bool:
    """vLLM's ``reset_prefix_cache(reset_connector=True)`` (what ``LLM.reset_prefix_cache``
    asks of the engine core)."""
    return bool(h.scheduler.reset_prefix_cache(reset_connector=True))


def test_reset_pending_eager_stores(model: Path) -> None:
    # Intended difference: Simple's reset() answers False while a store is in flight and
    # succeeds once it completed. kvoffload's reset succeeds at once: the store finishes
    # but its blocks are never published, and vLLM keeps the GPU blocks the copy reads
    # (the finished request's delayed free) until the store is reported.
    h = SchedHarness(model)
    h.hold()
    prompt = h.prompt(2)
    h.add(prompt)
    h.step()
    s = h.step()
    assert s.store is not None
    gpu = s.store.gpu
    assert all(h.gpu_pool.blocks[b].ref_cnt > 0 for b in gpu)
    assert h.connector.reset_cache() is True
    assert all(h.gpu_pool.blocks[b].ref_cnt > 0 for b in gpu)
    assert not reset(h)  # vLLM's GPU cache cannot reset while the copy holds blocks
    h.release()
    h.run()
    h.assert_idle()
    assert reset(h)
    assert h.cpu_hit_tokens(prompt) == 0


def test_reset_pending_lazy_stores(model: Path) -> None:
    # Intended difference as in test_reset_pending_eager_stores: kvoffload's reset
    # succeeds at once; the GPU blocks a lazy store reads stay held until it is reported.
    h = SchedHarness(model, num_gpu_blocks=8, lazy=True)
    h.hold()
    prompt = h.prompt(2)
    h.add(prompt)
    steps = h.run(until=lambda: bool(h.steps) and h.steps[-1].store is not None)
    gpu = steps[-1].store.gpu
    assert len(gpu) == 2
    assert all(h.gpu_pool.blocks[b].ref_cnt > 0 for b in gpu)
    assert h.connector.reset_cache() is True
    assert all(h.gpu_pool.blocks[b].ref_cnt > 0 for b in gpu)
    h.release()
    s = h.step()
    assert all(h.gpu_pool.blocks[b].ref_cnt == 0 for b in gpu)
    assert s.store is None
    assert h.cpu_hit_tokens(prompt) == 0
    # The blocks vLLM still caches are offloaded again: their copy from before the reset
    # is gone. (Upstream also checks that Simple's free-queue cursor is cleared, which has
    # no effect here that a test could see: the released blocks are back at the queue's
    # end either way.)
    s = h.step()
    assert s.store is not None
    assert sorted(s.store.gpu) == sorted(gpu)
    h.run()
    h.assert_idle()
    assert h.cpu_hit_tokens(prompt) == 2 * BS


def test_reset_pending_loads(model: Path) -> None:
    # Intended difference as in test_reset_pending_eager_stores: kvoffload's reset
    # succeeds at once; the load in flight finishes and vLLM keeps its GPU blocks until
    # it is reported.
    h = SchedHarness(model)
    prompt, _ = store_prompt(h, 2)
    h.evict_gpu_prefix_cache()
    h.hold()
    h.add(prompt)
    (load,) = h.step().loads
    assert h.connector.reset_cache() is True
    assert all(h.gpu_pool.blocks[b].ref_cnt > 0 for b in load.gpu)
    assert h.cpu_hit_tokens(prompt) == 0
    h.release()
    h.run()
    h.assert_idle()


# ---- context parallelism ----------------------------------------------------------------------


CP_SIZES = [
    pytest.param(2, 1, id="dcp2"),
    pytest.param(1, 2, id="pcp2"),
    pytest.param(2, 2, id="dcp2-pcp2"),
]


@pytest.mark.parametrize(("dcp", "pcp"), CP_SIZES)
def test_cp_block_size_scaling(model: Path, dcp: int, pcp: int) -> None:
    # vLLM 0.32 scales the scheduler's block (what it hashes) by DCP only: PCP ranks
    # split a prefill, not the KV of a block.
    h = SchedHarness(model, dcp=dcp, pcp=pcp)
    vbs = BS * dcp
    assert h.block_size == vbs
    prompt, (store,) = store_prompt(h, 1)
    # One stored block per vLLM block, and a hit counted in whole vLLM blocks.
    assert len(store.cpu) == 1
    h.evict_gpu_prefix_cache()
    assert h.cpu_hit_tokens(prompt) == vbs


@pytest.mark.parametrize(("dcp", "pcp"), CP_SIZES[:2])
def test_cp_eager_store_and_load_roundtrip(model: Path, dcp: int, pcp: int) -> None:
    h = SchedHarness(model, dcp=dcp, pcp=pcp)
    vbs = BS * dcp
    prompt, (store,) = store_prompt(h, 2)
    assert len(store.gpu) == 2
    h.evict_gpu_prefix_cache()
    req = h.add(prompt)
    s = h.step()
    assert s.lookups[req.request_id] == (2 * vbs, True)
    (load,) = s.loads
    assert load.valid
    assert len(load.gpu) == 2
    assert load.cpu == store.cpu
    h.run()
    h.assert_idle()


@pytest.mark.parametrize(("dcp", "pcp"), CP_SIZES)
def test_cp_effective_block_size_store_and_load(model: Path, dcp: int, pcp: int) -> None:
    h = SchedHarness(model, dcp=dcp, pcp=pcp, max_num_batched_tokens=128)
    vbs = BS * dcp
    # A prompt computed in chunks of one vLLM block: one block stored per chunk.
    h.set_token_budget(vbs)
    prompt = h.prompt(2)
    _, steps = h.serve(prompt)
    assert [len(s.cpu) for s in stores(steps)] == [1, 1]
    h.set_token_budget(128)
    # Its first block in vLLM's GPU cache, the second on CPU only: one block loaded.
    h.evict_gpu_prefix_cache()
    h.serve(prompt[: vbs + 1])
    req = h.add(prompt)
    s = h.step()
    assert s.lookups[req.request_id] == (vbs, True)
    (load,) = s.loads
    assert load.valid
    assert load.gpu == [h.gpu_blocks(req.request_id)[1]]
    h.run()
    h.assert_idle()


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_cp_lazy_target_blocks_scaling(model: Path, cp: int) -> None:
    # Lazy mode keeps two steps' worth of tokens (2 x max_num_batched_tokens = 128)
    # offloaded ahead of eviction: 8 vLLM blocks, 8 / cp when each covers 16 x cp tokens.
    # Four 3-block prompts fill the 12-block GPU pool in one step and finish; their
    # twelve cached blocks are the whole free queue when the next step walks it.
    h = SchedHarness(model, dcp=cp, num_gpu_blocks=13, lazy=True)
    h.set_token_budget(12 * h.block_size)
    for _ in range(4):
        h.add(h.prompt(3, extra_tokens=0))
    assert len(h.step().finished) == 4
    s = h.step()
    assert s.store is not None
    assert len(s.store.gpu) == 8 // cp
