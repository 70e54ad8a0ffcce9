"""Selecting the connector by name: the entry point, idempotent registration."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

pytest.importorskip("vllm")


def test_entry_point_is_installed() -> None:
    eps = entry_points(group="vllm.general_plugins")
    assert any(ep.value == "kvoffload.plugin:register" for ep in eps)


def test_registration_is_idempotent_and_resolves_the_class() -> None:
    from kvoffload.connector import KVOffloadConnector
    from kvoffload.plugin import CONNECTOR_NAME, register
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    register()
    register()
    assert KVConnectorFactory._registry[CONNECTOR_NAME]() is KVOffloadConnector
