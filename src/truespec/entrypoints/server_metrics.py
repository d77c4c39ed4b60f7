"""The server's Prometheus metrics, named as vLLM names them (``vllm:`` -> ``truespec:``).

Histograms and token counters are observed by the engine thread as outputs come out; gauges and the speculative
decoding counters are a snapshot the engine thread publishes after each step, read when /metrics is scraped.
Each server has its own registry, so two apps in one process never collide.
"""

import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from truespec.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "truespec:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name}
        names = ["model_name"]
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prefill tokens processed.", names,
                                     registry=self.registry).labels(**self.labels)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generation tokens processed.", names,
                                         registry=self.registry).labels(**self.labels)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token in seconds.", names,
                              buckets=TTFT_BUCKETS, registry=self.registry).labels(**self.labels)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds", "Mean time per output token in seconds.",
                              names, buckets=TPOT_BUCKETS, registry=self.registry).labels(**self.labels)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "End to end request latency in seconds.",
                             names, buckets=E2E_BUCKETS, registry=self.registry).labels(**self.labels)
        self.finished = Counter(PREFIX + "request_success", "Finished requests, by finish reason.",
                                names + ["finished_reason"], registry=self.registry)
        self._engine = _EngineCollector(self.labels)
        self.registry.register(self._engine)
        self._seen: set[str] = set()  # requests whose first output was observed (engine thread only)

    def observe_output(self, out: RequestOutput) -> None:
        """One DELTA output of a request (engine thread)."""
        if out.request_id not in self._seen:
            self._seen.add(out.request_id)
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            if out.metrics is not None and out.metrics.time_to_first_token is not None:
                self.ttft.observe(out.metrics.time_to_first_token)
        self.generation_tokens.inc(sum(len(c.token_ids) for c in out.outputs))
        if not out.finished:
            return
        self._seen.discard(out.request_id)
        m = out.metrics
        if m is not None and m.time_per_output_token is not None:
            self.tpot.observe(m.time_per_output_token)
        if m is not None and m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        self.finished.labels(finished_reason=out.outputs[0].finish_reason or "unknown", **self.labels).inc()

    def forget(self, request_id: str) -> None:
        """An aborted request (engine thread)."""
        self._seen.discard(request_id)

    def set_engine_stats(self, num_running: int, num_waiting: int, kv_cache_usage: float,
                         spec: dict[str, object]) -> None:
        """The engine thread's snapshot after a step."""
        self._engine.set(num_running, num_waiting, kv_cache_usage, spec)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self._lock = threading.Lock()
        self._snapshot: tuple[int, int, float, dict[str, object]] = (0, 0, 0.0, {})

    def set(self, num_running: int, num_waiting: int, kv_cache_usage: float, spec: dict[str, object]) -> None:
        with self._lock:
            self._snapshot = (num_running, num_waiting, kv_cache_usage, spec)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            num_running, num_waiting, usage, spec = self._snapshot
        keys, values = list(self.labels), list(self.labels.values())
        for name, doc, value in (("num_requests_running", "Requests in the running batch.", num_running),
                                 ("num_requests_waiting", "Requests waiting to be scheduled.", num_waiting),
                                 ("kv_cache_usage_perc", "KV cache usage (1 = full).", usage)):
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=keys)
            gauge.add_metric(values, value)
            yield gauge
        for name in SPEC_COUNTERS:
            counter = CounterMetricFamily(PREFIX + "spec_decode_" + name, f"Speculative decoding {name}.",
                                          labels=keys)
            counter.add_metric(values, float(spec.get(name, 0)))
            yield counter
        for name, doc in (("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
                          ("prefix_cache_hits", "Prompt tokens found in the prefix cache.")):
            counter = CounterMetricFamily(PREFIX + name, doc, labels=keys)
            counter.add_metric(values, float(spec.get(name, 0)))
            yield counter
