"""``KVOffloadConnector``: vLLM's connector interface over the Rust engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvoffload._native import ConfigError, parse_config
from kvoffload.metadata import KVOffloadHandshake, KVOffloadMetadata
from kvoffload.prometheus import KVOffloadPromMetrics
from kvoffload.scheduler import OffloadScheduler
from kvoffload.stats import KVOffloadStats
from kvoffload.vllm_adapter import (
    DISK_HIT_SOURCE,
    HOST_HIT_SOURCE,
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorPromMetrics,
    KVConnectorRole,
    KVConnectorStats,
    KVConnectorWorkerMetadata,
    SupportsHMA,
    block_size,
    bytes_per_block,
    event_specs,
    extra_config,
    kv_events_enabled,
    kv_group_block_sizes,
    kv_group_kinds,
    kv_in_host_memory,
    logger,
    max_num_batched_tokens,
    model_name,
    num_gpu_blocks,
    num_kv_groups,
    prefix_caching_enabled,
    remote_layout,
    remote_unsupported,
    requested_kv_cache_layout,
    tensor_parallel_rank,
    unsupported_kv_groups,
    warn_if_untested_vllm,
    world_size,
)

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch

    from kvoffload.worker import OffloadWorker


class KVOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    """Keeps KV blocks evicted from the GPU in host memory and loads them back.

    Supports vLLM's hybrid allocator (``SupportsHMA``): full-attention and sliding-window
    KV-cache groups are planned per group; other kinds are refused at construction.

    Config (``kv_connector_extra_config``): ``cpu_bytes_to_use`` (total over ranks,
    default 8 GiB), ``cpu_bytes_to_use_per_rank`` (wins), ``lazy_offload`` (default
    false). Requires prefix caching; without it the connector warns once and does
    nothing.
    """

    if HOST_HIT_SOURCE is not None:
        _cache_hit_source = HOST_HIT_SOURCE

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        warn_if_untested_vllm(logger)
        self._scheduler: OffloadScheduler | None = None
        self._worker: OffloadWorker | None = None
        #: The calls bound straight to the scheduler (see `_route_calls`).
        self._routed: list[str] = []
        #: Every KV-cache group's index: what a load fills (asked for every async load).
        self._group_ids: tuple[int, ...] = (0,)
        #: A CPU tier in front of the disk alone: each hit is split into host and disk.
        self._split_hit_sources = False
        try:
            config, warnings = parse_config(extra_config(vllm_config), world_size(vllm_config))
        except ConfigError as e:
            # In multiprocess mode the caller only sees "Engine core initialization
            # failed"; say what is wrong where the operator looks.
            logger.error("KVOffloadConnector: %s", e)
            raise
        for w in warnings:
            logger.warning("KVOffloadConnector: %s", w)
        if not prefix_caching_enabled(vllm_config):
            logger.warning(
                "KVOffloadConnector needs prefix caching (enable_prefix_caching=True); "
                "CPU offloading is disabled"
            )
            return
        if kv_cache_config is None:
            return
        unsupported = unsupported_kv_groups(kv_cache_config)
        if unsupported:
            kinds = ", ".join(f"group {i}: {kind}" for i, kind in unsupported)
            msg = (
                f"KVOffloadConnector cannot offload model {model_name(vllm_config)}: its "
                f"KV-cache groups include kinds kvoffload cannot offload ({kinds}); "
                "kvoffload offloads full-attention (MLA included), sliding-window and "
                "align-mode Mamba groups only"
            )
            logger.error(msg)
            raise ConfigError(msg)
        self._group_ids = tuple(range(num_kv_groups(kv_cache_config)))
        sizes = kv_group_block_sizes(kv_cache_config, vllm_config)
        if len(set(sizes)) > 1:
            msg = (
                f"KVOffloadConnector cannot offload model {model_name(vllm_config)}: its "
                f"KV-cache groups use different block sizes ({sizes}); kvoffload plans one "
                "block size"
            )
            logger.error(msg)
            raise ConfigError(msg)
        if config.disk is not None:
            config = self._disk_setup(config, vllm_config, kv_cache_config)
        layout = self._remote_layout(config, vllm_config, kv_cache_config, role)
        if role != KVConnectorRole.SCHEDULER:
            from kvoffload.worker import OffloadWorker

            self._worker = OffloadWorker(
                config,
                num_gpu_blocks=num_gpu_blocks(kv_cache_config),
                remote_layout=layout,
                kv_events=kv_events_enabled(vllm_config),
            )
            if config.faults:
                logger.warning("KVOffloadConnector: injecting copy faults: %s", config.faults)
            return
        # The scheduler sees one rank's KV cache config (the first one's); until every
        # rank reports its own pool (`set_xfer_handshake_metadata_pp_aware`), this is
        # its estimate. A rank's transfer engine refuses CPU ids past its pool anyway.
        per_block = bytes_per_block(kv_cache_config)
        num_cpu_blocks = config.num_cpu_blocks(per_block)
        if num_cpu_blocks == 0:
            logger.warning(
                "KVOffloadConnector: cpu budget of %d bytes holds no %d-byte block; "
                "CPU offloading is disabled",
                config.cpu_bytes_per_rank,
                per_block,
            )
            return
        host = kv_in_host_memory()
        sync = config.sync_loads(host)
        if sync and any(kind == "mamba" for kind, _ in kv_group_kinds(kv_cache_config)):
            # vLLM copies a request's hit state into its running block before the step's
            # forward, the only place a sync load runs: the copy would read the block
            # before the load filled it. An async load finishes before the request's
            # first step.
            if config.sync_loads(False):
                msg = (
                    f"KVOffloadConnector cannot load model {model_name(vllm_config)} "
                    'synchronously (load_mode "sync"): its Mamba-kind KV-cache groups '
                    'need load_mode "async" or "auto"'
                )
                logger.error(msg)
                raise ConfigError(msg)
            sync = False
        self._scheduler = OffloadScheduler(
            config,
            block_size=block_size(kv_cache_config, vllm_config),
            num_cpu_blocks=num_cpu_blocks,
            events=event_specs(kv_cache_config) if kv_events_enabled(vllm_config) else None,
            max_num_batched_tokens=max_num_batched_tokens(vllm_config),
            sync_loads=sync,
            # Copies within host memory finish inside the step (load_mode "sync", the
            # default there), stores included (see wait_for_save).
            stores_after_forward=sync and host,
            groups=kv_group_kinds(kv_cache_config),
            remote_layout=layout,
            split_hit_sources=self._split_hit_sources,
        )
        self._route_calls(self._scheduler)
        logger.info(
            "KVOffloadConnector: %d CPU blocks of %d bytes per rank (%.2f GiB), %s mode",
            num_cpu_blocks,
            per_block,
            num_cpu_blocks * per_block / 2**30,
            "lazy" if config.lazy_offload else "eager",
        )

    def _route_calls(self, sched: OffloadScheduler | None) -> None:
        """vLLM calls these every step: bound straight to the scheduler, a call skips
        this class's forwarding frame. A subclass that overrides one keeps its override.
        With no scheduler (offloading disabled after start-up), the class's own methods
        answer again."""
        for name in self._routed:
            del self.__dict__[name]
        self._routed = []
        if sched is None:
            return
        for name, target in (
            ("get_num_new_matched_tokens", sched.get_num_new_matched_tokens),
            ("update_state_after_alloc", sched.update_state_after_alloc),
            ("build_connector_meta", sched.build_connector_meta),
            ("update_connector_output", sched.update_connector_output),
            ("get_kv_connector_stats", sched.stats),
            # Without KV events there is never anything to take.
            ("take_events", list if sched.event_log is None else sched.take_events),
        ):
            if getattr(type(self), name) is getattr(KVOffloadConnector, name):
                setattr(self, name, target)
                self._routed.append(name)

    def _disk_setup(self, config: Any, vllm_config: Any, kv_cache_config: Any) -> Any:
        """The config with host memory sized to stage the disk when no CPU budget was
        given (Simple's disk mode): ``disk_buffer_slots`` blocks, or what one request's hit
        needs at once if more (a disk hit goes through CPU blocks before it loads)."""
        # Host memory only staging the disk (Simple's disk mode): every hit was read from
        # disk. With a CPU tier in front, a hit's blocks still on CPU are host hits and
        # those its fetch read from disk are disk hits; with Redis behind the disk too, a
        # fetched block may come from either, so it is not split.
        if DISK_HIT_SOURCE is not None and not config.disk["cpu_in_front"]:
            self._cache_hit_source = DISK_HIT_SOURCE
        self._split_hit_sources = (
            DISK_HIT_SOURCE is not None and config.disk["cpu_in_front"] and config.remote is None
        )
        blocks = -(
            -int(vllm_config.model_config.max_model_len) // block_size(kv_cache_config, vllm_config)
        )
        return config.staged(blocks, bytes_per_block(kv_cache_config))

    @staticmethod
    def _remote_layout(
        config: Any, vllm_config: Any, kv_cache_config: Any, role: Any
    ) -> dict[str, Any] | None:
        """This rank's remote-tier keys, or ``None`` without a remote tier (or when this
        engine cannot share blocks: said once, with the fix)."""
        if not config.has_lower_tier:
            return None
        shared = config.remote is not None or bool(config.disk["persist"])
        why = remote_unsupported(vllm_config, shared=shared)
        if why is not None and config.disk is not None:
            msg = f"KVOffloadConnector: the disk tier cannot serve this engine: {why}"
            logger.error(msg)
            raise ConfigError(msg)
        if why is not None:
            logger.warning("KVOffloadConnector: remote tier disabled: %s", why)
            return None
        # The scheduler probes with the keys of tensor rank 0, which writes them too.
        rank = 0 if role == KVConnectorRole.SCHEDULER else tensor_parallel_rank()
        bs = block_size(kv_cache_config, vllm_config)
        return remote_layout(
            vllm_config, bs, rank, kv_group_kinds(kv_cache_config), config.kv_cache_version
        )

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        # Asked once, before any connector exists, to pick how the KV cache is laid out.
        config, _ = parse_config(extra_config(vllm_config), world_size(vllm_config))
        return requested_kv_cache_layout(config.kv_cache_layout)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        # A load fills every group's blocks of the hit.
        return self._group_ids

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache, not a handoff: vLLM may drop a preempted request's stale output.
        return False

    # ---- scheduler role --------------------------------------------------------------

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.bind_gpu_block_pool(gpu_block_pool)

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        # Every (pipeline stage, tensor rank) reports; nothing here moves KV between ranks.
        self._cap_to_ranks(list(metadata.values()))

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self._cap_to_ranks(list(metadata.values()))

    def _cap_to_ranks(self, reports: list[KVConnectorHandshakeMetadata]) -> None:
        """Plans within the smallest rank's pool: ranks size their pools from their own
        tensors, and no rank may be asked for a CPU block it does not have."""
        if self._scheduler is None:
            return
        sizes = [r.num_cpu_blocks for r in reports if isinstance(r, KVOffloadHandshake)]
        if not sizes:
            return
        smallest = min(sizes)
        if smallest == 0:
            logger.warning(
                "KVOffloadConnector: a rank's cpu budget holds no block of its KV; CPU "
                "offloading is disabled"
            )
            self._scheduler = None
            self._route_calls(None)
            return
        if smallest != self._scheduler.num_cpu_blocks:
            logger.info(
                "KVOffloadConnector: ranks hold %s CPU blocks; planning within %d",
                sorted(set(sizes)),
                smallest,
            )
            self._scheduler.resize(smallest)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._scheduler is None:
            return 0, False
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[Any, int]:
        # vLLM asks after `update_state_after_alloc`, for requests with a hit.
        sched = self._scheduler
        if not self._split_hit_sources or sched is None or not num_external_tokens:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        disk = sched.lower_tier_tokens(request, num_external_tokens)
        split = ((HOST_HIT_SOURCE, num_external_tokens - disk), (DISK_HIT_SOURCE, disk))
        return {source: n for source, n in split if n}

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self._scheduler is not None:
            self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        if self._scheduler is None:
            return KVOffloadMetadata()
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # The planner tracks every group's blocks itself; the finish flushes them all.
        return self._finished(request)

    def _finished(self, request: Any) -> tuple[bool, None]:
        # Constant tuples: a finish allocates nothing here (see `IDLE_STEP`).
        if self._scheduler is not None and self._scheduler.request_finished(request):
            return True, None
        return False, None

    def take_events(self) -> Iterable[Any]:
        # Asked after every step: without KV events there is nothing to take (and the
        # empty tuple is a constant, where a list would be an allocation every step).
        scheduler = self._scheduler
        if scheduler is None or scheduler.event_log is None:
            return ()
        return scheduler.take_events()

    def reset_cache(self) -> bool | None:
        return self._scheduler.reset_cache() if self._scheduler is not None else None

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    # ---- worker role -----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._worker is not None:
            self._worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        # vLLM collects this from every rank after registration, before the first step.
        return self._worker.handshake() if self._worker is not None else None

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, KVOffloadMetadata):
            self._worker.handle_preemptions(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVOffloadMetadata):
            self._worker.submit(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        # Loads were submitted when the metadata was bound; synchronous ones (vLLM calls
        # this before the forward pass when the step has any) must be done now.
        if self._worker is not None:
            self._worker.finish_sync_loads()

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Synchronous loads finished in start_load_kv; asynchronous ones gate the
        # request in the scheduler.
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # Stores copy whole confirmed blocks of earlier steps, not this step's layers.
        return

    def wait_for_save(self) -> None:
        # KV in host memory: the step's store copies blocks this forward pass wrote, and
        # finishes here, so it is reported with this step. vLLM only steps while requests
        # are unfinished: an offline engine whose last request just finished would
        # otherwise hold its final blocks (and a lazy store's) until the next request.
        if self._worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, KVOffloadMetadata):
                self._worker.store_after_forward(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Completions travel as worker metadata; the scheduler side names the requests.
        if self._worker is not None:
            self._worker.poll()
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.take_worker_meta() if self._worker is not None else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._scheduler is not None:
            return self._scheduler.stats()
        if self._worker is not None:
            return self._worker.stats()
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KVOffloadStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return KVOffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # vLLM >= 0.33 sleep mode (``supports_sleep_mode`` is the base's default, True): the
    # worker releases its KV memory between these two calls.

    def unregister_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.restore_kv_caches()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # ---- introspection (tests, benchmarks) -------------------------------------------

    @property
    def offload_scheduler(self) -> OffloadScheduler | None:
        return self._scheduler

    @property
    def offload_worker(self) -> OffloadWorker | None:
        return self._worker
