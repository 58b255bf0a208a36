"""An emulated server's /metrics page, in vLLM 0.32's Prometheus dialect.

Names, types, labels (`engine` and `model_name` on every series, as a one-engine vLLM
prints them), 0-1 KV fractions and histogram buckets follow vLLM 0.32's production metrics
(vllm/v1/metrics/loggers.py), checked against a real 0.32 page in tests/fixtures/pages/vllm/
(tests/unit/test_sim_emulator_metrics.py), so the control plane's scraper reads the
emulator as it reads vLLM. Each server has its own `VllmMetrics`; a restarted server
starts a new one, so its counters reset as a restarted vLLM's do.

Two pages: `compact` has the fifteen families the control plane reads or may read; `full`
adds more of a vLLM 0.32 server's families (30-60 KB, 16 histograms, as a real page), each
fed by what the emulated engine did. The families the control plane parses are the same
in both. `sample_full_page` renders the full page of a server that has served a
workload, for benchmarks that need a realistic page without running a server.

With LoRA enabled, both pages carry `vllm:lora_requests_info` as vLLM v1 prints it: a gauge
whose labels name the adapters in flight and whose value is the Unix time that label set was
last set; every label set ever set stays a series of its own (`LORA_INFO_SERIES_KEPT`).
"""

from __future__ import annotations

import bisect
import math
import random
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Literal, get_args

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from controlplane.sim.emulator_engine import Sequence
from controlplane.sim.service import BatchingServer, ServerSpec

MetricsPage = Literal["full", "compact", "triton"]
METRICS_PAGES: tuple[MetricsPage, ...] = get_args(MetricsPage)

# vLLM's buckets: request latencies (e2e, queue and the phases) and time to first token.
LATENCY_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0),
    *(120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)
# The per-token histograms' buckets (vLLM's `inter_token_latency` bucket family): finer at
# the low end than vLLM's defaults (which start at 10 ms), for the emulator's fast test
# configurations, as a vLLM started with `--custom-histogram-buckets
# '{"inter_token_latency": [...]}'` has them.
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5),
    *(10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)
PREEMPTION_BUCKETS = (1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0)
# Tokens per engine step (vLLM 0.32's `iteration_tokens` bucket family).
ITERATION_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0)
# The emulator refuses no prompt for its length; the token-count buckets assume a server
# started with --max-model-len 32768, prefill chunked at 8192 tokens per step.
MAX_MODEL_LEN = 32768
MAX_NUM_BATCHED_TOKENS = 8192
BLOCK_SIZE = 16  # tokens per KV block, for the cache_config_info gauge
ENGINE = "0"  # vLLM v1 labels every series with its engine's index
# vLLM keeps every vllm:lora_requests_info label set it ever set; the emulator keeps this many,
# dropping the one set longest ago (a page of ~120 KB; the control plane's parser refuses more
# than 10,000).
LORA_INFO_SERIES_KEPT = 1024

# vLLM 0.32's FinishReason, each printed (zeros included). The emulator finishes requests
# with stop or length only; a stream its client closes is counted nowhere, as on vLLM 0.32
# (tests/fixtures/pages/vllm/README.md).
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")

GARBAGE_PAGE = (
    b"<html><head><title>502 Bad Gateway</title></head><body>upstream exporter crashed</body></html>\n"
)

_SAMPLE_CREATED = 1_767_225_600.0  # 2026-01-01: sample pages are byte-for-byte repeatable


def one_two_five(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit`: vLLM's token-count buckets for a model length."""
    bounds: list[float] = []
    scale = 1
    while scale <= limit:
        bounds.extend(float(m * scale) for m in (1, 2, 5) if m * scale <= limit)
        scale *= 10
    return tuple(bounds)


class _Histogram:
    """Bucket counts and a sum; `observe` takes many equal observations at once."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, the last one +Inf
        self.total = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        if times > 0:
            self.counts[bisect.bisect_left(self.bounds, value)] += times
            self.total += value * times

    def metric(self, name: str, doc: str, labels: Mapping[str, str], created: float) -> Metric:
        family = Metric(name, doc, "histogram")
        cumulative = 0
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            cumulative += count
            family.add_sample(
                # In name order, as vLLM prints them (engine, le, model_name).
                f"{name}_bucket",
                dict(sorted({**labels, "le": "+Inf" if bound == math.inf else repr(bound)}.items())),
                cumulative,
            )
        family.add_sample(f"{name}_count", dict(labels), cumulative)
        family.add_sample(f"{name}_sum", dict(labels), self.total)
        family.add_sample(f"{name}_created", dict(labels), created)
        return family


def _gauge(name: str, doc: str, labels: Mapping[str, str], value: float) -> Metric:
    family = Metric(name, doc, "gauge")
    family.add_sample(name, dict(labels), value)
    return family


def _counter(name: str, doc: str, values: list[tuple[Mapping[str, str], float]], created: float) -> Metric:
    family = Metric(name, doc, "counter")
    for labels, value in values:
        family.add_sample(f"{name}_total", dict(labels), value)
        family.add_sample(f"{name}_created", dict(labels), created)
    return family


class VllmMetrics(Collector):
    """The metrics of one emulated server's lifetime, rendered as `page` asks."""

    def __init__(
        self,
        model: str,
        *,
        page: MetricsPage = "full",
        max_model_len: int = MAX_MODEL_LEN,
        kv_capacity_tokens: int = ServerSpec.kv_capacity_tokens,
        created: float | None = None,
        max_loras: int = 0,
    ) -> None:
        """`max_loras`: the server's GPU adapter slots; 0 (LoRA disabled) leaves
        `vllm:lora_requests_info` off the page, as vLLM without --enable-lora."""
        if page not in METRICS_PAGES:
            raise ValueError(f"page: must be one of {', '.join(METRICS_PAGES)}, got {page!r}")
        self.model = model
        self.page: MetricsPage = page
        self.kv_capacity_tokens = kv_capacity_tokens
        self.max_loras = max_loras
        # (running_lora_adapters, waiting_lora_adapters) -> the Unix time it was last set, in
        # the order the label sets were first set (prometheus_client prints children so).
        self._lora_info: dict[tuple[str, str], float] = {}
        self._lora_newest = 0.0
        self.created = time.time() if created is None else created
        self._running = self._waiting = self._kv = 0.0
        # The compact page's families.
        self._e2e = _Histogram(LATENCY_BUCKETS)
        self._ttft = _Histogram(TTFT_BUCKETS)
        self._itl = _Histogram(TPOT_BUCKETS)
        self._request_tpot = _Histogram(TPOT_BUCKETS)
        self._queue = _Histogram(LATENCY_BUCKETS)
        self._success = dict.fromkeys(FINISH_REASONS, 0)
        self._prefix_queries = 0.0  # prompt tokens looked up in the prefix cache
        self._approximates = 0.0  # of those, found cached
        self._prompt = 0
        self._generation = 0
        # The full page's.
        tokens = one_two_five(max_model_len)
        self._inference = _Histogram(LATENCY_BUCKETS)
        self._prefill = _Histogram(LATENCY_BUCKETS)
        self._decode = _Histogram(LATENCY_BUCKETS)
        self._prompt_tokens = _Histogram(tokens)
        self._generation_tokens = _Histogram(tokens)
        self._max_tokens = _Histogram(tokens)
        self._max_generation = _Histogram(tokens)
        self._prefill_computed = _Histogram(tokens)
        self._preemptions = _Histogram(PREEMPTION_BUCKETS)
        self._n = _Histogram(N_BUCKETS)
        self._iteration = _Histogram(ITERATION_BUCKETS)

    def observe_finished(
        self, seq: Sequence, finish_reason: str, *, batch_size: int = 1, max_tokens: int | None = None
    ) -> None:
        """Count a request that ran to its end. `batch_size`: sequences running when it
        finished, itself included (its decode steps are counted as steps of that many
        tokens); `max_tokens`: the request's limit (default: its output, as the emulator
        always generates exactly max_tokens)."""
        out = seq.output_tokens
        self._e2e.observe(seq.latency_s)
        self._ttft.observe(seq.ttft_s)
        self._queue.observe(seq.queue_s)
        # As vLLM: one observation per gap between output tokens, all equal here, and one
        # per request of its mean (0 for a request of one token).
        self._itl.observe(seq.decode_s_per_token, out - 1)
        self._request_tpot.observe(seq.decode_s_per_token if out > 1 else 0.0)
        self._success[finish_reason] += 1
        self._prompt += seq.prompt_tokens
        self._generation += out
        self._inference.observe(seq.finished - seq.started)
        self._prefill.observe(seq.first_token - seq.started)
        self._decode.observe(seq.finished - seq.first_token)
        self._prompt_tokens.observe(seq.prompt_tokens)
        self._generation_tokens.observe(out)
        self._max_tokens.observe(out if max_tokens is None else max_tokens)
        self._max_generation.observe(out if max_tokens is None else max_tokens)
        self._prefill_computed.observe(seq.prompt_tokens - seq.cached_tokens)
        self._preemptions.observe(0)  # the emulator never preempts
        self._n.observe(1)  # the emulator answers n=1 only
        self._observe_steps(seq.prompt_tokens, out, max(1, batch_size))

    def observe_prefix(self, queries: int, hits: int) -> None:
        """A prompt looked up in the prefix cache: its tokens, and how many were cached."""
        self._prefix_queries += queries
        self._approximates += hits

    def observe_failed(self) -> None:
        """A request answered with an error. vLLM counts only successes: nothing to do."""

    def observe_lora(self, running: Iterable[str], waiting: Iterable[str], at: float | None = None) -> None:
        """The adapters of the requests running and waiting, as of `at` (Unix time, default
        now): that label set of `vllm:lora_requests_info` is set to the time, as vLLM sets it
        each engine step. Times only grow, so the newest set always has the greatest value."""
        if not self.max_loras:
            return
        key = (",".join(running), ",".join(waiting))
        now = time.time() if at is None else at
        self._lora_newest = now if now > self._lora_newest else math.nextafter(self._lora_newest, math.inf)
        self._lora_info[key] = self._lora_newest
        if len(self._lora_info) > LORA_INFO_SERIES_KEPT:
            del self._lora_info[min(self._lora_info, key=self._lora_info.__getitem__)]

    def _observe_steps(self, prompt: int, out: int, batch: int) -> None:
        """The engine has no global steps; this is a request's share of them: its prefill
        in chunks (the last one also yields its first token), then its other tokens as
        steps of `batch` tokens each, so that a step its batch shares is counted once
        across the batch. The histogram's sum stays prompt + generated tokens, as on vLLM."""
        chunks, last = divmod(prompt, MAX_NUM_BATCHED_TOKENS)
        self._iteration.observe(MAX_NUM_BATCHED_TOKENS, chunks)
        self._iteration.observe(last + 1)
        steps, rest = divmod(out - 1, batch)
        self._iteration.observe(batch, steps)
        if rest:
            self._iteration.observe(rest)

    def render(self, running: int, waiting: int, kv_use: float) -> bytes:
        """The page, with the gauges as of now."""
        self._running, self._waiting, self._kv = float(running), float(waiting), kv_use
        return generate_latest(self)

    def collect(self) -> Iterator[Metric]:
        """The families of the page, in prometheus_client's form."""
        m, at = {"engine": ENGINE, "model_name": self.model}, self.created
        yield _gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", m, self._running
        )
        yield _gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", m, self._waiting
        )
        yield _gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", m, self._kv)
        yield self._e2e.metric(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", m, at
        )
        yield self._ttft.metric(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", m, at
        )
        yield self._itl.metric(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", m, at
        )
        yield self._request_tpot.metric(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            m,
            at,
        )
        yield self._queue.metric(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", m, at
        )
        yield _counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [
                ({"engine": ENGINE, "finished_reason": r, "model_name": self.model}, n)
                for r, n in self._success.items()
            ],
            at,
        )
        yield _counter("vllm:prompt_tokens", "Number of prefill tokens processed.", [(m, self._prompt)], at)
        yield _counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", [(m, self._generation)], at
        )
        # What a request costs (the picker's KV credit, signals/parse.py): prefill and decode
        # times, and the prompt tokens found cached.
        yield self._prefill.metric(
            "vllm:request_prefill_time_seconds", "Seconds from scheduling to the first token.", m, at
        )
        yield self._decode.metric(
            "vllm:request_decode_time_seconds", "Seconds from the first token to the end.", m, at
        )
        # The prefix cache (sim/prefix_cache.py): prompt tokens looked up, and found.
        yield _counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            [(m, self._prefix_queries)],
            at,
        )
        yield _counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            [(m, self._approximates)],
            at,
        )
        if self.max_loras:
            yield self._lora_metric()
        if self.page == "full":
            yield from self._full_only()

    def _lora_metric(self) -> Metric:
        """vLLM v1's LoRA gauge: no engine or model label, `max_lora` the slots, the adapter
        lists joined by commas, each label set's value the Unix time it was last set."""
        family = Metric("vllm:lora_requests_info", "Running stats on lora requests.", "gauge")
        for (running, waiting), when in self._lora_info.items():
            labels = {
                "max_lora": str(self.max_loras),
                "running_lora_adapters": running,
                "waiting_lora_adapters": waiting,
            }
            family.add_sample("vllm:lora_requests_info", labels, when)
        return family

    def _full_only(self) -> Iterator[Metric]:
        e, at = {"engine": ENGINE, "model_name": self.model}, self.created
        yield _gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason (the emulator's wait for capacity only).",
            {"engine": ENGINE, "model_name": self.model, "reason": "capacity"},
            self._waiting,
        )
        yield self._max_generation.metric(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            e,
            at,
        )
        yield self._preemptions.metric(
            "vllm:request_num_preemptions", "Histogram of the number of times a request was preempted.", e, at
        )
        yield self._prefill_computed.metric(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            e,
            at,
        )
        yield self._inference.metric(
            "vllm:request_inference_time_seconds",
            "Seconds a request spent running (prefill and decode).",
            e,
            at,
        )
        yield self._prompt_tokens.metric(
            "vllm:request_prompt_tokens", "Prompt tokens per finished request.", e, at
        )
        yield self._generation_tokens.metric(
            "vllm:request_generation_tokens", "Generated tokens per finished request.", e, at
        )
        yield self._iteration.metric(
            "vllm:iteration_tokens_total", "Tokens (prompt and generated) per engine step.", e, at
        )
        yield self._max_tokens.metric(
            "vllm:request_params_max_tokens", "The max_tokens parameter of finished requests.", e, at
        )
        yield self._n.metric("vllm:request_params_n", "The n parameter of finished requests.", e, at)
        yield _counter(
            "vllm:num_preemptions",
            "Requests preempted by the scheduler (the emulator never preempts).",
            [(e, 0.0)],
            at,
        )
        # A few of vLLM 0.32's many labels (the real page's has 38).
        config = {
            "block_size": str(BLOCK_SIZE),
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "engine": ENGINE,
            "num_gpu_blocks": str(math.ceil(self.kv_capacity_tokens / BLOCK_SIZE)),
        }
        yield _gauge("vllm:cache_config_info", "The engine's KV-cache configuration (always 1).", config, 1.0)


class TritonMetrics(VllmMetrics):
    """The same bookkeeping, rendered in Triton Inference Server's dialect (the `nv_` families
    of its metrics port, 8002 on a real one): request success and failure counters, request,
    queue and compute durations in microseconds (cumulative), the pending requests gauge and
    per-GPU gauges. Triton counts failures, unlike vLLM; it has no latency histogram and no
    running-requests gauge."""

    def __init__(self, model: str, **kw: object) -> None:
        super().__init__(model, page="full", **kw)  # type: ignore[arg-type]
        self.failures = 0
        self._duration_us = self._queue_us = self._compute_us = 0.0
        self._count = 0

    def observe_finished(
        self, seq: Sequence, finish_reason: str, *, batch_size: int = 1, max_tokens: int | None = None
    ) -> None:
        super().observe_finished(seq, finish_reason, batch_size=batch_size, max_tokens=max_tokens)
        self._count += 1
        self._duration_us += seq.latency_s * 1e6
        self._queue_us += seq.queue_s * 1e6
        self._compute_us += (seq.finished - seq.started) * 1e6

    def observe_failed(self) -> None:
        self.failures += 1

    def render(self, running: int, waiting: int, kv_use: float) -> bytes:
        m = f'model="{self.model}",version="1"'
        ok = sum(self._success.values())
        families = [
            ("nv_inference_request_success", "counter", "Number of successful inference requests", ok),
            ("nv_inference_request_failure", "counter", "Number of failed inference requests", self.failures),
            ("nv_inference_count", "counter", "Number of inferences performed", self._count),
            ("nv_inference_exec_count", "counter", "Number of model executions performed", self._count),
            ("nv_inference_request_duration_us", "counter", "Cumulative inference request duration in "
             "microseconds (includes cached requests)", self._duration_us),
            ("nv_inference_queue_duration_us", "counter", "Cumulative inference queuing duration in "
             "microseconds", self._queue_us),
            ("nv_inference_compute_infer_duration_us", "counter", "Cumulative compute inference duration "
             "in microseconds", self._compute_us),
            ("nv_inference_pending_request_count", "gauge", "Instantaneous number of pending requests "
             "awaiting execution per-model.", waiting),
        ]  # fmt: skip
        lines: list[str] = []
        for name, kind, doc, value in families:
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f"{name}{{{m}}} {value:g}"]
        gpu = 'gpu_uuid="GPU-emulated-0"'
        lines += [
            "# HELP nv_gpu_utilization GPU utilization rate [0.0 - 1.0)",
            "# TYPE nv_gpu_utilization gauge",
            f"nv_gpu_utilization{{{gpu}}} {min(1.0, running / 8):g}",
            "# HELP nv_gpu_memory_used_bytes GPU used memory, in bytes",
            "# TYPE nv_gpu_memory_used_bytes gauge",
            f"nv_gpu_memory_used_bytes{{{gpu}}} {kv_use * 40e9:g}",
        ]
        return ("\n".join(lines) + "\n").encode()


def sample_full_page(model: str = "m", *, seed: int = 0, requests: int = 5000) -> str:
    """The full page of a server that has served `requests` requests (see `sample_page`):
    30-60 KB, 16 histograms (as vLLM 0.32's), every one populated. For benchmarks of scraping and parsing."""
    return sample_page(model, seed=seed, requests=requests, page="full")


def sample_page(
    model: str = "m",
    *,
    seed: int = 0,
    requests: int = 5000,
    page: MetricsPage = "full",
    spec: ServerSpec | None = None,
) -> str:
    """The page of a server (`spec`, ServerSpec's defaults if None) that has served
    `requests` requests of a chat-like workload arriving at 90% of its capacity, run
    through the emulator's batching model on a simulated clock; the gauges show the
    requests still in it. Pure, and the same text for the same arguments."""
    if requests < 1:
        raise ValueError(f"requests: must be >= 1, got {requests!r}")
    spec = spec or ServerSpec()
    rng = random.Random(seed)
    # Prompts around 600 tokens and answers around 180, long-tailed; clients cap answers.
    work: list[tuple[int, int, int]] = []
    for _ in range(requests + 4 * spec.slots):  # a few more arrive than finish
        limit = rng.choice((256, 512, 1024, 1024, 2048, 4096))
        prompt = min(MAX_MODEL_LEN - limit, max(1, round(rng.lognormvariate(math.log(600), 1.0))))
        out = min(limit, max(1, round(rng.lognormvariate(math.log(180), 0.9))))
        work.append((prompt, out, limit))
    mean_service = sum(p * spec.prefill_s_per_token + o * spec.decode_s_per_token for p, o, _ in work) / (
        len(work) * spec.speed
    )
    rate = 0.9 * spec.slots / mean_service
    server = BatchingServer(spec)
    metrics = VllmMetrics(
        model, page=page, kv_capacity_tokens=spec.kv_capacity_tokens, created=_SAMPLE_CREATED
    )
    decode = spec.decode_s_per_token / spec.speed
    arrival, submitted, finished = rng.expovariate(rate), 0, 0
    while finished < requests:
        due = server.next_event()
        if due is not None and (due <= arrival or submitted == len(work)):
            batch = len(server.running)
            for c in server.advance(due):
                if finished == requests:
                    break
                prompt, out, limit = work[c.request_id]
                seq = Sequence(c.prompt_tokens, c.output_tokens, c.submitted)
                seq.started, seq.first_token, seq.finished = c.started, c.first_token, c.finished
                seq.decode_s_per_token = decode
                reason = "length" if out == limit else "stop"
                metrics.observe_finished(seq, reason, batch_size=batch, max_tokens=limit)
                finished += 1
            continue
        server.submit(submitted, work[submitted][0], work[submitted][1], arrival)
        submitted += 1
        arrival += rng.expovariate(rate)
    return metrics.render(len(server.running), len(server.waiting), server.kv_use).decode()
