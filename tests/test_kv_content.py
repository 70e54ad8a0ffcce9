"""Every KV cell a forward pass reads holds the KV of its own request's tokens.

Randomised workloads (shared system prompts, arrivals, aborts, a GPU cache that preempts
and a CPU pool that evicts) run through vLLM's real schedulers: the synchronous
``Scheduler`` and the ``AsyncScheduler`` that vLLM uses by default on GPUs, where step
N+1 is scheduled before step N's output is processed (the engine core's batch queue of
two). kvoffload plans the copies; a fake worker follows kvoffload's worker contract and
tracks what every GPU and CPU block cell holds: the identity of the token prefix whose
KV it is (what a real KV depends on). It checks:

- each forward pass reads, for every scheduled request, cells holding its own prefix's
  identities, whether they came from vLLM's prefix cache, a CPU load or an earlier step;
- no copy overlaps a conflicting access while it is in flight (from the step that issues
  it to the step whose output reports it): a store reads GPU blocks that nothing
  writes and writes CPU blocks nothing reads; a load writes GPU blocks nothing else
  touches and reads CPU blocks no store writes.

The worker contract: a step's ``store_before_forward`` is copied first, then its loads
start (synchronous ones end before the forward pass) and its ``store`` starts; the
forward pass writes the scheduled tokens' cells, then reads; ``store_after_forward`` is
copied after it. Stores of requests vLLM preempted are waited for before the step's
copies (``handle_preemptions``). Asynchronous stores end after a random 0-4 further
steps, asynchronous loads after 0-2. Models: dense, and a sliding-window group beside a
full-attention one (vLLM's hybrid allocator), whose layers hold different KV for the same
tokens and read back only as far as their window. Where KV lives ("host": vLLM's CPU
backend; "gpu": anywhere else) decides the planner's step layout, as in the connector.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sched_harness import (
    SAMPLED_TOKEN,
    SchedHarness,
    block_ids,
    full_attention,
    runner_output,
    sliding_window,
)

BLOCK = 16


@dataclass
class Copy:
    kind: str  # "store" or "load"
    gpu: list[int]
    cpu: list[int]
    req_ids: frozenset[str]
    ends_at: int


@dataclass
class Tally:
    loaded: int = 0
    stored: int = 0
    preempted: int = 0
    aborted: int = 0
    finished: int = 0
    cells_read: int = 0


class ContentWorker:
    """kvoffload's workers as far as KV content goes, for one scheduler."""

    def __init__(self, h: SchedHarness, rng: random.Random, prompts: dict[str, list[int]]):
        self.h = h
        self.rng = rng
        self.prompts = prompts
        num_gpu = h.kv_cache_config.num_blocks
        #: Per KV-cache group: the sliding window in tokens, or None (full attention).
        self.windows = [
            getattr(g.kv_cache_spec, "sliding_window", None)
            for g in h.kv_cache_config.kv_cache_groups
        ]
        num_cpu = h.planner.num_cpu_blocks
        self.gpu: list[list[Any]] = [[None] * BLOCK for _ in range(num_gpu)]
        self.cpu: list[list[Any]] = [[None] * BLOCK for _ in range(num_cpu)]
        self.gpu_reads: Counter[int] = Counter()  # stores reading a GPU block
        self.gpu_writes: Counter[int] = Counter()  # loads writing a GPU block
        self.cpu_reads: Counter[int] = Counter()  # loads reading a CPU block
        self.cpu_writes: Counter[int] = Counter()  # stores writing a CPU block
        self.in_flight: dict[int, Copy] = {}
        #: Copies ended in the current step: its output reports them.
        self.done: list[int] = []
        #: Each request's block table per group, as vLLM's model runner keeps it.
        self.tables: dict[str, list[list[int]]] = {}
        self.ids: dict[str, list[int]] = {}
        self.step = 0
        self.tally = Tally()

    # ---- what a cell should hold ----------------------------------------------------------

    def cell(self, group: int, req_id: str, pos: int) -> tuple[int, int]:
        """What a group's cell for token ``pos`` of ``req_id`` holds: groups are different
        layers, so their KV differs for the same tokens."""
        return group, self.prefix_id(req_id, pos)

    def prefix_id(self, req_id: str, pos: int) -> int:
        ids = self.ids.setdefault(req_id, [])
        prompt = self.prompts[req_id]
        while len(ids) <= pos:
            p = len(ids)
            token = prompt[p] if p < len(prompt) else SAMPLED_TOKEN
            ids.append(hash((ids[-1] if ids else 0, token)))
        return ids[pos]

    # ---- copies ------------------------------------------------------------------------------

    def where(self, what: str) -> str:
        return f"step {self.step}: {what}"

    def start(
        self, tid: int, kind: str, gpu: list[int], cpu: list[int], *, reqs: Any, lag: int
    ) -> None:
        assert len(gpu) == len(cpu), self.where(f"copy {tid} pairs {gpu} with {cpu}")
        for g, c in zip(gpu, cpu, strict=True):
            if kind == "store":
                assert not self.gpu_writes[g], self.where(f"store {tid} reads GPU {g} mid-load")
                assert not self.cpu_reads[c], self.where(f"store {tid} writes CPU {c} mid-load")
                assert not self.cpu_writes[c], self.where(f"store {tid} writes CPU {c} twice")
                self.gpu_reads[g] += 1
                self.cpu_writes[c] += 1
            else:
                assert not self.gpu_reads[g], self.where(f"load {tid} writes GPU {g} mid-store")
                assert not self.gpu_writes[g], self.where(f"load {tid} writes GPU {g} twice")
                assert not self.cpu_writes[c], self.where(f"load {tid} reads CPU {c} mid-store")
                self.gpu_writes[g] += 1
                self.cpu_reads[c] += 1
        self.in_flight[tid] = Copy(kind, gpu, cpu, frozenset(reqs), self.step + lag)

    def finish(self, tid: int) -> None:
        copy = self.in_flight.pop(tid)
        for g, c in zip(copy.gpu, copy.cpu, strict=True):
            if copy.kind == "store":
                self.cpu[c] = list(self.gpu[g])
                self.gpu_reads[g] -= 1
                self.cpu_writes[c] -= 1
                self.tally.stored += 1
            else:
                self.gpu[g] = list(self.cpu[c])
                self.gpu_writes[g] -= 1
                self.cpu_reads[c] -= 1
                self.tally.loaded += 1
        self.done.append(tid)

    # ---- one step ----------------------------------------------------------------------------

    def execute(self, so: Any) -> Any:
        from vllm.v1.outputs import KVConnectorOutput

        from kvoffload.metadata import KVOffloadMetadata, KVOffloadWorkerMetadata

        self.step += 1
        self.done = []
        meta = so.kv_connector_metadata
        assert isinstance(meta, KVOffloadMetadata), type(meta)
        preempted = set(meta.preempted_req_ids or ())
        self.tally.preempted += len(preempted)
        for tid, copy in list(self.in_flight.items()):
            if copy.kind == "store" and copy.req_ids & preempted:
                self.finish(tid)
        computed = self.read_tables(so)
        if meta.store_before_forward is not None:
            tid, gpu, cpu, reqs = meta.store_before_forward[:4]
            self.start(tid, "store", block_ids(gpu), block_ids(cpu), reqs=reqs, lag=0)
            self.finish(tid)
        for tid, req_id, gpu, cpu, valid, sync in meta.loads:
            assert valid, self.where(f"load {tid} of {req_id} has no CPU hit behind it")
            lag = 0 if sync else self.rng.randint(0, 2)
            self.start(tid, "load", block_ids(gpu), block_ids(cpu), reqs=(req_id,), lag=lag)
            if sync:
                self.finish(tid)
        if meta.store is not None:
            tid, gpu, cpu, reqs = meta.store[:4]
            self.start(
                tid, "store", block_ids(gpu), block_ids(cpu), reqs=reqs, lag=self.rng.randint(0, 4)
            )
        self.forward(so, computed)
        if meta.store_after_forward is not None:
            tid, gpu, cpu, reqs = meta.store_after_forward[:4]
            self.start(tid, "store", block_ids(gpu), block_ids(cpu), reqs=reqs, lag=0)
            self.finish(tid)
        for tid, copy in list(self.in_flight.items()):
            if copy.ends_at <= self.step:
                self.finish(tid)
        wm = None
        if self.done:
            wm = KVOffloadWorkerMetadata(transfer_ids=self.done, ok=[True] * len(self.done))
        return runner_output(self.h.scheduler, so, KVConnectorOutput(kv_connector_worker_meta=wm))

    def read_tables(self, so: Any) -> dict[str, int]:
        """Updates the block tables as vLLM's model runner does; returns each scheduled
        request's tokens computed before this step."""
        computed: dict[str, int] = {}
        groups = len(self.windows)
        for r in so.scheduled_new_reqs:
            self.tables[r.req_id] = [list(ids) for ids in r.block_ids]
            computed[r.req_id] = r.num_computed_tokens
        cached = so.scheduled_cached_reqs
        resumed = set(cached.resumed_req_ids or ())
        for i, req_id in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            if req_id in resumed or req_id not in self.tables:
                self.tables[req_id] = [[] for _ in range(groups)]
            if new is not None:
                for table, ids in zip(self.tables[req_id], new, strict=True):
                    table.extend(ids)
            computed[req_id] = cached.num_computed_tokens[i]
        for req_id in so.finished_req_ids:
            self.tables.pop(req_id, None)
        return computed

    def forward(self, so: Any, computed: dict[str, int]) -> None:
        # Every layer writes the batch's new KV before its attention reads: a request may
        # read blocks another request of the same step computes (vLLM caches them at
        # allocation).
        for req_id, n in so.num_scheduled_tokens.items():
            start = computed[req_id]
            for group, table in enumerate(self.tables[req_id]):
                for pos in range(start, start + n):
                    g = table[pos // BLOCK]
                    what = f"forward writes GPU {g} ({req_id} group {group} token {pos})"
                    assert not self.gpu_reads[g], self.where(f"{what} mid-store")
                    assert not self.gpu_writes[g], self.where(f"{what} mid-load")
                    self.gpu[g][pos % BLOCK] = self.cell(group, req_id, pos)
        for req_id in so.num_scheduled_tokens:
            start = computed[req_id]
            for group, table in enumerate(self.tables[req_id]):
                # A sliding window's first new token attends back `window - 1` tokens;
                # vLLM frees (nulls) the blocks before that.
                window = self.windows[group]
                first = 0 if window is None else max(0, start - window + 1)
                for pos in range(first, start):
                    g = table[pos // BLOCK]
                    where = f"GPU {g} ({req_id} group {group} token {pos})"
                    assert not self.gpu_writes[g], self.where(f"forward reads {where} mid-load")
                    assert self.gpu[g][pos % BLOCK] == self.cell(group, req_id, pos), self.where(
                        f"forward reads wrong KV at {where}"
                    )
                self.tally.cells_read += start - first


def workload(rng: random.Random, requests: int) -> list[tuple[int, str, list[int], int]]:
    """``(arrival step, request id, prompt, max_tokens)``: prompts are one of 8 system
    prompts of 2-5 blocks plus a unique tail."""
    systems = [[rng.randrange(3, 1000) for _ in range(rng.randint(2, 5) * BLOCK)] for _ in range(8)]
    arrivals = []
    t = 0.0
    for i in range(requests):
        t += rng.expovariate(0.3)
        prompt = rng.choice(systems) + [rng.randrange(3, 1000) for _ in range(rng.randint(1, 20))]
        arrivals.append((int(t), f"r{i}", prompt, rng.randint(1, 32)))
    return arrivals


def run(h: SchedHarness, seed: int, requests: int, async_scheduling: bool) -> Tally:
    """Replays a seeded workload as vLLM's engine core steps (``step`` or, with async
    scheduling, ``step_with_batch_queue``) until every request and copy is done."""
    rng = random.Random(seed)
    arrivals = workload(rng, requests)
    prompts = {rid: p for _, rid, p, _ in arrivals}
    worker = ContentWorker(h, rng, prompts)
    sched = h.scheduler
    depth = 2 if async_scheduling else 1
    queue: deque[tuple[Any, Any]] = deque()
    todo = deque(arrivals)
    live: set[str] = set()
    now = 0
    for _ in range(20_000):
        while todo and todo[0][0] <= now:
            _, rid, prompt, max_tokens = todo.popleft()
            h.add(prompt, max_tokens=max_tokens, req_id=rid)
            live.add(rid)
        if live and rng.random() < 0.03:
            rid = rng.choice(sorted(live))
            h.abort(rid)
            live.discard(rid)
            worker.tally.aborted += 1
        busy = sched.has_requests() or worker.in_flight or h.connector.has_pending_push_work()
        if not busy and not queue:
            if not todo:
                break
            now = todo[0][0]
            continue
        now += 1
        if busy:
            so = sched.schedule()
            queue.appendleft((so, worker.execute(so)))
            if len(queue) < depth and (so.total_num_scheduled_tokens > 0 or sched.has_requests()):
                continue
        so, out = queue.pop()
        for outs in sched.update_from_output(so, out).values():
            for o in outs.outputs:
                if o.finish_reason is not None:
                    live.discard(o.request_id)
                    worker.tally.finished += 1
    else:
        raise AssertionError(f"not done: {len(live)} requests live, {worker.in_flight}")
    assert not live
    h.assert_idle()
    return worker.tally


CONFIGS = [
    # (scheduler, where KV lives, load_mode)
    pytest.param(("sync", "host", "sync"), id="sync-host-syncloads"),
    pytest.param(("sync", "host", "async"), id="sync-host-asyncloads"),
    pytest.param(("sync", "gpu", "async"), id="sync-gpu-asyncloads"),
    pytest.param(("async", "gpu", "async"), id="async-gpu-asyncloads"),
    pytest.param(("async", "gpu", "sync"), id="async-gpu-syncloads"),
]


#: KV-cache groups: a dense model, and a hybrid one (vLLM's hybrid allocator: a
#: sliding-window group beside a full-attention group, one block pool).
MODELS = {
    "dense": lambda: None,
    "sliding+full": lambda: [
        (["model.layers.0.self_attn.attn"], sliding_window(2 * BLOCK)),
        (["model.layers.1.self_attn.attn"], full_attention()),
    ],
}


#: Pool and batch sizes: prompts prefilled in chunks with a CPU pool that holds most of
#: them; whole prompts per step (requests often finish in the step after their prefill)
#: with a CPU pool far smaller than the GPU cache; one block per step with a CPU pool
#: half the GPU cache's size.
SHAPES = {
    "chunked": {"num_gpu_blocks": 16, "num_cpu_blocks": 40, "max_num_batched_tokens": 64},
    "whole-prompts": {"num_gpu_blocks": 20, "num_cpu_blocks": 8, "max_num_batched_tokens": 128},
    "small-steps": {"num_gpu_blocks": 20, "num_cpu_blocks": 12, "max_num_batched_tokens": 16},
}


@pytest.mark.parametrize(
    ("kv_groups", "mode"),
    [(g, m) for g in sorted(MODELS) for m in ("eager", "lazy")],
    ids=lambda v: v,
)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_read_sees_its_own_kv(
    model: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    config: tuple[str, str, str],
    mode: str,
    kv_groups: str,
    shape: str,
    seed: int,
) -> None:
    import kvoffload.connector

    scheduler, kv_in, load_mode = config
    monkeypatch.setattr(kvoffload.connector, "kv_in_host_memory", lambda: kv_in == "host")
    h = SchedHarness(
        model,
        lazy=mode == "lazy",
        load_mode=load_mode,
        max_num_seqs=8,
        async_scheduling=scheduler == "async",
        groups=MODELS[kv_groups](),
        **SHAPES[shape],
    )
    tally = run(h, seed, requests=100, async_scheduling=scheduler == "async")
    # Not vacuous: CPU copies served reads, and the pools were under pressure.
    assert tally.stored, tally
    assert tally.loaded, tally
    assert tally.finished + tally.aborted == 100, tally
    assert tally.cells_read > 10_000, tally
