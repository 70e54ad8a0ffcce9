"""The value checksum's definition, as its module doc states it, against the Rust code:
``scripts/value_sum_reference.py`` (a Python transcription of the doc) must reproduce the
known answers ``value_sum``'s unit test (and the aarch64 harness) pins for every kernel, so
neither the doc nor the code can change alone."""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import value_sum_reference  # noqa: E402

KNOWN_ANSWERS = REPO / "crates/offload-core/src/tier/value_sum/known_answers.rs"


def pinned_cases() -> list[tuple[int, int, int]]:
    body = KNOWN_ANSWERS.read_text().split("const KNOWN_ANSWERS", 1)[1]
    body = body.split("];", 1)[0]
    cases = re.findall(r"\(\s*(0x[0-9a-f_]+|\d+),\s*(\d+),\s*(0x[0-9a-f_]+)\s*\)", body)
    return [(int(s.replace("_", ""), 0), int(n), int(v.replace("_", ""), 0)) for s, n, v in cases]


def fill() -> int:
    found = re.search(r"KNOWN_ANSWER_FILL: u32 = ([0-9_]+);", KNOWN_ANSWERS.read_text())
    assert found, "KNOWN_ANSWER_FILL not found"
    return int(found.group(1).replace("_", ""))


def test_the_reference_reproduces_every_known_answer_the_rust_code_pins() -> None:
    cases = pinned_cases()
    assert len(cases) == 6, cases
    for seed, length, expected in cases:
        data = value_sum_reference.pattern(length, fill())
        assert value_sum_reference.value_sum(seed, data) == expected, (seed, length)
