"""Worker-role adapter: registered KV tensors -> regions -> the Rust transfer engine."""

from __future__ import annotations

import sys
from array import array
from typing import TYPE_CHECKING, Any

from kvoffload._native import DeviceError, EngineShutdownError, KVOffloadError, TransferEngine
from kvoffload.cuda_events import CUDA, engine_backend, record_compute_event
from kvoffload.metadata import KVOffloadMetadata, KVOffloadWorkerMetadata
from kvoffload.stats import CounterDeltas, KVOffloadStats
from kvoffload.vllm_adapter import kv_regions, logger

if TYPE_CHECKING:
    import torch

#: How long a preempted request's in-flight stores may take before the step goes on
#: without them (a copy that slow means the device is broken): they are then reported
#: failed, so nothing they copied is ever served.
PREEMPTION_FENCE_TIMEOUT_S = 30.0
SYNC_LOAD_TIMEOUT_S = 30.0
SHUTDOWN_TIMEOUT_S = 5.0
#: How long a step waits for its after-forward store (KV in host memory) before leaving it
#: to finish in the background.
STORE_AFTER_FORWARD_TIMEOUT_S = 30.0


def block_list(raw: bytes) -> list[int]:
    """Little-endian u32 block ids as ints."""
    ids = array("I")
    ids.frombytes(raw)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tolist()


class OffloadWorker:
    """Submits each step's copies at once and reports completions without blocking."""

    def __init__(
        self,
        *,
        num_cpu_blocks: int,
        bytes_per_block: int,
        num_gpu_blocks: int,
        faults: str | None = None,
    ) -> None:
        self._faults = faults
        self._num_cpu_blocks = num_cpu_blocks
        self._bytes_per_block = bytes_per_block
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
        # Loads already reported failed whose copies may still complete later.
        self._abandoned: set[int] = set()
        self._stats = CounterDeltas()
        # CUDA backend: the compute-stream event each in-flight copy waits on, kept alive
        # until the copy completes (the engine's stream waits on it; see cuda_events).
        self._cuda = False
        self._events: dict[int, Any] = {}

    @property
    def engine(self) -> TransferEngine | None:
        return self._engine

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        regions = kv_regions(kv_caches, self._num_gpu_blocks)
        per_block = sum(r.block_bytes for r in regions)
        if per_block != self._bytes_per_block:
            msg = (
                f"kvoffload: registered KV tensors hold {per_block} bytes per block but the "
                f"KV cache config says {self._bytes_per_block}; refusing to offload"
            )
            logger.error(msg)
            raise KVOffloadError(msg)
        backend, device = engine_backend(kv_caches)
        self._cuda = backend == CUDA
        self._engine = TransferEngine(
            [(r.base, r.num_blocks, r.block_bytes, r.block_stride) for r in regions],
            self._num_cpu_blocks,
            backend=backend,
            device=device,
            faults=self._faults,
        )
        logger.info(
            "KVOffloadConnector worker: %d regions, %d CPU blocks, %.2f GiB host memory (%s)",
            len(regions),
            self._num_cpu_blocks,
            self._engine.host_bytes / 2**30,
            self._engine.backend_detail,
        )

    def handle_preemptions(self, metadata: KVOffloadMetadata) -> None:
        """Waits for in-flight stores reading preempted requests' blocks, which this step's
        forward may overwrite; stores of other requests keep running."""
        if not metadata.preempted_req_ids or not self._stores or self._engine is None:
            return
        preempted = set(metadata.preempted_req_ids)
        fence = [tid for tid, reqs in self._stores.items() if not reqs.isdisjoint(preempted)]
        if not fence:
            return
        try:
            done = self._engine.wait_for(fence, PREEMPTION_FENCE_TIMEOUT_S)
        except KVOffloadError as e:
            # The forward pass may now overwrite what these stores read: never publish
            # them (their late completions are ignored).
            logger.error("kvoffload: waiting for stores of preempted requests failed: %s", e)
            for tid in fence:
                self._record(tid, False, str(e))
                self._abandoned.add(tid)
            return
        for tid, ok, err in done:
            self._record(tid, ok, err)

    def submit(self, metadata: KVOffloadMetadata) -> None:
        self._sync_loads = []
        if self._engine is None:
            for tid, _req_id, gpu, _cpu, _valid, _sync in metadata.loads:
                self._fail_load(tid, gpu, "no KV caches registered")
            if metadata.store is not None:
                self._record(metadata.store[0], False, "no KV caches registered")
            return
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
            try:
                self._engine.submit(tid, False, gpu, cpu, wait_event)
            except KVOffloadError as e:
                self._loads.pop(tid, None)
                self._fail_load(tid, gpu, str(e))
                continue
            if event is not None:
                self._events[tid] = event
            if sync:
                self._sync_loads.append(tid)
        if metadata.store is not None:
            tid, gpu, cpu, req_ids = metadata.store
            self._stores[tid] = frozenset(req_ids)
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
        try:
            done = self._engine.wait_for(pending, SYNC_LOAD_TIMEOUT_S)
        except KVOffloadError as e:
            # The blocks cannot be trusted: report them failed so vLLM recomputes.
            logger.error("kvoffload: synchronous loads did not finish: %s", e)
            for tid in pending:
                gpu = self._loads.pop(tid, None)
                if gpu is not None:
                    self._abandoned.add(tid)
                    self._fail_load(tid, gpu, str(e))
            return
        for tid, ok, err in done:
            self._record(tid, ok, err)

    def store_after_forward(self, metadata: KVOffloadMetadata) -> None:
        """Runs the step's after-forward store (KV in host memory) and waits for it, so
        it is reported with this step.

        If it does not finish in time it stays in flight and is reported when it does:
        its blocks stay held until then, as nothing may reuse them while it reads them.
        """
        if metadata.store_after_forward is None:
            return
        tid, gpu, cpu, req_ids = metadata.store_after_forward
        if self._engine is None:
            self._record(tid, False, "no KV caches registered")
            return
        self._stores[tid] = frozenset(req_ids)
        try:
            self._engine.submit(tid, True, gpu, cpu, None)
        except KVOffloadError as e:
            self._stores.pop(tid, None)
            self._record(tid, False, str(e))
            return
        try:
            done = self._engine.wait_for([tid], STORE_AFTER_FORWARD_TIMEOUT_S)
        except (EngineShutdownError, DeviceError) as e:
            # The copy thread is gone: nothing reads the blocks any more, nothing would
            # ever report the store.
            self._stores.pop(tid, None)
            self._record(tid, False, str(e))
            return
        except KVOffloadError as e:
            logger.warning("kvoffload: store %d still running after the step: %s", tid, e)
            return
        for done_tid, ok, err in done:
            self._record(done_tid, ok, err)

    def poll(self) -> None:
        if self._engine is None:
            return
        for tid, ok, err in self._engine.poll():
            self._record(tid, ok, err)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_worker_meta(self) -> KVOffloadWorkerMetadata | None:
        if not self._done_ids:
            return None
        meta = KVOffloadWorkerMetadata(transfer_ids=self._done_ids, ok=self._done_ok)
        self._done_ids, self._done_ok = [], []
        return meta

    def stats(self) -> KVOffloadStats | None:
        if self._engine is None or not self._stats.due():
            return None
        return self._stats.delta(self._engine.stats())

    def shutdown(self) -> None:
        if self._engine is None:
            return
        try:
            self._engine.shutdown(SHUTDOWN_TIMEOUT_S)
        except KVOffloadError as e:
            logger.warning("kvoffload: transfer engine shutdown: %s", e)

    def _fail_load(self, tid: int, gpu: bytes, why: str) -> None:
        logger.warning("kvoffload: load %d failed: %s", tid, why)
        self._load_errors.update(block_list(gpu))
        self._done_ids.append(tid)
        self._done_ok.append(False)

    def _record(self, tid: int, ok: bool, err: str | None) -> None:
        if tid in self._abandoned:
            self._abandoned.discard(tid)
            return
        gpu = self._loads.pop(tid, None)
        self._stores.pop(tid, None)
        self._events.pop(tid, None)
        if not ok:
            if gpu is not None:
                self._load_errors.update(block_list(gpu))
            logger.warning("kvoffload: transfer %d failed: %s", tid, err)
        self._done_ids.append(tid)
        self._done_ok.append(ok)
