"""The disk tier end to end on real vLLM (the tiny model, vLLM's CPU backend).

One process runs the engines one after the other, as an operator restarting a server
would: Simple's disk config copied as is, a small CPU pool with and without the disk
behind it, a restart with ``disk_persist``, and injected disk faults. Outputs are compared
token for token with vLLM without kvoffload; disk files live in a temporary directory.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from vllm_harness import run_script

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    sys.path.insert(0, {tests!r})
    from vllm_harness import (
        cpu_hit_tokens, distinct_prompts, drain, engine, generate, planner_stats,
        reset_gpu_prefix_cache, scheduler_connector, shared_prefix_prompts, worker_connector,
    )

    # Keeps what the connector and vLLM's GPU block pool publish (KV events on).
    def spy_events(llm, into):
        def spy(take, name):
            def taken():
                got = list(take() or ())
                for e in got:
                    into.append(dict(
                        source=name, kind=type(e).__name__, medium=getattr(e, "medium", None),
                        hashes=[str(h) for h in getattr(e, "block_hashes", ())],
                        tokens=list(getattr(e, "token_ids", ()) or ()),
                        group=getattr(e, "group_idx", None),
                    ))
                return got
            return taken
        conn = scheduler_connector(llm)
        conn.take_events = spy(conn.take_events, "connector")
        manager = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
        manager.take_events = spy(manager.take_events, "gpu")

    prompts = shared_prefix_prompts(4, 4)
    # Enough distinct blocks to push the prompts' blocks out of a small CPU pool.
    flush = distinct_prompts(6, 640, seed=7)
    disk_dir = {disk_dir!r}
    results = {{}}
    with engine({model!r}, **{engine_kw!r}) as llm:
        results["reference"] = generate(llm, prompts)
    for phase in json.loads({phases!r}):
        cfg = {{
            "kv_connector": "KVOffloadConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": phase["extra"],
        }}
        kw = dict({engine_kw!r})
        events = []
        if phase.get("events"):
            from vllm.config import KVEventsConfig

            kw["kv_events_config"] = KVEventsConfig(
                enable_kv_cache_events=True, publisher="null"
            )
        with engine({model!r}, cfg, **kw) as llm:
            if phase.get("events"):
                spy_events(llm, events)
            first = []
            if not phase.get("fresh"):
                first = generate(llm, prompts)
                generate(llm, flush)
                drain(llm)
                reset_gpu_prefix_cache(llm)
            again = generate(llm, prompts)
            hits = cpu_hit_tokens(llm)
            planner = planner_stats(llm)
            tier = worker_connector().offload_worker.tier
            worker = dict(tier.stats()) if tier is not None else {{}}
            during = sorted(os.listdir(disk_dir))
        results[phase["name"]] = dict(
            first=first, again=again, hits=hits, planner=planner, worker=worker,
            during=during, after=sorted(os.listdir(disk_dir)), events=events,
        )
    print("RESULT", json.dumps(results))
    """
)

DISK_BYTES = 48 * 2**20
#: Eight blocks of the tiny model (128 KiB each): far less than the prompts' blocks.
SMALL_CPU = 8 * 128 * 2**10


def _run(
    model: Path,
    disk_dir: Path,
    phases: list[dict[str, Any]],
    engine_kw: dict[str, Any] | None = None,
) -> dict[str, Any]:
    script = SCRIPT.format(
        tests=str(Path(__file__).parent),
        model=str(model),
        disk_dir=str(disk_dir),
        phases=json.dumps(phases),
        engine_kw=engine_kw or {},
    )
    return run_script(script, {})


def _disk(disk_dir: Path, **extra: Any) -> dict[str, Any]:
    """Simple's disk keys as its docs show them, plus ``extra``."""
    return {
        "kv_offload_backend": "disk",
        "disk_path": str(disk_dir / "kv"),
        "disk_capacity_bytes": DISK_BYTES,
        **extra,
    }


@pytest.fixture(scope="module")
def runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    disk_dir = tmp_path_factory.mktemp("disk")
    phases = [
        {"name": "simple", "extra": _disk(disk_dir), "events": True},
        {"name": "cpu_only", "extra": {"cpu_bytes_to_use": SMALL_CPU}},
        {"name": "cpu_disk", "extra": _disk(disk_dir, cpu_bytes_to_use=SMALL_CPU)},
        {"name": "persist_a", "extra": _disk(disk_dir, disk_persist=True)},
        {"name": "persist_b", "extra": _disk(disk_dir, disk_persist=True), "fresh": True},
        {
            "name": "faults",
            "extra": _disk(
                disk_dir,
                **{
                    # Every second and third read fails: the engine's second lookup
                    # reads as few as two blocks before a failure cuts its chain.
                    "kvoffload.faults": "disk_enospc_every=3,disk_read_eio_every=2,"
                    "disk_short_read_every=3"
                },
            ),
        },
        {
            "name": "corrupt",
            "extra": _disk(disk_dir, **{"kvoffload.faults": "disk_corrupt_read_every=1"}),
        },
    ]
    return _run(tiny_model, disk_dir, phases)


def test_simples_disk_config_works_unchanged(runs: dict[str, Any]) -> None:
    """Simple's keys as is: token-identical, blocks served from disk, host memory only
    stages, and a clean shutdown leaves no file behind."""
    r = runs["simple"]
    assert r["first"] == runs["reference"]
    assert r["again"] == runs["reference"]
    assert r["worker"]["disk_writes"] > 0, r["worker"]
    assert r["worker"]["disk_reads"] > 0, r["worker"]
    assert r["planner"]["remote_hit_tokens"] > 0, r["planner"]
    assert r["worker"]["disk_buffered_io"] == 0, "ext4 takes O_DIRECT"
    assert r["during"] == ["kv.rank_0", "kv.rank_0.idx"], r["during"]
    assert r["after"] == [], r["after"]


def test_disk_blocks_are_announced_with_medium_storage(runs: dict[str, Any]) -> None:
    """KV events on, Simple's disk config: the blocks the disk holds are announced with
    medium STORAGE under the hashes vLLM published for them on the GPU, with their
    tokens; the staging memory is not announced (as Simple announces its disk pool)."""
    events = runs["simple"]["events"]
    # vLLM's own announcement of each block on the GPU: hash -> its tokens.
    gpu = {
        h: e["tokens"][i * 128 : (i + 1) * 128]
        for e in events
        if e["source"] == "gpu" and e["kind"] == "BlockStored"
        for i, h in enumerate(e["hashes"])
    }
    mine = [e for e in events if e["source"] == "connector"]
    stored = [e for e in mine if e["kind"] == "BlockStored"]
    assert stored, "no disk block announced"
    assert {e["medium"] for e in mine} == {"STORAGE"}, {e["medium"] for e in mine}
    for e in stored:
        (h,) = e["hashes"]
        assert e["group"] == 0
        assert e["tokens"] == gpu[h], "another block's tokens, or a hash vLLM never published"


def test_a_sliding_window_model_is_served_from_disk(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A sliding-window + full-attention model (two KV-cache groups): the disk takes the
    lower-tier path every model takes, so a disk hit is what both groups can serve,
    token-identical to vLLM without kvoffload."""
    from tiny_model import build_sliding_window_llama

    path = tmp_path_factory.mktemp("hybrid") / "m"
    model = build_sliding_window_llama(tiny_model, path, ["sliding_attention", "full_attention"])
    disk_dir = tmp_path_factory.mktemp("disk-hybrid")
    # Two requests at a time, as in tests/test_group_kinds.py.
    r = _run(model, disk_dir, [{"name": "simple", "extra": _disk(disk_dir)}], {"max_num_seqs": 2})
    s = r["simple"]
    assert s["first"] == r["reference"]
    assert s["again"] == r["reference"]
    assert s["worker"]["disk_reads"] > 0, s["worker"]
    assert s["planner"]["remote_hit_tokens"] > 0, s["planner"]
    assert s["after"] == [], s["after"]


def test_disk_behind_a_small_cpu_pool_serves_more(runs: dict[str, Any]) -> None:
    cpu, disk = runs["cpu_only"], runs["cpu_disk"]
    assert cpu["again"] == runs["reference"]
    assert disk["again"] == runs["reference"]
    assert disk["hits"] >= cpu["hits"] + 4 * 128, (cpu["hits"], disk["hits"])
    assert disk["hits"] >= 2 * max(cpu["hits"], 1), (cpu["hits"], disk["hits"])


def test_restart_with_persist_serves_the_previous_engines_prefixes(runs: dict[str, Any]) -> None:
    a, b = runs["persist_a"], runs["persist_b"]
    assert a["after"] == ["kv.rank_0", "kv.rank_0.idx"], a["after"]
    assert b["again"] == runs["reference"]
    assert b["worker"]["disk_recovered_blocks"] > 0, b["worker"]
    assert b["planner"]["remote_hit_tokens"] > 0, b["planner"]
    assert b["hits"] > 0


def test_injected_disk_faults_cost_misses_never_wrong_tokens(runs: dict[str, Any]) -> None:
    r = runs["faults"]
    assert r["first"] == runs["reference"]
    assert r["again"] == runs["reference"]
    w = r["worker"]
    assert w["disk_errors_enospc"] > 0, w
    assert w["disk_errors_eio"] + w["disk_errors_short"] > 0, w
    c = runs["corrupt"]
    assert c["again"] == runs["reference"]
    assert c["worker"]["disk_checksum_failures"] > 0, c["worker"]
    assert c["planner"]["remote_fetched_blocks"] == 0, c["planner"]


KILLED_WRITER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    from vllm_harness import distinct_prompts, engine, generate, shared_prefix_prompts

    cfg = {{
        "kv_connector": "KVOffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {extra!r},
    }}
    with engine({model!r}, cfg) as llm:
        generate(llm, shared_prefix_prompts(4, 4))
        print("READY", flush=True)
        # Stores keep going when the parent kills the process; bounded, so the first
        # prompts' blocks are not evicted from the small disk before the kill.
        for seed in range(100, 106):
            generate(llm, distinct_prompts(4, 640, seed=seed))
        time.sleep(600)
    """
)


def test_sigkill_during_stores_then_restart_serves_nothing_half_written(
    tiny_model: Path, tmp_path: Path
) -> None:
    """An engine killed (SIGKILL) while it writes blocks, then a restart with
    ``disk_persist``: the files are recovered and whatever survived the kill is served
    only when intact, token-identical to vLLM without kvoffload."""
    import os
    import signal
    import subprocess
    import sys
    import time

    extra = _disk(tmp_path, disk_persist=True)
    script = KILLED_WRITER.format(
        tests=str(Path(__file__).parent), model=str(tiny_model), extra=extra
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=os.environ.copy(),
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 300
        for line in proc.stdout:
            if line.startswith("READY") or time.monotonic() > deadline:
                break
        time.sleep(1.0)  # mid-stream: the distinct prompts' blocks are being written
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kv.rank_0", "kv.rank_0.idx"]
    r = _run(tiny_model, tmp_path, [{"name": "after", "extra": extra, "fresh": True}])
    after = r["after"]
    assert after["again"] == r["reference"]
    assert after["worker"]["disk_recovered_blocks"] > 0, after["worker"]
    assert after["planner"]["remote_hit_tokens"] > 0, after["planner"]
