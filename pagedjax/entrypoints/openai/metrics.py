"""Prometheus metrics of one server, under vLLM's names with a `pagedjax:` prefix.

The engine's state (queue lengths, KV usage, token totals) is read from `engine.stats()` at
each scrape; the request latencies are observed by the serving code as requests finish. All
metrics live on the app's own registry, so two apps in a process never share one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedjax.outputs import RequestOutput

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_TOKEN_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip

# stats() key -> (metric name, help); gauges, then counters (totals since start-up).
_GAUGES = {
    "running": ("pagedjax:num_requests_running", "Requests running in the engine's batch."),
    "waiting": ("pagedjax:num_requests_waiting", "Requests waiting to be scheduled."),
    "kv_usage": ("pagedjax:kv_cache_usage_perc", "KV cache usage (1 means 100 percent)."),
    "kv_blocks_used": ("pagedjax:kv_cache_blocks_used", "KV cache blocks in use."),
    "kv_blocks_total": ("pagedjax:kv_cache_blocks_total", "KV cache blocks in the pool."),
    "prefix_cache_hit_rate": (
        "pagedjax:prefix_cache_hit_rate",
        "Share of queried prompt tokens the prefix cache served.",
    ),
    "num_devices": ("pagedjax:num_devices", "Devices the engine runs on (all replicas)."),
    "weights_bytes_per_device": (
        "pagedjax:weights_bytes_per_device",
        "Bytes of weights on the fullest device.",
    ),
    "weights_bytes_total": ("pagedjax:weights_bytes_total", "Bytes of weights on all devices."),
    "kv_cache_bytes_per_device": (
        "pagedjax:kv_cache_bytes_per_device",
        "Bytes of KV pool on the fullest device.",
    ),
    "kv_cache_bytes_total": ("pagedjax:kv_cache_bytes_total", "Bytes of KV pool on all devices."),
}
_COUNTERS = {
    "num_preemptions": ("pagedjax:num_preemptions", "Preemptions since start-up."),
    "num_prompt_tokens": ("pagedjax:prompt_tokens", "Prompt tokens processed."),
    "num_generated_tokens": ("pagedjax:generation_tokens", "Tokens generated."),
    "spec_decode_num_drafts": (
        "pagedjax:spec_decode_num_drafts",
        "Sequence steps that verified draft tokens (speculative decoding).",
    ),
    "spec_decode_num_draft_tokens": (
        "pagedjax:spec_decode_num_draft_tokens",
        "Draft tokens proposed.",
    ),
    "spec_decode_num_accepted_tokens": (
        "pagedjax:spec_decode_num_accepted_tokens",
        "Draft tokens accepted.",
    ),
}


class _EngineCollector(Collector):
    """Reads the engine's statistics when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], dict], model_name: str) -> None:
        self._stats, self._model_name = stats, model_name

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._stats()
        except Exception:  # a scrape must not fail: the request metrics still count
            logger.exception("could not read the engine's statistics")
            return
        for table, family in ((_GAUGES, GaugeMetricFamily), (_COUNTERS, CounterMetricFamily)):
            for key, (name, documentation) in table.items():
                if key in stats:
                    metric = family(name, documentation, labels=["model_name"])
                    metric.add_metric([self._model_name], float(stats[key]))
                    yield metric

    def describe(self) -> Iterator[Metric]:
        return iter(())  # names depend on what stats() holds: not checked at registration


class ServerMetrics:
    """The metrics of one app: `render()` answers a scrape."""

    def __init__(self, stats: Callable[[], dict], model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats, model_name))
        self.model_name = model_name

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                name,
                documentation,
                ["model_name"],
                buckets=buckets,
                registry=self.registry,
            ).labels(model_name)

        self.time_to_first_token = histogram(
            "pagedjax:time_to_first_token_seconds",
            "Time from a request's arrival to its first token.",
            _LATENCY_BUCKETS,
        )
        self.time_per_output_token = histogram(
            "pagedjax:time_per_output_token_seconds",
            "Mean time between a request's output tokens after the first.",
            _TOKEN_LATENCY_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "pagedjax:e2e_request_latency_seconds",
            "Time from a request's arrival to its end.",
            _LATENCY_BUCKETS,
        )
        self.request_success = Counter(
            "pagedjax:request_success",
            "Finished completions, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )

    def observe_finished(self, output: RequestOutput, num_tokens: int) -> None:
        """Records a finished request; num_tokens: its longest completion's token count."""
        metrics = output.metrics
        first, end = metrics.first_token_time, metrics.finished_time
        if first is not None:
            self.time_to_first_token.observe(max(first - metrics.arrival_time, 0.0))
            if end is not None and num_tokens > 1:
                self.time_per_output_token.observe(max(end - first, 0.0) / (num_tokens - 1))
        if end is not None:
            self.e2e_request_latency.observe(max(end - metrics.arrival_time, 0.0))
        for completion in output.outputs:
            reason = completion.finish_reason or "unknown"
            self.request_success.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
