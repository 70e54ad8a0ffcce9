#!/usr/bin/env python3
"""The value checksum (value format 2) transcribed from its definition, independently of
the Rust code: ``crates/offload-core/src/tier/value_sum/mod.rs``'s module doc.

Prints the known answers that ``value_sum/known_answers.rs`` pins (seed, length, sum over the
test's byte pattern), so a change of the definition, or a doc that no longer says what
the code computes, shows as a difference. Slow (pure Python), for checking only.

    python3 scripts/value_sum_reference.py
"""

from __future__ import annotations

MASK = (1 << 64) - 1
MERGE_PRIME = 0x9E3779B97F4A7C15
SCRAMBLE_PRIME = 0x9E3779B1
INIT = [
    0xC2B2AE3D,
    0x9E3779B185EBCA87,
    0xC2B2AE3D27D4EB4F,
    0x165667B19E3779F9,
    0x85EBCA77C2B2AE63,
    0x85EBCA77,
    0x27D4EB2F165667C5,
    0x9E3779B1,
]


def splitmix64(seed: int, n: int) -> list[int]:
    out, state = [], seed
    for _ in range(n):
        state = (state + 0x9E3779B97F4A7C15) & MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        out.append(z ^ (z >> 31))
    return out


def merge_round(h: int, v: int) -> int:
    x = ((h ^ v) * MERGE_PRIME) & MASK
    return ((x << 31) | (x >> 33)) & MASK


def fmix64(h: int) -> int:
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & MASK
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & MASK
    return h ^ (h >> 33)


def accumulate(acc: list[int], stripe: bytes, keys: list[int], n: int) -> None:
    for j in range(8):
        w = int.from_bytes(stripe[8 * j : 8 * j + 8], "little")
        x = w ^ keys[n + j]
        acc[j ^ 1] = (acc[j ^ 1] + w) & MASK
        acc[j] = (acc[j] + (x & 0xFFFFFFFF) * (x >> 32)) & MASK


def value_sum(seed: int, data: bytes) -> int:
    keys, acc, n = splitmix64(seed, 24), list(INIT), 0
    whole = len(data) // 64
    for s in range(whole):
        accumulate(acc, data[64 * s : 64 * s + 64], keys, n)
        n += 1
        if n == 16:
            for j in range(8):
                a = acc[j] ^ (acc[j] >> 47) ^ keys[16 + j]
                acc[j] = (a * SCRAMBLE_PRIME) & MASK
            n = 0
    tail = data[64 * whole :]
    if tail:
        accumulate(acc, tail + bytes(64 - len(tail)), keys, n)
    h = merge_round(seed ^ MERGE_PRIME, len(data))
    for a in acc:
        h = merge_round(h, a)
    return fmix64(h)


def pattern(n: int, mul: int) -> bytes:
    """The unit test's bytes: ``(i * mul mod 2^32) >> 3``, low byte."""
    return bytes((((i * mul) & 0xFFFFFFFF) >> 3) & 0xFF for i in range(n))


def main() -> None:
    seed = 0x4B564F4656414C55
    for s, n in [(0, 0), (0, 1), (7, 63), (7, 64), (seed, 1024), (seed, 5000)]:
        print(f"seed {s:#x}, {n} bytes: {value_sum(s, pattern(n, 2654435761)):#018x}")


if __name__ == "__main__":
    main()
