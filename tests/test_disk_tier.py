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

    # vLLM's prompt_tokens_cached_by_source, by source.
    def hit_sources(llm):
        return {{
            m.labels.get("source"): m.value for m in llm.get_metrics()
            if m.name.removesuffix("_total") == "vllm:prompt_tokens_cached_by_source"
        }}

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

    prompts = shared_prefix_prompts(**{prompt_kw!r})
    # Enough distinct blocks to push the prompts' blocks out of a small CPU pool.
    flush = distinct_prompts(6, 640, seed=7)
    disk_dir = {disk_dir!r}
    results = {{}}
    with engine({model!r}, **{engine_kw!r}) as llm:
        results["reference"] = generate(llm, prompts)
    for phase in json.loads({phases!r}):
        if phase.get("damage"):
            # Every block a previous engine left: 16 bytes of each 4 KiB page overwritten.
            data = os.path.join(disk_dir, "kv.rank_0")
            with open(data, "r+b") as f:
                for at in range(512, os.path.getsize(data), 4096):
                    f.seek(at)
                    f.write(os.urandom(16))
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
            sources = hit_sources(llm)
            repeat = {{}}
            if phase.get("repeat"):
                # One prompt alone, twice: its blocks come from disk or CPU the first
                # time, and are on CPU the second.
                drain(llm)
                for _ in range(2):
                    reset_gpu_prefix_cache(llm)
                    generate(llm, prompts[:1])
                    repeat = dict(before=repeat.get("after", sources), after=hit_sources(llm))
            # kvoffload's own series, summed over their labels.
            series = {{}}
            for m in llm.get_metrics():
                name = m.name.removesuffix("_total")
                if name.startswith("vllm:kv_offload_") and hasattr(m, "value"):
                    series[name] = series.get(name, 0) + m.value
            planner = planner_stats(llm)
            tier = worker_connector().offload_worker.tier
            worker = dict(tier.stats()) if tier is not None else {{}}
            during = sorted(os.listdir(disk_dir))
        results[phase["name"]] = dict(
            first=first, again=again, hits=hits, sources=sources, repeat=repeat, series=series,
            planner=planner, worker=worker, during=during, after=sorted(os.listdir(disk_dir)),
            events=events,
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
    prompt_kw: dict[str, Any] | None = None,
) -> dict[str, Any]:
    script = SCRIPT.format(
        prompt_kw=prompt_kw or {"n_requests": 4, "n_systems": 4},
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
        {"name": "cpu_disk", "extra": _disk(disk_dir, cpu_bytes_to_use=SMALL_CPU), "repeat": True},
        {"name": "persist_a", "extra": _disk(disk_dir, disk_persist=True)},
        {"name": "persist_b", "extra": _disk(disk_dir, disk_persist=True), "fresh": True},
        {
            "name": "damaged",
            "extra": _disk(disk_dir, disk_persist=True),
            "fresh": True,
            "damage": True,
        },
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
    # Without disk_persist the data file has no name once open: only the index is seen.
    assert r["during"] == ["kv.rank_0.idx"], r["during"]
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


def test_a_gated_deltanet_model_is_served_from_disk(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A Mamba-kind KV-cache group (Gated DeltaNet layers, vLLM's align mode): a disk hit
    loads the recurrent state at its boundary, read from disk, token-identical to vLLM
    without kvoffload."""
    from test_group_kinds import SSM_ENGINE_ARGS
    from tiny_model import build_tiny_qwen3_next

    path = tmp_path_factory.mktemp("gdn") / "m"
    model = build_tiny_qwen3_next(path, tiny_model, layer_types=("linear_attention",) * 2)
    disk_dir = tmp_path_factory.mktemp("disk-gdn")
    prompts = {"n_requests": 4, "n_systems": 4, "system_tokens": 1500}
    # The staging memory holds these few blocks: a restart empties it, so the second
    # engine's hits are read from disk.
    extra = _disk(disk_dir, disk_persist=True)
    phases = [{"name": "a", "extra": extra}, {"name": "b", "extra": extra, "fresh": True}]
    r = _run(model, disk_dir, phases, SSM_ENGINE_ARGS, prompts)
    assert r["a"]["first"] == r["reference"]
    assert r["a"]["again"] == r["reference"]
    b = r["b"]
    assert b["again"] == r["reference"]
    assert b["worker"]["disk_reads"] > 0, b["worker"]
    assert b["planner"]["remote_hit_tokens"] > 0, b["planner"]


def test_disk_behind_a_small_cpu_pool_serves_more(runs: dict[str, Any]) -> None:
    cpu, disk = runs["cpu_only"], runs["cpu_disk"]
    assert cpu["again"] == runs["reference"]
    assert disk["again"] == runs["reference"]
    assert disk["hits"] >= cpu["hits"] + 4 * 128, (cpu["hits"], disk["hits"])
    assert disk["hits"] >= 2 * max(cpu["hits"], 1), (cpu["hits"], disk["hits"])


def test_hits_are_counted_under_the_tier_that_served_them(runs: dict[str, Any]) -> None:
    """vLLM's ``prompt_tokens_cached_by_source``: with a CPU tier in front of the disk, a
    hit's tokens read from disk for it count as ``disk``, those still on CPU as ``host``;
    Simple's disk mode (host memory only stages the disk) counts every hit as ``disk``."""
    both = runs["cpu_disk"]
    src = both["sources"]
    # The CPU pool was flushed: every prompt's hit was read from disk for it.
    assert src.get("disk", 0) == both["hits"] > 0, src
    assert src.get("host", 0) == 0, src
    # A prompt served alone right after it was served: from CPU.
    again = both["repeat"]
    assert again["after"]["host"] > again["before"]["host"], again
    assert again["after"]["disk"] == again["before"]["disk"], again
    simple = runs["simple"]
    assert simple["sources"].get("disk", 0) == simple["hits"] > 0, simple["sources"]
    assert simple["sources"].get("host", 0) == 0, simple["sources"]


def test_the_disk_alone_below_the_cpu_reports_disk_series(runs: dict[str, Any]) -> None:
    """With no remote tier, the lower tier's counters are the disk's: reported as
    ``vllm:kv_offload_disk_*``, the remote tier's series stay at zero."""
    series = runs["simple"]["series"]
    assert series.get("vllm:kv_offload_disk_hit_tokens", 0) > 0, series
    assert series.get("vllm:kv_offload_disk_fetched_blocks", 0) > 0, series
    remote = {k: v for k, v in series.items() if k.startswith("vllm:kv_offload_remote_") and v}
    assert remote == {}, remote


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
    # The files themselves damaged under every block, then a restart: nothing served,
    # every block read counted.
    d = runs["damaged"]
    assert d["again"] == runs["reference"]
    assert d["worker"]["disk_recovered_blocks"] > 0, d["worker"]
    assert d["worker"]["disk_checksum_failures"] > 0, d["worker"]
    assert d["planner"]["remote_fetched_blocks"] == 0, d["planner"]
    # Every read I/O flips a byte in the middle of what it read: a block read alone is
    # lost, a run of blocks read with one I/O loses the block with the flip, and the
    # rest of the run (checked block by block) may be served.
    c = runs["corrupt"]
    assert c["again"] == runs["reference"]
    assert c["worker"]["disk_checksum_failures"] > 0, c["worker"]


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


def test_a_second_engine_on_the_same_disk_path_is_refused_at_start(
    model: Path, tmp_path: Path, rank_zero: None
) -> None:
    """Two engines' workers on one ``disk_path``: the second refuses to start, naming the
    path, and the first one's files are untouched; once it is gone the path is free."""
    from kvoffload._native import RemoteTierError
    from sched_harness import Rank, SchedHarness

    h = SchedHarness(model, extra=_disk(tmp_path, disk_capacity_bytes=2**20))
    first = Rank(h.scheduler.vllm_config, 1)
    try:
        with pytest.raises(RemoteTierError, match=r"kv\.rank_0\.idx is locked by another engine"):
            Rank(h.scheduler.vllm_config, 1)
        assert first.worker.tier is not None
    finally:
        first.shutdown()
    Rank(h.scheduler.vllm_config, 1).shutdown()
