#!/usr/bin/env python3
"""Where vLLM's per-layer KV layout loses copy bandwidth: a probe for one GPU session.

    python scripts/gpu_copy_probe.py --out probe.json

vLLM (0.32) keeps each layer's K and V in their own tensors, so one 16-token block of a
Llama-3-8B-shaped cache is 64 copies of 32 KiB. ``gpu_check.py`` measured kvoffload's
``cuMemcpyBatchAsync`` path at well under one large pinned copy's bandwidth there, and a
16-block load submitted behind large stores waited for them. This probe separates the
candidate causes, on the same geometry (64 regions, 32 KiB per copy, scattered ids):

- one batch call on one stream: the call's CPU time (does the driver block while its queue
  is full?) and the bandwidth;
- the same copies split over 2, 4 and 8 streams (several copy engines at once);
- the same copies in batch calls of 2048 (bounded work per call);
- a copy kernel (SMs, not copy engines) reading and writing pinned host memory directly,
  at several grid sizes;
- the decode proxy of ``gpu_check.py`` slowed down by the kernel and by 4-stream copies.

Needs torch and cupy with CUDA (both on the project's GPU machine); not part of CI.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gpu_measure as gc

REGIONS = 2 * gc.LAYERS
CHUNK = gc.HALF_BLOCK_BYTES  # 32 KiB
BLOCKS = 4096  # per region on the host; twice that on the device, to scatter 4096

KERNEL = r"""
extern "C" __global__ void copy_chunks(const unsigned long long* __restrict__ src,
                                       const unsigned long long* __restrict__ dst, int n) {
    // One chunk of 2048 16-byte words per block iteration, eight loads in flight per thread.
    for (int i = blockIdx.x; i < n; i += gridDim.x) {
        const int4* s = reinterpret_cast<const int4*>(src[i]);
        int4* d = reinterpret_cast<int4*>(dst[i]);
        int4 v[8];
#pragma unroll
        for (int k = 0; k < 8; k++) v[k] = s[threadIdx.x + k * 256];
#pragma unroll
        for (int k = 0; k < 8; k++) d[threadIdx.x + k * 256] = v[k];
    }
}
"""


class MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("src_access_order", ctypes.c_uint),
        ("src_loc_type", ctypes.c_uint),
        ("src_loc_id", ctypes.c_int),
        ("dst_loc_type", ctypes.c_uint),
        ("dst_loc_id", ctypes.c_int),
        ("flags", ctypes.c_uint),
    ]


class Probe:
    def __init__(self, torch: Any, cupy: Any) -> None:
        self.torch = torch
        self.cupy = cupy
        dev = torch.device("cuda", 0)
        self.dev = [
            torch.empty(2 * BLOCKS * CHUNK, dtype=torch.uint8, device=dev) for _ in range(REGIONS)
        ]
        for t in self.dev:
            t.random_()
        self.host = torch.empty(REGIONS * BLOCKS * CHUNK, dtype=torch.uint8, pin_memory=True)
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.batch = self.lib.cuMemcpyBatchAsync_v2
        self.batch.restype = ctypes.c_int
        self.attrs = MemcpyAttributes(1, 0, 0, 0, 0, 1)
        self.kernel = cupy.RawKernel(KERNEL, "copy_chunks")
        self.streams = [torch.cuda.Stream(priority=0) for _ in range(8)]

    def copies(self, n: int, seed: int) -> tuple[list[int], list[int]]:
        """(device addresses, host addresses) of n scattered blocks in every region."""
        rng = random.Random(seed)
        gpu = gc.scattered(n, 2 * BLOCKS, rng)
        cpu = rng.sample(range(BLOCKS), n)
        hbase = self.host.data_ptr()
        dev, host = [], []
        for r, t in enumerate(self.dev):
            base = t.data_ptr()
            for g, c in zip(gpu, cpu, strict=True):
                dev.append(base + g * CHUNK)
                host.append(hbase + (r * BLOCKS + c) * CHUNK)
        return dev, host

    def plan(self, src: list[int], dst: list[int], streams: int, per_call: int) -> list[Any]:
        """The batch calls that copy `src` to `dst` over `streams` streams, at most
        `per_call` copies per call, with their argument arrays built ahead of timing."""
        n = len(src)
        share = -(-n // streams)
        calls = []
        for s in range(streams):
            for lo in range(s * share, min(n, (s + 1) * share), per_call):
                hi = min(n, (s + 1) * share, lo + per_call)
                count = hi - lo
                calls.append(
                    (
                        s,
                        (ctypes.c_uint64 * count)(*dst[lo:hi]),
                        (ctypes.c_uint64 * count)(*src[lo:hi]),
                        (ctypes.c_size_t * count)(*([CHUNK] * count)),
                        count,
                    )
                )
        return calls

    def dma(self, calls: list[Any]) -> tuple[float, float]:
        """Runs a plan: (wall seconds to completion, CPU seconds inside the driver calls)."""
        idx = (ctypes.c_size_t * 1)(0)
        in_calls = 0.0
        start = time.perf_counter()
        for s, dsts, srcs, sizes, count in calls:
            t0 = time.perf_counter()
            rc = self.batch(
                dsts,
                srcs,
                sizes,
                ctypes.c_size_t(count),
                ctypes.byref(self.attrs),
                idx,
                ctypes.c_size_t(1),
                ctypes.c_void_p(self.streams[s].cuda_stream),
            )
            in_calls += time.perf_counter() - t0
            if rc != 0:
                raise RuntimeError(f"cuMemcpyBatchAsync_v2 returned {rc}")
        for s in {c[0] for c in calls}:
            self.streams[s].synchronize()
        return time.perf_counter() - start, in_calls

    def table(self, addrs: list[int]) -> Any:
        return self.cupy.asarray(addrs, dtype=self.cupy.uint64)

    def sm_copy(self, src: Any, dst: Any, grid: int, stream: Any) -> float:
        """The copy kernel over device-resident address tables, on `stream`."""
        start = time.perf_counter()
        with self.cupy.cuda.ExternalStream(stream.cuda_stream):
            self.kernel((grid,), (256,), (src, dst, self.cupy.int32(len(src))))
        stream.synchronize()
        return time.perf_counter() - start

    def chunk(self, addr: int) -> Any:
        """The 32 KiB at `addr`, as a uint8 tensor view (device or pinned host)."""
        for t in [*self.dev, self.host]:
            off = addr - t.data_ptr()
            if 0 <= off < t.numel():
                return t[off : off + CHUNK]
        raise ValueError(f"address {addr:#x} is in no buffer")


def best(fn: Callable[[], float], reps: int = 3) -> float:
    fn()
    return statistics.median(fn() for _ in range(reps))


def check_bytes(probe: Probe, n: int) -> bool:
    """The kernel's D2H then H2D copies land the source bytes (spot check of 3 chunks each)."""
    torch = probe.torch
    stream = probe.streams[0]
    dev, host = probe.copies(n, seed=99)
    back, _ = probe.copies(n, seed=100)
    probe.sm_copy(probe.table(dev), probe.table(host), 64, stream)
    picks = (0, len(dev) // 2, len(dev) - 1)
    ok = all(torch.equal(probe.chunk(dev[k]).cpu(), probe.chunk(host[k])) for k in picks)
    probe.sm_copy(probe.table(host), probe.table(back), 64, stream)
    return ok and all(torch.equal(probe.chunk(back[k]).cpu(), probe.chunk(host[k])) for k in picks)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="probe.json")
    args = parser.parse_args()
    import cupy
    import torch

    probe = Probe(torch, cupy)
    results: dict[str, Any] = {"chunk_bytes": CHUNK, "regions": REGIONS, "rows": []}
    results["kernel_round_trip_ok"] = check_bytes(probe, 64)
    print(f"kernel round trip bytes equal: {results['kernel_round_trip_ok']}", flush=True)

    def row(**kw: Any) -> None:
        results["rows"].append(kw)
        print(kw, flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")

    for n in (256, 4096):
        dev, host = probe.copies(n, seed=n)
        nbytes = len(dev) * CHUNK
        for d2h in (True, False):
            src, dst = (dev, host) if d2h else (host, dev)
            way = "D2H" if d2h else "H2D"
            for streams, per_call in (
                (1, 1 << 30),
                (1, 2048),
                (2, 1 << 30),
                (4, 1 << 30),
                (8, 1 << 30),
            ):
                calls = probe.plan(src, dst, streams, per_call)
                runs = [probe.dma(calls) for _ in range(4)][1:]
                wall = statistics.median(r[0] for r in runs)
                row(
                    blocks=n,
                    way=way,
                    path="dma",
                    streams=streams,
                    per_call=min(per_call, len(dev)),
                    gbps=gc.gbps(nbytes, wall),
                    call_ms=statistics.median(r[1] for r in runs) * 1e3,
                )
            tables = probe.table(src), probe.table(dst)
            for grid in (8, 16, 32, 66, 132, 264):
                wall = best(lambda g=grid, t=tables: probe.sm_copy(*t, g, probe.streams[0]))
                row(blocks=n, way=way, path="kernel", grid=grid, gbps=gc.gbps(nbytes, wall))

    proxy = gc.DecodeProxy(torch, torch.device("cuda", 0))
    dev, host = probe.copies(256, seed=5)
    low = torch.cuda.Stream(priority=0)
    dev_t, host_t = probe.table(dev), probe.table(host)

    def interference(label: str, copy: Callable[[], None]) -> None:
        stop = threading.Event()
        moved = [0]

        def loop() -> None:
            while not stop.is_set():
                copy()
                moved[0] += 2 * len(dev) * CHUNK

        proxy.run(3)
        iters = max(10, int(1.5 / (proxy.run(10) / 10)))
        alone = min(proxy.run(iters) for _ in range(2))
        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        time.sleep(0.2)
        t0 = time.perf_counter()
        busy = proxy.run(iters)
        elapsed = time.perf_counter() - t0
        stop.set()
        thread.join(60)
        row(
            decode=label,
            step_ms=alone / iters * 1e3,
            slowdown_pct=(busy / alone - 1) * 100,
            copy_gbps=gc.gbps(moved[0], elapsed),
        )

    out_plan, in_plan = probe.plan(dev, host, 4, 1 << 30), probe.plan(host, dev, 4, 1 << 30)
    interference("dma x4 streams", lambda: (probe.dma(out_plan), probe.dma(in_plan)))
    for grid in (16, 32, 66):
        interference(
            f"kernel grid {grid}",
            lambda g=grid: (
                probe.sm_copy(dev_t, host_t, g, low),
                probe.sm_copy(host_t, dev_t, g, low),
            ),
        )
    print(json.dumps(results["rows"][-4:], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
