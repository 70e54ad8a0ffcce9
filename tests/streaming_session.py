"""Runs streaming-input sessions (``AsyncLLM.generate`` fed by a ``StreamingInput``
generator) on the tiny model, empties the GPU prefix cache, then replays each session's
whole history as one plain request; prints ``RESULT <json>`` with every token produced
and the tokens served from CPU.

A script, not a test: ``AsyncLLM`` runs its engine core in another process, which needs a
``__main__`` guard, and vLLM freezes its environment at the first engine start.
Usage: ``python streaming_session.py MODEL_DIR CONFIG_JSON`` (``null``: no connector).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from vllm_harness import BLOCK_TOKENS, KV_CACHE_BYTES

N_SESSIONS = 4
N_CHUNKS = 4
#: Each chunk's prompt plus its output ends on a block boundary, so the sampled token the
#: session drops at the end of a chunk is the one that completed a block: vLLM truncates
#: that block's hash and hashes the block again with the next chunk's first token.
MAX_TOKENS = 8
CHUNK_TOKENS = 2 * BLOCK_TOKENS - MAX_TOKENS


def session_chunks(session: int) -> list[list[int]]:
    rng = random.Random(1000 + session)
    return [[rng.randrange(3, 1000) for _ in range(CHUNK_TOKENS)] for _ in range(N_CHUNKS)]


async def run_session(llm: Any, session: int) -> tuple[list[int], list[int]]:
    """The session's tokens in order (every chunk's prompt, then its output) and its
    output tokens alone."""
    from vllm import SamplingParams
    from vllm.engine.protocol import StreamingInput
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    chunks = session_chunks(session)
    params = SamplingParams(
        temperature=0,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )

    async def inputs() -> Any:
        for chunk in chunks:
            # A copy: vLLM's front end extends the session's first prompt list in place.
            yield StreamingInput(prompt=TokensPrompt(prompt_token_ids=list(chunk)))

    outputs: list[int] = []
    async for out in llm.generate(inputs(), params, request_id=f"session-{session}"):
        outputs.extend(out.outputs[0].token_ids)
    # The session keeps each chunk's output but its last token; the last chunk's output is
    # all the caller gets beyond the history.
    history: list[int] = []
    for i, chunk in enumerate(chunks):
        history += chunk + outputs[i * MAX_TOKENS : (i + 1) * MAX_TOKENS - 1]
    return history, outputs


async def replay(llm: Any, prompt: list[int], request_id: str) -> list[int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    final = None
    async for out in llm.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id):
        final = out
    assert final is not None
    return list(final.outputs[0].token_ids)


async def main(model: str, kv_transfer_config: dict[str, Any] | None) -> dict[str, Any]:
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.reader import get_metrics_snapshot

    args = AsyncEngineArgs(
        model=model,
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=True,
        max_model_len=2048,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        distributed_executor_backend="uni",
        disable_log_stats=False,
        seed=0,
        kv_transfer_config=kv_transfer_config,
    )
    llm = AsyncLLM.from_engine_args(args)
    try:
        sessions = await asyncio.gather(*(run_session(llm, s) for s in range(N_SESSIONS)))
        # Empties the GPU prefix cache (not the connector's): the replays' prefixes can
        # only come from CPU.
        reset = await llm.reset_prefix_cache()
        replays = []
        for s, (history, _) in enumerate(sessions):
            replays.append(await replay(llm, history, f"replay-{s}"))
    finally:
        llm.shutdown()
    hits = sum(
        m.value for m in get_metrics_snapshot() if m.name == "vllm:external_prefix_cache_hits"
    )
    return {
        "sessions": [outputs for _, outputs in sessions],
        "reset": reset,
        "replays": replays,
        "cpu_hit_tokens": int(hits),
    }


if __name__ == "__main__":
    result = asyncio.run(main(sys.argv[1], json.loads(sys.argv[2])))
    print("RESULT", json.dumps(result))
