"""Monotonic counters turned into the per-report deltas of :class:`KVOffloadStats`."""

from __future__ import annotations

import time

from kvoffload.stats import KVOffloadStats

#: vLLM asks for connector stats after every step and never while idle, so a report held
#: back for an interval would keep the last counts of a burst from /metrics until the next
#: request: every call with something new reports it (a few microseconds).
REPORT_INTERVAL_S = 0.0


class CounterDeltas:
    """Turns monotonic counters into deltas, at most once per ``interval_s`` seconds, with
    gauges that changed and the copy times gathered since; ``None`` when it is not time
    yet or nothing changed."""

    def __init__(self, interval_s: float = REPORT_INTERVAL_S) -> None:
        self._last: dict[str, int] = {}
        self._gauges: dict[str, int] = {}
        self._interval = interval_s
        self._next = 0.0

    def due(self) -> bool:
        if not self._interval:
            return True
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self._interval
        return True

    def delta(
        self,
        counters: list[tuple[str, int]],
        gauges: dict[str, int] | None = None,
        times: dict[str, list[float]] | None = None,
    ) -> KVOffloadStats | None:
        deltas = []
        last = self._last
        for name, value in counters:
            d = value - last.get(name, 0)
            if d:
                deltas.append((name, d))
                last[name] = value
        return self.report(deltas, gauges, times)

    def report(
        self,
        deltas: list[tuple[str, int]],
        gauges: dict[str, int] | None = None,
        times: dict[str, list[float]] | None = None,
    ) -> KVOffloadStats | None:
        """Like :meth:`delta`, from counter increases computed by the caller."""
        # Called after every engine step: nothing is built unless something changed.
        changed: dict[str, int] = {}
        if gauges:
            last = self._gauges
            for n, v in gauges.items():
                if last.get(n) != v:
                    changed[n] = last[n] = v
        new_times = {n: v for n, v in times.items() if v} if times else {}
        if not deltas and not changed and not new_times:
            return None
        return KVOffloadStats.of(dict(deltas), changed, new_times)
