"""KV tensors in every layout vLLM can give the worker (``vllm.v1.kv_cache_layout``), built
by vLLM's own ``create_kv_cache_views``: regions cover each block's bytes exactly once, a
block-outer layout makes a block of every layer one copy run, and blocks round-trip
through host memory byte for byte whatever the layout."""

from __future__ import annotations

import itertools
import struct
import time

import pytest

pytest.importorskip("vllm")

import torch

from kvoffload import parse_config
from kvoffload.metadata import KVOffloadMetadata
from kvoffload.vllm_adapter import (
    BLOCK_OUTER_LAYOUT,
    kv_regions,
    requested_kv_cache_layout,
)
from kvoffload.worker import OffloadWorker

kv_cache_layout = pytest.importorskip("vllm.v1.kv_cache_layout")
from layout_views import vllm_kv_caches as make_kv_caches  # noqa: E402

LAYOUTS = [layout.name for layout in kv_cache_layout.KVCacheLayout]
NUM_LAYERS, NUM_BLOCKS = 4, 8


def vllm_kv_caches(layout: str) -> tuple[dict[str, torch.Tensor], torch.Tensor, int]:
    return make_kv_caches(layout, num_layers=NUM_LAYERS, num_blocks=NUM_BLOCKS)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_regions_cover_every_block_exactly_once(layout: str) -> None:
    kv, raw, page = vllm_kv_caches(layout)
    for view in kv.values():
        for b in range(NUM_BLOCKS):
            view[b].fill_(b + 1)
    regions = kv_regions(kv, NUM_BLOCKS)
    base = raw.data_ptr()
    for b in range(NUM_BLOCKS):
        spans = sorted(
            (r.base - base + b * r.block_stride, r.block_bytes)
            for r in regions
            if r.num_blocks == NUM_BLOCKS
        )
        assert sum(n for _, n in spans) == NUM_LAYERS * page
        for (start, n), (next_start, _) in itertools.pairwise(spans):
            assert start + n <= next_start, f"{layout}: regions overlap in block {b}"
        for start, n in spans:
            held = raw[start : start + n].view(torch.float16)
            assert bool((held == b + 1).all()), f"{layout}: block {b} region holds other bytes"


@pytest.mark.parametrize("layout", ["BLNHC", "BLHNC", "BHLNC"])
def test_block_outer_layouts_are_one_region(layout: str) -> None:
    kv, _, page = vllm_kv_caches(layout)
    (region,) = kv_regions(kv, NUM_BLOCKS)
    assert region.block_bytes == region.block_stride == NUM_LAYERS * page


def ids(*xs: int) -> bytes:
    return struct.pack(f"<{len(xs)}I", *xs)


def round_trip(layout: str) -> int:
    """Stores blocks 2, 3 and 5, wipes the GPU copy, loads them back into 5, 6 and 7 and
    checks every byte; returns the copy runs the engine submitted."""
    kv, raw, page = vllm_kv_caches(layout)
    raw.copy_(torch.randint(-128, 127, raw.shape, dtype=torch.int8))
    # Random bytes hold float NaNs, which never compare equal: compare bit patterns.
    kv = {name: view.view(torch.int16) for name, view in kv.items()}
    before = {name: view.clone() for name, view in kv.items()}
    config, _ = parse_config({"cpu_bytes_to_use": 4 * NUM_LAYERS * page}, 1)
    worker = OffloadWorker(config, num_gpu_blocks=NUM_BLOCKS)
    worker.register_kv_caches(kv)
    try:
        worker.submit(KVOffloadMetadata(store=(1, ids(2, 3, 5), ids(0, 1, 2), ["r"])))
        wait_reported(worker, 1)
        raw.zero_()
        worker.submit(KVOffloadMetadata(loads=[(2, "s", ids(5, 6, 7), ids(0, 1, 2), True, False)]))
        wait_reported(worker, 1)
        for name, view in kv.items():
            for src, dst in [(2, 5), (3, 6), (5, 7)]:
                assert torch.equal(view[dst], before[name][src]), (layout, name, src)
        assert worker.engine is not None
        return int(dict(worker.engine.stats())["runs_submitted"])
    finally:
        worker.shutdown()


def wait_reported(worker: OffloadWorker, n: int) -> None:
    deadline = time.monotonic() + 10
    seen = 0
    while seen < n:
        assert time.monotonic() < deadline, "the transfer was never reported"
        worker.poll()
        meta = worker.take_worker_meta()
        if meta is not None:
            assert all(meta.ok), meta
            seen += len(meta.transfer_ids)
        time.sleep(0.005)


def test_block_outer_layout_round_trips_in_fewer_copy_runs() -> None:
    layer_outer = round_trip("LBNHC")
    block_outer = round_trip(BLOCK_OUTER_LAYOUT)
    assert block_outer * NUM_LAYERS == layer_outer, (block_outer, layer_outer)


@pytest.mark.parametrize("layout", ["LBHNC", "LHBNC", "BHLNC"])
def test_every_layout_round_trips_byte_for_byte(layout: str) -> None:
    assert round_trip(layout) > 0


def test_the_layout_request_follows_the_config_key() -> None:
    from kvoffload import ConfigError

    assert requested_kv_cache_layout("engine") is None
    # vLLM's CPU backend reads one layout only: "auto" asks for nothing there.
    assert requested_kv_cache_layout("auto") is None
    assert requested_kv_cache_layout("BHLNC") == "BHLNC"
    # Shaped like a layout name, so the config parser lets it through; vLLM has no such
    # layout, and the error lists the ones it has.
    with pytest.raises(ConfigError, match=r"kv_cache_layout='NLBHC'.*BLNHC"):
        requested_kv_cache_layout("NLBHC")
    with pytest.raises(ConfigError, match="kv_cache_layout"):
        parse_config({"kv_cache_layout": "NHD"}, 1)
