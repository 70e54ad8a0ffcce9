"""Helpers shared by the Python benchmarks: machine description, statistics, JSON output."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


#: Every method vLLM calls on a scheduler-role connector (those a connector lacks are
#: skipped).
SCHEDULER_METHODS = (
    "get_num_new_matched_tokens",
    "get_external_cache_hit_sources",
    "get_loaded_kv_cache_group_ids",
    "update_state_after_alloc",
    "update_state_after_free",
    "on_new_request",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "register_finished_partial_tail",
    "take_events",
    "take_unavailable_requests",
    "has_pending_block_frees",
    "has_pending_push_work",
    "get_kv_connector_stats",
)

#: Every method vLLM's model runner calls on a worker-role connector while serving.
WORKER_METHODS = (
    "bind_connector_metadata",
    "clear_connector_metadata",
    "handle_preemptions",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
    "get_kv_connector_stats",
)


def add_chat_args(p: argparse.ArgumentParser, cpu_help: str) -> None:
    """The returning-users chat workload of the tier TTFT benchmarks (remote, disk), and
    the engine it runs on."""
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--question-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=2, help="vLLM max_num_seqs")
    p.add_argument("--kv-cache-mib", type=float, default=72, help="vLLM's own KV cache")
    p.add_argument("--cpu-mib", type=float, default=512, help=cpu_help)
    p.add_argument("--max-model-len", type=int, default=4096)


def chat_workload(args: argparse.Namespace, model: Any) -> tuple[Any, Any]:
    """``(Workload, EngineSpec)`` of :func:`add_chat_args`' arguments: every user sends one
    long document and a question, once (``scripts/demo_runner.py``'s types; the caller has
    ``scripts`` on ``sys.path``)."""
    from demo_runner import EngineSpec, Workload

    w = Workload(
        "unique", args.users, 1, args.system_tokens, args.question_tokens, args.output_tokens
    )
    kv_bytes = int(args.kv_cache_mib * 2**20)
    return w, EngineSpec(model, True, args.max_model_len, args.concurrency, kv_bytes)


def add_output_args(p: argparse.ArgumentParser, smoke: str) -> None:
    """``--json``, ``--log`` (vLLM's log) and ``--smoke`` (``smoke``: what it runs)."""
    p.add_argument("--json", help="write the results here")
    p.add_argument("--log", type=Path, help="vLLM's log (default: the terminal)")
    p.add_argument("--smoke", action="store_true", help=f"{smoke} (CI smoke test)")


def machine() -> dict[str, Any]:
    """Where the figures come from (printed and stored with every result)."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    versions: dict[str, str] = {"python": platform.python_version()}
    for mod in ("vllm", "torch"):
        m = sys.modules.get(mod)
        if m is not None:
            versions[mod] = str(getattr(m, "__version__", "?"))
    return {
        "cpu": model,
        "cores": cores,
        "gpu": _gpu_name(),
        "date": datetime.date.today().isoformat(),
        "versions": versions,
    }


def _gpu_name() -> str | None:
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            return str(torch.cuda.get_device_name(0))
    except Exception:
        return None
    return None


def describe(m: dict[str, Any]) -> str:
    gpu = f", {m['gpu']}" if m.get("gpu") else ", no GPU"
    v = ", ".join(f"{k} {val}" for k, val in m["versions"].items())
    return f"{m['date']}: {m['cpu']}, {m['cores']} cores{gpu} ({v})"


def summary_ns(samples: list[int]) -> dict[str, float]:
    """Mean / p50 / p99 of nanosecond samples, in microseconds."""
    if not samples:
        return {"n": 0, "mean_us": 0.0, "p50_us": 0.0, "p99_us": 0.0}
    s = sorted(samples)
    p99 = s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]
    return {
        "n": len(s),
        "mean_us": statistics.fmean(s) / 1e3,
        "p50_us": s[len(s) // 2] / 1e3,
        "p99_us": p99 / 1e3,
    }


def ratio(slow: float, fast: float) -> float:
    return slow / fast if fast > 0 else float("inf")


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    print(f"wrote {path}")
