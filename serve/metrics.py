"""The node's and the router's Prometheus metrics, on prometheus-client.

    registry = Registry()
    requests = registry.counter("hstu_node_requests_total", "Score requests answered.", ("code",))
    requests.inc(code="200")
    latency = registry.histogram("hstu_node_request_seconds", "...", buckets=LATENCY_BUCKETS_S)
    registry.gauge_callback("hstu_node_queue_depth", "...", lambda: batcher.queue_depth)
    text = registry.render()   # served with CONTENT_TYPE

Each `Registry` owns a `CollectorRegistry` of its own rather than prometheus-client's global
one, so that several nodes or routers in one process (the tests) keep their series apart.
Call sites pass label values as keywords (`inc(3, tier="host")`), one line per update; the
metrics themselves are prometheus-client's, thread-safe for the event loop and the compute
thread alike.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import prometheus_client
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry

# The text format every Prometheus version scrapes; what `generate_latest` writes for our names.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
FINE_LATENCY_BUCKETS_S = (0.00005, 0.0001, 0.00015, 0.0002, 0.0003, 0.0004, 0.0005, 0.00075, 0.001, 0.002, 0.005,
                          0.01, 0.05)  # sub-millisecond work: the router's own time, index lookups
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)

# A `*_created` timestamp series per counter and histogram doubles the scrape and no query here
# uses it; the setting is process-wide in prometheus-client, and only serving processes import this.
prometheus_client.disable_created_metrics()


class Series:
    """A prometheus-client counter or histogram updated as `inc(amount, **labels)` / `observe(value, **labels)`.

    Wrong or missing label names raise prometheus-client's ValueError, as does a negative increment.
    """

    def __init__(self, metric: prometheus_client.Counter | prometheus_client.Histogram) -> None:
        self.metric = metric

    def _child(self, labels: dict[str, object]):
        return self.metric.labels(**labels) if labels else self.metric

    def inc(self, amount: float = 1.0, **labels: object) -> None:
        self._child(labels).inc(amount)

    def observe(self, value: float, **labels: object) -> None:
        self._child(labels).observe(value)


class CallbackGauge(Collector):
    """A gauge read at scrape time from `read()`: a number, or {label values (tuple): number}."""

    def __init__(self, name: str, help_text: str, read: Callable[[], object], labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.labelnames = list(labelnames)
        self._read = read

    def describe(self) -> list[GaugeMetricFamily]:
        # Lets the registry refuse a duplicate name at registration without calling `read`.
        return [GaugeMetricFamily(self.name, self.help, labels=self.labelnames)]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self.name, self.help, labels=self.labelnames)
        value = self._read()
        items = sorted(value.items()) if isinstance(value, dict) else [((), value)]
        for key, number in items:
            label_values = key if isinstance(key, tuple) else (key,)
            family.add_metric([str(v) for v in label_values], float(number))
        yield family


class Registry:
    """One process part's metrics (a node's, a router's) in a `CollectorRegistry` of its own."""

    def __init__(self) -> None:
        self.collectors = CollectorRegistry()

    def counter(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> Series:
        return Series(prometheus_client.Counter(name, help_text, labelnames, registry=self.collectors))

    def histogram(self, name: str, help_text: str, buckets: Sequence[float], labelnames: Sequence[str] = ()) -> Series:
        return Series(prometheus_client.Histogram(name, help_text, labelnames, registry=self.collectors,
                                                  buckets=buckets))

    def gauge_callback(self, name: str, help_text: str, read: Callable[[], object],
                       labelnames: Sequence[str] = ()) -> CallbackGauge:
        gauge = CallbackGauge(name, help_text, read, labelnames)
        self.collectors.register(gauge)
        return gauge

    def render(self) -> str:
        """The exposition of every metric (CONTENT_TYPE)."""
        return prometheus_client.generate_latest(self.collectors).decode()


def parse_samples(text: str) -> dict[str, float]:
    """{`name{labels}`: value} of an exposition (for tests and the benchmark, which read /metrics)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
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
