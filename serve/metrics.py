"""Prometheus text exposition (format 0.0.4) for the node and the router, without a client library.

    registry = Registry()
    requests = registry.counter("hstu_node_requests_total", "Score requests answered.", ("code",))
    requests.inc(code="200")
    latency = registry.histogram("hstu_node_request_seconds", "...", buckets=LATENCY_BUCKETS_S)
    registry.gauge_callback("hstu_node_queue_depth", "...", lambda: batcher.queue_depth)
    text = registry.render()

Metrics are updated from the event loop and from the compute thread: each holds a lock.
"""
from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
FINE_LATENCY_BUCKETS_S = (0.00005, 0.0001, 0.00015, 0.0002, 0.0003, 0.0004, 0.0005, 0.00075, 0.001, 0.002, 0.005,
                          0.01, 0.05)  # sub-millisecond work: the router's own time, index lookups
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)

LabelValues = tuple[str, ...]


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, object]) -> LabelValues:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {sorted(labels)}")
        return tuple(str(labels[n]) for n in self.labelnames)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def samples(self) -> Iterable[str]:
        raise NotImplementedError


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labelnames)
        self._values: dict[LabelValues, float] = {} if labelnames else {(): 0.0}

    def inc(self, amount: float = 1.0, **labels: object) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter only goes up (got {amount})")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def samples(self) -> Iterable[str]:
        with self._lock:
            items = sorted(self._values.items())
        for key, value in items:
            yield f"{self.name}{_labels(self.labelnames, key)} {_number(value)}"


class Gauge(_Metric):
    """A value read at render time from `read()` (-> number, or {label values: number})."""

    kind = "gauge"

    def __init__(self, name: str, help_text: str, read: Callable[[], object], labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labelnames)
        self._read = read

    def samples(self) -> Iterable[str]:
        value = self._read()
        items = sorted(value.items()) if isinstance(value, dict) else [((), value)]
        for key, number in items:
            key = key if isinstance(key, tuple) else (key,)
            yield f"{self.name}{_labels(self.labelnames, key)} {_number(number)}"


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Sequence[float], labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labelnames)
        if list(buckets) != sorted(buckets) or not buckets:
            raise ValueError(f"{self.name}: buckets must be sorted and non-empty")
        self.buckets = tuple(float(b) for b in buckets)
        self._series: dict[LabelValues, list[float]] = {}  # per-bucket counts + [+Inf count, sum]

    def observe(self, value: float, **labels: object) -> None:
        key = self._key(labels)
        with self._lock:
            series = self._series.setdefault(key, [0.0] * (len(self.buckets) + 2))
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    series[i] += 1
            series[-2] += 1
            series[-1] += value

    def samples(self) -> Iterable[str]:
        with self._lock:
            items = sorted((k, list(v)) for k, v in self._series.items())
        for key, series in items:
            for bound, count in zip(self.buckets, series):
                yield f"{self.name}_bucket{_labels(self.labelnames + ('le',), key + (_number(bound),))} {_number(count)}"
            yield f"{self.name}_bucket{_labels(self.labelnames + ('le',), key + ('+Inf',))} {_number(series[-2])}"
            yield f"{self.name}_count{_labels(self.labelnames, key)} {_number(series[-2])}"
            yield f"{self.name}_sum{_labels(self.labelnames, key)} {_number(series[-1])}"


class Registry:
    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}

    def _add(self, metric: _Metric):
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} registered twice")
        self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> Counter:
        return self._add(Counter(name, help_text, labelnames))

    def histogram(self, name: str, help_text: str, buckets: Sequence[float], labelnames: Sequence[str] = ()) -> Histogram:
        return self._add(Histogram(name, help_text, buckets, labelnames))

    def gauge_callback(self, name: str, help_text: str, read: Callable[[], object], labelnames: Sequence[str] = ()) -> Gauge:
        return self._add(Gauge(name, help_text, read, labelnames))

    def render(self) -> str:
        lines: list[str] = []
        for metric in self._metrics.values():
            lines += metric.header()
            lines += metric.samples()
        return "\n".join(lines) + "\n"


def _labels(names: Sequence[str], values: Sequence[str]) -> str:
    if not names:
        return ""
    escaped = (str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for v in values)
    return "{" + ",".join(f'{n}="{v}"' for n, v in zip(names, escaped)) + "}"


def _number(value: float) -> str:
    value = float(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def parse_samples(text: str) -> dict[str, float]:
    """{`name{labels}`: value} of an exposition (for tests and the benchmark, which read /metrics)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def histogram_quantile(q: float, samples: dict[str, float], name: str) -> float:
    """The q-quantile of histogram `name` (no labels) from parsed samples, interpolated inside its
    bucket as Prometheus' histogram_quantile does; nan without observations."""
    buckets = []
    for key, count in samples.items():
        if key.startswith(f'{name}_bucket{{le="') and key.endswith('"}'):
            bound = key[len(name) + len('_bucket{le="'):-2]
            buckets.append((math.inf if bound == "+Inf" else float(bound), count))
    buckets.sort()
    if not buckets or buckets[-1][1] == 0:
        return math.nan
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower
