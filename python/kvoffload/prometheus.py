"""kvoffload's series on vLLM's ``/metrics``: one Prometheus counter, gauge or histogram per
key of the stats payload (:mod:`kvoffload.stats` names them)."""

from __future__ import annotations

from typing import Any

from kvoffload.stats import (
    COUNTER_SERIES,
    COUNTERS,
    GAUGE_SERIES,
    GAUGES,
    LABEL_OF,
    TIME_BUCKETS,
    TIME_SERIES,
    TIMES,
)
from kvoffload.vllm_adapter import KVConnectorPromMetrics


class KVOffloadPromMetrics(KVConnectorPromMetrics):
    """kvoffload's series on vLLM's ``/metrics``, labelled per engine like vLLM's own."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM picks the classes (its multiprocess-safe wrappers in API servers with several
        # processes); their constructors take prometheus_client's keywords.
        counter: Any = self._counter_cls
        gauge: Any = self._gauge_cls
        histogram: Any = self._histogram_cls
        self._series: dict[str, Any] = {}
        for name, extra, doc in COUNTER_SERIES.values():
            if name not in self._series:
                labels = [LABEL_OF[name]] if extra else []
                self._series[name] = counter(
                    name=f"{name}_total", documentation=doc, labelnames=labelnames + labels
                )
        for name, doc in GAUGE_SERIES.values():
            self._series[name] = gauge(
                name=name,
                documentation=doc,
                labelnames=labelnames,
                multiprocess_mode="mostrecent",
            )
        for kind, name in TIME_SERIES.items():
            self._series[name] = histogram(
                name=name,
                documentation=f"Time from submitting a {kind} to its completion, per rank.",
                labelnames=labelnames,
                buckets=TIME_BUCKETS,
            )
        self._children: dict[tuple[int, str, tuple[str, ...]], Any] = {}
        # Every counter shows from the start, at 0 until something happens: a scrape
        # can tell "no failed store" from "not reported".
        for engine_idx in per_engine_labelvalues:
            for name, extra, _doc in COUNTER_SERIES.values():
                self._child(engine_idx, name, extra)

    def _child(self, engine_idx: int, name: str, extra: tuple[str, ...] = ()) -> Any:
        key = (engine_idx, name, extra)
        child = self._children.get(key)
        if child is None:
            values = [*self.per_engine_labelvalues[engine_idx], *extra]
            child = self._children[key] = self._series[name].labels(*values)
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.get(COUNTERS, {}).items():
            series = COUNTER_SERIES.get(key)
            if series is not None and value > 0:
                self._child(engine_idx, series[0], series[1]).inc(value)
        for key, value in transfer_stats_data.get(GAUGES, {}).items():
            if key in GAUGE_SERIES:
                self._child(engine_idx, GAUGE_SERIES[key][0]).set(value)
        for key, values in transfer_stats_data.get(TIMES, {}).items():
            if key in TIME_SERIES:
                child = self._child(engine_idx, TIME_SERIES[key])
                for v in values:
                    child.observe(v)
