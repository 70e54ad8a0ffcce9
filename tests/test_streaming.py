"""Streaming-input sessions end to end: one request id carries several input chunks, and
vLLM truncates the request's block hashes at the end of each chunk (dropping the last
sampled token) and hashes the next chunk's blocks again. Outputs with kvoffload must be
token-identical to outputs without it, and the sessions' blocks must come back from CPU."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm_harness import offload_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

TESTS = Path(__file__).parent
SCRIPT = TESTS / "streaming_session.py"


def run_sessions(
    model: Path, kv_transfer_config: dict[str, Any] | None, **env: str
) -> dict[str, Any]:
    """Runs ``streaming_session.py`` (``AsyncLLM``: the engine core is another process)."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(model), json.dumps(kv_transfer_config)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path]), **env},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(line[len("RESULT ") :])


def tracing_config() -> dict[str, Any]:
    return {
        **offload_config(),
        "kv_connector": "TracingConnector",
        "kv_connector_module_path": "tracing_connector",
    }


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> dict[str, Any]:
    result = run_sessions(tiny_model, None)
    assert result["reset"]
    return result


def test_sessions_are_token_identical_and_served_from_cpu(
    tiny_model: Path, reference: dict[str, Any], tmp_path: Path
) -> None:
    from streaming_session import BLOCK_TOKENS, CHUNK_TOKENS, MAX_TOKENS, N_CHUNKS, N_SESSIONS

    trace = tmp_path / "trace.jsonl"
    result = run_sessions(tiny_model, tracing_config(), KVOFFLOAD_TRACE=str(trace))
    assert result["sessions"] == reference["sessions"]
    assert result["reset"]
    assert result["replays"] == reference["replays"]
    # Every full block of every session's history was stored, then served.
    history = N_CHUNKS * (CHUNK_TOKENS + MAX_TOKENS - 1)
    assert result["cpu_hit_tokens"] == N_SESSIONS * (history // BLOCK_TOKENS) * BLOCK_TOKENS

    # The run went through the rewriting path: each later chunk reached the connector as a
    # newly scheduled request under the session's id, with computed tokens kept from the
    # chunk before and its hash list regrown past them.
    calls = [json.loads(line) for line in trace.read_text().splitlines()]
    chunk_starts: dict[str, list[dict[str, Any]]] = {}
    for call in calls:
        if call["call"] == "build_connector_meta":
            for row in call["new"]:
                chunk_starts.setdefault(row["req"], []).append(row)
    sessions = {r: rows for r, rows in chunk_starts.items() if r.startswith("session-")}
    assert len(sessions) == N_SESSIONS
    for rows in sessions.values():
        assert len(rows) == N_CHUNKS
        for prev, row in itertools.pairwise(rows):
            assert row["num_computed_tokens"] > prev["num_computed_tokens"]
            assert row["len_block_hashes"] * BLOCK_TOKENS > row["num_computed_tokens"]


def test_corrupted_cpu_copies_change_the_output(
    tiny_model: Path, reference: dict[str, Any]
) -> None:
    """Guards the equality test: with every stored block overwritten, the replays, which
    can only load their prefixes from CPU, come out different."""
    result = run_sessions(tiny_model, tracing_config(), KVOFFLOAD_CORRUPT="1")
    assert result["cpu_hit_tokens"] > 0
    assert result["replays"] != reference["replays"]
