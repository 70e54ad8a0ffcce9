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
3. times a 16-block load submitted behind 12 stores of 256 blocks (lanes);
4. measures how much a decode proxy (memory-bound, replayed from a CUDA graph) and a matmul
   loop on the compute stream slow down while the engine stores and loads back to back;
5. checks ordering (``scripts/gpu_ordering.py``): stores submitted as the worker submits
   them, right after a delayed kernel wrote their blocks, hold every byte the kernel wrote,
   and a kernel reading loaded blocks right after the load's wait sees the loaded bytes,
   with the copy lanes busy, in both layouts (``--ordering-only``: this stage alone); a
   mismatch exits 1.

It prints a table and the lane, decode and matmul lines, and writes every number to
``--out`` as JSON after every stage; ``scripts/render_docs.py`` renders the committed copy
(docs/benchmarks/gpu_check.json) into docs/gpu_check.md and the README. Exit status: 0 ok,
1 byte mismatch or engine error, 2 no usable GPU or extension.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gpu_measure as gm
from gpu_measure import (
    BLOCK_BYTES,
    DECODE_JOB_BLOCKS,
    WAIT_S,
    DecodeProxy,
    Layout,
    Runner,
    decode_slowdown,
    gbps,
    lane_check,
    matmul_slowdown,
    median_time,
    scattered,
    synchronize,
)
from gpu_ordering import blnhc_regions_via_adapter, ordering_check
from gpu_ordering import sizes as ordering_sizes

REPO = Path(__file__).resolve().parent.parent


FULL_SIZES = (1, 16, 256, 4096)
QUICK_SIZES = (1, 16, 256)
#: (layout, copy path) pairs measured. The copy path is always the copy engines ("dma"):
#: commit 6a161cc also measured an SM copy kernel, dropped for what it cost compute (its
#: rows are in docs/benchmarks/gpu_check.json).
CONFIGS = (("per-layer", "dma"), ("cross-layer", "dma"))


# ---- pure helpers (tested by --self-test, no torch needed) --------------------------------


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
    ("copy", "copy", "s"),
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

    failures, tests = 0, 0
    import gpu_ordering

    for module in (sys.modules[__name__], gm, gpu_ordering):
        result = doctest.testmod(module, verbose=False)
        failures, tests = failures + result.failed, tests + result.attempted
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


def driver_version() -> str | None:
    """The CUDA driver's version as ``cuDriverGetVersion`` reports it (e.g. ``13.0``)."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


def make_engine(native: Any, layout: Layout, num_cpu: int, device: Any, **kw: Any) -> Any:
    """A CUDA engine over the layout's regions, host memory pinned. A dry run's tensors
    live on the CPU, which the checked constructor refuses, so it passes raw addresses."""
    if gm.DRY_RUN:
        engine = native.TransferEngine._unchecked(
            layout.regions, num_cpu, backend="cuda", device=0, **kw
        )
    else:
        engine = native.TransferEngine(
            layout.regions, num_cpu, layout.parts, backend="cuda", device=device.index or 0, **kw
        )
    engine.wait_ready(WAIT_S)
    return engine


def measure_layout(
    torch: Any,
    native: Any,
    *,
    name: str,
    copy: str,
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
    engine = make_engine(native, layout, max_n, device)
    info = {
        "layout": name,
        "copy": copy,
        "regions": len(layout.regions),
        "region_block_bytes": layout.regions[0][2],
        "backend_detail": engine.backend_detail,
        "pin_seconds": time.perf_counter() - t0,
        "host_bytes": engine.host_bytes,
    }
    runner = Runner(engine, torch, rng)
    correct = {
        copy: round_trip_check(torch, layout, runner, min(max_n // 2, 64), max_n),
    }
    # The cuMemcpyAsync loop path, on a small engine.
    small = make_engine(native, layout, 64, device, cuda_batch=False)
    correct["dma loop"] = round_trip_check(torch, layout, Runner(small, torch, rng), 32, 64)
    small.shutdown()
    info["correct"] = correct

    rows = []
    if gm.DRY_RUN:
        rng_ids = random.Random(seed)
        for n in sizes:
            gpu = scattered(n, num_gpu, rng_ids)
            cpu = rng_ids.sample(range(max_n), n)
            wall, sub = runner.transfer(True, gpu, cpu)
            rows.append(
                {
                    "layout": name,
                    "copy": copy,
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
                "copy": copy,
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
    parser.add_argument(
        "--ordering-only", action="store_true", help="only the ordering check (stage 5)"
    )
    parser.add_argument("--fake-driver", help=argparse.SUPPRESS)  # dry run, see gm.DRY_RUN
    args = parser.parse_args(argv)
    if args.self_test:
        return self_test()
    if args.fake_driver:
        gm.DRY_RUN = True
        os.environ["KVOFFLOAD_LIBCUDA"] = str(Path(args.fake_driver).resolve())

    started = time.perf_counter()
    try:
        import torch
    except ImportError:
        print("gpu_check: torch is not installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() and not gm.DRY_RUN:
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

    if gm.DRY_RUN:
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
        "driver_version": None if gm.DRY_RUN else driver_version(),
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

    result: dict[str, Any] = {
        "ok": True,
        "meta": meta,
        "layouts": [],
        "rows": [],
        "lanes": [],
        "decode": [],
        "matmul": [],
        "ordering": [],
    }

    def save() -> None:
        # After every stage, so that a run cut short still leaves what it measured.
        meta["seconds"] = time.perf_counter() - started
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")

    try:
        proxy = None if gm.DRY_RUN or args.ordering_only else DecodeProxy(torch, device)
        for i, (name, copy) in enumerate(() if args.ordering_only else CONFIGS):
            layout_rows, info, layout, engine = measure_layout(
                torch,
                native,
                name=name,
                copy=copy,
                sizes=sizes,
                reps=reps,
                device=device,
                seed=args.seed + i,
            )
            result["rows"] += layout_rows
            result["layouts"].append(info)
            result["ok"] = result["ok"] and all(info["correct"].values())
            label = f"{name} ({copy})"
            print(f"  {label}: {info['backend_detail']}; correct: {info['correct']}", flush=True)
            save()
            tag = {"layout": name, "copy": copy}
            lanes = lane_check(torch, layout, engine) | tag
            result["lanes"].append(lanes)
            print(f"  {label} lanes: {lanes}", flush=True)
            if proxy is not None:
                decode = decode_slowdown(torch, proxy, layout, engine, DECODE_JOB_BLOCKS) | tag
                result["decode"].append(decode)
                print(f"  {label} decode: {decode}", flush=True)
                matmul = matmul_slowdown(torch, layout, engine, max(sizes), device) | tag
                result["matmul"].append(matmul)
            save()
            engine.shutdown()
            del layout, engine
            if not gm.DRY_RUN:
                torch.cuda.empty_cache()
                # Pinned buffers of this layout go back to the OS, not torch's host cache.
                getattr(torch._C, "_host_emptyCache", lambda: None)()
        for i, (name, _copy) in enumerate(CONFIGS):
            ordering = run_ordering(torch, native, name, device, args.seed + 100 + i)
            result["ordering"].append(ordering)
            result["ok"] = result["ok"] and ordering["ok"]
            print(f"  {name} ordering: {ordering}", flush=True)
            save()
    except Exception as e:  # the JSON still records what ran
        result["ok"] = False
        meta["error"] = f"{type(e).__name__}: {e}"
        print(f"gpu_check: {meta['error']}", file=sys.stderr)
    save()
    print_summary(result, args.out)
    return 0 if result["ok"] else 1


def run_ordering(torch: Any, native: Any, name: str, device: Any, seed: int) -> dict[str, Any]:
    """Stage 5 on a fresh layout and engine (sized by ``gpu_ordering.sizes``)."""
    _, _, num_gpu, num_cpu = ordering_sizes()
    layout = Layout(torch, name, num_gpu, device)
    engine = make_engine(native, layout, num_cpu, device)
    try:
        ordering = ordering_check(torch, layout, engine, seed)
        if name == "cross-layer":
            ordering["blnhc_regions_via_adapter"] = blnhc_regions_via_adapter(torch, layout)
            ordering["ok"] = ordering["ok"] and ordering["blnhc_regions_via_adapter"] is not False
        return ordering
    finally:
        engine.shutdown()
        del layout
        if not gm.DRY_RUN:
            torch.cuda.empty_cache()


def print_summary(result: dict[str, Any], out: str) -> None:
    meta = result["meta"]
    print()
    print(f"kvoffload GPU check, {meta['date']}, {meta['gpu']}, torch {meta['torch']}")
    print()
    print(format_table(result["rows"], TABLE_COLUMNS))
    for lanes in result["lanes"]:
        print(
            f"{lanes['layout']} ({lanes['copy']}) lanes: a {lanes['load_blocks']}-block load "
            f"took {lanes['load_alone_ms']:.2f} ms alone, {lanes['load_behind_stores_ms']:.2f} "
            f"ms behind {lanes['stores']} stores of {lanes['store_blocks']} blocks (done after "
            f"{lanes['stores_done_ms']:.1f} ms; {lanes['stores_pending_at_load']} still "
            f"pending when it completed): {'ok' if lanes['ok'] else 'NOT ok'}"
        )
    for d in result["decode"]:
        print(
            f"{d['layout']} ({d['copy']}) decode proxy: {d['step_ms']:.3f} ms/step alone "
            f"({d['weight_gbps']:.0f} GB/s of weights), {d['slowdown_pct']:+.1f}% while "
            f"kvoffload copies {d['blocks_per_job']}-block jobs at {d['copy_gbps_during']:.1f} GB/s"
        )
    for m in result["matmul"]:
        print(
            f"{m['layout']} ({m['copy']}) matmul {m['matmul_size']}^3 bf16 x{m['iterations']}: "
            f"{m['alone_s']:.3f} s alone, {m['with_copies_s']:.3f} s while kvoffload copies "
            f"{m['blocks_per_job']}-block jobs at {m['copy_gbps_during']:.1f} GB/s: "
            f"{m['slowdown_pct']:+.1f}%"
        )
    print()
    print(f"correct: {result['ok']}; {meta['seconds']:.0f} s; results in {out}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
