"""kvoffload: a CPU KV-cache offloading connector for vLLM with a Rust engine.

Select it in vLLM with ``kv_transfer_config={"kv_connector": "KVOffloadConnector",
"kv_role": "kv_both"}``; the name is registered by the ``vllm.general_plugins`` entry
point. Importing this package does not import vLLM or torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvoffload._native import (
    ConfigError,
    DeviceError,
    EngineShutdownError,
    HostMemoryError,
    InvalidInputError,
    KVOffloadError,
    QueueFullError,
    RemoteTierError,
    TransferError,
    UnknownRequestError,
    UnknownTransferError,
    __version__,
    parse_config,
)

if TYPE_CHECKING:
    from kvoffload.connector import KVOffloadConnector

__all__ = [
    "ConfigError",
    "DeviceError",
    "EngineShutdownError",
    "HostMemoryError",
    "InvalidInputError",
    "KVOffloadConnector",
    "KVOffloadError",
    "QueueFullError",
    "RemoteTierError",
    "TransferError",
    "UnknownRequestError",
    "UnknownTransferError",
    "__version__",
    "parse_config",
]


def __getattr__(name: str) -> Any:
    # The connector imports vLLM; load it only when asked for.
    if name == "KVOffloadConnector":
        from kvoffload.connector import KVOffloadConnector

        return KVOffloadConnector
    raise AttributeError(f"module 'kvoffload' has no attribute {name!r}")
