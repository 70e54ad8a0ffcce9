"""How long each copy took, from submission to completion, for the stats' histograms."""

from __future__ import annotations

import time

#: Copy times kept between two stats reports, per direction (vLLM asks every step).
MAX_TIMES_PER_REPORT = 4096


class CopyTimes:
    """Submission times of the copies in flight, and the times of those that ended since
    the last :meth:`take` (capped at :data:`MAX_TIMES_PER_REPORT` per direction)."""

    def __init__(self) -> None:
        self._started: dict[int, float] = {}
        self._times: dict[str, list[float]] = {"store": [], "load": []}

    def start(self, tid: int) -> None:
        self._started[tid] = time.perf_counter()

    def cancel(self, tid: int) -> None:
        """A copy that was never submitted."""
        self._started.pop(tid, None)

    def ended(self, tid: int, ok: bool, store: bool) -> None:
        """A completion: a successful copy's time is kept, a failed one's dropped."""
        started = self._started.pop(tid, None)
        if ok and started is not None:
            times = self._times["store" if store else "load"]
            if len(times) < MAX_TIMES_PER_REPORT:
                times.append(time.perf_counter() - started)

    def take(self) -> dict[str, list[float]]:
        times, self._times = self._times, {"store": [], "load": []}
        return times
