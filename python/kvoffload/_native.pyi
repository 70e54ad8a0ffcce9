"""Typed stubs for the Rust extension ``kvoffload._native`` (crates/offload-py)."""

from collections.abc import Collection, Mapping, Sequence
from typing import Any, Literal, final

__all__ = [
    "ConfigError",
    "DeviceError",
    "EngineShutdownError",
    "HostMemoryError",
    "InvalidInputError",
    "KVOffloadError",
    "LazyCandidates",
    "OffloadConfig",
    "Planner",
    "QueueFullError",
    "RemoteTierError",
    "TransferEngine",
    "TransferError",
    "UnknownRequestError",
    "UnknownTransferError",
    "WorkerTier",
    "__version__",
    "parse_config",
    "remote_sharing_problem",
    "tier_block_hash",
]

__version__: str

# ---- errors: one class per core error kind, all under KVOffloadError -----------------

class KVOffloadError(Exception): ...
class ConfigError(KVOffloadError, ValueError): ...
class InvalidInputError(KVOffloadError, ValueError): ...
class UnknownRequestError(KVOffloadError, LookupError): ...
class UnknownTransferError(KVOffloadError, LookupError): ...
class TransferError(KVOffloadError, RuntimeError): ...
class QueueFullError(KVOffloadError, RuntimeError): ...
class EngineShutdownError(KVOffloadError, RuntimeError): ...
class DeviceError(KVOffloadError, RuntimeError): ...
class HostMemoryError(KVOffloadError, MemoryError): ...
class RemoteTierError(KVOffloadError, RuntimeError): ...

# ---- config ---------------------------------------------------------------------------

@final
class OffloadConfig:
    @property
    def cpu_bytes_per_rank(self) -> int: ...
    @property
    def lazy_offload(self) -> bool: ...
    @property
    def world_size(self) -> int: ...
    @property
    def faults(self) -> str | None: ...
    @property
    def kv_cache_layout(self) -> str:
        """``"auto"``, ``"engine"`` or a vLLM layout name (upper case)."""
    @property
    def kv_cache_version(self) -> str | None:
        """The operator's version of the weights, part of persisted/shared KV keys."""
    @property
    def remote(self) -> dict[str, Any] | None:
        """The remote tier's settings (``url`` with passwords masked, ``namespace``,
        ``timeout_ms``, ``write``, ``max_inflight_bytes``), or ``None``."""
    @property
    def disk(self) -> dict[str, Any] | None:
        """The disk tier's settings (``path``, ``capacity_bytes``, ``buffer_slots``,
        ``use_page_cache``, ``persist``, ``cpu_in_front``), or ``None``."""
    @property
    def has_lower_tier(self) -> bool: ...
    @property
    def writes_lower(self) -> bool: ...
    @property
    def cpu_stages_only(self) -> bool: ...
    def staged(self, serve_blocks: int, bytes_per_block: int) -> OffloadConfig: ...
    def num_cpu_blocks(self, bytes_per_block: int) -> int: ...
    def sync_loads(self, kv_in_host_memory: bool) -> bool: ...

def parse_config(
    extra: Mapping[str, Any] | None, world_size: int
) -> tuple[OffloadConfig, list[str]]:
    """Validates ``kv_connector_extra_config``; returns the config and warnings.

    Raises ``ConfigError`` naming the key and the value for every invalid value."""

# ---- scheduler side -------------------------------------------------------------------

#: ``(transfer_id, req_id, gpu_blocks, cpu_blocks, valid, sync)``; block lists are
#: little-endian u32 bytes.
_LoadTuple = tuple[int, str, bytes, bytes, bool, bool]
#: ``(transfer_id, gpu_blocks, cpu_blocks, req_ids)``.
_StoreTuple = tuple[int, bytes, bytes, list[str]]
#: With events on, per stored block: the planner's key (16 bytes, as ``take_events``
#: names the block), its source (request index in ``req_ids`` and block position;
#: ``None``: lazy) and for a lazy block vLLM's hash (``BlockHashWithGroupId``; the list
#: is empty when no block is lazy).
_StoreEvents = tuple[list[bytes], list[tuple[int, int] | None], list[bytes | None]]
#: ``(loads, store, held_gpu_blocks, store_events, store_groups)``.
_StepTuple = tuple[list[_LoadTuple], _StoreTuple | None, list[int], _StoreEvents | None, list[int]]
#: ``(transfer_id, req_id, keys, cpu_blocks, blocks, cpu_keys)``.
_FetchTuple = tuple[int, str, bytes, bytes, list[tuple[int, int]], list[bytes]]

@final
class LazyCandidates:
    """GPU blocks a free-queue walk found for the planner (``Planner.walk_free_queue``);
    their keys stay in Rust. ``Planner.offer_lazy`` and the next ``schedule_lazy`` or
    ``schedule_output`` take them: a second use finds none."""
    def __len__(self) -> int: ...
    @property
    def gpu_block_ids(self) -> list[int]:
        """The candidates' GPU block ids, least recently used first."""

@final
class Planner:
    def __new__(
        cls,
        block_size: int,
        num_cpu_blocks: int,
        world_size: int = 1,
        lazy: bool = False,
        events: bool = False,
        sync_loads: bool = False,
        stores_after_forward: bool = False,
        groups: Sequence[tuple[str, int | None]] | None = None,
    ) -> Planner:
        """``stores_after_forward``: each step's store is copied within the step (KV in
        host memory), an eager one after the forward pass, a lazy one before it.
        ``groups``: per KV-cache group, vLLM's spec kind (``"full_attention"``,
        ``"mla_attention"``, ``"sliding_window"``) and the tokens a sliding-window group
        keeps (``sliding_window + extra_retained_tokens``; ``None`` otherwise). Omitted:
        one full-attention group."""
    def lookup(
        self,
        req_id: str,
        block_hashes: Sequence[bytes],
        num_tokens: int,
        num_computed_tokens: int,
    ) -> int | None:
        """``None`` while a remote tier is being asked: ask again next step."""
    def attach_remote(self, config: OffloadConfig, layout: Mapping[str, Any]) -> None:
        """Connects the remote tier of ``config`` with the keys of ``layout``; raises
        ``RemoteTierError`` when the store cannot be used."""
    def take_fetches(self) -> list[_FetchTuple]:
        """``(transfer_id, req_id, keys, cpu_blocks, blocks, cpu_keys)``: 16-byte remote
        keys, u32 ids; ``blocks``: each block's ``(kv_cache_group, position in the
        request)``; ``cpu_keys`` (events on; else empty): each block's key in the CPU
        tier, as ``take_events`` names it."""
    def complete_fetches(self, reports: list[tuple[int, int]]) -> list[int]:
        """Applies per-rank reports ``(transfer_id, filled)``; the fetches now retired."""
    def block_hashes(self, cpu_blocks: bytes) -> tuple[bytes, bytes]:
        """``(hashes, cpu_blocks)`` of the blocks that hold a hash."""
    @property
    def has_remote(self) -> bool: ...
    def remote_hit_tokens(self, req_id: str) -> int:
        """Tokens of the request's hit its fetch from the tier below the CPU brought (they
        follow the tokens that were on CPU already); 0 without one."""
    def on_alloc(
        self,
        req_id: str,
        gpu_block_ids: Sequence[int] | tuple[Sequence[int], ...] | None,
        num_computed_tokens: int,
        num_external_tokens: int,
    ) -> None:
        """``gpu_block_ids``: a tuple of one list per KV-cache group (vLLM's
        ``KVCacheBlocks.get_block_ids()``), or the list of a model with one group."""
    def on_alloc_blocks(
        self,
        req_id: str,
        blocks: tuple[Sequence[Any], ...] | Sequence[Any],
        num_computed_tokens: int,
        num_external_tokens: int,
    ) -> None:
        """``on_alloc`` given vLLM's allocated blocks (``KVCacheBlocks.blocks``: a tuple
        of one sequence of objects with a ``block_id`` per KV-cache group, or the
        sequence of a model with one group): only the blocks the load fills are read."""
    def schedule(
        self,
        new_req_ids: list[str],
        new_num_computed: list[int],
        new_block_ids: list[Any],
        cached_req_ids: list[str],
        cached_num_computed: list[int],
        cached_new_block_ids: list[Any],
        resumed_req_ids: Collection[str],
        hash_lists: Mapping[str, Sequence[bytes]],
        lazy_gpu_block_ids: list[int] | None = None,
        lazy_block_hashes: list[bytes] | None = None,
        strip: int = 0,
        num_scheduled_tokens: Mapping[str, int] | None = None,
    ) -> _StepTuple:
        """Returns ``(loads, store, held_gpu_blocks, store_events, store_groups)``: held
        GPU blocks (lazy mode's selected blocks, none with ``stores_after_forward``, where
        a lazy store is copied before the step's forward pass; sliding-window blocks a
        multi-group store reads) must be kept from reuse until ``complete`` releases
        them; with events on and a store, ``store_events`` (see ``_StoreEvents``) says
        what each stored block's KV event needs; with several KV-cache groups,
        ``store_groups`` says each stored block's group. The lazy lists are for callers
        that do not walk vLLM's queue (``walk_free_queue``)."""
    def schedule_output(
        self,
        scheduler_output: Any,
        hash_lists: Mapping[str, Sequence[bytes]],
        lazy: LazyCandidates | None = None,
        after_forward: bool = False,
    ) -> _StepTuple | None:
        """``schedule`` for vLLM: the request lists are read from its ``SchedulerOutput``
        (``scheduled_new_reqs``, ``scheduled_cached_reqs``, and ``num_scheduled_tokens``
        with ``after_forward``, for planners whose stores run after the forward pass),
        the lazy candidates are a free-queue walk's; ``None`` when the step moves and
        holds nothing."""
    def schedule_lazy(self, lazy: LazyCandidates | None = None) -> _StepTuple | None:
        """``schedule`` for a planner that does not read the scheduled requests
        (``reads_scheduled_requests`` false): only a free-queue walk's lazy candidates;
        ``None`` when the step plans nothing. Refused (``InvalidInputError``) by other
        planners."""
    def request_finished(
        self, req_id: str, block_hashes: Sequence[bytes], num_computed_tokens: int
    ) -> bool: ...
    def complete(
        self, transfer_ids: list[int], ok: list[bool]
    ) -> tuple[list[str], list[str], list[int], list[int], list[int]]:
        """Returns ``(finished_sending, finished_recving, load_error_blocks,
        released_gpu_blocks, retired_stores)`` (``retired_stores``: with events on, the
        store transfers that retired, published or failed)."""
    def take_events(self) -> list[tuple[Any, ...]]: ...
    def reset(self) -> None: ...
    def has_work_in_flight(self) -> bool: ...
    def has_pending_plan(self) -> bool: ...
    @property
    def num_groups(self) -> int: ...
    @property
    def num_requests(self) -> int: ...
    @property
    def num_cpu_blocks(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    def stats(self) -> list[tuple[str, int]]: ...
    def offer_lazy(self, candidates: LazyCandidates) -> list[int]:
        """Lazy mode: selects blocks among ``candidates`` (taken) for the next step's
        store now; returns the ids to hold from now on (none with
        ``stores_after_forward``: that store is copied before the next forward pass)."""
    def walk_free_queue(
        self, start: Any, tail: Any, limit: int, strip: int
    ) -> tuple[Any | None, bool, LazyCandidates]:
        """Lazy mode: examines up to ``limit`` nodes of vLLM's GPU free queue from
        ``start``, stopping at ``tail``; returns ``(last_node, at_tail, candidates)``
        with the cached blocks (hash ``bytes`` ending in ``strip`` bytes of group id)
        whose key the CPU tier neither holds nor is storing, in queue order.
        ``last_node`` is ``None`` when no node was examined; blocks skipped as present are
        counted in ``dedup_skipped``. An eager planner returns no block."""
    @property
    def reads_scheduled_requests(self) -> bool:
        """Whether ``schedule`` reads the request lists (a lazy planner does not)."""
    def take_stats_report(self) -> tuple[dict[str, int], dict[str, int]] | None:
        """What changed since the previous call: ``({counter: increase},
        {gauge: value})`` with the counters that grew and the gauges that changed
        (``cpu_blocks_used``, ``cpu_blocks_capacity``); ``None`` when nothing did."""

# ---- worker side ----------------------------------------------------------------------

#: ``(transfer_id, ok, error message or None)``.
_CompletionTuple = tuple[int, bool, str | None]

@final
class TransferEngine:
    def __new__(
        cls,
        regions: Sequence[tuple[int, int, int, int]],
        num_cpu_blocks: int,
        tensors: Sequence[Any],
        hugepages: bool = True,
        backend: Literal["host", "cuda"] = "host",
        device: int = 0,
        cuda_batch: bool = True,
        faults: str | None = None,
    ) -> TransferEngine: ...
    @staticmethod
    def _unchecked(
        regions: Sequence[tuple[int, int, int, int]],
        num_cpu_blocks: int,
        hugepages: bool = True,
        backend: Literal["host", "cuda"] = "host",
        device: int = 0,
        cuda_batch: bool = True,
        faults: str | None = None,
    ) -> TransferEngine:
        """UNCHECKED raw addresses: a wrong one is memory corruption (tests, tools)."""
    def submit(
        self,
        transfer_id: int,
        store: bool,
        gpu_blocks: bytes,
        cpu_blocks: bytes,
        wait_event: int | None = None,
    ) -> None: ...
    def poll(self) -> list[_CompletionTuple]: ...
    def wait_for(self, transfer_ids: list[int], timeout_s: float) -> list[_CompletionTuple]: ...
    def shutdown(self, timeout_s: float = 5.0) -> None: ...
    def unregister(self, timeout_s: float = 5.0) -> None: ...
    def register(
        self, regions: Sequence[tuple[int, int, int, int]], tensors: Sequence[Any]
    ) -> None: ...
    @property
    def registered(self) -> bool: ...
    def read_cpu_block(self, region: int, cpu_block: int) -> bytes: ...
    def write_cpu_block(self, region: int, cpu_block: int, data: bytes) -> None: ...
    @property
    def num_cpu_blocks(self) -> int: ...
    @property
    def cpu_block_bytes(self) -> int: ...
    @property
    def host_bytes(self) -> int: ...
    @property
    def backend(self) -> str: ...
    @property
    def backend_detail(self) -> str: ...
    @property
    def ready(self) -> bool: ...
    def wait_ready(self, timeout_s: float) -> None: ...
    @property
    def stopped(self) -> str | None: ...
    def stats(self) -> list[tuple[str, int]]: ...

@final
class WorkerTier:
    def __new__(
        cls,
        engine: TransferEngine,
        config: OffloadConfig,
        layout: Mapping[str, Any],
        events: bool = False,
    ) -> WorkerTier: ...
    @property
    def writes(self) -> bool: ...
    def fetch(self, transfer_id: int, hashes: bytes, cpu_blocks: bytes) -> None: ...
    def take_reports(self) -> list[tuple[int, int]]: ...
    def write_stored(self, hashes: bytes, cpu_blocks: bytes) -> int: ...
    def stats(self) -> list[tuple[str, int]]: ...
    def take_disk_changes(self) -> tuple[bytes, bytes]:
        """Blocks that came onto this rank's disk and left it since the last call:
        ``(stored, removed)`` 16-byte hashes concatenated."""
    def shutdown(self, drain_s: float = 1.0) -> None: ...

def tier_block_hash(group: int, block_hash: bytes) -> bytes:
    """The 16-byte key the tiers below the CPU give vLLM's ``block_hash`` of ``group``."""

def remote_sharing_problem(hash_algo: str, pythonhashseed_set: bool) -> str | None:
    """Why engines with this hash setup cannot share blocks (with the fix), or ``None``."""
