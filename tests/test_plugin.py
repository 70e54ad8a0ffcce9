"""Selecting the connector by name: the entry point, idempotent registration."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

pytest.importorskip("vllm")


def test_entry_point_is_installed() -> None:
    eps = entry_points(group="vllm.general_plugins")
    assert any(ep.value == "kvoffload.plugin:register" for ep in eps)


def test_registration_is_idempotent_and_resolves_the_class() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvoffload.connector import KVOffloadConnector
    from kvoffload.plugin import CONNECTOR_NAME, register

    register()
    register()
    assert KVConnectorFactory._registry[CONNECTOR_NAME]() is KVOffloadConnector


def test_module_path_selection_resolves_the_class() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvoffload.connector import KVOffloadConnector

    cfg = KVTransferConfig(
        kv_connector="KVOffloadConnector",
        kv_role="kv_both",
        kv_connector_module_path="kvoffload.connector",
    )
    assert KVConnectorFactory.get_connector_class(cfg) is KVOffloadConnector
