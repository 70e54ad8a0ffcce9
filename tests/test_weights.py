"""The identity of a checkpoint's weights (``kvoffload.weights``), part of the keys of
every tier that outlives the engine: other weights under the same name and shape never
share keys, the same weights always do, and ``kv_cache_version`` tells in-place updates
apart."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from kvoffload.weights import checkpoint_identity, weights_identity


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's shape with other random weights (seed 1)."""
    from tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("model") / "tiny_llama_seed1", seed=1)


def same_name_other_weights(tiny_model: Path, other_weights: Path, at: Path) -> Path:
    """``tiny_model``'s files (tokenizer, config) at ``at``, with ``other_weights``'
    weights: same name, same shape and tokens, other values."""
    shutil.copytree(tiny_model, at)
    assert json.loads((other_weights / "config.json").read_text()) == json.loads(
        (tiny_model / "config.json").read_text()
    )
    shutil.copy(other_weights / "model.safetensors", at / "model.safetensors")
    return at


def test_the_same_weights_have_one_identity_wherever_they_are(
    tiny_model: Path, tmp_path: Path
) -> None:
    copy = shutil.copytree(tiny_model, tmp_path / "elsewhere")
    assert checkpoint_identity(copy) == checkpoint_identity(tiny_model)
    assert checkpoint_identity(tiny_model).startswith("checkpoint:")


def test_other_weights_of_the_same_shape_have_another_identity(
    tiny_model: Path, other_weights: Path, tmp_path: Path
) -> None:
    swapped = same_name_other_weights(tiny_model, other_weights, tmp_path / "m")
    # Same file names, sizes, configs and safetensors header: only the values differ.
    header = (tiny_model / "model.safetensors").read_bytes()[:8]
    assert (swapped / "model.safetensors").read_bytes()[:8] == header
    n = struct.unpack("<Q", header)[0] + 8
    assert (swapped / "model.safetensors").read_bytes()[:n] == (
        tiny_model / "model.safetensors"
    ).read_bytes()[:n]
    assert checkpoint_identity(swapped) != checkpoint_identity(tiny_model)


def test_a_changed_config_or_index_changes_the_identity(tiny_model: Path, tmp_path: Path) -> None:
    copy = shutil.copytree(tiny_model, tmp_path / "m")
    base = checkpoint_identity(copy)
    config = json.loads((copy / "config.json").read_text())
    config["rope_theta"] = 1234.0
    (copy / "config.json").write_text(json.dumps(config))
    assert checkpoint_identity(copy) != base


def test_kv_cache_version_sets_apart_weights_updated_in_place() -> None:
    assert weights_identity("checkpoint:ab", None) == "checkpoint:ab"
    assert weights_identity("checkpoint:ab", "7") != weights_identity("checkpoint:ab", "8")
    assert weights_identity("checkpoint:ab", "7") != weights_identity("checkpoint:ab", None)


def test_the_checkpoint_vllm_loads_is_identified_or_named(tiny_model: Path) -> None:
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from kvoffload.vllm_adapter.config import checkpoint_of

    cfg = SimpleNamespace(
        model_config=SimpleNamespace(model=str(tiny_model), revision=None),
        load_config=SimpleNamespace(download_dir=None),
    )
    assert checkpoint_of(cfg) == checkpoint_identity(tiny_model)
    missing = SimpleNamespace(
        model_config=SimpleNamespace(model="no-such-org/no-such-model", revision="r1"),
        load_config=SimpleNamespace(download_dir=None),
    )
    assert checkpoint_of(missing) == "unresolved:no-such-org/no-such-model@r1"
