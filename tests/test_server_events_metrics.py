"""vLLM's OpenAI server with kvoffload: the KV events a router reads and the /metrics series.

One server per model (default multiprocess mode, loopback only): the tiny Llama, and the
same Llama with a sliding-window layer, whose two KV-cache groups vLLM's hybrid allocator
keeps. Each runs a workload that overflows the GPU cache and the CPU pool, then comes back
to an early prompt, so blocks are stored, loaded and evicted on CPU. The events are read
back through vLLM's own ZMQ replay socket (every batch since the start, so a subscriber
joining late misses nothing) and decoded as vLLM's ``KVEventBatch``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_harness import (
    BLOCK_TOKENS,
    KV_CACHE_BYTES,
    free_port,
    kv_events_zmq,
    offload_config,
    replay_events,
    shared_prefix_prompts,
)

STARTUP_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
#: Distinct 5-block prompts: more than the GPU cache (31 blocks) holds, and more than the
#: CPU pool (twice the GPU cache) holds, so both evict.
NUM_PROMPTS = 14


class Server:
    def __init__(self, model: Path, base: str, replay: str, log: Path) -> None:
        self.model = model
        self.base = base
        self.replay = replay
        self.log = log

    def complete(self, prompt: list[int], max_tokens: int = 4) -> dict[str, Any]:
        body = json.dumps(
            {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        ).encode()
        req = urllib.request.Request(
            f"{self.base}/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            return json.loads(r.read())

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.base}/metrics", timeout=REQUEST_TIMEOUT_S) as r:
            return r.read().decode()


def wait_healthy(proc: subprocess.Popen[bytes], base: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    pytest.fail(f"server not healthy in {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stops the server and the engine processes it started (its own process group)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(STOP_TIMEOUT_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # engine processes left behind, if any


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(None, id="dense"),
        pytest.param(["sliding_attention", "full_attention"], id="sliding+full"),
    ],
)
def server(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, request: Any
) -> Iterator[Server]:
    """The server on the tiny Llama, or on the same Llama with a sliding-window layer
    (vLLM's hybrid allocator on: two KV-cache groups, events per group)."""
    from tiny_model import build_sliding_window_llama

    model = tiny_model
    if request.param is not None:
        path = tmp_path_factory.mktemp("sliding") / "m"
        model = build_sliding_window_llama(tiny_model, path, request.param)
    port, events_port, replay_port = free_port(), free_port(), free_port()
    kv_transfer = offload_config(cpu_bytes_to_use=2 * KV_CACHE_BYTES)
    kv_events = kv_events_zmq(events_port, replay_port)
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--enable-prefix-caching",
        "--max-model-len",
        "2048",
        "--kv-cache-memory-bytes",
        str(KV_CACHE_BYTES),
        "--seed",
        "0",
        "--kv-transfer-config",
        json.dumps(kv_transfer),
        "--kv-events-config",
        json.dumps(kv_events),
    ]
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's default: multiprocess
    log = tmp_path_factory.mktemp("server") / "server.log"
    base = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            wait_healthy(proc, base, log)
            srv = Server(model, base, f"tcp://127.0.0.1:{replay_port}", log)
            prompts = shared_prefix_prompts(
                NUM_PROMPTS, NUM_PROMPTS, system_tokens=5 * BLOCK_TOKENS, tail_tokens=8
            )
            for p in prompts:
                srv.complete(p)
            # An early prompt: gone from the GPU cache, still on CPU.
            srv.complete(prompts[NUM_PROMPTS // 3])
            yield srv
        finally:
            stop(proc)


def test_cpu_events_name_blocks_vllm_published_for_the_gpu(server: Server) -> None:
    events = replay_events(server.replay, REQUEST_TIMEOUT_S)
    gpu: dict[tuple[int, Any], list[int]] = {}
    gpu_kinds: dict[int, str] = {}
    cpu_stored: list[Any] = []
    cpu_removed: list[Any] = []
    for e in events:
        medium = getattr(e, "medium", None)
        if type(e).__name__ == "BlockStored":
            if medium == "GPU":
                bs = e.block_size
                gpu_kinds[e.group_idx] = e.kv_cache_spec_kind
                for i, h in enumerate(e.block_hashes):
                    gpu[(e.group_idx, h)] = e.token_ids[i * bs : (i + 1) * bs]
            elif medium == "CPU":
                cpu_stored.append(e)
        elif type(e).__name__ == "BlockRemoved" and medium == "CPU":
            cpu_removed.append(e)
    assert gpu, "vLLM published no GPU block"
    assert cpu_stored, "kvoffload published no CPU block"
    assert cpu_removed, "the CPU pool evicted nothing"
    # One token block has one hash in every group. vLLM publishes a sliding-window group's
    # blocks only while they are inside the window; kvoffload keeps the earlier ones too (a
    # prompt that diverges sooner still hits them), under the hash vLLM gave that block.
    by_hash = {h: tokens for (_, h), tokens in gpu.items()}
    stored: set[tuple[int, Any]] = set()
    for e in cpu_stored:
        kind = gpu_kinds[e.group_idx]
        assert e.kv_cache_spec_kind == kind
        assert e.block_size == BLOCK_TOKENS
        bs = e.block_size
        for i, h in enumerate(e.block_hashes):
            key = (e.group_idx, h)
            assert h in by_hash, f"CPU block {key!r} was never published for the GPU"
            if kind != "sliding_window":
                assert key in gpu, f"CPU block {key!r} was never published for its group"
            assert e.token_ids[i * bs : (i + 1) * bs] == by_hash[h]
            stored.add(key)
        if e.parent_block_hash is not None:
            assert e.parent_block_hash in by_hash
    # Every group of the model has blocks on CPU: a hybrid model's sliding-window group
    # too, under the group index and kind vLLM publishes it with.
    assert {g for g, _ in stored} == set(gpu_kinds)
    removed = {(e.group_idx, h) for e in cpu_removed for h in e.block_hashes}
    assert removed <= stored


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    total, found = 0.0, False
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", re.MULTILINE)
    for m in pattern.finditer(text):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
            found = True
    assert found, f"{name} {labels} is not on /metrics"
    return total


def test_metrics_show_offload_series(server: Server) -> None:
    # The engine reports the stats of a step with its output; the server's loggers may
    # record them after the response went out.
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    text = server.metrics()
    while (
        metric(text, "vllm:prompt_tokens_cached_by_source_total", source="host") == 0
        and time.monotonic() < deadline
    ):
        time.sleep(0.5)
        text = server.metrics()
    capacity = metric(text, "vllm:kv_offload_cpu_blocks_capacity")
    assert capacity > 0
    assert 0 < metric(text, "vllm:kv_offload_cpu_blocks_used") <= capacity
    for name in (
        "vllm:kv_offload_lookups_total",
        "vllm:kv_offload_hit_tokens_total",
        "vllm:kv_offload_stored_blocks_total",
        "vllm:kv_offload_loaded_blocks_total",
        "vllm:kv_offload_stored_bytes_total",
        "vllm:kv_offload_loaded_bytes_total",
        "vllm:kv_offload_evicted_blocks_total",
        "vllm:kv_offload_store_seconds_count",
        "vllm:kv_offload_load_seconds_count",
    ):
        assert metric(text, name) > 0, name
    assert metric(text, "vllm:kv_offload_skipped_store_blocks_total", reason="no_space") >= 0
    assert metric(text, "vllm:kv_offload_failed_transfers_total", direction="store") == 0
    hits = metric(text, "vllm:kv_offload_hit_tokens_total")
    assert metric(text, "vllm:prompt_tokens_cached_by_source_total", source="host") == hits


def test_concurrent_completions_match_vllm_without_kvoffload(server: Server) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_harness import engine

    # 16 requests at once over 4 long shared prefixes: far more KV than the GPU cache holds,
    # so vLLM evicts and preempts while kvoffload stores and loads.
    prompts = shared_prefix_prompts(16, 4, system_tokens=5 * BLOCK_TOKENS, tail_tokens=8, seed=7)
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: server.complete(p, 16)["choices"][0]["text"], prompts))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    with engine(server.model) as llm:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
        expected = [o.outputs[0].text for o in outs]
    assert got == expected
