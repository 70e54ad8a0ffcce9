"""Which weights a checkpoint holds, in well under a second for a 100 GB checkpoint.

A tier that outlives the engine (the remote tier, a persisted disk) keys blocks by a
fingerprint of everything that decides what their bytes mean; the weights are part of it,
or an engine restarted on a fine-tune of the same name would be served KV of the old
weights. Reading the weights is out of the question at start-up, so the identity is: every
file's name and size; the whole of the small JSON files (``config.json``,
``*.index.json``, ...); each safetensors file's header (tensor names, dtypes, shapes,
offsets); and a few sampled runs of bytes spread over every weight file's data. Two
checkpoints of one shape with other values (random initialisations, a fine-tune, which
moves nearly every value) differ in the sampled bytes. Weights updated in place, without
new files (RL), are told apart by the operator's ``kv_cache_version`` instead.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

#: Files whose data is sampled.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".npz", ".h5")
#: Runs of bytes sampled from each weight file's data, evenly spread, and their length.
SAMPLES_PER_FILE = 8
SAMPLE_BYTES = 4096
#: JSON files up to this size are digested whole (configs and shard indexes are small;
#: a large ``tokenizer.json`` counts by name and size).
MAX_DIGESTED_JSON_BYTES = 4 * 2**20
#: A safetensors header longer than this is not a safetensors header.
MAX_SAFETENSORS_HEADER_BYTES = 100 * 2**20


def _files(root: Path) -> list[tuple[str, Path]]:
    """``(name relative to root, path)`` of every regular file, sorted; hidden entries
    (``.git``, ``.cache``) are skipped. A single-file checkpoint (GGUF) is itself."""
    if root.is_file():
        return [(root.name, root)]
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            if name.startswith("."):
                continue
            path = Path(dirpath) / name
            if path.is_file():
                found.append((path.relative_to(root).as_posix(), path))
    return sorted(found)


def _safetensors_header(fd: int, size: int) -> tuple[bytes, int]:
    """The header's bytes and where the data starts (``(b"", 0)`` if it is no header)."""
    raw = os.pread(fd, 8, 0)
    if len(raw) < 8:
        return b"", 0
    (length,) = struct.unpack("<Q", raw)
    if length > min(MAX_SAFETENSORS_HEADER_BYTES, size - 8):
        return b"", 0
    return os.pread(fd, length, 8), 8 + length


def _digest_file(h: hashlib._Hash, name: str, path: Path) -> None:
    size = path.stat().st_size
    h.update(struct.pack("<Q", len(name)) + name.encode() + struct.pack("<Q", size))
    lower = name.lower()
    if lower.endswith(".json"):
        if size <= MAX_DIGESTED_JSON_BYTES:
            h.update(path.read_bytes())
        return
    if not lower.endswith(WEIGHT_SUFFIXES):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        start = 0
        if lower.endswith(".safetensors"):
            header, start = _safetensors_header(fd, size)
            h.update(header)
        span = size - start
        if span <= 0:
            return
        step = max(span // SAMPLES_PER_FILE, 1)
        for i in range(SAMPLES_PER_FILE):
            offset = start + min(i * step, max(span - SAMPLE_BYTES, 0))
            h.update(os.pread(fd, SAMPLE_BYTES, offset))
        # The very end too: the last tensor's tail.
        h.update(os.pread(fd, SAMPLE_BYTES, max(size - SAMPLE_BYTES, start)))
    finally:
        os.close(fd)


def checkpoint_identity(root: str | os.PathLike[str]) -> str:
    """``"checkpoint:<hex>"``: a digest of the checkpoint at ``root`` (a directory, or a
    single-file checkpoint) as described in the module docs. Raises ``OSError`` when it
    cannot be read."""
    h = hashlib.sha256()
    for name, path in _files(Path(root)):
        _digest_file(h, name, path)
    return "checkpoint:" + h.hexdigest()[:32]


def weights_identity(checkpoint: str, kv_cache_version: str | None) -> str:
    """The ``weights`` field of a tier's layout: the checkpoint's identity, and the
    operator's ``kv_cache_version`` when set."""
    if kv_cache_version is None:
        return checkpoint
    return f"{checkpoint}|kv_cache_version={kv_cache_version}"
