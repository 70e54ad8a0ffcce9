"""The shared Redis Cluster tier end to end: engines in separate processes share one
3-master cluster on loopback (``scripts/redis_cluster.sh``, one for the module).

Engine A (its own process) computes a set of prompts with ``remote_url`` set and writes
their blocks behind; engines in other processes, with empty CPU pools, then serve those
prefixes from the cluster, token-identical to vLLM without kvoffload. A wrong namespace
misses, corrupted values are recomputed, and masters killed between two batches cost
misses, never a hang. Tests run in file order: corruption, then killed masters, last.
Every prompt has its own long prefix, so each one that is not local needs the cluster.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest

from vllm_harness import run_script

REPO = Path(__file__).resolve().parent.parent
CLUSTER = REPO / "scripts" / "redis_cluster.sh"
NAMESPACE = "kvoffload-e2e"

WRITER = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    from vllm_harness import (
        engine, generate, offload_config, shared_prefix_prompts, worker_connector,
    )

    prompts = shared_prefix_prompts(4, 4)
    with engine({model!r}, **{engine_kw!r}) as llm:
        reference = generate(llm, prompts)
    cfg = offload_config(remote_url={url!r}, remote_namespace={ns!r})
    with engine({model!r}, cfg, **{engine_kw!r}) as llm:
        outputs = generate(llm, prompts)
        tier = worker_connector().offload_worker.tier
        queued = dict(tier.stats())["remote_writes_queued"] if tier is not None else 0
    print("RESULT", json.dumps(dict(reference=reference, outputs=outputs, queued=queued)))
    """
)

#: Each phase is a fresh engine with an empty CPU pool: ``ns`` (namespace), ``extra``
#: (more config keys), ``plain`` (vLLM without kvoffload: the reference), ``kill`` (pid
#: files: those masters are killed after the first half of the prompts is served),
#: ``events`` (KV events on: the CPU hashes the connector announced are counted).
READER = textwrap.dedent(
    """
    import json, os, signal, sys
    sys.path.insert(0, {tests!r})
    from vllm_harness import (
        engine, generate, offload_config, planner_stats, scheduler_connector,
        shared_prefix_prompts, worker_connector,
    )

    prompts = shared_prefix_prompts(4, 4)
    results = {{}}
    for phase in json.loads({phases!r}):
        if phase.get("plain"):
            with engine({model!r}) as llm:
                results[phase["name"]] = dict(outputs=generate(llm, prompts))
            continue
        cfg = offload_config(
            remote_url={url!r}, remote_namespace=phase["ns"], **phase.get("extra", {{}})
        )
        kw = dict({engine_kw!r})
        if phase.get("events"):
            from vllm.config import KVEventsConfig

            kw["kv_events_config"] = KVEventsConfig(
                enable_kv_cache_events=True, publisher="null"
            )
        with engine({model!r}, cfg, **kw) as llm:
            if phase.get("kill"):
                outputs = generate(llm, prompts[:2])
                for pid_file in phase["kill"]:
                    with open(pid_file) as f:
                        os.kill(int(f.read().strip()), signal.SIGKILL)
                outputs += generate(llm, prompts[2:])
            else:
                outputs = generate(llm, prompts)
            stats = planner_stats(llm)
            tier = worker_connector().offload_worker.tier
            worker = dict(tier.stats()) if tier is not None else {{}}
            log = scheduler_connector(llm).offload_scheduler.event_log
            announced = log.num_resident if log is not None else None
            groups = scheduler_connector(llm).offload_scheduler.planner.num_groups
        results[phase["name"]] = dict(
            outputs=outputs, planner=stats, worker=worker, announced=announced, groups=groups
        )
    print("RESULT", json.dumps(results))
    """
)


def _cli(port: str, *args: str) -> str:
    return subprocess.run(
        ["redis-cli", "-h", "127.0.0.1", "-p", port, *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout


@pytest.fixture(scope="module")
def cluster() -> Any:
    # No skip without redis-server: scripts/setup.sh installs it, and a tier left untested
    # must not pass as tested.
    proc = subprocess.run(
        ["bash", str(CLUSTER), "start"], check=False, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"cannot start the cluster: {proc.stderr}"
    env = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    directory = env["REDIS_CLUSTER_DIR"]
    try:
        yield directory, env["REDIS_CLUSTER_URL"]
    finally:
        subprocess.run(["bash", str(CLUSTER), "stop", directory], check=False, timeout=120)


def _write(
    cluster: tuple[str, str], model: Path, ns: str, engine_kw: dict[str, Any]
) -> dict[str, Any]:
    """Engine A's run: the reference outputs (vLLM without kvoffload) and its own."""
    _, url = cluster
    tests = str(Path(__file__).parent)
    script = WRITER.format(tests=tests, model=str(model), url=url, ns=ns, engine_kw=engine_kw)
    result = run_script(script, {})
    assert result["outputs"] == result["reference"]
    assert result["queued"] > 0, "engine A wrote nothing behind"
    return result


@pytest.fixture(scope="module")
def written(cluster: tuple[str, str], tiny_model: Path) -> dict[str, Any]:
    return _write(cluster, tiny_model, NAMESPACE, {})


def _read(
    cluster: tuple[str, str],
    model: Path,
    phases: list[dict[str, Any]],
    engine_kw: dict[str, Any] | None = None,
) -> dict[str, Any]:
    _, url = cluster
    script = READER.format(
        tests=str(Path(__file__).parent),
        model=str(model),
        url=url,
        phases=json.dumps(phases),
        engine_kw=engine_kw or {},
    )
    return run_script(script, {})


def _check_served_from_cluster(
    r: dict[str, Any], reference: list[list[int]], *, groups: int
) -> None:
    """The "sync" and "async" phases of ``r`` (a planner of ``groups`` KV-cache groups)
    were served from the cluster, token-identical to ``reference``, and every fetched
    block is on the CPU tier like the ones the engine stored itself, announced with them
    (vLLM's hashes, for a KV-aware router)."""
    for name in ("sync", "async"):
        assert r[name]["groups"] == groups, name
        assert r[name]["outputs"] == reference, name
        planner = r[name]["planner"]
        assert planner["remote_hit_tokens"] > 0, (name, planner)
        assert planner["remote_failed_fetch_blocks"] == 0, (name, planner)
        assert r[name]["worker"]["remote_bytes_read"] > 0, (name, r[name]["worker"])
    sync = r["sync"]["planner"]
    assert r["sync"]["announced"] == sync["stored_blocks"] + sync["remote_fetched_blocks"]


def test_engines_share_prefixes_through_the_cluster(
    cluster: tuple[str, str], tiny_model: Path, written: dict[str, Any]
) -> None:
    """Engine B (another process, an empty CPU pool) serves the prefixes only engine A
    computed, token-identical to vLLM without kvoffload, with sync and async loads; under
    another namespace the same prompts miss."""
    phases = [
        {"name": "sync", "ns": NAMESPACE, "events": True},
        {"name": "async", "ns": NAMESPACE, "extra": {"load_mode": "async"}},
        {"name": "other", "ns": "another-deployment"},
    ]
    r = _read(cluster, tiny_model, phases)
    reference = written["reference"]
    _check_served_from_cluster(r, reference, groups=1)
    other = r["other"]
    assert other["outputs"] == reference
    assert other["planner"]["remote_probe_round_trips"] > 0
    assert other["planner"]["remote_hit_tokens"] == 0
    assert other["planner"]["remote_fetches"] == 0


def test_a_disk_in_front_of_the_cluster_falls_through_to_it_and_writes_both(
    cluster: tuple[str, str], tiny_model: Path, written: dict[str, Any], tmp_path: Path
) -> None:
    """The disk tier stacked on the cluster (``kv_offload_backend: "disk"`` and
    ``remote_url``): engine B's disk is empty, so its lookups continue to the cluster and
    serve engine A's prefixes token-identically; the blocks it stores itself go to its
    disk (and to the cluster: ``disk_in_front_of_a_remote_store`` in tier_disk.rs)."""
    disk = {
        "kv_offload_backend": "disk",
        "disk_path": str(tmp_path / "kv"),
        "disk_capacity_bytes": 48 * 2**20,
    }
    r = _read(cluster, tiny_model, [{"name": "disk", "ns": NAMESPACE, "extra": disk}])["disk"]
    assert r["outputs"] == written["reference"]
    assert r["planner"]["remote_hit_tokens"] > 0, r["planner"]
    assert r["planner"]["remote_failed_fetch_blocks"] == 0, r["planner"]
    assert r["worker"]["disk_writes"] > 0, r["worker"]


def test_other_weights_under_the_same_name_never_share_blocks(
    cluster: tuple[str, str], tiny_model: Path, tmp_path: Path
) -> None:
    """One model directory, written by engine A; a fresh engine on the same directory
    shares its blocks. Then the directory's weights are replaced by another random
    initialisation of the same shape (same name, config, tokenizer, so the same block
    hashes): the next engine finds none of A's blocks and computes its own outputs."""
    from test_weights import same_name_other_weights
    from tiny_model import build_tiny_llama

    ns = "kvoffload-weights"
    model = shutil.copytree(tiny_model, tmp_path / "served")
    written = _write(cluster, model, ns, {})
    same = _read(cluster, model, [{"name": "same", "ns": ns}])["same"]
    assert same["outputs"] == written["reference"]
    assert same["planner"]["remote_hit_tokens"] > 0, same["planner"]

    other = build_tiny_llama(tmp_path / "seed1", seed=1)
    shutil.rmtree(model)
    same_name_other_weights(tiny_model, other, model)
    r = _read(cluster, model, [{"name": "plain", "plain": True}, {"name": "updated", "ns": ns}])
    updated = r["updated"]
    assert updated["planner"]["remote_probe_round_trips"] > 0
    assert updated["planner"]["remote_hit_tokens"] == 0, updated["planner"]
    assert updated["planner"]["remote_fetches"] == 0, updated["planner"]
    assert updated["outputs"] == r["plain"]["outputs"]
    assert r["plain"]["outputs"] != written["reference"], "the weights change nothing"


#: The sliding-window + full-attention model's engine: two requests at a time, as in
#: ``tests/test_group_kinds.py``.
HYBRID_ENGINE_ARGS = {"max_num_seqs": 2}


def test_a_sliding_window_model_shares_prefixes_through_the_cluster(
    cluster: tuple[str, str], tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A model with a sliding-window and a full-attention group (vLLM's hybrid allocator
    on): engine B serves from the cluster what every group of engine A's prompts needs,
    token-identical to vLLM without kvoffload, with sync and async loads."""
    from tiny_model import build_sliding_window_llama

    path = tmp_path_factory.mktemp("hybrid") / "m"
    model = build_sliding_window_llama(tiny_model, path, ["sliding_attention", "full_attention"])
    ns = f"{NAMESPACE}-hybrid"
    written = _write(cluster, model, ns, HYBRID_ENGINE_ARGS)
    phases = [
        {"name": "sync", "ns": ns, "events": True},
        {"name": "async", "ns": ns, "extra": {"load_mode": "async"}},
    ]
    r = _read(cluster, model, phases, HYBRID_ENGINE_ARGS)
    _check_served_from_cluster(r, written["reference"], groups=2)


def _corrupt_all(directory: str) -> int:
    """Overwrites a run of payload bytes in every value of the namespace; returns how many."""
    n = 0
    for pid_file in Path(directory).glob("*.pid"):
        port = pid_file.stem
        for key in _cli(port, "--scan", "--pattern", f"{NAMESPACE}:*").split():
            _cli(port, "SETRANGE", key, "100", "kvoffload-corrupted")
            n += 1
    return n


def test_corrupted_values_are_recomputed(
    cluster: tuple[str, str], tiny_model: Path, written: dict[str, Any]
) -> None:
    """Every stored value corrupted: the checksums refuse them, the blocks are recomputed
    (token-identical), and no request is offered the failed fetch again."""
    directory, _ = cluster
    assert _corrupt_all(directory) > 0
    r = _read(cluster, tiny_model, [{"name": "corrupt", "ns": NAMESPACE}])["corrupt"]
    assert r["outputs"] == written["reference"]
    assert r["worker"]["remote_corrupt_values"] > 0, r["worker"]
    assert r["planner"]["remote_failed_fetch_blocks"] > 0, r["planner"]
    assert r["planner"]["remote_hit_tokens"] == 0, r["planner"]
    assert r["planner"]["remote_fetched_blocks"] == 0, r["planner"]
    assert r["planner"]["remote_fetches"] <= 4, "a failed fetch was offered again"


def test_killed_masters_cost_misses_not_a_hang(
    cluster: tuple[str, str], tiny_model: Path, written: dict[str, Any]
) -> None:
    """Two of the three masters killed while the engine runs (between its first two and
    last two prompts, whose prefixes are only in the cluster): the remaining requests
    finish (every call has a deadline) with the same tokens. Two, so that the last
    prompts' keys (spread over the masters by hash slot) surely meet a dead one."""
    directory, _ = cluster
    victims = [str(p) for p in sorted(Path(directory).glob("*.pid"))[:2]]
    r = _read(cluster, tiny_model, [{"name": "kill", "ns": NAMESPACE, "kill": victims}])
    assert r["kill"]["outputs"] == written["reference"]
    planner = r["kill"]["planner"]
    assert planner["remote_probe_round_trips"] > 0
    assert planner["remote_failed_keys"] > 0, planner
