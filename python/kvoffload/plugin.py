"""vLLM plugin entry point: makes ``KVOffloadConnector`` selectable by name."""

from __future__ import annotations

CONNECTOR_NAME = "KVOffloadConnector"


def register() -> None:
    """Registers the connector with vLLM's factory; safe to call any number of times.

    vLLM runs every ``vllm.general_plugins`` entry point in every process it starts, so
    the name is known in the engine core and in each worker.
    """
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # vLLM not installed: nothing to register with.
        return
    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return
    KVConnectorFactory.register_connector(CONNECTOR_NAME, "kvoffload.connector", CONNECTOR_NAME)
