"""Connector statistics in vLLM's ``KVConnectorStats`` shape."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kvoffload.vllm_adapter import KVConnectorStats


@dataclass
class KVOffloadStats(KVConnectorStats):
    """Counter deltas since the previous report (vLLM sums them across steps and ranks)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVOffloadStats:
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in self.data.items() if isinstance(v, (int, float))}

    def is_empty(self) -> bool:
        return not any(self.data.values())


#: vLLM asks for connector stats every step; its loggers print every few seconds, so
#: reporting the deltas once per interval keeps the per-step cost to a clock read.
REPORT_INTERVAL_S = 1.0


class CounterDeltas:
    """Turns monotonic counters into deltas, at most once per ``interval_s`` seconds,
    returning ``None`` when it is not time yet or nothing moved."""

    def __init__(self, interval_s: float = REPORT_INTERVAL_S) -> None:
        self._last: dict[str, int] = {}
        self._interval = interval_s
        self._next = 0.0

    def due(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self._interval
        return True

    def delta(self, counters: list[tuple[str, int]]) -> KVOffloadStats | None:
        data: dict[str, Any] = {}
        last = self._last
        for name, value in counters:
            d = value - last.get(name, 0)
            if d:
                data[name] = d
                last[name] = value
        return KVOffloadStats(data=data) if data else None
