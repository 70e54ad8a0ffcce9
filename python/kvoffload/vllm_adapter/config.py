"""vLLM's configuration objects: the connector's settings, the KV cache groups and their
block geometry, the parallel layout, and the KV cache layout to ask vLLM for."""

from __future__ import annotations

from typing import Any

#: Environment variable that injects copy faults (tests), like the ``kvoffload.faults`` key.
FAULTS_ENV = "KVOFFLOAD_FAULTS"


def extra_config(vllm_config: Any) -> dict[str, Any]:
    """``kv_connector_extra_config`` (empty when absent), plus ``KVOFFLOAD_FAULTS`` from the
    environment when the config does not set ``kvoffload.faults``."""
    import os

    ktc = vllm_config.kv_transfer_config
    extra = dict(ktc.kv_connector_extra_config or {}) if ktc is not None else {}
    if "kvoffload.faults" not in extra and os.environ.get(FAULTS_ENV):
        extra["kvoffload.faults"] = os.environ[FAULTS_ENV]
    return extra


def world_size(vllm_config: Any) -> int:
    return int(vllm_config.parallel_config.world_size)


def checkpoint_of(vllm_config: Any) -> str:
    """The identity of the model's weights (``kvoffload.weights.checkpoint_identity``) of
    the checkpoint vLLM loads: the model directory or file, or for a hub id its snapshot in
    the local cache (never downloaded here). Computed once per process and model. A
    checkpoint that cannot be found is identified by name and revision only, with a
    warning: set ``kv_cache_version`` whenever its weights change."""
    model = vllm_config.model_config
    key = (str(model.model), str(getattr(model, "revision", None)))
    if key not in _CHECKPOINTS:
        _CHECKPOINTS[key] = _find_checkpoint(vllm_config)
    return _CHECKPOINTS[key]


_CHECKPOINTS: dict[tuple[str, str], str] = {}


def _find_checkpoint(vllm_config: Any) -> str:
    import os
    import time

    from kvoffload.vllm_adapter import logger
    from kvoffload.weights import checkpoint_identity

    model = vllm_config.model_config
    name, revision = str(model.model), getattr(model, "revision", None)
    path = name if os.path.exists(name) else None
    if path is None:
        try:
            from huggingface_hub import snapshot_download

            download_dir = getattr(getattr(vllm_config, "load_config", None), "download_dir", None)
            path = snapshot_download(
                name, revision=revision, cache_dir=download_dir, local_files_only=True
            )
        except Exception as e:
            logger.warning(
                "kvoffload: checkpoint of %s not found locally (%s); persisted and shared KV "
                "is keyed by its name and revision only: set kv_cache_version whenever its "
                "weights change",
                name,
                e,
            )
            return f"unresolved:{name}@{revision}"
    started = time.perf_counter()
    identity = checkpoint_identity(path)
    logger.info(
        "kvoffload: weights of %s identified as %s (%.0f ms)",
        path,
        identity,
        (time.perf_counter() - started) * 1e3,
    )
    return identity


def remote_layout(
    vllm_config: Any,
    block_size: int,
    tp_rank: int,
    kinds: list[tuple[str, int | None]],
    kv_cache_version: str | None = None,
) -> dict[str, Any]:
    """What decides the meaning of a block's bytes on this rank: the remote tier's keys
    (``offload_core::tier::KvLayout``), the weights included (their checkpoint's identity
    and the operator's ``kv_cache_version``). Scheduler and workers build it the same
    way. ``kinds``: the KV-cache groups' ``(kind, window)`` (see ``kv_group_kinds``), part
    of the model's identity: a group's blocks hold its layers only."""
    import os

    from vllm.v1.core.kv_cache_utils import DEFAULT_NONE_HASH_SEED

    from kvoffload.weights import weights_identity

    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    dtype = str(cache.cache_dtype)
    if dtype == "auto":
        dtype = str(model.dtype).removeprefix("torch.")
    # vLLM derives NONE_HASH from PYTHONHASHSEED when set, else (cryptographic hashes) from
    # a fixed default; a random per-process seed is refused by `remote_unsupported`.
    seed = os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED)
    groups = ",".join(kind if window is None else f"{kind}:{window}" for kind, window in kinds)
    return {
        "model_id": f"{model.model} [{groups}]",
        "dtype": dtype,
        "block_size": int(block_size),
        "num_layers": int(model.get_num_layers(parallel)),
        "num_kv_heads": int(model.get_num_kv_heads(parallel)),
        "head_size": int(model.get_head_size()),
        "tp_rank": int(tp_rank),
        "tp_size": int(parallel.tensor_parallel_size),
        "kv_cache_group": 0,
        "hash_algo": str(cache.prefix_caching_hash_algo),
        "none_hash_seed": seed,
        "weights": weights_identity(checkpoint_of(vllm_config), kv_cache_version),
    }


def remote_unsupported(vllm_config: Any, *, shared: bool = True) -> str | None:
    """Why this engine cannot use a tier below the CPU (with what to change), or ``None``.
    Every model the planner plans can: a lower-tier hit is what every KV-cache group can
    serve. ``shared``: whether blocks outlive the engine or go to others (a remote store,
    a persisted disk), so the block hashes must agree across processes."""
    import os

    from kvoffload._native import remote_sharing_problem

    parallel = vllm_config.parallel_config
    if int(getattr(parallel, "pipeline_parallel_size", 1)) != 1:
        return "pipeline parallelism is not supported by the remote tier"
    if int(getattr(parallel, "decode_context_parallel_size", 1)) != 1:
        return "decode context parallelism is not supported by the remote tier"
    if not shared:
        return None
    algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
    return remote_sharing_problem(algo, "PYTHONHASHSEED" in os.environ)


def tensor_parallel_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def prefix_caching_enabled(vllm_config: Any) -> bool:
    return bool(vllm_config.cache_config.enable_prefix_caching)


def kv_events_enabled(vllm_config: Any) -> bool:
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and cfg.enable_kv_cache_events)


def kv_in_host_memory() -> bool:
    """Whether vLLM keeps KV in host memory (its CPU backend): copies are memcpy."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def max_num_batched_tokens(vllm_config: Any) -> int:
    return int(vllm_config.scheduler_config.max_num_batched_tokens)


def num_kv_groups(kv_cache_config: Any) -> int:
    return len(kv_cache_config.kv_cache_groups)


#: KV-cache group kinds the planner knows which blocks a request holds of: full attention
#: (MLA included) keeps them all for the request's life; sliding window frees those before
#: its window, which the planner neither stores nor loads.
OFFLOADABLE_KINDS = frozenset({"full_attention", "mla_attention", "sliding_window", "mamba"})


def model_name(vllm_config: Any) -> str:
    model_config = getattr(vllm_config, "model_config", None)
    return str(getattr(model_config, "model", None) or "<unknown model>")


def unsupported_kv_groups(kv_cache_config: Any) -> list[tuple[int, str]]:
    """``(group index, kind)`` of every KV-cache group kvoffload cannot offload.

    Full attention (MLA included), sliding window and Mamba in vLLM's
    ``mamba_cache_mode="align"`` are planned per group (see ``offload_core::GroupKind``).
    Chunked-local and R-SWA groups, and Mamba groups in another cache mode or with
    speculative or prefill-checkpoint blocks (which vLLM relocates or rewrites in place),
    free or rewrite blocks of a running request by rules the planner does not model, so a
    store planned from the table vLLM scheduled could read blocks that already belong to
    someone else, and a hit could skip state the model needs.
    """
    from vllm.v1 import kv_cache_interface as kvi

    rswa = getattr(kvi, "RSWASpec", None)
    out: list[tuple[int, str]] = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        kind = str(kvi.get_kv_cache_spec_kind(spec).value)
        if rswa is not None and isinstance(spec, rswa):
            kind = "reference_sliding_window"
        if kind == "mamba":
            kind = (
                _mamba_unsupported(spec, getattr(kv_cache_config, "hash_block_size", None)) or kind
            )
        if kind not in OFFLOADABLE_KINDS:
            out.append((i, kind))
    return out


def _mamba_unsupported(spec: Any, hash_block_size: int | None) -> str | None:
    """The refused form of a Mamba group's kind (naming the setting), or ``None`` when
    its states are where the planner expects them: one per block boundary a chunk ended
    at, never moved, each keyed by its block's hash (vLLM's partial-block Mamba hits hash
    finer blocks and key states at sub-block positions)."""
    mode = str(getattr(spec, "mamba_cache_mode", None))
    if mode != "align":
        return f"mamba (mamba_cache_mode={mode!r}; kvoffload needs 'align')"
    if hash_block_size is not None and int(hash_block_size) != int(spec.block_size):
        return (
            f"mamba (hashed in {hash_block_size}-token blocks, one state per "
            f"{spec.block_size}-token block)"
        )
    for field in ("num_speculative_blocks", "num_prefill_checkpoint_blocks"):
        if int(getattr(spec, field, 0) or 0) > 0:
            return f"mamba ({field}={getattr(spec, field)})"
    return None


def kv_group_kinds(kv_cache_config: Any) -> list[tuple[str, int | None]]:
    """Per KV-cache group, the planner's ``(kind, window)``: a sliding-window group keeps
    ``sliding_window + extra_retained_tokens`` tokens (what vLLM's
    ``get_num_skipped_tokens`` leaves a request)."""
    from vllm.v1 import kv_cache_interface as kvi

    out: list[tuple[str, int | None]] = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        kind = str(kvi.get_kv_cache_spec_kind(spec).value)
        window = None
        if kind == "sliding_window":
            window = int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0) or 0)
        out.append((kind, window))
    return out


def kv_group_block_sizes(kv_cache_config: Any, vllm_config: Any) -> list[int]:
    """Tokens per block of each KV-cache group as vLLM's scheduler sees them (a group
    sharded by decode context parallelism spans ``block_size x dcp`` tokens, a Mamba
    state is not sharded)."""
    dcp = int(getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) or 1)
    return [
        int(g.kv_cache_spec.block_size)
        * (dcp if getattr(g.kv_cache_spec, "dcp_sharded", False) else 1)
        for g in kv_cache_config.kv_cache_groups
    ]


def block_size(kv_cache_config: Any, vllm_config: Any) -> int:
    """Tokens per block of the (single) KV-cache group as vLLM's scheduler sees them: what
    it hashes and allocates.

    Under decode context parallelism each rank holds ``1 / dcp`` of a block's tokens in its
    block of the same id, so a scheduler block spans ``block_size x dcp`` tokens (vLLM
    0.32's ``resolve_dcp_kv_block_size``; prefill context parallelism does not scale it).
    The planner counts in these blocks; each rank copies its share of the same block id.
    """
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    dcp = int(getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) or 1)
    sharded = bool(getattr(spec, "dcp_sharded", False))
    return int(spec.block_size) * (dcp if sharded else 1)


def num_gpu_blocks(kv_cache_config: Any) -> int:
    return int(kv_cache_config.num_blocks)


def bytes_per_block(kv_cache_config: Any) -> int:
    """Bytes one block id occupies across every layer of this rank.

    A CPU block holds a GPU block id's bytes in every KV tensor. vLLM's tensors describe
    where each layer's page of block 0 lies in one backing allocation
    (``offset + l * layer_stride``); with the hybrid allocator the groups' layers overlay
    the same bytes (a block id belongs to one group at a time), so the pages' union is
    counted, not their sum. Without that placement (older vLLM), every layer's page.
    """
    pages = {
        name: int(g.kv_cache_spec.page_size_bytes)
        for g in kv_cache_config.kv_cache_groups
        for name in g.layer_names
    }
    tensors = kv_cache_config.kv_cache_tensors
    if not tensors or not all(hasattr(t, "layer_stride") for t in tensors):
        return sum(pages.values())
    spans = sorted(
        (int(t.offset) + i * int(t.layer_stride), pages.get(name, int(t.block_stride)))
        for t in tensors
        for i, name in enumerate(t.layers)
    )
    total = 0
    covered = 0
    for start, size in spans:
        end = start + size
        if end > covered:
            total += end - max(start, covered)
            covered = end
    return total


#: Where a block of every layer is one contiguous run, keeping FlashAttention's preferred
#: block interior (tokens, then heads): one copy per block instead of one per layer.
BLOCK_OUTER_LAYOUT = "BLNHC"


def requested_kv_cache_layout(setting: str) -> str | None:
    """The KV cache layout name to ask vLLM for, given the ``kv_cache_layout`` key
    (``"auto"``, ``"engine"`` or a vLLM layout name), or ``None`` to ask for nothing.

    ``"auto"`` asks for :data:`BLOCK_OUTER_LAYOUT` on CUDA only: vLLM's CPU backend reads
    one layout, and vLLM would log a warning on every start before ignoring the request.
    """
    if setting == "engine":
        return None
    layouts: list[str] | None
    try:
        from vllm.v1.kv_cache_layout import KVCacheLayout

        layouts = list(KVCacheLayout.__members__)
    except ImportError:  # pragma: no cover - vLLM before named layouts
        layouts = None
    if setting == "auto":
        from vllm.platforms import current_platform

        on_cuda = current_platform.is_cuda()
        return BLOCK_OUTER_LAYOUT if on_cuda and layouts is not None else None
    if layouts is None or setting not in layouts:
        from kvoffload._native import ConfigError

        known = sorted(layouts or [])
        raise ConfigError(
            f"kv_cache_layout={setting!r} is not a KV cache layout of this vLLM "
            f'(known: {", ".join(known) or "none"}); use "auto", "engine" or one of them'
        )
    return setting
