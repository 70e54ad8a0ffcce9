"""Selecting the connector by name: the entry point, idempotent registration."""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvoffload.connector import KVOffloadConnector


class CountingConnector(KVOffloadConnector):
    """Overrides a per-step method, as a subclass may."""

    metas = 0

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        CountingConnector.metas += 1
        return super().build_connector_meta(scheduler_output)


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


def test_a_subclass_override_of_a_per_step_method_is_called(tmp_path: Path) -> None:
    """The connector binds its per-step methods straight to its scheduler; a subclass
    selected by module path (as the tests' tracing connector is) keeps its override."""
    from sched_harness import build_scheduler, full_attention, kv_cache_config, model_config_dir

    layers = ["model.layers.0.self_attn.attn"]
    sched = build_scheduler(
        model_config_dir(tmp_path),
        kv_cache_config(64, [(layers, full_attention())]),
        connector="CountingConnector",
        module_path=__name__,
        extra={"cpu_bytes_to_use": 1 << 20},
    )
    assert type(sched.get_kv_connector()) is CountingConnector
    sched.schedule()
    sched.schedule()
    assert CountingConnector.metas == 2
