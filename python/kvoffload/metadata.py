"""Per-step metadata that crosses processes (pickled by vLLM's multiprocess executor)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvoffload.vllm_adapter import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

#: ``(transfer_id, req_id, gpu_blocks, cpu_blocks, valid, sync)``; block lists are
#: little-endian ``u32`` bytes, which pickle and cross into Rust without a Python object
#: per block. ``sync`` loads finish before the step's forward pass.
LoadSpec = tuple[int, str, bytes, bytes, bool, bool]
#: ``(transfer_id, gpu_blocks, cpu_blocks, req_ids)``.
StoreSpec = tuple[int, bytes, bytes, list[str]]
#: ``(transfer_id, req_id, keys, cpu_blocks, blocks, cpu_keys)``: fetch blocks by their
#: 16-byte remote keys into CPU blocks the scheduler reserved for them (``blocks``: each
#: one's ``(kv_cache_group, position in the request)``; ``cpu_keys``, with KV events on:
#: each one's key in the CPU tier, as the planner's events name it; workers use neither).
FetchSpec = tuple[int, str, bytes, bytes, list[tuple[int, int]], list[bytes]]


@dataclass
class KVOffloadMetadata(KVConnectorMetadata):
    """Scheduler -> workers: the step's copies."""

    loads: list[LoadSpec] = field(default_factory=list)
    store: StoreSpec | None = None
    #: KV in host memory, lazy mode: the step's store of blocks freed earlier, copied
    #: before its loads and forward pass (which may write blocks it reallocated), so they
    #: are never held (see ``OffloadWorker.submit``).
    store_before_forward: StoreSpec | None = None
    #: KV in host memory: the step's store runs after the forward pass, which writes some
    #: of its blocks, and is over when the step ends (see ``OffloadWorker.store_after_forward``).
    store_after_forward: StoreSpec | None = None
    #: Requests preempted this step: their GPU blocks may be reused by this step's
    #: forward, so in-flight stores reading them must finish first.
    preempted_req_ids: list[str] = field(default_factory=list)
    #: Remote tier: fetches into CPU blocks, and ``(hashes, cpu_blocks)`` of the step's
    #: store, which workers write behind once it completed.
    fetches: list[FetchSpec] = field(default_factory=list)
    store_hashes: tuple[bytes, bytes] | None = None


#: The metadata of every step that moves nothing, which is most steps. vLLM builds a
#: step's metadata right after allocating its scheduler output, so the next allocation is
#: where its garbage collector tends to run; one shared instance keeps the connector from
#: being that allocation. Never mutated: a step that moves anything gets its own.
IDLE_STEP = KVOffloadMetadata()


@dataclass
class KVOffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler: transfers this rank finished since its last report."""

    transfer_ids: list[int] = field(default_factory=list)
    ok: list[bool] = field(default_factory=list)
    #: Remote fetches finished: ``(transfer_id, leading blocks filled)``.
    fetched: list[tuple[int, int]] = field(default_factory=list)
    #: KV events on: each rank's disk changes, ``(rank, stored keys, removed keys)``
    #: (see ``kvoffload.disk_events``).
    disk: list[tuple[int, bytes, bytes]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVOffloadWorkerMetadata:
        if not isinstance(other, KVOffloadWorkerMetadata):
            return self
        return KVOffloadWorkerMetadata(
            transfer_ids=self.transfer_ids + other.transfer_ids,
            ok=self.ok + other.ok,
            fetched=self.fetched + other.fetched,
            disk=self.disk + other.disk,
        )


@dataclass
class KVOffloadHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler, once at startup (after KV caches are registered): the size of
    this rank's CPU pool, which the scheduler must never plan past."""

    num_cpu_blocks: int
