"""Ordering check of ``scripts/gpu_check.py``: copies submitted the way the worker submits
them see exactly what the compute stream wrote, with the copy lanes busy.

Stores: each step a slow kernel (``torch.cuda._sleep``) and then a write of every byte of
N blocks with a step-dependent pattern are queued on PyTorch's current stream; right
after, as ``kvoffload.worker.OffloadWorker.submit`` does on CUDA, an event is recorded
there (``kvoffload.cuda_events.record_compute_event``) and the store is submitted with it,
while other stores and loads keep both lanes busy. Every stored byte must be the step's
pattern: a store that did not wait for the event would copy the blocks before the delayed
write landed. Loads: a slow kernel then a write of garbage into the target blocks (the
previous forward pass still using them), the load submitted with the event recorded
after it, waited for, and then a kernel on the current stream reads the blocks: it must
see the loaded bytes, neither the garbage nor the old values. A control store submitted
without its event shows the check can see a race at all (on a GPU it should).

Runs once per layout: vLLM's per-layer layout and the block-contiguous one (BLNHC: every
layer's K and V of a block id in one run). On the fake driver (``--fake-driver`` dry run)
the kernels are CPU tensor operations and no event is passed: the bookkeeping, patterns
and checks run, the ordering itself needs a GPU.
"""

from __future__ import annotations

import random
import struct
from typing import Any

import gpu_measure as gm

#: Steps per layout (a dry run: DRY_STEPS), blocks written and stored per step, background
#: jobs of each direction per step and their blocks.
STEPS = 48
DRY_STEPS = 3
BLOCKS_PER_STEP = 8
BUSY_JOBS = 2
BUSY_BLOCKS = 32
DRY_BUSY_BLOCKS = 2
#: GPU clock cycles the slow kernel spins before each write (about a millisecond).
SLEEP_CYCLES = 2_000_000


def pattern(step: int, part: int) -> int:
    """The byte every position of part ``part`` of a block holds after step ``step``'s
    write; never the load check's garbage byte 0xEE.

    >>> pattern(0, 0), pattern(1, 0), pattern(0, 1)
    (1, 38, 12)
    >>> all(pattern(s, p) != 0xEE for s in range(300) for p in range(64))
    True
    """
    value = (step * 37 + part * 11 + 1) % 255
    return value + 1 if value == 0xEE else value


def ids_bytes(ids: list[int]) -> bytes:
    """Little-endian u32 block ids, as the engine takes them.

    >>> ids_bytes([1, 2])
    b'\\x01\\x00\\x00\\x00\\x02\\x00\\x00\\x00'
    """
    return struct.pack(f"<{len(ids)}I", *ids)


class Lanes:
    """Submits jobs and keeps the events they wait on alive until they complete."""

    def __init__(self, torch: Any, engine: Any) -> None:
        self.torch = torch
        self.engine = engine
        self.next_id = 1_000_000
        #: Jobs in flight -> the event each waits on (``None`` without one).
        self.pending: dict[int, Any] = {}
        self.failed: list[tuple[int, str | None]] = []

    def submit(self, store: bool, gpu: list[int], cpu: list[int], *, wait: bool = True) -> int:
        """Submits like the worker: on CUDA, after an event recorded on the current stream."""
        tid = self.next_id
        self.next_id += 1
        event, handle = None, None
        if wait and not gm.DRY_RUN:
            from kvoffload.cuda_events import record_compute_event

            event, handle = record_compute_event()
        self.engine.submit(tid, store, ids_bytes(gpu), ids_bytes(cpu), handle)
        self.pending[tid] = event
        return tid

    def _done(self, done: list[tuple[int, bool, str | None]]) -> None:
        for tid, ok, err in done:
            self.pending.pop(tid, None)
            if not ok:
                self.failed.append((tid, err))

    def wait(self, tids: list[int]) -> None:
        self._done(self.engine.wait_for(tids, gm.WAIT_S))

    def drain(self) -> None:
        """Waits for every job in flight (completions of earlier waits included)."""
        self._done(self.engine.poll())
        self.wait(list(self.pending))


def _slow_write(torch: Any, layout: gm.Layout, ids: list[int], value: Any) -> None:
    """Queues a slow kernel, then a write of every byte of blocks ``ids`` of each part:
    ``value(part)`` (an int per part)."""
    if not gm.DRY_RUN:
        torch.cuda._sleep(SLEEP_CYCLES)
    index = torch.tensor(ids, device=layout.parts[0].device)
    for k, part in enumerate(layout.parts):
        part.view(torch.uint8).index_fill_(0, index, value(k))


def _mismatched_store_blocks(engine: Any, layout: gm.Layout, cpu: list[int], step: int) -> int:
    """CPU blocks of ``cpu`` whose bytes are not all step ``step``'s pattern."""
    bad = 0
    for c in cpu:
        for r, (_, _, nbytes, _) in enumerate(layout.regions):
            if engine.read_cpu_block(r, c) != bytes([pattern(step, r)]) * nbytes:
                bad += 1
                break
    return bad


def sizes() -> tuple[int, int, int, int]:
    """``(steps, busy blocks, GPU blocks, CPU blocks)`` the check needs (smaller in a dry
    run, whose "GPU" blocks are host memory).

    >>> sizes()[2:]
    (840, 456)
    """
    steps, busy = (DRY_STEPS, DRY_BUSY_BLOCKS) if gm.DRY_RUN else (STEPS, BUSY_BLOCKS)
    n = BLOCKS_PER_STEP
    return steps, busy, (2 * steps + 1) * n + 2 * busy, (steps + 1) * n + 2 * busy


def ordering_check(torch: Any, layout: gm.Layout, engine: Any, seed: int) -> dict[str, Any]:
    """Runs the store and load checks on ``layout``, whose GPU and CPU block counts are
    at least ``sizes()``'s; returns what was checked and what mismatched."""
    steps, busy_blocks, _, _ = sizes()
    rng = random.Random(seed)
    lanes = Lanes(torch, engine)
    n = BLOCKS_PER_STEP
    gpu_ids = list(range(layout.num_gpu_blocks))
    rng.shuffle(gpu_ids)
    # Disjoint GPU blocks: each step's written blocks, load targets, the control's, the
    # background jobs' (a block is never written while a copy of another step reads it).
    written = [gpu_ids[s * n : (s + 1) * n] for s in range(steps + 1)]
    base = (steps + 1) * n
    targets = [gpu_ids[base + s * n : base + (s + 1) * n] for s in range(steps)]
    busy_gpu = gpu_ids[base + steps * n : base + steps * n + 2 * busy_blocks]
    stored_cpu = [list(range(s * n, (s + 1) * n)) for s in range(steps + 1)]
    busy_cpu = list(range((steps + 1) * n, (steps + 1) * n + 2 * busy_blocks))

    def keep_lanes_busy() -> None:
        # Background stores and loads on blocks of their own (GPU and CPU).
        for _ in range(BUSY_JOBS):
            lanes.submit(True, busy_gpu[:busy_blocks], busy_cpu[:busy_blocks])
            lanes.submit(False, busy_gpu[busy_blocks:], busy_cpu[busy_blocks:])

    # Stores: the delayed write, then the store right after it.
    for s in range(steps):
        keep_lanes_busy()
        _slow_write(torch, layout, written[s], lambda k, s=s: pattern(s, k))
        lanes.submit(True, written[s], stored_cpu[s])
    lanes.drain()
    store_bad = sum(
        _mismatched_store_blocks(engine, layout, stored_cpu[s], s) for s in range(steps)
    )
    # Control: the same without the event.
    _slow_write(torch, layout, written[steps], lambda k: pattern(steps, k))
    lanes.wait([lanes.submit(True, written[steps], stored_cpu[steps], wait=False)])
    control_bad = _mismatched_store_blocks(engine, layout, stored_cpu[steps], steps)

    # Loads: the previous forward's delayed write, the load after it, then a read.
    load_bad = 0
    for s in range(steps):
        keep_lanes_busy()
        _slow_write(torch, layout, targets[s], lambda _k: 0xEE)
        lanes.wait([lanes.submit(False, targets[s], stored_cpu[s])])
        index = torch.tensor(targets[s], device=layout.parts[0].device)
        for k, part in enumerate(layout.parts):
            seen = part.view(torch.uint8).index_select(0, index)
            if not bool((seen == pattern(s, k)).all().item()):
                load_bad += 1
    lanes.drain()
    return {
        "layout": layout.name,
        "steps": steps,
        "blocks_per_step": n,
        "busy_jobs_per_step": 2 * BUSY_JOBS,
        "sleep_cycles": 0 if gm.DRY_RUN else SLEEP_CYCLES,
        "stored_blocks_checked": steps * n,
        "store_mismatched_blocks": store_bad,
        "loaded_parts_checked": steps * len(layout.parts),
        "load_mismatched_parts": load_bad,
        "failed_transfers": len(lanes.failed),
        "control_mismatched_blocks": control_bad,
        "ok": store_bad == 0 and load_bad == 0 and not lanes.failed,
    }


def blnhc_regions_via_adapter(torch: Any, layout: gm.Layout) -> bool | None:
    """Whether kvoffload's vLLM adapter turns per-layer views of the block-contiguous
    tensor (what vLLM hands a connector under BLNHC) into exactly the engine's one region;
    ``None`` where vLLM is not installed (the adapter needs it)."""
    try:
        from kvoffload.vllm_adapter import kv_regions
    except ImportError:
        return None
    (t,) = layout.tensors  # [blocks, layers, 2, tokens, heads, head]
    views = {f"model.layers.{i}.self_attn.attn": t[:, i].transpose(0, 1) for i in range(t.shape[1])}
    regions = kv_regions(views, layout.num_gpu_blocks)
    got = [(r.base, r.num_blocks, r.block_bytes, r.block_stride) for r in regions]
    return got == layout.regions
