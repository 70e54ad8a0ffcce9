"""The disk tier end to end with tensor_parallel_size=2 (the tiny model, vLLM's CPU
backend, one worker process per rank).

One script runs vLLM without kvoffload, then kvoffload with Simple's disk config, then a
small CPU pool in front of a small disk with KV events on, read back through vLLM's ZMQ
replay socket: each rank writes its own shard of a block, and the scheduler announces the
block on disk only once both ranks reported it there; a reset of the CPU tier
(``reset_connector``) announces the disk's blocks again.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path
from typing import Any

import pytest

from test_disk_tier import SMALL_CPU, _disk
from vllm_harness import TENSOR_PARALLEL_ENV, run_script

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    sys.path.insert(0, {tests!r})
    from vllm_harness import (
        cpu_hit_tokens, distinct_prompts, engine, free_port, generate, kv_events_zmq,
        replay_events, reset_gpu_prefix_cache, shared_prefix_prompts,
    )

    def disk_stats(worker):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return dict(get_kv_transfer_group().offload_worker.tier.stats())

    def event(e):
        parent = getattr(e, "parent_block_hash", None)
        return dict(
            kind=type(e).__name__, medium=getattr(e, "medium", None),
            hashes=[str(h) for h in getattr(e, "block_hashes", ())],
            tokens=list(getattr(e, "token_ids", ()) or ()),
            parent=None if parent is None else str(parent),
        )

    if __name__ == "__main__":
        prompts = shared_prefix_prompts(4, 4)
        args = dict(distributed_executor_backend="mp", tensor_parallel_size=2, max_num_seqs=2)
        with engine({model!r}, **args) as llm:
            results = dict(reference=generate(llm, prompts))
        for phase in json.loads({phases!r}):
            cfg = {{
                "kv_connector": "KVOffloadConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": phase["extra"],
            }}
            kw = dict(args)
            if phase.get("events"):
                from vllm.config import KVEventsConfig

                replay = free_port()
                kw["kv_events_config"] = KVEventsConfig(**kv_events_zmq(free_port(), replay))
            disk_dir = phase["disk_dir"]
            events = []
            with engine({model!r}, cfg, **kw) as llm:
                first = generate(llm, prompts)
                # More blocks than host memory holds: the prompts' blocks are read from disk.
                generate(llm, distinct_prompts(6, 640, seed=7))
                reset_gpu_prefix_cache(llm)
                again = generate(llm, prompts)
                hits = cpu_hit_tokens(llm)
                reset = {{}}
                if phase.get("reset"):
                    # The CPU tier emptied as well: its blocks still on disk are read again.
                    before = llm.collective_rpc(disk_stats)
                    reset_gpu_prefix_cache(llm, connector=True)
                    reset = dict(again=generate(llm, prompts), reads=[
                        b["disk_reads"] - a["disk_reads"]
                        for a, b in zip(before, llm.collective_rpc(disk_stats))
                    ])
                if phase.get("evict"):
                    # New blocks past the disk's capacity: it evicts older ones.
                    generate(llm, distinct_prompts(6, 640, seed=8))
                ranks = llm.collective_rpc(disk_stats)
                during = sorted(os.listdir(disk_dir))
                if phase.get("events"):
                    # The publisher sends from its own thread: let it send the last batch.
                    time.sleep(1)
                    events = [event(e) for e in replay_events(f"tcp://127.0.0.1:{{replay}}", 60)]
            results[phase["name"]] = dict(
                first=first, again=again, hits=hits, reset=reset, ranks=ranks, during=during,
                after=sorted(os.listdir(disk_dir)), events=events,
            )
        print("RESULT", json.dumps(results))
    """
)

#: The CPU-in-front phase's disk per rank: 64 slots of a rank's 64 KiB half of a tiny-model
#: block (and the index file: a 4 KiB header, 96 entries of 128 bytes), fewer than the
#: blocks the phase writes (the last prompts evict).
SMALL_DISK = 64 * 2**16 + 4096 + 96 * 128


@pytest.fixture(scope="module")
def runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    simple, cpu_disk = tmp_path_factory.mktemp("simple"), tmp_path_factory.mktemp("cpu_disk")
    phases = [
        {"name": "simple", "extra": _disk(simple), "disk_dir": str(simple)},
        {
            "name": "cpu_disk",
            "extra": _disk(cpu_disk, cpu_bytes_to_use=SMALL_CPU, disk_capacity_bytes=SMALL_DISK),
            "disk_dir": str(cpu_disk),
            "events": True,
            "reset": True,
            "evict": True,
        },
    ]
    script = SCRIPT.format(
        tests=str(Path(__file__).parent), model=str(tiny_model), phases=json.dumps(phases)
    )
    return run_script(script, TENSOR_PARALLEL_ENV)


pytestmark = pytest.mark.skipif(
    (os.cpu_count() or 1) < 2, reason="tensor parallel 2 binds two CPU cores"
)


@pytest.mark.parametrize("phase", ["simple", "cpu_disk"])
def test_tensor_parallel_ranks_each_serve_their_own_disk_files(
    runs: dict[str, Any], phase: str
) -> None:
    """Simple's disk config, and a CPU tier in front of the disk, with
    tensor_parallel_size=2: one file set per rank, each rank writes and reads its own
    shard, token-identical to the same engine without kvoffload, nothing left after a
    clean shutdown."""
    r = runs[phase]
    assert r["first"] == runs["reference"]
    assert r["again"] == runs["reference"]
    assert r["hits"] > 0
    assert r["during"] == ["kv.rank_0.idx", "kv.rank_1.idx"]  # data files: unnamed once open
    for rank in r["ranks"]:
        assert rank["disk_writes"] > 0, rank
        assert rank["disk_reads"] > 0, rank
    assert r["after"] == []


def test_tensor_parallel_disk_blocks_are_announced_after_their_cpu_event_and_removed(
    runs: dict[str, Any],
) -> None:
    """KV events with two ranks: a block is announced on disk (STORAGE) under the hash,
    tokens and parent of its CPU announcement, after it; no more blocks than either rank
    wrote; the disk's evictions are removed (STORAGE) and only announced blocks are."""
    r = runs["cpu_disk"]
    events = r["events"]
    cpu: dict[str, dict[str, Any]] = {}
    storage: list[str] = []
    removed: list[str] = []
    for e in events:
        if e["medium"] == "CPU" and e["kind"] == "BlockStored":
            (h,) = e["hashes"]
            cpu[h] = e
        elif e["medium"] == "STORAGE" and e["kind"] == "BlockStored":
            (h,) = e["hashes"]
            assert h in cpu, "announced on disk before (or without) its CPU announcement"
            assert (e["tokens"], e["parent"]) == (cpu[h]["tokens"], cpu[h]["parent"])
            assert len(e["tokens"]) == 128
            storage.append(h)
        elif e["medium"] == "STORAGE" and e["kind"] == "BlockRemoved":
            for h in e["hashes"]:
                assert h in storage, "removed before it was announced"
                removed.append(h)
    assert storage, "no block announced on disk: the ranks' reports were not both counted"
    assert len(set(storage)) <= min(rank["disk_writes"] for rank in r["ranks"]), r["ranks"]
    assert removed, ("the disk evicted nothing", r["ranks"])
    assert len(set(removed)) <= min(rank["disk_evictions"] for rank in r["ranks"]), r["ranks"]


def test_tensor_parallel_a_cpu_reset_announces_the_disk_again(runs: dict[str, Any]) -> None:
    """``reset_prefix_cache(reset_connector=True)``: the CPU tier's ``AllBlocksCleared``
    (no medium) is followed by the STORAGE announcements of every block on both ranks'
    disks, which then serve the prompts token-identically."""
    r = runs["cpu_disk"]
    assert r["reset"]["again"] == runs["reference"]
    assert all(n > 0 for n in r["reset"]["reads"]), r["reset"]["reads"]
    events = r["events"]
    # The last clear: the GPU pool's, or the connector's own where the pool's reset
    # failed (blocks in use) and only the CPU tier was reset; the disk's blocks follow
    # it either way.
    last = max(i for i, e in enumerate(events) if e["kind"] == "AllBlocksCleared")
    on_disk: set[str] = set()
    for e in events[:last]:
        if e["medium"] == "STORAGE":
            if e["kind"] == "BlockStored":
                on_disk.update(e["hashes"])
            else:
                on_disk.difference_update(e["hashes"])
    again = {
        h
        for e in events[last:]
        if e["medium"] == "STORAGE" and e["kind"] == "BlockStored"
        for h in e["hashes"]
    }
    assert on_disk, "nothing was announced on disk before the reset"
    assert on_disk <= again, len(on_disk - again)
