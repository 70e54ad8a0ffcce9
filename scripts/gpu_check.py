#!/usr/bin/env python3
"""kvoffload GPU check: correctness and bandwidth of the CUDA copy engine, in one command.

    python scripts/gpu_check.py --out gpu_check.json          # full run, < 5 min on one H200
    python scripts/gpu_check.py --quick --out quick.json       # ~1 min smoke run
    python scripts/gpu_check.py --self-test                    # CPU-only checks of this script

Needs torch with CUDA and one GPU; no vLLM. It first makes ``kvoffload._native`` importable
for this Python (see ``--native``, ``--wheel``, ``--skip-build``; by default it builds the
extension from this checkout), then, for Llama-3-8B-shaped KV caches (32 layers, 8 KV heads,
head size 128, bf16, 16-token blocks: 2 MiB per block id) in vLLM's per-layer layout
(64 regions of 32 KiB: K and V of each layer) and in cross-layer form (one region, one
2 MiB block per id):

1. round-trips random blocks GPU -> CPU -> GPU (into other block ids) and compares bytes,
   with the batch copy path and with the ``cuMemcpyAsync`` loop; a mismatch exits 1;
2. measures store (GPU -> CPU) and load (CPU -> GPU) GB/s at 1, 16, 256 and 4096 scattered
   blocks, against one large pinned ``cudaMemcpyAsync`` of the same bytes and a per-block
   ``torch`` ``copy_(non_blocking=True)`` loop, with CPU microseconds per block to submit;
3. measures how much a matmul loop on the compute stream slows down while the engine
   copies.

It prints a Markdown table (paste it into the README with the date and GPU) and writes
every number to ``--out`` as JSON. Exit status: 0 ok, 1 byte mismatch or engine error,
2 no usable GPU or extension.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import itertools
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

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

FULL_SIZES = (1, 16, 256, 4096)
QUICK_SIZES = (1, 16, 256)
WAIT_S = 120.0


# ---- pure helpers (tested by --self-test, no torch needed) --------------------------------


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


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """A Markdown table: ``columns`` are ``(key, header, format spec)``; a missing or
    ``None`` value prints as ``-``.

    >>> print(format_table([{"n": 1, "x": 2.345}, {"n": 16}],
    ...                    [("n", "blocks", "d"), ("x", "GB/s", ".1f")]))
    | blocks | GB/s |
    |-------:|-----:|
    |      1 |  2.3 |
    |     16 |    - |
    """
    cells = [[header for _, header, _ in columns]]
    for row in rows:
        line = []
        for key, _, spec in columns:
            value = row.get(key)
            line.append("-" if value is None else format(value, spec))
        cells.append(line)
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(cells[0], widths, strict=True)) + " |"]
    out.append("|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    for line in cells[1:]:
        out.append("| " + " | ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) + " |")
    return "\n".join(out)


TABLE_COLUMNS = (
    ("layout", "layout", "s"),
    ("blocks", "blocks", "d"),
    ("mib", "MiB", ".0f"),
    ("store_gbps", "kvoffload store GB/s", ".1f"),
    ("load_gbps", "kvoffload load GB/s", ".1f"),
    ("memcpy_d2h_gbps", "1x memcpy D2H GB/s", ".1f"),
    ("memcpy_h2d_gbps", "1x memcpy H2D GB/s", ".1f"),
    ("torch_d2h_gbps", "torch loop D2H GB/s", ".1f"),
    ("torch_h2d_gbps", "torch loop H2D GB/s", ".1f"),
    ("submit_us_per_block", "kvoffload submit us/block", ".2f"),
    ("torch_us_per_block", "torch loop us/block", ".2f"),
)


def self_test() -> int:
    import doctest

    failures, tests = doctest.testmod(sys.modules[__name__], verbose=False)
    print(f"self-test: {tests - failures}/{tests} doctests passed")
    return 1 if failures else 0


# ---- getting the extension ---------------------------------------------------------------


def _run(cmd: list[str], cwd: Path = REPO) -> bool:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=cwd, check=False).returncode == 0


def _use_native_file(so: Path) -> None:
    """Makes ``kvoffload`` importable from this checkout's sources plus a built ``.so``."""
    pkg_root = Path(tempfile.mkdtemp(prefix="kvoffload-gpu-check-"))
    pkg = pkg_root / "kvoffload"
    shutil.copytree(REPO / "python" / "kvoffload", pkg, ignore=shutil.ignore_patterns("*.so"))
    shutil.copy2(so, pkg / "_native.abi3.so")
    sys.path.insert(0, str(pkg_root))


def ensure_native(args: argparse.Namespace) -> None:
    """Installs or builds ``kvoffload._native`` for this interpreter, per the options."""
    if args.native:
        _use_native_file(Path(args.native))
        return
    if args.wheel:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--force-reinstall"]
        if not _run([*cmd, args.wheel]):
            raise SystemExit(f"pip could not install {args.wheel}")
        return
    if args.skip_build:
        return
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--force-reinstall"]
    # Offline machines have no index to fetch maturin from: try without isolation too.
    if _run([*pip, "."]) or _run([*pip, "--no-build-isolation", "."]):
        return
    if shutil.which("cargo") and _run(["cargo", "build", "--release", "-p", "offload-py"]):
        _use_native_file(REPO / "target" / "release" / "lib_native.so")
        return
    raise SystemExit(
        "could not build kvoffload for this Python (pip and cargo failed); build a wheel "
        "elsewhere and pass --wheel, or pass --native path/to/_native.abi3.so"
    )


# ---- measurements ------------------------------------------------------------------------


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


def round_trip_check(torch: Any, layout: Layout, runner: Runner, count: int, num_cpu: int) -> bool:
    """Stores `count` random blocks, loads them into other block ids, compares bytes, and
    spot-checks host copies against the device."""
    rng = runner.rng
    ids = rng.sample(range(layout.num_gpu_blocks), 2 * count)
    src, dst = ids[:count], ids[count:]
    cpu = rng.sample(range(num_cpu), count)
    expected = layout.gather(torch, src)
    runner.transfer(True, src, cpu)
    runner.transfer(False, dst, cpu)
    synchronize(torch)
    ok = layout.equal(torch, dst, expected)
    for k in rng.sample(range(count), min(3, count)):
        for r in (0, len(layout.parts) - 1):
            host = runner.engine.read_cpu_block(r, cpu[k])
            dev = expected[r][k].contiguous().view(torch.uint8).cpu().numpy().tobytes()
            ok = ok and host == dev
    return ok


def measure_layout(
    torch: Any,
    native: Any,
    *,
    name: str,
    sizes: Sequence[int],
    reps: int,
    device: Any,
    seed: int,
) -> tuple[list[dict[str, Any]], dict[str, Any], Layout, Any]:
    max_n = max(sizes)
    num_gpu = 2 * max_n + 2
    layout = Layout(torch, name, num_gpu, device)
    rng = random.Random(seed)
    t0 = time.perf_counter()
    engine = native.TransferEngine(
        layout.regions, max_n, layout.parts, backend="cuda", device=device.index or 0
    )
    engine.wait_ready(WAIT_S)
    info = {
        "layout": name,
        "regions": len(layout.regions),
        "region_block_bytes": layout.regions[0][2],
        "backend_detail": engine.backend_detail,
        "pin_seconds": time.perf_counter() - t0,
        "host_bytes": engine.host_bytes,
    }
    runner = Runner(engine, torch, rng)
    correct = {
        "batch": round_trip_check(torch, layout, runner, min(max_n // 2, 64), max_n),
    }
    # The cuMemcpyAsync loop path, on a small engine.
    loop_engine = native.TransferEngine(
        layout.regions, 64, layout.parts, backend="cuda", device=device.index or 0, cuda_batch=False
    )
    loop_engine.wait_ready(WAIT_S)
    correct["loop"] = round_trip_check(torch, layout, Runner(loop_engine, torch, rng), 32, 64)
    loop_engine.shutdown()
    info["correct"] = correct

    rows = []
    if DRY_RUN:
        rng_ids = random.Random(seed)
        for n in sizes:
            gpu = scattered(n, num_gpu, rng_ids)
            cpu = rng_ids.sample(range(max_n), n)
            wall, sub = runner.transfer(True, gpu, cpu)
            rows.append(
                {
                    "layout": name,
                    "blocks": n,
                    "mib": n * BLOCK_BYTES / 2**20,
                    "store_gbps": gbps(n * BLOCK_BYTES, wall),
                    "load_gbps": gbps(n * BLOCK_BYTES, runner.transfer(False, gpu, cpu)[0]),
                    "submit_us_per_block": sub / n * 1e6,
                }
            )
        return rows, info, layout, engine

    # Baselines: one pinned host buffer and one contiguous device buffer of max_n blocks.
    pinned = torch.empty(max_n * BLOCK_BYTES, dtype=torch.uint8, pin_memory=True)
    flat = torch.empty(max_n * BLOCK_BYTES, dtype=torch.uint8, device=device)
    side = torch.cuda.Stream(device=device, priority=0)
    host_views = [
        torch.empty((max_n, *p.shape[1:]), dtype=p.dtype, pin_memory=True) for p in layout.parts
    ]

    def memcpy(n: int, d2h: bool) -> float:
        nbytes = n * BLOCK_BYTES
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.cuda.stream(side):
            if d2h:
                pinned[:nbytes].copy_(flat[:nbytes], non_blocking=True)
            else:
                flat[:nbytes].copy_(pinned[:nbytes], non_blocking=True)
        side.synchronize()
        return time.perf_counter() - start

    def torch_loop(gpu: Sequence[int], d2h: bool) -> tuple[float, float]:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.cuda.stream(side):
            for c, g in enumerate(gpu):
                for part, host in zip(layout.parts, host_views, strict=True):
                    if d2h:
                        host[c].copy_(part[g], non_blocking=True)
                    else:
                        part[g].copy_(host[c], non_blocking=True)
        issued = time.perf_counter()
        side.synchronize()
        return time.perf_counter() - start, issued - start

    for n in sizes:
        # No two GPU ids consecutive, so no pair can merge with the next: every block is
        # its own copy per region.
        gpu = scattered(n, num_gpu, rng)
        cpu = rng.sample(range(max_n), n)
        nbytes = n * BLOCK_BYTES
        submits: list[float] = []

        def store(
            gpu: list[int] = gpu, cpu: list[int] = cpu, submits: list[float] = submits
        ) -> float:
            wall, sub = runner.transfer(True, gpu, cpu)
            submits.append(sub)
            return wall

        def load(gpu: list[int] = gpu, cpu: list[int] = cpu) -> float:
            return runner.transfer(False, gpu, cpu)[0]

        t_store = median_time(store, reps)
        t_load = median_time(load, reps)
        loop_reps = 1 if n * len(layout.parts) > 20_000 else reps
        loop_d2h = [torch_loop(gpu, True) for _ in range(loop_reps + 1)][1:]
        loop_h2d = [torch_loop(gpu, False) for _ in range(loop_reps + 1)][1:]
        rows.append(
            {
                "layout": name,
                "blocks": n,
                "mib": nbytes / 2**20,
                "store_gbps": gbps(nbytes, t_store),
                "load_gbps": gbps(nbytes, t_load),
                "memcpy_d2h_gbps": gbps(nbytes, median_time(lambda n=n: memcpy(n, True), reps)),
                "memcpy_h2d_gbps": gbps(nbytes, median_time(lambda n=n: memcpy(n, False), reps)),
                "torch_d2h_gbps": gbps(nbytes, statistics.median(t for t, _ in loop_d2h)),
                "torch_h2d_gbps": gbps(nbytes, statistics.median(t for t, _ in loop_h2d)),
                "submit_us_per_block": statistics.median(submits) / n * 1e6,
                "torch_us_per_block": statistics.median(i for _, i in loop_d2h) / n * 1e6,
            }
        )
        print(format_table(rows[-1:], TABLE_COLUMNS).splitlines()[-1], flush=True)
    return rows, info, layout, engine


def matmul_slowdown(torch: Any, layout: Layout, engine: Any, n: int, device: Any) -> dict[str, Any]:
    """Time of a bf16 matmul loop on the compute stream, alone and while the engine
    stores and loads `n` scattered blocks back to back."""
    size = 8192
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=device)

    def mm(iters: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            torch.mm(a, b)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    mm(3)
    iters = max(10, int(2.0 / max(mm(10) / 10, 1e-6)))  # about 2 s alone
    alone = min(mm(iters) for _ in range(2))

    rng = random.Random(7)
    runner = Runner(engine, torch, rng)
    gpu = scattered(n, layout.num_gpu_blocks, rng)
    cpu = rng.sample(range(n), n)
    stop = threading.Event()
    moved = [0]
    errors: list[BaseException] = []

    def copier() -> None:
        try:
            while not stop.is_set():
                # No wait event: the compute stream holds seconds of queued matmuls, and
                # the point is to copy while they run.
                runner.transfer(True, gpu, cpu, wait=False)
                runner.transfer(False, gpu, cpu)
                moved[0] += 2 * n * BLOCK_BYTES
        except BaseException as e:  # reported below
            errors.append(e)

    thread = threading.Thread(target=copier, daemon=True)
    thread.start()
    time.sleep(0.2)
    start = time.perf_counter()
    with_copies = mm(iters)
    copied = moved[0]
    elapsed = time.perf_counter() - start
    stop.set()
    thread.join(WAIT_S)
    if errors:
        raise RuntimeError(f"copies during the matmul loop failed: {errors[0]}")
    flops = 2 * size**3 * iters
    return {
        "matmul_size": size,
        "iterations": iters,
        "alone_s": alone,
        "with_copies_s": with_copies,
        "slowdown_pct": (with_copies / alone - 1) * 100,
        "alone_tflops": flops / alone / 1e12,
        "copy_gbps_during": gbps(copied, elapsed),
        "blocks_per_job": n,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="kvoffload GPU check: correctness and bandwidth of the CUDA copy engine"
    )
    parser.add_argument("--out", default="gpu_check.json", help="JSON results file")
    parser.add_argument("--quick", action="store_true", help="sizes up to 256 blocks, fewer reps")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per point")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--skip-build", action="store_true", help="use the installed kvoffload")
    parser.add_argument("--wheel", help="pip install this wheel instead of building")
    parser.add_argument("--native", help="use this built _native.abi3.so with these sources")
    parser.add_argument("--self-test", action="store_true", help="CPU-only checks, then exit")
    parser.add_argument("--fake-driver", help=argparse.SUPPRESS)  # dry run, see DRY_RUN
    args = parser.parse_args(argv)
    if args.self_test:
        return self_test()
    if args.fake_driver:
        global DRY_RUN  # noqa: PLW0603 - a one-way switch set before anything runs
        DRY_RUN = True
        os.environ["KVOFFLOAD_LIBCUDA"] = str(Path(args.fake_driver).resolve())

    started = time.perf_counter()
    try:
        import torch
    except ImportError:
        print("gpu_check: torch is not installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() and not DRY_RUN:
        print("gpu_check: torch sees no CUDA device", file=sys.stderr)
        return 2
    ensure_native(args)
    try:
        from kvoffload import _native as native
    except ImportError as e:
        print(f"gpu_check: cannot import kvoffload._native: {e}", file=sys.stderr)
        return 2
    if not hasattr(native.TransferEngine, "wait_ready"):
        print("gpu_check: the installed kvoffload has no CUDA backend; rebuild", file=sys.stderr)
        return 2

    if DRY_RUN:
        device = torch.device("cpu")
        props = argparse.Namespace(name="fake CUDA driver (dry run)", total_memory=0)
    else:
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.init()
        props = torch.cuda.get_device_properties(device)
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    reps = args.reps or (3 if args.quick else 5)
    meta = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": props.name,
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "driver_version": getattr(torch._C, "_cuda_getDriverVersion", lambda: None)(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "sizes": list(sizes),
        "reps": reps,
        "block_bytes": BLOCK_BYTES,
        "model": "Llama-3-8B KV: 32 layers x (K, V) x 16 tokens x 8 heads x 128 x bf16",
    }
    print(
        f"gpu_check: {meta['gpu']}, driver {meta['driver_version']}, torch {meta['torch']}, "
        f"blocks of {BLOCK_BYTES / 2**20:.0f} MiB, sizes {list(sizes)}",
        flush=True,
    )

    rows: list[dict[str, Any]] = []
    layouts: list[dict[str, Any]] = []
    matmul: dict[str, Any] = {}
    ok = True
    try:
        for i, name in enumerate(("per-layer", "cross-layer")):
            layout_rows, info, layout, engine = measure_layout(
                torch, native, name=name, sizes=sizes, reps=reps, device=device, seed=args.seed + i
            )
            rows += layout_rows
            layouts.append(info)
            ok = ok and all(info["correct"].values())
            print(f"  {name}: {info['backend_detail']}; correct: {info['correct']}", flush=True)
            if name == "cross-layer" and not DRY_RUN:
                matmul = matmul_slowdown(torch, layout, engine, max(sizes), device)
            engine.shutdown()
            del layout, engine
            if not DRY_RUN:
                torch.cuda.empty_cache()
                # Pinned buffers of this layout go back to the OS, not torch's host cache.
                getattr(torch._C, "_host_emptyCache", lambda: None)()
    except Exception as e:  # the JSON still records what ran
        ok = False
        meta["error"] = f"{type(e).__name__}: {e}"
        print(f"gpu_check: {meta['error']}", file=sys.stderr)

    meta["seconds"] = time.perf_counter() - started
    result = {"ok": ok, "meta": meta, "layouts": layouts, "rows": rows, "matmul": matmul}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")

    print()
    print(f"kvoffload GPU check, {meta['date']}, {meta['gpu']}, torch {meta['torch']}")
    print()
    print(format_table(rows, TABLE_COLUMNS))
    if matmul:
        print()
        print(
            f"matmul {matmul['matmul_size']}^3 bf16 x{matmul['iterations']} on the compute "
            f"stream: {matmul['alone_s']:.3f} s alone, {matmul['with_copies_s']:.3f} s while "
            f"kvoffload copies {matmul['blocks_per_job']}-block jobs at "
            f"{matmul['copy_gbps_during']:.1f} GB/s: {matmul['slowdown_pct']:+.1f}%"
        )
    print()
    print(f"correct: {ok}; {meta['seconds']:.0f} s; results in {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
