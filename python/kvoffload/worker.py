"""Worker-role adapter: registered KV tensors -> regions -> the Rust transfer engine."""

from __future__ import annotations

import sys
from array import array
from typing import TYPE_CHECKING, Any

from kvoffload._native import (
    HostMemoryError,
    KVOffloadError,
    OffloadConfig,
    TransferEngine,
    WorkerTier,
)
from kvoffload.copy_times import CopyTimes
from kvoffload.cuda_events import CUDA, engine_backend, record_compute_event
from kvoffload.host_memory import host_memory
from kvoffload.metadata import (
    KVOffloadHandshake,
    KVOffloadMetadata,
    KVOffloadWorkerMetadata,
    StoreSpec,
)
from kvoffload.stat_deltas import CounterDeltas
from kvoffload.stats import KVOffloadStats
from kvoffload.vllm_adapter import Region, kv_regions, logger
from kvoffload.worker_tier import LowerTiers

if TYPE_CHECKING:
    import torch

#: How long a preempted request's in-flight stores, or a step's synchronous loads, may take
#: before the worker gives up on the device (a copy that slow means the device is broken).
#: Giving up stops the transfer engine for good (``TransferEngine.wait_for``): the wait
#: still returns only once the copies already running have ended, so a copy is never
#: reported finished while it can still write, and every later copy fails, so requests
#: recompute instead of waiting on the device again.
PREEMPTION_FENCE_TIMEOUT_S = 30.0
SYNC_LOAD_TIMEOUT_S = 30.0
SHUTDOWN_TIMEOUT_S = 5.0
#: How long a step waits for a store copied within it (KV in host memory) before leaving
#: it to finish in the background.
STORE_WITHIN_STEP_TIMEOUT_S = 30.0

#: What a worker whose engine did not stop in time keeps alive for the rest of the process:
#: the copy thread may still write into the registered KV tensors (and read torch events),
#: so they are leaked rather than freed under it.
_LEAKED_ON_SHUTDOWN: list[tuple[Any, ...]] = []


def block_list(raw: bytes) -> list[int]:
    """Little-endian u32 block ids as ints."""
    ids = array("I")
    ids.frombytes(raw)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tolist()


def kv_tensor_list(kv_caches: dict[str, Any]) -> list[torch.Tensor]:
    """Every tensor of vLLM's ``{layer: tensor or tensors}``."""
    return [
        t
        for value in kv_caches.values()
        for t in (value if isinstance(value, (list, tuple)) else [value])
    ]


def region_tuples(regions: list[Region]) -> list[tuple[int, int, int, int]]:
    """The ``TransferEngine``'s form of regions."""
    return [(r.base, r.num_blocks, r.block_bytes, r.block_stride) for r in regions]


class OffloadWorker:
    """Submits each step's copies at once and reports completions without blocking."""

    def __init__(
        self,
        config: OffloadConfig,
        *,
        num_gpu_blocks: int,
        remote_layout: dict[str, Any] | None = None,
        kv_events: bool = False,
    ) -> None:
        self._config = config
        # vLLM publishes KV events: the disk tier reports its changes for them.
        self._kv_events = kv_events
        # Tiers below the CPU: started over the engine's host memory once it exists.
        self._remote_layout = remote_layout if config.has_lower_tier else None
        self._lower = LowerTiers()
        self._faults = config.faults
        # Sized from this rank's own KV tensors in `register_kv_caches`: pipeline stages
        # with uneven layer splits, or a draft model's KV on the last one, make bytes per
        # block differ between ranks, so every rank fits its byte budget on its own.
        self._num_cpu_blocks = 0
        self._num_gpu_blocks = num_gpu_blocks
        self._engine: TransferEngine | None = None
        # In-flight transfers: loads -> their GPU blocks (reported on failure);
        # stores -> the requests whose blocks they read (fenced on preemption).
        self._loads: dict[int, bytes] = {}
        self._stores: dict[int, frozenset[str]] = {}
        self._done_ids: list[int] = []
        self._done_ok: list[bool] = []
        self._load_errors: set[int] = set()
        self._sync_loads: list[int] = []
        self._stats = CounterDeltas()
        self._times = CopyTimes()
        # CUDA backend: the compute-stream event each in-flight copy waits on, kept alive
        # until the engine reports the copy done (its stream waits on it; see cuda_events).
        self._cuda = False
        self._events: dict[int, Any] = {}
        # The registered KV tensors: the engine copies into them, so they stay referenced
        # for as long as its copy thread may run.
        self._kv_caches: dict[str, torch.Tensor] = {}

    @property
    def engine(self) -> TransferEngine | None:
        return self._engine

    @property
    def tier(self) -> WorkerTier | None:
        """The tiers below the CPU on this rank (``None`` without them)."""
        return self._lower.tier

    @property
    def num_cpu_blocks(self) -> int:
        """This rank's CPU pool, in blocks (0 until KV caches are registered). The
        scheduler plans within the smallest over all ranks (see ``handshake``)."""
        return self._num_cpu_blocks

    def handshake(self) -> KVOffloadHandshake:
        """What the scheduler learns from this rank before the first step."""
        return KVOffloadHandshake(num_cpu_blocks=self._num_cpu_blocks)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        regions = kv_regions(kv_caches, self._num_gpu_blocks)
        per_block = sum(r.block_bytes for r in regions)
        self._num_cpu_blocks = self._config.num_cpu_blocks(per_block)
        if self._num_cpu_blocks == 0:
            logger.warning(
                "KVOffloadConnector worker: cpu budget of %d bytes holds no %d-byte block of "
                "this rank; CPU offloading is disabled",
                self._config.cpu_bytes_per_rank,
                per_block,
            )
            return
        backend, device = engine_backend(kv_caches)
        self._cuda = backend == CUDA
        self._kv_caches = dict(kv_caches)
        tensors = kv_tensor_list(kv_caches)
        pool_bytes = self._num_cpu_blocks * per_block
        memory = host_memory()
        try:
            self._engine = TransferEngine(
                region_tuples(regions),
                self._num_cpu_blocks,
                tensors,
                backend=backend,
                device=device,
                faults=self._faults,
            )
        except HostMemoryError as e:
            # In multiprocess mode the caller only sees "Engine core initialization
            # failed": say which setting asked for too much where the operator looks.
            have = (
                ""
                if memory is None
                else f"; this machine has {memory[0] / 2**30:.2f} GiB of memory, "
                f"{memory[1] / 2**30:.2f} GiB available"
            )
            msg = (
                f"KVOffloadConnector worker: cannot allocate this rank's CPU pool of "
                f"{pool_bytes} bytes ({self._num_cpu_blocks} blocks of {per_block} bytes, "
                f"from cpu_bytes_to_use: {self._config.cpu_bytes_per_rank} bytes per "
                f"rank): {e}{have}; lower cpu_bytes_to_use"
            )
            logger.error("%s", msg)
            raise HostMemoryError(msg) from e
        if memory is not None and pool_bytes > memory[1]:
            # Mapped, not yet backed: pages are taken as blocks are stored.
            logger.warning(
                "KVOffloadConnector worker: this rank's CPU pool (%.2f GiB) is larger than "
                "the memory available now (%.2f GiB of %.2f GiB); the system may run out of "
                "memory as the pool fills: lower cpu_bytes_to_use",
                pool_bytes / 2**30,
                memory[1] / 2**30,
                memory[0] / 2**30,
            )
        logger.info(
            "KVOffloadConnector worker: %d regions, %d CPU blocks, %.2f GiB host memory (%s)",
            len(regions),
            self._num_cpu_blocks,
            self._engine.host_bytes / 2**30,
            self._engine.backend_detail,
        )
        if self._remote_layout is not None:
            self._lower.start(self._engine, self._config, self._remote_layout, self._kv_events)

    def handle_preemptions(self, metadata: KVOffloadMetadata) -> None:
        """Waits for in-flight stores reading preempted requests' blocks, which this step's
        forward may overwrite; stores of other requests keep running."""
        if not metadata.preempted_req_ids or not self._stores or self._engine is None:
            return
        preempted = set(metadata.preempted_req_ids)
        fence = [tid for tid, reqs in self._stores.items() if not reqs.isdisjoint(preempted)]
        if not fence:
            return
        self._wait(fence, PREEMPTION_FENCE_TIMEOUT_S, "stores of preempted requests")

    def submit(self, metadata: KVOffloadMetadata) -> None:
        self._sync_loads = []
        self._lower.submit_fetches(metadata)
        if self._engine is None:
            for tid, _req_id, gpu, _cpu, _valid, _sync in metadata.loads:
                self._fail_load(tid, gpu, "no KV caches registered")
            for store in (metadata.store, metadata.store_before_forward):
                if store is not None:
                    self._record(store[0], False, "no KV caches registered")
            return
        if metadata.store_before_forward is not None:
            # Blocks freed in earlier steps, which this step may have reallocated: copied
            # before a load or the forward pass writes them.
            self._store_within_step(
                metadata.store_before_forward, metadata, "the step's lazy store"
            )
        # On CUDA every copy of the step waits for the work already on the compute
        # stream: stores must not read blocks still being written, and (with vLLM's
        # async scheduling) a load must not overwrite a reallocated block that the
        # previous step's forward pass may still read.
        event, wait_event = None, None
        if self._cuda and (metadata.loads or metadata.store is not None):
            event, wait_event = record_compute_event()
        for tid, _req_id, gpu, cpu, valid, sync in metadata.loads:
            if not valid:
                self._fail_load(tid, gpu, "no CPU hit backs this load")
                continue
            self._loads[tid] = gpu
            self._times.start(tid)
            try:
                self._engine.submit(tid, False, gpu, cpu, wait_event)
            except KVOffloadError as e:
                self._loads.pop(tid, None)
                self._times.cancel(tid)
                self._fail_load(tid, gpu, str(e))
                continue
            if event is not None:
                self._events[tid] = event
            if sync:
                self._sync_loads.append(tid)
        if metadata.store is not None:
            tid, gpu, cpu, req_ids = metadata.store
            self._stores[tid] = frozenset(req_ids)
            self._lower.note_store(tid, metadata)
            self._times.start(tid)
            try:
                self._engine.submit(tid, True, gpu, cpu, wait_event)
            except KVOffloadError as e:
                self._stores.pop(tid, None)
                self._record(tid, False, str(e))
                return
            if event is not None:
                self._events[tid] = event

    def finish_sync_loads(self) -> None:
        """Waits for this step's synchronous loads: their requests run in this forward."""
        if not self._sync_loads or self._engine is None:
            return
        pending, self._sync_loads = self._sync_loads, []
        self._wait(pending, SYNC_LOAD_TIMEOUT_S, "synchronous loads")

    def _wait(self, tids: list[int], timeout_s: float, what: str) -> None:
        """Waits for `tids` and records their completions. A timeout stops the engine but the
        wait still ends only after the running copies did, so each completion recorded here
        (a failure included) means that copy no longer touches its blocks."""
        if self._engine is None:
            return
        try:
            done = self._engine.wait_for(tids, timeout_s)
        except KVOffloadError as e:
            # Only a dead copy thread gets here, and then nothing copies any more.
            logger.error("kvoffload: waiting for %s failed: %s", what, e)
            done = [
                (tid, False, str(e)) for tid in tids if tid in self._loads or tid in self._stores
            ]
        failed = [err for _tid, ok, err in done if not ok]
        if failed:
            logger.error("kvoffload: %d of the %s failed: %s", len(failed), what, failed[0])
        for tid, ok, err in done:
            self._record(tid, ok, err)

    def store_after_forward(self, metadata: KVOffloadMetadata) -> None:
        """Runs the step's after-forward store (KV in host memory) and waits for it, so
        it is reported with this step and an idle engine holds no GPU block.

        A store slower than its wait stops the engine like any other timed-out wait: the
        report still comes only once the copy no longer reads its blocks.
        """
        if metadata.store_after_forward is not None:
            self._store_within_step(metadata.store_after_forward, metadata, "the step's store")

    def _store_within_step(self, store: StoreSpec, metadata: KVOffloadMetadata, what: str) -> None:
        """Copies ``store`` and waits for it (see ``store_after_forward``). Issued only
        where KV lives in host memory: no compute stream to wait on."""
        tid, gpu, cpu, req_ids = store
        if self._engine is None:
            self._record(tid, False, "no KV caches registered")
            return
        self._stores[tid] = frozenset(req_ids)
        self._lower.note_store(tid, metadata)
        self._times.start(tid)
        try:
            self._engine.submit(tid, True, gpu, cpu, None)
        except KVOffloadError as e:
            self._stores.pop(tid, None)
            self._record(tid, False, str(e))
            return
        self._wait([tid], STORE_WITHIN_STEP_TIMEOUT_S, what)

    def poll(self) -> None:
        self._lower.poll()
        if self._engine is None:
            return
        for tid, ok, err in self._engine.poll():
            self._record(tid, ok, err)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_worker_meta(self) -> KVOffloadWorkerMetadata | None:
        if not self._done_ids and not self._lower.has_reports:
            return None
        meta = KVOffloadWorkerMetadata(
            transfer_ids=self._done_ids,
            ok=self._done_ok,
            fetched=self._lower.take_fetched(),
            disk=self._lower.take_disk_reports(),
        )
        self._done_ids, self._done_ok = [], []
        return meta

    def stats(self) -> KVOffloadStats | None:
        if self._engine is None or not self._stats.due():
            return None
        tier_counters, gauges = self._lower.stats()
        counters = self._engine.stats() + tier_counters
        return self._stats.delta(counters, gauges, times=self._times.take())

    def unregister_kv_caches(self) -> None:
        """vLLM's sleep mode is about to release the KV memory: stops copying to and from
        it, waits for the copies running (at most ``SHUTDOWN_TIMEOUT_S``) and lets go of
        the device regions. Transfers still queued, and every one submitted until
        ``restore_kv_caches``, fail without copying (reported as failed: loads recompute,
        stores are never published). The CPU tier keeps its blocks. Idempotent."""
        engine = self._engine
        if engine is None or not engine.registered:
            return
        try:
            engine.unregister(SHUTDOWN_TIMEOUT_S)
        except KVOffloadError as e:
            # The copies may still run; the engine has stopped, so nothing new starts.
            logger.error("kvoffload: unregistering the KV caches for sleep mode: %s", e)
        else:
            logger.info("kvoffload: KV caches unregistered (sleep mode); copies paused")
        self.poll()

    def restore_kv_caches(self) -> None:
        """After vLLM's wake-up: the same KV tensors (remapped) are copied to and from
        again. Idempotent."""
        engine = self._engine
        if engine is None or engine.registered:
            return
        regions = kv_regions(self._kv_caches, self._num_gpu_blocks)
        try:
            engine.register(region_tuples(regions), kv_tensor_list(self._kv_caches))
        except KVOffloadError as e:
            # Copies keep failing (requests recompute); vLLM's wake-up goes on.
            logger.error("kvoffload: restoring the KV caches after sleep mode: %s", e)
            return
        logger.info("kvoffload: KV caches restored after sleep mode; copies resume")

    def shutdown(self) -> None:
        self._lower.shutdown()
        if self._engine is None:
            return
        try:
            self._engine.shutdown(SHUTDOWN_TIMEOUT_S)
        except KVOffloadError as e:
            # The copy thread still runs: it keeps the host memory itself, and the KV tensors
            # and events it may touch must outlive it, so they are never freed.
            logger.error(
                "kvoffload: transfer engine did not stop (%s); leaking %d KV tensors and %d "
                "events rather than freeing memory a copy may still write",
                e,
                len(self._kv_caches),
                len(self._events),
            )
            _LEAKED_ON_SHUTDOWN.append((self._engine, self._kv_caches, self._events))
        self._kv_caches, self._events = {}, {}

    def _fail_load(self, tid: int, gpu: bytes, why: str) -> None:
        logger.warning("kvoffload: load %d failed: %s", tid, why)
        self._load_errors.update(block_list(gpu))
        self._done_ids.append(tid)
        self._done_ok.append(False)

    def _record(self, tid: int, ok: bool, err: str | None) -> None:
        """One completion reported by the engine: the copy has ended, so its event may go."""
        gpu = self._loads.pop(tid, None)
        store = self._stores.pop(tid, None) is not None
        self._lower.store_ended(tid, ok)
        self._events.pop(tid, None)
        self._times.ended(tid, ok, store)
        if not ok:
            if gpu is not None:
                self._load_errors.update(block_list(gpu))
            logger.warning("kvoffload: transfer %d failed: %s", tid, err)
        self._done_ids.append(tid)
        self._done_ok.append(ok)
