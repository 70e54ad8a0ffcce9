"""``KVOffloadConnector`` for tests that run vLLM's engine core in its own process, selected
with ``kv_connector_module_path``.

``KVOFFLOAD_TRACE=<file>``: the scheduler side appends one JSON line per connector call,
with what it saw of each request (``num_computed_tokens``, ``len(block_hashes)``, and the
first bytes of each block hash, to show where a hash list was rewritten).
``KVOFFLOAD_CORRUPT=1``: the worker side overwrites every block it stored with random
bytes, so whatever is loaded back is wrong (guards the tests' equality checks).
"""

from __future__ import annotations

import json
import os
from typing import Any

from kvoffload.connector import KVOffloadConnector
from kvoffload.metadata import KVOffloadMetadata
from kvoffload.worker import block_list

TRACE_ENV = "KVOFFLOAD_TRACE"
CORRUPT_ENV = "KVOFFLOAD_CORRUPT"


def _hash_prefixes(hashes: Any) -> list[str]:
    return [bytes(h)[:3].hex() for h in hashes]


class TracingConnector(KVOffloadConnector):
    def _trace(self, call: str, **fields: Any) -> None:
        path = os.environ.get(TRACE_ENV)
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"call": call, **fields}) + "\n")

    def _request(self, request: Any) -> dict[str, Any]:
        return {
            "req": request.request_id,
            "status": str(request.status.name),
            "num_tokens": request.num_tokens,
            "num_computed_tokens": request.num_computed_tokens,
            "len_block_hashes": len(request.block_hashes),
            "hashes": _hash_prefixes(request.block_hashes),
        }

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        hit, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        self._trace(
            "get_num_new_matched_tokens",
            **self._request(request),
            arg_num_computed_tokens=num_computed_tokens,
            hit=hit,
        )
        return hit, is_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._trace(
            "update_state_after_alloc",
            **self._request(request),
            num_external_tokens=num_external_tokens,
        )
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        hash_lists = self._scheduler._hash_lists if self._scheduler is not None else {}
        new = [
            {
                "req": r.req_id,
                "num_computed_tokens": r.num_computed_tokens,
                "num_blocks": len(r.block_ids[0]),
                "num_scheduled": scheduler_output.num_scheduled_tokens.get(r.req_id),
                "len_block_hashes": len(hash_lists.get(r.req_id, ())),
            }
            for r in scheduler_output.scheduled_new_reqs
        ]
        cached_data = scheduler_output.scheduled_cached_reqs
        cached = [
            {
                "req": r,
                "num_computed_tokens": n,
                "resumed": r in (cached_data.resumed_req_ids or ()),
                "num_scheduled": scheduler_output.num_scheduled_tokens.get(r),
                "len_block_hashes": len(hash_lists.get(r, ())),
                "hashes": _hash_prefixes(hash_lists.get(r, ())),
            }
            for r, n in zip(cached_data.req_ids, cached_data.num_computed_tokens, strict=True)
        ]
        for row in new:
            row["hashes"] = _hash_prefixes(hash_lists.get(row["req"], ()))
        meta = super().build_connector_meta(scheduler_output)
        self._trace("build_connector_meta", new=new, cached=cached)
        return meta

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished(request, block_ids)
        self._trace("request_finished", **self._request(request), delay_free=delay)
        return delay, params

    def wait_for_save(self) -> None:
        super().wait_for_save()
        worker = self._worker
        if not os.environ.get(CORRUPT_ENV) or worker is None or worker.engine is None:
            return
        meta = self._connector_metadata
        if not isinstance(meta, KVOffloadMetadata):
            return
        import torch

        stores = [
            s
            for s in (meta.store, meta.store_before_forward, meta.store_after_forward)
            if s is not None
        ]
        engine = worker.engine
        floats = engine.cpu_block_bytes // 2 // 4  # the tiny model: two layers of float32
        for _tid, _gpu, cpu, _reqs in stores:
            for block in block_list(cpu):
                for region in range(2):
                    engine.write_cpu_block(region, block, torch.randn(floats).numpy().tobytes())
