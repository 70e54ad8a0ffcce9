#!/usr/bin/env python3
"""Regenerates the CUDA backend's copy-kernel PTX from its CUDA C source with NVRTC.

    pip download --no-deps -d /tmp/nvrtc nvidia-cuda-nvrtc-cu11==11.8.89
    python scripts/build_copy_kernel.py --nvrtc /tmp/nvrtc/.../libnvrtc.so.11.2

NVRTC 11.8 emits PTX ISA 7.8, the newest that the oldest driver kvoffload accepts (CUDA
11.8) can JIT; compute_70 covers every GPU vLLM runs on. The PTX starts with the SHA-256 of
the source it came from; a Rust test checks that it matches ``copy_kernel.cu``, so the two
cannot drift apart. No GPU is needed.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import sys
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent.parent / "crates/offload-core/src/transfer/cuda"
SOURCE = KERNEL_DIR / "copy_kernel.cu"
PTX = KERNEL_DIR / "copy_kernel.ptx"
OPTIONS = (b"--gpu-architecture=compute_70", b"-std=c++14")


def compile_ptx(nvrtc: ctypes.CDLL, source: bytes) -> bytes:
    prog = ctypes.c_void_p()
    rc = nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source, b"copy_kernel.cu", 0, None, None)
    if rc != 0:
        raise SystemExit(f"nvrtcCreateProgram failed ({rc})")
    opts = (ctypes.c_char_p * len(OPTIONS))(*OPTIONS)
    rc = nvrtc.nvrtcCompileProgram(prog, len(OPTIONS), opts)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        raise SystemExit(f"nvrtcCompileProgram failed ({rc}):\n{log.value.decode()}")
    nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetPTX(prog, ptx)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return ptx.value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nvrtc", required=True, help="path to libnvrtc.so (CUDA 11.8)")
    args = parser.parse_args()
    source = SOURCE.read_bytes()
    ptx = compile_ptx(ctypes.CDLL(args.nvrtc), source)
    digest = hashlib.sha256(source).hexdigest()
    header = f"// Generated from copy_kernel.cu (sha256 {digest}) by {Path(__file__).name}.\n"
    PTX.write_text(header + ptx.decode())
    print(f"wrote {PTX} ({len(ptx)} bytes of PTX)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
