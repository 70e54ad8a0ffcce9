"""The main job: a multi-user chat workload on a real vLLM engine, without and with kvoffload.

Users with long system prompts hold conversations and take turns; vLLM's KV cache is far
smaller than all the conversations, so by the time a user asks again the prefix has been
evicted. Plain vLLM recomputes it; kvoffload copies it back from host memory. A second
workload where nothing repeats shows what kvoffload costs when it cannot help.

The two configurations run alternately (--repeats times each), each run on a fresh engine,
one engine at a time. vLLM's own log goes to a file (--log; --verbose shows it instead).

    python scripts/demo.py                 # a random-weight Llama built locally (no download)
    python scripts/demo.py --model /path/to/hf-model --kv-cache-mib 4096 --cpu-mib 65536
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benches"))
from _common import REPO, machine
from demo_report import LABELS, plot, table
from demo_runner import EngineSpec, Workload, offload_config, run

#: The locally built model (tests/tiny_model.py: DEMO_SHAPE) and its tokenizer's vocabulary.
DEMO_MODEL_DIR = Path.home() / ".cache" / "kvoffload" / "demo_llama"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="HF model directory or name (default: the local demo Llama)")
    g = p.add_argument_group("chat workload")
    g.add_argument("--users", type=int, default=5, help="conversations (default 5)")
    g.add_argument("--turns", type=int, default=8, help="questions per user (default 8)")
    g.add_argument("--system-tokens", type=int, default=2000, help="system prompt (default 2000)")
    g.add_argument("--question-tokens", type=int, default=64, help="per question (default 64)")
    g.add_argument("--output-tokens", type=int, default=16, help="per answer (default 16)")
    g = p.add_argument_group("no-reuse workload")
    g.add_argument("--unique-prompts", type=int, default=8, help="prompts (default 8)")
    g.add_argument("--unique-tokens", type=int, default=1024, help="per prompt (default 1024)")
    g = p.add_argument_group("engine")
    g.add_argument("--concurrency", type=int, default=3, help="vLLM max_num_seqs (default 3)")
    g.add_argument("--kv-cache-mib", type=float, default=72, help="vLLM's KV cache (default 72)")
    g.add_argument("--cpu-mib", type=float, default=512, help="kvoffload's pool (default 512)")
    g.add_argument("--lazy", action="store_true", help="kvoffload lazy_offload (default eager)")
    g.add_argument("--max-model-len", type=int, default=4096)
    g.add_argument(
        "--threads",
        type=int,
        default=1,
        help="vLLM CPU backend: OpenMP threads, unbound (default 1). More are faster on an\n"
        "idle machine, but when other processes compete for the cores every parallel\n"
        "region waits for a descheduled thread and a step takes 10x longer",
    )
    g = p.add_argument_group("measurement and output")
    g.add_argument("--repeats", type=int, default=2, help="runs per configuration (default 2)")
    g.add_argument(
        "--unique-repeats", type=int, default=3, help="no-reuse runs per configuration (default 3)"
    )
    g.add_argument(
        "--json", type=Path, help="raw results (default: docs/demo.json; with --model: ./demo.json)"
    )
    g.add_argument("--plot", type=Path, help="TTFT plot (default: docs/demo.png, or demo.png)")
    g.add_argument("--log", type=Path, help="vLLM's log file (default: in the temp directory)")
    g.add_argument("--verbose", action="store_true", help="vLLM's log on the terminal")
    args = p.parse_args(argv)
    out = REPO / "docs" if args.model is None else Path.cwd()
    args.json = args.json or out / "demo.json"
    args.plot = args.plot or out / "demo.png"
    args.log = args.log or Path(tempfile.gettempdir()) / "kvoffload-demo-vllm.log"
    return args


@contextmanager
def quiet(log: Path | None) -> Iterator[IO[str]]:
    """Sends everything written to fds 1 and 2 (vLLM's logger, warnings, native libraries,
    vLLM's own progress bars) to ``log`` and yields a stream to the terminal. ``None``:
    nothing is redirected."""
    sys.stdout.flush()
    sys.stderr.flush()
    term = os.fdopen(os.dup(1), "w", buffering=1)
    if log is None:
        try:
            yield term
        finally:
            term.close()
        return
    saved = os.dup(1), os.dup(2)
    log.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield term
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for s in saved:
            os.close(s)
        term.close()


class Progress:
    """One line per run; redrawn as a bar while the run goes on when the terminal is a tty."""

    def __init__(self, term: IO[str], label: str, total: int) -> None:
        self.term, self.label, self.total, self.done = term, label, total, 0
        self.tty = term.isatty()
        self.t0 = time.perf_counter()
        self._draw()

    def _draw(self, end: str = "") -> None:
        if not self.tty and not end:
            return
        width = 24
        full = width * self.done // max(1, self.total)
        bar = "#" * full + "." * (width - full)
        secs = time.perf_counter() - self.t0
        line = f"  {self.label:44} [{bar}] {self.done:3}/{self.total} requests {secs:6.1f} s"
        self.term.write(("\r" if self.tty else "") + line + end)
        self.term.flush()

    def step(self) -> None:
        self.done += 1
        self._draw()

    def close(self) -> None:
        self._draw("\n")


def demo_model() -> tuple[str, int, str]:
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_model import DEMO_SHAPE, build_demo_llama

    path = build_demo_llama(DEMO_MODEL_DIR)
    s = DEMO_SHAPE
    desc = (
        f"random-weight Llama ({s['num_hidden_layers']} layers, hidden {s['hidden_size']}, "
        f"{s['num_attention_heads']} heads / {s['num_key_value_heads']} KV heads of "
        f"{s['head_dim']}, float32)"
    )
    from transformers import AutoConfig

    return str(path), int(AutoConfig.from_pretrained(path).vocab_size), desc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model is None:
        # Before torch is imported: OpenMP reads these once.
        os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if args.model is None:
        print("[demo] building the demo model (cached under ~/.cache/kvoffload) ...", flush=True)
    with quiet(None if args.verbose else args.log) as term:

        def say(msg: str) -> None:
            term.write(f"[demo] {msg}\n")
            term.flush()

        if args.model is None:
            model, vocab, desc = demo_model()
        else:
            from transformers import AutoConfig

            model, desc = args.model, args.model
            vocab = int(AutoConfig.from_pretrained(model).vocab_size)
        if not args.verbose:
            say(f"vLLM's log: {args.log}")
        spec = EngineSpec(
            model=model,
            tiny_cpu=args.model is None,
            max_model_len=args.max_model_len,
            concurrency=args.concurrency,
            kv_cache_bytes=int(args.kv_cache_mib * 2**20),
        )
        kvo = offload_config(int(args.cpu_mib * 2**20), lazy=args.lazy)
        workloads = {
            "chat": Workload(
                "chat",
                args.users,
                args.turns,
                args.system_tokens,
                args.question_tokens,
                args.output_tokens,
            ),
            "unique": Workload(
                "unique", args.unique_prompts, 1, args.unique_tokens - 16, 16, args.output_tokens
            ),
        }
        plan = [("chat", rep) for rep in range(args.repeats)]
        plan += [("unique", rep) for rep in range(args.unique_repeats)]
        say(
            f"{len(plan) * 2} runs: the chat workload {args.repeats}x and the no-reuse "
            f"workload {args.unique_repeats}x per configuration, alternating"
        )
        import vllm  # noqa: F401  (its version goes into the machine record)

        runs: list[dict[str, Any]] = []
        reference: dict[str, list[list[int]]] = {}
        n = 0
        for wname, rep in plan:
            w = workloads[wname]
            # Alternate which configuration goes first, so neither always runs on a machine
            # the other has just warmed.
            order = ["vllm", "kvoffload"] if rep % 2 == 0 else ["kvoffload", "vllm"]
            for cfg in order:
                n += 1
                bar = Progress(term, f"run {n}/{len(plan) * 2}: {wname}, {LABELS[cfg]}", w.requests)
                r = run(spec, kvo if cfg == "kvoffload" else None, w, vocab, bar.step)
                bar.close()
                outputs = r.pop("outputs")
                # Every run of a workload is compared with its first run.
                reference.setdefault(wname, outputs)
                r.update(workload=wname, config=cfg, rep=rep)
                r["identical"] = outputs == reference[wname]
                runs.append(r)
        data = {
            "demo": 1,
            "machine": machine(),
            "model": {"path": model if args.model else None, "description": desc},
            "engine": {
                "kv_cache_mib": args.kv_cache_mib,
                "kv_cache_blocks": runs[0]["kv_cache_blocks"],
                "block_size": runs[0]["block_size"],
                "concurrency": args.concurrency,
                "cpu_mib": args.cpu_mib,
                "lazy": args.lazy,
                "threads": args.threads if args.model is None else None,
            },
            "workloads": {k: vars(v) for k, v in workloads.items()},
            "runs": runs,
        }
        write(args, data, say)
        term.write("\n" + table(data) + "\n")
        ok = all(r["identical"] for r in runs)
    return 0 if ok else 1


def write(args: argparse.Namespace, data: dict[str, Any], say: Callable[[str], None]) -> None:
    import json

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    plot(data, args.plot)
    say(f"wrote {args.json} and {args.plot}")
    if args.json.resolve() == (REPO / "docs" / "demo.json").resolve():
        from render_docs import render_all

        changed = render_all(write=True)
        if changed:
            say(f"re-rendered from the new results: {', '.join(changed)}")


if __name__ == "__main__":
    sys.exit(main())
