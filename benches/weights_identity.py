"""Start-up cost of the weights' identity (``kvoffload.weights.checkpoint_identity``) on a
checkpoint of a 70B-class model's size: 100 GB of bf16 safetensors shards, simulated with
sparse files (the data reads as zeros and takes no disk) that carry real safetensors
headers (every tensor's name, dtype, shape and offsets, as ``save_pretrained`` writes
them), plus ``config.json`` and ``model.safetensors.index.json``.

Prints the median and worst time of several runs (the page cache is warm after the first;
the first run is printed too). The goal is under a second.

    .venv/bin/python benches/weights_identity.py [--gb 100] [--runs 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))

from kvoffload.weights import checkpoint_identity

#: A Llama-3-70B-like layer: (name, shape) of its bf16 tensors.
HIDDEN, INTER, KV = 8192, 28672, 1024
LAYER = [
    ("input_layernorm.weight", [HIDDEN]),
    ("self_attn.q_proj.weight", [HIDDEN, HIDDEN]),
    ("self_attn.k_proj.weight", [KV, HIDDEN]),
    ("self_attn.v_proj.weight", [KV, HIDDEN]),
    ("self_attn.o_proj.weight", [HIDDEN, HIDDEN]),
    ("post_attention_layernorm.weight", [HIDDEN]),
    ("mlp.gate_proj.weight", [INTER, HIDDEN]),
    ("mlp.up_proj.weight", [INTER, HIDDEN]),
    ("mlp.down_proj.weight", [HIDDEN, INTER]),
]
SHARD_BYTES = 5 * 10**9


def tensors(total_bytes: int) -> list[tuple[str, list[int], int]]:
    """``(name, shape, bytes)`` of layers until ``total_bytes``."""
    out = []
    size = 0
    layer = 0
    while size < total_bytes:
        for name, shape in LAYER:
            n = 2
            for d in shape:
                n *= d
            out.append((f"model.layers.{layer}.{name}", shape, n))
            size += n
        layer += 1
    return out


def write_checkpoint(root: Path, total_bytes: int) -> tuple[int, int]:
    """Writes the sparse shards, their index and a config; returns (files, bytes)."""
    shards: list[list[tuple[str, list[int], int]]] = [[]]
    size = 0
    for t in tensors(total_bytes):
        if size + t[2] > SHARD_BYTES and shards[-1]:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t[2]
    weight_map = {}
    total = 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for tensor, shape, n in shard:
            header[tensor] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
            weight_map[tensor] = name
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(root / name, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + offset)
        total += 8 + len(raw) + offset
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (root / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN})
    )
    return len(shards) + 2, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=100.0)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true", help="1 GB, 2 runs")
    args = parser.parse_args()
    gb, runs = (1.0, 2) if args.smoke else (args.gb, args.runs)
    with tempfile.TemporaryDirectory(prefix="kvoffload-weights-") as tmp:
        files, total = write_checkpoint(Path(tmp), int(gb * 10**9))
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            identity = checkpoint_identity(tmp)
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    print(
        f"checkpoint_identity: {total / 1e9:.1f} GB in {files} files (sparse bf16 "
        f"safetensors shards with real headers): first run {times[0] * 1e3:.1f} ms, median "
        f"{median * 1e3:.1f} ms, worst {max(times) * 1e3:.1f} ms of {runs} "
        f"(goal < 1000 ms: {'met' if max(times) < 1.0 else 'not met'}); {identity}"
    )
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {"bytes": total, "files": files, "seconds": times, "identity": identity},
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
