"""An emulated server's /metrics page, in vLLM's Prometheus dialect.

Names, label (`model_name`), 0-1 KV fractions and histogram buckets follow vLLM's
production metrics, so the control plane's scraper reads the emulator as it reads vLLM.
Each server has its own registry; a restarted server starts a new one, so its counters
reset as a restarted vLLM's do.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from controlplane.sim.emulator_engine import Sequence

# vLLM's buckets: request latencies (e2e, queue) and time to first token.
LATENCY_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0),
    *(120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5),
    *(10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
FINISH_REASONS = ("stop", "length")

GARBAGE_PAGE = (
    b"<html><head><title>502 Bad Gateway</title></head><body>upstream exporter crashed</body></html>\n"
)


class VllmMetrics:
    """The metrics of one emulated server's lifetime."""

    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        r, m, label = self.registry, model, ["model_name"]
        self._running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", label, registry=r
        ).labels(m)
        self._waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", label, registry=r
        ).labels(m)
        self._kv = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", label, registry=r
        ).labels(m)
        self._kv_legacy = Gauge(
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage. Deprecated: use vllm:kv_cache_usage_perc.",
            label,
            registry=r,
        ).labels(m)
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            label,
            buckets=LATENCY_BUCKETS,
            registry=r,
        ).labels(m)
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            label,
            buckets=TTFT_BUCKETS,
            registry=r,
        ).labels(m)
        self._tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            label,
            buckets=TPOT_BUCKETS,
            registry=r,
        ).labels(m)
        self._queue = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            label,
            buckets=LATENCY_BUCKETS,
            registry=r,
        ).labels(m)
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self._success = {reason: success.labels(m, reason) for reason in FINISH_REASONS}
        self._prompt = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", label, registry=r
        ).labels(m)
        self._generation = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", label, registry=r
        ).labels(m)

    def observe_finished(self, seq: Sequence, finish_reason: str) -> None:
        """Count a request that ran to its end."""
        self._e2e.observe(seq.latency_s)
        self._ttft.observe(seq.ttft_s)
        self._queue.observe(seq.queue_s)
        for _ in range(seq.output_tokens - 1):  # as vLLM: one observation per inter-token gap
            self._tpot.observe(seq.decode_s_per_token)
        self._success[finish_reason].inc()
        self._prompt.inc(seq.prompt_tokens)
        self._generation.inc(seq.output_tokens)

    def render(self, running: int, waiting: int, kv_use: float) -> bytes:
        """The page, with the gauges as of now."""
        self._running.set(running)
        self._waiting.set(waiting)
        self._kv.set(kv_use)
        self._kv_legacy.set(kv_use)
        return generate_latest(self.registry)
