#!/usr/bin/env python
"""Disk tier bandwidth and scale: runs ``cargo bench -p offload-core --bench disk`` (which
measures, in one run on the same disk, for 64 KiB, 256 KiB and 2 MiB blocks, with
``O_DIRECT`` and with the page cache: the tier's reads and writes, raw sequential I/O as
``dd iflag=direct bs=4M`` does it, and a Python copy of Simple's one-``preadv``-at-a-time
read loop with two buffer slots, medians of 9 interleaved runs; the checksum's cost; the
in-memory index at 5 M entries; the index rebuild at restart) and stores its result with
the machine and the file system it ran on.

    .venv/bin/python benches/disk_tier.py --dir /path/on/the/disk \\
        --json docs/benchmarks/disk_tier.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, write_json

REPO = Path(__file__).resolve().parent.parent


def filesystem(path: Path) -> str:
    out = subprocess.run(
        ["df", "--output=fstype", str(path)], capture_output=True, text=True, check=False
    )
    lines = out.stdout.split()
    return lines[-1] if out.returncode == 0 and lines else "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=str(REPO / "target"), help="where the files go")
    p.add_argument("--json", help="write the result here")
    p.add_argument(
        "--only-index",
        action="store_true",
        help="measure only the in-memory index at scale (seconds, no disk I/O) and replace "
        "the `index` part of the existing --json file, recording the machine it ran on",
    )
    args = p.parse_args()
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "KVOFFLOAD_BENCH_DIR": str(directory), "PYTHON": sys.executable}
    if args.only_index:
        env.update(KVOFFLOAD_BENCH_BLOCK_SIZES="", KVOFFLOAD_BENCH_REBUILD_BLOCKS="0")
    out = subprocess.run(
        ["cargo", "bench", "-q", "-p", "offload-core", "--bench", "disk"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if args.only_index:
        if not args.json:
            p.error("--only-index updates the file given with --json")
        index = {**result["index"], "machine": machine()}
        print("index", json.dumps({k: v for k, v in index.items() if not k.startswith("runs")}))
        whole = json.loads(Path(args.json).read_text())
        whole["index"] = index
        write_json(args.json, whole)
        return
    result.pop("dir", None)
    result["filesystem"] = filesystem(directory)
    result["machine"] = machine()
    for c in result["configs"]:
        m, r = c["medians"], c["ratios"]
        print(
            f"{c['block_bytes']:>8} B {c['mode']:<10} raw {m['raw_read_gbps']:.2f} "
            f"tier {m['tier_read_seq_gbps']:.2f} python {m['python_simple_read_gbps']:.2f} "
            f"GB/s: {r['read_vs_python_simple']:.2f}x Simple's loop"
        )
    for part in ("checksum", "index", "rebuild"):
        if part in result:
            brief = {k: v for k, v in result[part].items() if not k.startswith("runs")}
            print(part, json.dumps(brief))
    write_json(args.json, result)


if __name__ == "__main__":
    main()
