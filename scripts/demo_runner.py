"""The demo's workloads and the engine run that measures them (imports vLLM lazily).

Two workloads, both seeded so every run sees the same token ids:

- ``chat``: users with long system prompts hold conversations. Each turn's prompt is the
  system prompt, the earlier questions and answers, and a new question; a user asks the next
  question as soon as the answer arrives. With vLLM's KV cache smaller than all users'
  conversations, a user's prefix has been evicted by the time the next question comes.
- ``unique``: prompts that share nothing, so there is nothing to reuse: what kvoffload
  costs when it cannot help.
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Workload:
    """What one run sends (the JSON stores these fields)."""

    name: str
    users: int
    turns: int
    system_tokens: int
    question_tokens: int
    output_tokens: int
    seed: int = 0

    @property
    def requests(self) -> int:
        return self.users * self.turns


@dataclass(frozen=True)
class EngineSpec:
    """How the engine is built; ``None`` transfer config means plain vLLM."""

    model: str
    tiny_cpu: bool
    max_model_len: int
    concurrency: int
    kv_cache_bytes: int


def offload_config(cpu_bytes: int, *, lazy: bool = False) -> dict[str, Any]:
    return {
        "kv_connector": "KVOffloadConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes, "lazy_offload": lazy},
    }


class _Conversations:
    """Token ids of every user's conversation; a turn's prompt grows with the answers."""

    def __init__(self, w: Workload, vocab: int) -> None:
        rng = random.Random(w.seed)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(3, vocab) for _ in range(n)]

        self.w = w
        # Turn 0 of the `unique` workload is all there is: its "system prompt" is the whole
        # prompt, different for every request.
        self.history = [tokens(w.system_tokens) for _ in range(w.users)]
        self.questions = [
            [tokens(w.question_tokens) for _ in range(w.turns)] for _ in range(w.users)
        ]

    def prompt(self, user: int, turn: int) -> list[int]:
        return self.history[user] + self.questions[user][turn]

    def answered(self, user: int, turn: int, answer: list[int]) -> None:
        self.history[user] = self.prompt(user, turn) + answer


def _counters(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if hasattr(m, "value"):
            out[m.name] = out.get(m.name, 0.0) + float(m.value)
    return out


def _engine(spec: EngineSpec, kv_transfer_config: dict[str, Any] | None) -> Any:
    from vllm import LLM

    kw: dict[str, Any] = {
        "model": spec.model,
        "enforce_eager": True,
        "enable_prefix_caching": True,
        "max_model_len": spec.max_model_len,
        "max_num_seqs": spec.concurrency,
        "kv_cache_memory_bytes": spec.kv_cache_bytes,
        "disable_log_stats": False,
        "seed": 0,
    }
    if spec.tiny_cpu:  # the locally built model: float32 on vLLM's CPU backend
        kw["dtype"] = "float32"
        kw["distributed_executor_backend"] = "uni"
    if kv_transfer_config is not None:
        kw["kv_transfer_config"] = kv_transfer_config
    return LLM(**kw)


def _shutdown(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

    ensure_kv_transfer_shutdown()


def _one_pass(
    engine: Any,
    workload: Workload,
    vocab: int,
    params: Any,
    *,
    concurrency: int,
    on_request_done: Callable[[], None],
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Sends every request of ``workload`` to ``engine`` and steps it until all finished;
    returns each request's record (prompt length, output, time to first token) by id, and
    the ids in submission order."""
    from vllm.inputs import TokensPrompt

    conv = _Conversations(workload, vocab)
    requests: dict[str, dict[str, Any]] = {}
    order: list[str] = []

    def submit(user: int, turn: int) -> None:
        rid = f"u{user}t{turn}"
        prompt = conv.prompt(user, turn)
        requests[rid] = {"user": user, "turn": turn, "prompt_tokens": len(prompt)}
        order.append(rid)
        engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)

    # Turn-major order, at most max_num_seqs requests in flight, one per user: by the time a
    # user asks again, the other users' turns have passed through the cache. Users join
    # one after another (a user's first question waits for the previous user's first
    # token) rather than all at the same instant.
    waiting = [(u, t) for t in range(workload.turns) for u in range(workload.users)]
    busy: set[int] = set()
    started: set[str] = set()

    def ready(u: int, t: int) -> bool:
        return u not in busy and (t > 0 or u == 0 or f"u{u - 1}t0" in started)

    def refill() -> None:
        while len(busy) < concurrency:
            nxt = next(((u, t) for u, t in waiting if ready(u, t)), None)
            if nxt is None:
                return
            waiting.remove(nxt)
            busy.add(nxt[0])
            submit(*nxt)

    refill()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids:
                started.add(out.request_id)
            if not out.finished:
                continue
            r = requests[out.request_id]
            answer = list(out.outputs[0].token_ids)
            r["output"] = answer
            r["ttft_s"] = float(out.metrics.first_token_latency)
            on_request_done()
            conv.answered(r["user"], r["turn"], answer)
            busy.discard(r["user"])
        refill()
    return requests, order


def run(
    spec: EngineSpec,
    kv_transfer_config: dict[str, Any] | None,
    workload: Workload,
    vocab: int,
    on_request_done: Callable[[], None] = lambda: None,
    *,
    warm: bool = False,
    extra: Callable[[Any], dict[str, Any]] | None = None,
    probe: Callable[[Any], Callable[[], dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """Runs ``workload`` on a fresh engine (shut down afterwards) and returns per-request
    time to first token and output tokens (ordered by user, then turn), wall and process
    CPU time, and the engine's token counters: prompt
    tokens served from vLLM's own prefix cache, from the connector, and recomputed.

    ``warm``: run the workload once first, then drop vLLM's own prefix cache, and measure
    the second pass (what a connector holds is all that is left of the first).
    ``extra``: called with the engine after the measured pass, before shutdown; what it
    returns is the result's ``extra``. ``probe``: called with the engine right before the
    measured pass; what it returns is called right after it, and its result is the
    result's ``probe``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=workload.output_tokens, ignore_eos=True)
    llm = _engine(spec, kv_transfer_config)
    try:
        engine = llm.llm_engine
        # First forward passes, kernel set-up and the first large activations, on a prompt
        # as long as a system prompt that shares no block with the workload (token 2 never
        # occurs in it): otherwise the first request of every run pays for them.
        llm.generate(
            [TokensPrompt(prompt_token_ids=[2] * workload.system_tokens)],
            SamplingParams(max_tokens=2, ignore_eos=True),
            use_tqdm=False,
        )
        if warm:
            _one_pass(
                engine, workload, vocab, params, concurrency=spec.concurrency,
                on_request_done=lambda: None,
            )  # fmt: skip
            llm.reset_prefix_cache()
        before = _counters(llm)
        read_probe = probe(llm) if probe is not None else None
        t0, c0 = time.perf_counter(), time.process_time()
        requests, order = _one_pass(
            engine, workload, vocab, params, concurrency=spec.concurrency,
            on_request_done=on_request_done,
        )  # fmt: skip
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        probed = read_probe() if read_probe is not None else None
        after = _counters(llm)
        cache = engine.vllm_config.cache_config
        blocks, block_size = int(cache.num_gpu_blocks), int(cache.block_size)
        more = extra(llm) if extra is not None else {}
    finally:
        _shutdown(llm)

    def delta(name: str) -> int:
        return int(after.get(name, 0.0) - before.get(name, 0.0))

    reqs = [
        requests[rid]
        for rid in sorted(order, key=lambda k: (requests[k]["user"], requests[k]["turn"]))
    ]
    prompt_tokens = sum(r["prompt_tokens"] for r in reqs)
    gpu_hits = delta("vllm:prefix_cache_hits")
    cpu_hits = delta("vllm:external_prefix_cache_hits")
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "kv_cache_blocks": blocks,
        "block_size": block_size,
        "prompt_tokens": prompt_tokens,
        "gpu_hit_tokens": gpu_hits,
        "cpu_hit_tokens": cpu_hits,
        "recomputed_tokens": prompt_tokens - gpu_hits - cpu_hits,
        "output_tokens": sum(len(r["output"]) for r in reqs),
        "ttft_s": [r["ttft_s"] for r in reqs],
        "outputs": [r["output"] for r in reqs],
        "extra": more,
        "probe": probed,
    }
