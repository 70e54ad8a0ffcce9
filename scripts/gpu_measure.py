"""What ``gpu_check.py`` measures on a GPU: KV tensors shaped like Llama-3-8B's, an engine
runner, and the interference checks (compute slowed while the engine copies; a load behind
a backlog of stores). Also imported by ``gpu_copy_probe.py``.

The pure helpers at the top run anywhere (``gpu_check.py --self-test`` runs their
doctests); the rest needs torch and, except in a ``--fake-driver`` dry run, a GPU.
"""

from __future__ import annotations

import itertools
import random
import statistics
import sys
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from typing import Any

# Llama-3-8B KV geometry.
LAYERS = 32
KV_HEADS = 8
HEAD_SIZE = 128
BLOCK_TOKENS = 16
DTYPE_BYTES = 2  # bf16
HALF_BLOCK_BYTES = BLOCK_TOKENS * KV_HEADS * HEAD_SIZE * DTYPE_BYTES  # one K or V: 32 KiB
BLOCK_BYTES = LAYERS * 2 * HALF_BLOCK_BYTES  # one block id, every layer: 2 MiB

#: `--fake-driver` dry run: CPU tensors stand in for device memory, the fake driver
#: (crates/offload-core/tests/fake_cuda) for libcuda; GPU-only measurements are skipped.
DRY_RUN = False
#: Blocks per store and per load job while the decode proxy runs.
DECODE_JOB_BLOCKS = 256
#: Longest wait for one job or for the engine to be ready.
WAIT_S = 120.0


def gbps(num_bytes: int, seconds: float) -> float:
    """Decimal GB/s; 0 for a non-positive time.

    >>> gbps(2_000_000_000, 0.5)
    4.0
    >>> gbps(10, 0.0)
    0.0
    """
    return num_bytes / seconds / 1e9 if seconds > 0 else 0.0


def ids_bytes(ids: Sequence[int]) -> bytes:
    """Block ids as the little-endian u32 bytes ``TransferEngine.submit`` takes.

    >>> ids_bytes([1, 256])
    b'\\x01\\x00\\x00\\x00\\x00\\x01\\x00\\x00'
    """
    a = array("I", ids)
    if sys.byteorder == "big":
        a.byteswap()
    return a.tobytes()


def scattered(count: int, limit: int, rng: random.Random) -> list[int]:
    """``count`` distinct ids below ``limit``, no two consecutive in sequence (so the
    engine cannot coalesce them: the scattered worst case).

    >>> ids = scattered(100, 1000, random.Random(1))
    >>> len(set(ids)) == 100 and all(b != a + 1 for a, b in itertools.pairwise(ids))
    True
    """
    if count * 2 > limit:
        raise ValueError(f"cannot pick {count} scattered ids below {limit}")
    while True:
        ids = rng.sample(range(limit), count)
        if all(b != a + 1 for a, b in itertools.pairwise(ids)):
            return ids


class Layout:
    """KV tensors of one layout, their engine regions, and per-block views for torch."""

    def __init__(self, torch: Any, name: str, num_gpu_blocks: int, device: Any) -> None:
        self.name = name
        self.num_gpu_blocks = num_gpu_blocks
        shape_half = (BLOCK_TOKENS, KV_HEADS, HEAD_SIZE)
        if name == "per-layer":
            # vLLM's FlashAttention layout: one [2, blocks, 16, 8, 128] tensor per layer.
            self.tensors = [
                torch.empty((2, num_gpu_blocks, *shape_half), dtype=torch.bfloat16, device=device)
                for _ in range(LAYERS)
            ]
            self.parts = [t[i] for t in self.tensors for i in range(2)]  # K, V per layer
        else:
            # Cross-layer: one tensor, every layer's K and V of a block id contiguous.
            t = torch.empty(
                (num_gpu_blocks, LAYERS, 2, *shape_half), dtype=torch.bfloat16, device=device
            )
            self.tensors = [t]
            self.parts = [t]
        for t in self.tensors:
            t.view(torch.uint8).random_()
        self.regions = []
        for p in self.parts:
            es = p.element_size()
            self.regions.append((p.data_ptr(), num_gpu_blocks, p[0].numel() * es, p.stride(0) * es))
        assert sum(r[2] for r in self.regions) == BLOCK_BYTES

    def gather(self, torch: Any, ids: Sequence[int]) -> list[Any]:
        index = torch.tensor(list(ids), device=self.parts[0].device)
        return [p.index_select(0, index) for p in self.parts]

    def equal(self, torch: Any, ids: Sequence[int], expected: list[Any]) -> bool:
        """Byte equality: random bf16 bit patterns include NaNs, which never compare equal."""
        return all(
            torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
            for a, b in zip(self.gather(torch, ids), expected, strict=True)
        )


def synchronize(torch: Any) -> None:
    if not DRY_RUN:
        torch.cuda.synchronize()


class Runner:
    """Submits jobs to one engine and times them."""

    def __init__(self, engine: Any, torch: Any, rng: random.Random) -> None:
        self.engine = engine
        self.torch = torch
        self.rng = rng
        self.next_id = 1

    def transfer(
        self, store: bool, gpu: Sequence[int], cpu: Sequence[int], wait: bool = True
    ) -> tuple[float, float]:
        """Runs one job to completion; returns (wall seconds, submit seconds). A store
        waits for the current stream's work so far, as the worker's stores do, unless
        `wait` is false."""
        tid = self.next_id
        self.next_id += 1
        g, c = ids_bytes(gpu), ids_bytes(cpu)
        event = handle = None
        start = time.perf_counter()
        if store and wait and not DRY_RUN:
            # As the worker does: the copies wait for the compute stream's work so far.
            event = self.torch.cuda.Event()
            event.record()
            handle = int(event.cuda_event)
        self.engine.submit(tid, store, g, c, handle)
        submitted = time.perf_counter()
        done = self.engine.wait_for([tid], WAIT_S)
        end = time.perf_counter()
        del event
        if not done or not done[0][1]:
            raise RuntimeError(f"transfer {tid} failed: {done}")
        return end - start, submitted - start


def median_time(fn: Callable[[], float], reps: int) -> float:
    fn()  # warm-up
    return statistics.median(fn() for _ in range(reps))


class Copier:
    """A background thread that stores and loads `n` scattered blocks back to back (the
    worst case for interference: both copy directions always busy), counting bytes."""

    def __init__(self, torch: Any, layout: Layout, engine: Any, n: int, seed: int) -> None:
        rng = random.Random(seed)
        self.runner = Runner(engine, torch, rng)
        self.gpu = scattered(n, layout.num_gpu_blocks, rng)
        self.cpu = rng.sample(range(engine.num_cpu_blocks), n)
        self.job_bytes = 2 * n * BLOCK_BYTES
        self.moved = 0
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                # No wait event: the compute stream holds seconds of queued work, and the
                # point is to copy while it runs.
                self.runner.transfer(True, self.gpu, self.cpu, wait=False)
                self.runner.transfer(False, self.gpu, self.cpu)
                self.moved += self.job_bytes
        except BaseException as e:  # re-raised by __exit__
            self.errors.append(e)

    def __enter__(self) -> Copier:
        self._thread.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(WAIT_S)
        if self.errors:
            raise RuntimeError(f"copies during the compute loop failed: {self.errors[0]}")


def slowdown(
    torch: Any, run: Callable[[int], float], layout: Layout, engine: Any, n: int
) -> dict[str, Any]:
    """`run(iters)` timed alone (best of 2, about 2 s each) and once while a `Copier` of
    `n`-block jobs keeps both directions busy."""
    run(3)
    iters = max(10, int(2.0 / max(run(10) / 10, 1e-6)))
    alone = min(run(iters) for _ in range(2))
    with Copier(torch, layout, engine, n, seed=7) as copier:
        start = time.perf_counter()
        with_copies = run(iters)
        copied, elapsed = copier.moved, time.perf_counter() - start
    return {
        "layout": layout.name,
        "iterations": iters,
        "alone_s": alone,
        "with_copies_s": with_copies,
        "slowdown_pct": (with_copies / alone - 1) * 100,
        "copy_gbps_during": gbps(copied, elapsed),
        "blocks_per_job": n,
    }


def matmul_slowdown(torch: Any, layout: Layout, engine: Any, n: int, device: Any) -> dict[str, Any]:
    """A compute-bound loop of 8192^3 bf16 matmuls on the compute stream."""
    size = 8192
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=device)

    def mm(iters: int) -> float:
        torch.cuda.current_stream().synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            torch.mm(a, b)
        torch.cuda.current_stream().synchronize()
        return time.perf_counter() - start

    result = slowdown(torch, mm, layout, engine, n)
    result["matmul_size"] = size
    result["alone_tflops"] = 2 * size**3 * result["iterations"] / result["alone_s"] / 1e12
    return result


class DecodeProxy:
    """Llama-3-8B's decode step at batch 16 without attention: per layer the QKV, output,
    gate/up and down projections (14 GB of bf16 weights in all), memory-bound like real
    decode, captured in a CUDA graph as vLLM captures decode."""

    HIDDEN, INTER, QKV, BATCH = 4096, 14336, 6144, 16

    def __init__(self, torch: Any, device: Any) -> None:
        h, i, q = self.HIDDEN, self.INTER, self.QKV
        self.torch = torch

        def w(rows: int, cols: int) -> Any:
            return torch.randn(rows, cols, dtype=torch.bfloat16, device=device) * 0.02

        self.weights = [(w(h, q), w(h, h), w(h, 2 * i), w(i, h)) for _ in range(LAYERS)]
        self.weight_bytes = sum(t.numel() * t.element_size() for ws in self.weights for t in ws)
        self.x = torch.randn(self.BATCH, h, dtype=torch.bfloat16, device=device)
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self._step()

    def _step(self) -> Any:
        f = self.torch.nn.functional
        x = self.x
        for wqkv, wo, wgu, wd in self.weights:
            qkv = x @ wqkv
            gu = x @ wgu
            x = (
                x
                + qkv[:, : self.HIDDEN] @ wo
                + (f.silu(gu[:, : self.INTER]) * gu[:, self.INTER :]) @ wd
            )
        return x

    def run(self, iters: int) -> float:
        self.torch.cuda.current_stream().synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            self.graph.replay()
        self.torch.cuda.current_stream().synchronize()
        return time.perf_counter() - start


def decode_slowdown(
    torch: Any, proxy: DecodeProxy, layout: Layout, engine: Any, n: int
) -> dict[str, Any]:
    """The decode proxy's step time alone and while the engine copies `n`-block jobs."""
    result = slowdown(torch, proxy.run, layout, engine, n)
    step = result["alone_s"] / result["iterations"]
    result["step_ms"] = step * 1e3
    result["weight_gbps"] = gbps(proxy.weight_bytes, step)
    return result


def lane_check(torch: Any, layout: Layout, engine: Any) -> dict[str, Any]:
    """A 16-block load submitted behind 12 stores of (up to) 256 blocks: its latency alone and
    behind the stores, and how many stores were still pending when it completed. Loads
    have their own lane and stream, so the load must not wait for the backlog."""
    rng = random.Random(11)
    runner = Runner(engine, torch, rng)
    stores, load_n = 12, 16
    store_n = min(256, (engine.num_cpu_blocks - load_n) // stores)
    half = layout.num_gpu_blocks // 2
    cpu = rng.sample(range(engine.num_cpu_blocks), stores * store_n + load_n)
    store_gpu = scattered(store_n, half, rng)  # read by every store
    load_gpu = [half + g for g in scattered(load_n, half, rng)]  # written by the load only
    load_cpu = cpu[stores * store_n :]
    alone = median_time(lambda: runner.transfer(False, load_gpu, load_cpu)[0], 5)
    synchronize(torch)
    engine.poll()
    store_ids = list(range(runner.next_id, runner.next_id + stores))
    load_id = runner.next_id + stores
    runner.next_id = load_id + 1
    start = time.perf_counter()
    for k, tid in enumerate(store_ids):
        chunk = cpu[k * store_n : (k + 1) * store_n]
        engine.submit(tid, True, ids_bytes(store_gpu), ids_bytes(chunk), None)
    engine.submit(load_id, False, ids_bytes(load_gpu), ids_bytes(load_cpu), None)
    done = engine.wait_for([load_id], WAIT_S)
    behind = time.perf_counter() - start
    early = {c[0] for c in engine.poll() if c[0] in store_ids}
    rest = engine.wait_for([t for t in store_ids if t not in early], WAIT_S)
    backlog = time.perf_counter() - start
    failed = [c for c in [*done, *rest] if not c[1]]
    if failed:
        raise RuntimeError(f"lane check transfer failed: {failed[0]}")
    pending = stores - len(early)
    return {
        "stores": stores,
        "store_blocks": store_n,
        "load_blocks": load_n,
        "load_alone_ms": alone * 1e3,
        "load_behind_stores_ms": behind * 1e3,
        "stores_done_ms": backlog * 1e3,
        "stores_pending_at_load": pending,
        "ok": pending > 0 and behind < backlog / 2,
    }
