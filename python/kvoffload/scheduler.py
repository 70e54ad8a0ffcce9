"""Scheduler-role adapter: vLLM's scheduler calls -> the Rust planner."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from kvoffload._native import KVOffloadError, OffloadConfig, Planner
from kvoffload.disk_events import DiskEventLog
from kvoffload.events import CpuEventLog
from kvoffload.metadata import IDLE_STEP, KVOffloadMetadata, KVOffloadWorkerMetadata
from kvoffload.stats import KVOffloadStats, disk_tier_counters
from kvoffload.vllm_adapter import (
    EventSpec,
    FreeQueueWalker,
    GpuBlockHolder,
    GpuResetWatch,
    allocated_blocks,
    logger,
    skips_prefix_cache,
)

if TYPE_CHECKING:
    from kvoffload._native import _StepTuple

#: A step that plans nothing, unpacked like a plan without building one: every field is
#: only tested or iterated, never changed, and the loads are replaced before they are sent.
_NO_PLAN: Final[_StepTuple] = ((), None, (), None, ())  # type: ignore[assignment]

#: Lazy mode keeps this many steps' worth of batched tokens offloaded ahead of eviction
#: (the same watermark as vLLM's SimpleCPUOffloadConnector).
LAZY_WATERMARK_STEPS = 2


class OffloadScheduler:
    """Owns the planner; one Rust call per vLLM call, never one per block."""

    def __init__(
        self,
        config: OffloadConfig,
        *,
        block_size: int,
        num_cpu_blocks: int,
        events: list[EventSpec] | None,
        max_num_batched_tokens: int,
        sync_loads: bool,
        stores_after_forward: bool = False,
        groups: list[tuple[str, int | None]] | None = None,
        remote_layout: dict[str, Any] | None = None,
        split_hit_sources: bool = False,
    ) -> None:
        self._planner_args: dict[str, Any] = {
            "world_size": config.world_size,
            "lazy": config.lazy_offload,
            "events": events is not None,
            "sync_loads": sync_loads,
            "stores_after_forward": stores_after_forward,
            "groups": groups,
        }
        self._block_size = block_size
        # The remote tier's settings and keys; workers write stored blocks behind when
        # `remote_write` is on, so each store's hashes go with it.
        self._config = config
        self._remote_layout = remote_layout if config.has_lower_tier else None
        self._remote_writes = self._remote_layout is not None and config.writes_lower
        # The disk alone below the CPU: the lower tier's counters are reported as disk_*.
        self._disk_alone = config.disk is not None and config.remote is None
        # The connector splits each hit into host and disk tokens (`lower_tier_tokens`).
        self._split_hit_sources = split_hit_sources
        self._use_planner(self._new_planner(num_cpu_blocks))
        self._async_loads = not sync_loads
        self._stores_after_forward = stores_after_forward
        # With events on: the log of CPU events, and the requests it snapshots blocks of
        # (finished ones until the step that issues their last store); with a disk tier,
        # the disk's "STORAGE" events, from the blocks the CPU log publishes.
        self._disk_events: DiskEventLog | None = None
        self._events: CpuEventLog | None = None
        if events is not None:
            if config.disk is not None and self._remote_layout is not None:
                self._disk_events = DiskEventLog(block_size, events, config.world_size)
            self._events = CpuEventLog(
                block_size,
                events,
                None if self._disk_events is None else self._disk_events.cpu_published,
            )
        # Simple's disk mode (no CPU budget): host memory only stages the disk, and its
        # blocks leave it within a request or two. Simple announces its disk pool alone
        # (medium "STORAGE"); CPU events for the staging blocks would have a router count
        # them in host memory, so only the disk's events are published.
        self._cpu_events_published = config.disk is None or bool(config.disk["cpu_in_front"])
        # With events on: tells when vLLM's GPU pool was reset (see `take_events`).
        self._gpu_reset: GpuResetWatch | None = None
        self._requests: dict[str, Any] = {}
        self._finished: dict[str, Any] = {}
        self._lazy = config.lazy_offload
        step_blocks = -(-max_num_batched_tokens // block_size)
        self._lazy_limit = LAZY_WATERMARK_STEPS * step_blocks
        # Freed blocks are offered between steps only while the free queue is shorter
        # than what one step's batch may allocate (see `_offer_freed`).
        self._offer_below = step_blocks
        # Each request's own hash list, which vLLM extends (and, for streaming sessions,
        # truncates and regrows) in place; the planner reads it where it needs a hash
        # and checks it against what it read before.
        self._hash_lists: dict[str, Any] = {}
        self._walker: FreeQueueWalker | None = None
        # Holds GPU blocks an eager store reads that vLLM frees from running requests
        # (sliding-window and Mamba groups).
        self._holder: GpuBlockHolder | None = None
        #: When hits are split by source: each request's last hit offered (its tokens).
        self._offered_hits: dict[str, int] = {}
        if not self._lazy:
            # Nothing is offered between steps: vLLM's per-step call goes to the reports.
            self.update_connector_output = self._apply_reports  # type: ignore[method-assign]

    @property
    def planner(self) -> Planner:
        return self._planner

    @property
    def event_log(self) -> CpuEventLog | None:
        return self._events

    @property
    def num_cpu_blocks(self) -> int:
        return self._planner.num_cpu_blocks

    def resize(self, num_cpu_blocks: int) -> None:
        """Plans within ``num_cpu_blocks`` from now on. Only before the first request:
        vLLM reports the ranks' pools at startup."""
        if self._planner.num_requests or self._planner.has_work_in_flight():
            raise KVOffloadError(
                f"kvoffload: cannot resize the CPU pool to {num_cpu_blocks} blocks once "
                "requests were planned"
            )
        self._use_planner(self._new_planner(num_cpu_blocks))

    def _use_planner(self, planner: Planner) -> None:
        self._planner = planner
        # Fixed for a planner's life; read every step.
        self._reads_requests = planner.reads_scheduled_requests
        self._has_remote = planner.has_remote
        # Only a hit with a tier below the CPU can be split.
        self._records_hits = self._split_hit_sources and self._has_remote

    def _new_planner(self, num_cpu_blocks: int) -> Planner:
        planner = Planner(self._block_size, num_cpu_blocks, **self._planner_args)
        if self._remote_layout is None or num_cpu_blocks == 0:
            return planner
        try:
            planner.attach_remote(self._config, self._remote_layout)
        except KVOffloadError as e:
            # A cache, not a source of truth: the engine serves without it.
            logger.error("kvoffload: remote tier unavailable, running without it: %s", e)
        else:
            logger.info("kvoffload: remote tier %s attached", self._config.remote)
        return planner

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        if self._events is not None:
            self._gpu_reset = GpuResetWatch(gpu_block_pool)
        # Only lazy mode walks the free queue (the walker follows the queue's removals).
        if self._lazy:
            self._walker = FreeQueueWalker(gpu_block_pool)
        else:
            self._holder = GpuBlockHolder(gpu_block_pool)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        req_id = request.request_id
        hashes = request.block_hashes
        self._hash_lists[req_id] = hashes
        if self._events is not None:
            self._requests[req_id] = request
        if skips_prefix_cache(request):
            # vLLM discards any hit for it (prompt logprobs need every prompt token
            # computed); a lookup would only pin blocks until the allocation drops them.
            return 0, False
        hit = self._planner.lookup(req_id, hashes, request.num_tokens, num_computed_tokens)
        if hit is None:
            # The remote tier is being asked; vLLM keeps the request waiting this step.
            return None, False
        if not hit:
            return 0, False  # a constant: most lookups allocate nothing (see `IDLE_STEP`)
        if self._records_hits:
            self._offered_hits[req_id] = hit
        return hit, self._async_loads

    def lower_tier_tokens(self, request: Any, accepted: int) -> int:
        """Of the ``accepted`` tokens of ``request``'s hit, those its fetch from the tier
        below the CPU brought: the hit's last tokens (the fetch continued the CPU hit)."""
        req_id = request.request_id
        offered = self._offered_hits.get(req_id, 0)
        fetched = min(self._planner.remote_hit_tokens(req_id), offered)
        return max(0, min(accepted, offered) - (offered - fetched))

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._planner.on_alloc_blocks(
            request.request_id,
            allocated_blocks(blocks),
            request.num_computed_tokens,
            num_external_tokens,
        )

    def build_connector_meta(self, scheduler_output: Any) -> KVOffloadMetadata:
        after_forward = self._stores_after_forward
        planner = self._planner
        # The walk's candidates go from the walk to the planner as a handle: their keys
        # stay in Rust.
        lazy = None if self._walker is None else self._walker.candidates(self._lazy_limit, planner)
        if self._reads_requests:
            plan = planner.schedule_output(scheduler_output, self._hash_lists, lazy, after_forward)
        else:
            # Most lazy steps plan nothing: then no plan tuple is built at all.
            plan = planner.schedule_lazy(lazy)
        if plan is None:
            loads, store, held, store_events, groups = _NO_PLAN
        else:
            loads, store, held, store_events, groups = plan
        if self._events is not None:
            if store is not None and store_events is not None:
                requests = self._requests if not self._finished else self._finished_first()
                self._events.store_issued(store, store_events, requests, groups)
            self._finished.clear()
        if held:
            holder = self._walker or self._holder
            if holder is not None:
                holder.hold(held)
        preempted = scheduler_output.preempted_req_ids
        if plan is None:
            if not preempted and not self._has_remote:
                return IDLE_STEP
            loads = []
        preempted = list(preempted) if preempted else []
        # Positional (loads, store, store_before_forward, store_after_forward,
        # preempted_req_ids): built every step, and keywords cost a dict. Within the step
        # (KV in host memory), a lazy store goes before the forward pass, an eager one after.
        if not after_forward:
            meta = KVOffloadMetadata(loads, store, None, None, preempted)
        elif self._lazy:
            meta = KVOffloadMetadata(loads, None, store, None, preempted)
        else:
            meta = KVOffloadMetadata(loads, None, None, store, preempted)
        if self._has_remote:
            meta.fetches = planner.take_fetches()
            if meta.fetches and self._events is not None:
                self._events.fetch_issued(meta.fetches, self._requests)
        if self._remote_writes and store is not None:
            meta.store_hashes = planner.block_hashes(store[2])
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        # Before the reports: blocks a retired store releases were just stored.
        self._offer_freed()
        self._apply_reports(connector_output)

    def _offer_freed(self) -> None:
        # vLLM calls this after freeing the step's finished requests. Their blocks join
        # the free queue at its tail; when the whole queue is shorter than one step's
        # batch, the next step's allocations may evict them before its plan's walk sees
        # them. Offered now, the chosen ones join the next step's store, held until it
        # retires unless that store is copied before the step's forward pass. (With
        # the two-step watermark as the bound instead, the shared trace stored a fifth
        # more blocks for the same recomputation.)
        # With no unfinished request left, vLLM may not step again (an offline engine
        # stops when generate returns): an offered store would hold its GPU blocks and
        # stay pending until the next request. Those blocks are walked in that request's
        # first step instead.
        walker = self._walker
        if (
            walker is None
            or not self._hash_lists
            or walker.queue.num_free_blocks > self._offer_below
        ):
            return
        walked = walker.candidates(self._lazy_limit, self._planner)
        if not walked:
            return
        # With events on, the planner keeps vLLM's hashes of what it was offered until
        # the next plan says which of them it stores.
        held = self._planner.offer_lazy(walked)
        if held:
            walker.hold(held)

    def _apply_reports(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        # Most steps report nothing; an ABC's isinstance is not free, so the exact type
        # (what the workers send) is tried first.
        if meta is None or (
            type(meta) is not KVOffloadWorkerMetadata
            and not isinstance(meta, KVOffloadWorkerMetadata)
        ):
            return
        if meta.fetched:
            try:
                fetched = self._planner.complete_fetches(meta.fetched)
            except KVOffloadError as e:
                logger.error("kvoffload: ignoring a bad fetch report: %s", e)
            else:
                if fetched and self._events is not None:
                    self._events.stores_retired(self._planner.take_events(), fetched)
        if meta.transfer_ids:
            self._apply_completions(connector_output, meta)
        # After the completions: the CPU tier publishes a block before its disk write.
        if meta.disk and self._disk_events is not None:
            self._disk_events.reports(meta.disk)

    def _apply_completions(self, connector_output: Any, meta: KVOffloadWorkerMetadata) -> None:
        try:
            sending, recving, load_errors, released, retired = self._planner.complete(
                meta.transfer_ids, meta.ok
            )
        except KVOffloadError as e:
            logger.error("kvoffload: ignoring a bad completion report: %s", e)
            return
        if retired and self._events is not None:
            self._events.stores_retired(self._planner.take_events(), retired)
        if sending:
            if connector_output.finished_sending is None:
                connector_output.finished_sending = set()
            connector_output.finished_sending.update(sending)
        if recving:
            if connector_output.finished_recving is None:
                connector_output.finished_recving = set()
            connector_output.finished_recving.update(recving)
        if load_errors:
            logger.warning("kvoffload: %d GPU blocks failed to load from CPU", len(load_errors))
        if released:
            holder = self._walker or self._holder
            if holder is not None:
                holder.release(released)

    def request_finished(self, request: Any) -> bool:
        req_id = request.request_id
        self._hash_lists.pop(req_id, None)
        if self._offered_hits:
            self._offered_hits.pop(req_id, None)
        if self._events is not None and self._requests.pop(req_id, None) is not None:
            self._finished[req_id] = request
        return self._planner.request_finished(
            req_id, request.block_hashes, request.num_computed_tokens
        )

    def take_events(self) -> list[Any]:
        events = self._events
        if events is None:
            return []
        planner_events = self._planner.take_events()
        # vLLM takes its GPU pool's events just before these, into the same batch: after
        # a reset of the pool that batch holds its AllBlocksCleared (no medium), and
        # routers forget what the CPU tier and the disk still hold and serve. They are
        # announced again after it (once, whether or not `reset_cache` ran too).
        watch = self._gpu_reset
        if watch is not None and watch.was_reset():
            events.announce_again(planner_events)
            planner_events = []
            if self._disk_events is not None:
                self._disk_events.announce_again()
        cpu = events.take(planner_events)
        if self._disk_events is None:
            return cpu
        disk = self._disk_events.take()
        if not self._cpu_events_published:
            return disk
        return cpu + disk if disk else cpu

    def _finished_first(self) -> dict[str, Any]:
        # A finished request's last blocks are issued in the step after it finished; a
        # new request reusing its id in between does not own those blocks.
        return {**self._requests, **self._finished}

    def reset_cache(self) -> bool:
        if self._events is not None:
            # Events buffered before the reset still name blocks it is about to drop.
            self._events.convert(self._planner.take_events())
        self._planner.reset()
        if self._events is not None:
            self._events.reset()
            if self._disk_events is not None and self._cpu_events_published:
                # The CPU tier's AllBlocksCleared tells routers to forget the disk's
                # blocks too; they stay there and are served.
                self._disk_events.announce_again()
        if self._walker is not None:
            self._walker.reset()
        return True

    def has_pending_push_work(self) -> bool:
        return self._planner.has_work_in_flight()

    def stats(self) -> KVOffloadStats | None:
        # vLLM asks after every step and never while idle: a report held back for an
        # interval would keep a burst's last counts from /metrics until the next
        # request. (Flushing when no request is left is not enough: vLLM also idles with
        # a streaming session waiting for input, or paused with its requests kept. And
        # reporting less often than Simple is not the same work: compare_scheduler
        # compares both reporting every step.) Counter increases and changed gauges are
        # compared in Rust: None when nothing moved.
        report = self._planner.take_stats_report()
        if report is None:
            return None
        counters, gauges = report
        if self._disk_alone:
            counters = disk_tier_counters(counters)
        return KVOffloadStats.of(counters, gauges, {})
