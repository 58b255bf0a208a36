"""The `prometheus` signal source: instant PromQL queries against a Prometheus server.

For fleets larger than one process can scrape, and for users who already collect vLLM
metrics with Prometheus. Every `signals.prometheus.interval` one round of instant queries
(`GET /api/v1/query`) asks for each family the policies and the rollout analysis read
(vLLM dialect), summed by the label that carries the endpoint's `host:port`
(`address_label`) and `model_name`; weight rounds in between get nothing new.

The query texts (`build_queries`), the decoding of one answer (`decode_answer`) and the
conversion of a round's answers into one `ScrapeResult` per endpoint (`convert`) are pure
and unit-tested; `PrometheusSource` is the thin aiohttp shell around them.

Rules (docs/signals.md, "The Prometheus source"):
- A series counts for endpoint (model, address) when its address label is the address,
  and its `model_name` is the model or absent; a server labelling one other model (vLLM's
  served name is often the Hugging Face id) is taken as serving just that model.
- Staleness comes from the sample timestamps: age = the query's evaluation time minus the
  newest timestamp of the endpoint's gauges, both on Prometheus's clock. A sample no newer
  than the one delivered before is not delivered again.
- A round with any failed query (unreachable, timeout, HTTP error, status error, malformed
  answer) delivers nothing, so every endpoint's signals age and fade to capacity; never an
  exception, never a health verdict. Health is not observed through Prometheus at all.
- A family without a series for an endpoint leaves that field None; an endpoint without
  any series gets an error (counted like an unreadable page) and no sample.
- The success counter and the request latency histogram (about 30 series per endpoint)
  are asked only for models with more than one version: the rollout analysis, their only
  reader, needs two (elsewhere vLLM's success count is its latency count, always asked).
- Answers in Prometheus's own compact JSON are read without `json` (`_decode_plain`), and
  samples are built positionally: at 5,000 endpoints a round is CPU-bound on this.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import structlog

from controlplane.fleet.model import Fleet, PrometheusSpec
from controlplane.net.http import client_session
from controlplane.obs.metrics import PROMETHEUS_OUTCOMES, Metrics
from controlplane.signals.parse import ServerSample
from controlplane.signals.store import EndpointKey, ScrapeResult

log = structlog.get_logger("controlplane.signals")

MODEL_LABEL = "model_name"
MAX_ANSWER_BYTES = 64 << 20  # an answer larger than this is refused, not buffered
LONG_QUERY = 4000  # characters: longer queries go in a POST body, past URL length limits

# ServerSample fields read from Prometheus, one query each, in the order convert() lists them.
FIELDS = (
    "running",
    "waiting",
    "kv_use",
    "latency_sum_s",
    "latency_count",
    "successes",
    "token_latency_sum_s",
    "token_latency_count",
)
SAMPLE_TIME = "sample_time"  # the query giving each endpoint's newest sample timestamp
BUCKETS = "latency_buckets"

# vLLM: field -> metric names, the first present per endpoint wins (as parse.py's fallbacks).
VLLM_FAMILIES: dict[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "kv_use": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "latency_sum_s": ("vllm:e2e_request_latency_seconds_sum",),
    "latency_count": ("vllm:e2e_request_latency_seconds_count",),
    # Only requests that finished with an answer (parse.py: abort and error are not successes).
    "successes": ('vllm:request_success_total{finished_reason!~"abort|error"}',),
    # vLLM 0.11 renamed the per-token histogram inter_token_latency; its per-request mean
    # (request_time_per_output_token) is the last resort, as in parse.py.
    "token_latency_sum_s": (
        "vllm:time_per_output_token_seconds_sum",
        "vllm:inter_token_latency_seconds_sum",
        "vllm:request_time_per_output_token_seconds_sum",
    ),
    "token_latency_count": (
        "vllm:time_per_output_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:request_time_per_output_token_seconds_count",
    ),
}
# Fields averaged over an endpoint's series rather than summed: a data-parallel vLLM prints
# one KV gauge per engine, each a share of that engine's own pool (parse.py's _MEAN_FIELDS).
MEAN_FIELDS = frozenset({"kv_use"})
ANALYSIS_ONLY = ("successes",)  # asked only for models in a rollout (see analysed_addresses)
VLLM_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
VLLM_BUCKET = "vllm:e2e_request_latency_seconds_bucket"


class PrometheusQueryFailed(Exception):
    """One query got no usable answer; `outcome` is its label in the queries metric."""

    def __init__(self, outcome: str, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome


@dataclass(frozen=True)
class Query:
    """One instant query: `name` is a ServerSample field, SAMPLE_TIME or BUCKETS."""

    name: str
    promql: str


def _string(text: str) -> str:
    """A PromQL string literal (Go escapes, as JSON's for ASCII)."""
    return json.dumps(text)


def build_queries(address_label: str, analysed: Iterable[str] = ()) -> tuple[Query, ...]:
    """The round's queries: one per field, the sample times and, for the `analysed`
    addresses only (none asked when empty), the success counter and the latency histogram.
    Sums run in Prometheus, by address and model."""
    addresses = sorted(set(analysed))
    only = f"{address_label}=~{_string('|'.join(re.escape(a) for a in addresses))}"
    out = []
    for name, metrics in VLLM_FAMILIES.items():
        if name in ANALYSIS_ONLY and not addresses:
            continue
        by = f"{'avg' if name in MEAN_FIELDS else 'sum'} by ({address_label}, {MODEL_LABEL})"
        where = only if name in ANALYSIS_ONLY else ""
        out.append(Query(name, " or ".join(f"{by} ({_select(metric, where)})" for metric in metrics)))
    # One gauge's timestamp per group, the next where it lacks the first: timestamp() drops
    # the metric name, so several families in one timestamp() would collide.
    stamped = f"max by ({address_label}, {MODEL_LABEL})"
    out.append(Query(SAMPLE_TIME, " or ".join(f"{stamped} (timestamp({g}))" for g in VLLM_GAUGES)))
    if addresses:
        out.append(
            Query(BUCKETS, f"sum by ({address_label}, {MODEL_LABEL}, le) ({_select(VLLM_BUCKET, only)})")
        )
    return tuple(out)


def _select(metric: str, matcher: str) -> str:
    """A selector: `metric` (maybe with matchers already) with one more `matcher`, if any."""
    if not matcher:
        return metric
    if metric.endswith("}"):
        return f"{metric[:-1]},{matcher}}}"
    return f"{metric}{{{matcher}}}"


def analysed_addresses(fleet: Fleet) -> list[str]:
    """Endpoints whose success counter and latency histogram are asked: those of models with
    more than one version. A rollout needs two, and the rollout analysis is the only reader
    of both (elsewhere vLLM's success count is its latency count, which is always asked)."""
    return sorted(
        {ep.address for m in fleet.models if len(m.versions) > 1 for v in m.versions for ep in v.endpoints}
    )


@dataclass(frozen=True)
class Vector:
    """One instant-vector answer: each series' value, as Prometheus wrote it, by its label
    set in canonical form (`series_key`); and the query's evaluation time."""

    values: Mapping[str, str]
    evaluated: float | None = None
    unlabelled: bool = True  # some series may lack a model_name label (False: none does)


def series_key(labels: Mapping[str, str]) -> str:
    """A label set in canonical form: `"name":"value"` pairs sorted by name, comma-joined:
    exactly how Prometheus writes a series' labels in JSON when nothing needs escaping."""
    return ",".join(f'"{k}":"{v}"' for k, v in sorted(labels.items()))


_PLAIN_PREFIX = '{"status":"success","data":{"resultType":"vector","result":['
_PLAIN_SUFFIX = "]}}"
_PLAIN_START = '{"metric":{'
_PLAIN_END = '"]}'
_PLAIN_FIRST = re.compile(r'\{"metric":\{[^{}]*\},"value":\[([0-9.e+-]+),"')
_MODEL_PAIR = f'"{MODEL_LABEL}":"'
_LABEL_PAIR = re.compile(r'"([^"]*)":"([^"]*)"')


def decode_answer(status: int, body: bytes) -> Vector:
    """One /api/v1/query answer as a Vector; raise PrometheusQueryFailed saying why not.

    Prometheus writes an instant vector in one canonical compact form. An answer in exactly
    that form with nothing escaped is read with a few C-speed string operations and no
    per-series objects (`_decode_plain`: 3-4x cheaper than `json.loads` at 5,000 series);
    anything else goes through `json` and the checks below."""
    if status == 200:
        plain = _decode_plain(body)
        if plain is not None:
            return plain
    try:
        doc = json.loads(body)
    except ValueError as e:
        if status != 200:
            raise PrometheusQueryFailed("http_error", f"HTTP {status}: {body[:200]!r}") from None
        raise PrometheusQueryFailed("invalid", f"not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise PrometheusQueryFailed("invalid", f"expected a JSON object, got {type(doc).__name__}")
    if doc.get("status") == "error":
        why = f"{doc.get('errorType', 'error')}: {doc.get('error', '')}"
        raise PrometheusQueryFailed("error" if status < 500 else "http_error", f"HTTP {status}: {why}")
    if status != 200:
        raise PrometheusQueryFailed("http_error", f"HTTP {status}")
    data = doc.get("data")
    if doc.get("status") != "success" or not isinstance(data, dict):
        raise PrometheusQueryFailed("invalid", f"unexpected answer: status {doc.get('status')!r}")
    if data.get("resultType") != "vector" or not isinstance(data.get("result"), list):
        raise PrometheusQueryFailed(
            "invalid", f"expected an instant vector, got resultType {data.get('resultType')!r}"
        )
    return _vector_of(data["result"])


def _decode_plain(body: bytes) -> Vector | None:
    """The canonical form read with a few C-speed string operations, or None when the
    answer is not exactly that form.

    In it every series is `{"metric":{LABELS},"value":[T,"VALUE"]}`, joined by commas, T
    being the query's one evaluation time. Unescaped, neither separator below can occur
    inside LABELS or VALUE, so one split yields labels and values alternately."""
    try:
        text = body.decode()
    except UnicodeDecodeError:
        return None
    if not text.startswith(_PLAIN_PREFIX) or not text.endswith(_PLAIN_SUFFIX) or "\\" in text:
        return None
    inner = text[len(_PLAIN_PREFIX) : -len(_PLAIN_SUFFIX)]
    if not inner:
        return Vector({}, None, unlabelled=False)
    first = _PLAIN_FIRST.match(inner)
    if first is None or not inner.endswith(_PLAIN_END):
        return None
    stamp = first.group(1)
    head = f'}},"value":[{stamp},"'  # a series' labels, then its value
    tail = '"]},{"metric":{'  # one series, then the next
    series = inner[len(_PLAIN_START) : -len(_PLAIN_END)]
    n = series.count(tail) + 1
    if series.count(head) != n:
        return None  # another shape, or series stamped with different times
    parts = series.replace(tail, head).split(head)
    if len(parts) != 2 * n:
        return None
    names = [name for name, _ in _LABEL_PAIR.findall(parts[0])]
    if names != sorted(names):
        return None  # labels not in Prometheus's order (another server's encoder): keys differ
    values = dict(zip(parts[0::2], parts[1::2], strict=True))
    if len(values) != n:
        return None  # a label set twice: the general path sums them
    try:
        evaluated = float(stamp)
    except ValueError:
        return None
    # Unescaped, the label name appears once in each series that has it and nowhere else.
    return Vector(values, evaluated, unlabelled=text.count(_MODEL_PAIR) != n)


def _vector_of(result: list[Any]) -> Vector:
    values: dict[str, str] = {}
    evaluated: float | None = None
    try:
        for item in result:
            key = series_key(item["metric"])
            at, value = item["value"]
            if not isinstance(value, str):
                raise TypeError(f"value {value!r} is not a string")
            evaluated = float(at)
            before = values.get(key)
            values[key] = value if before is None else repr(float(before) + float(value))
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        raise PrometheusQueryFailed("invalid", f"unexpected series: {e!r}") from None
    return Vector(values, evaluated, unlabelled=any(_MODEL_PAIR not in k for k in values))


@dataclass
class Conversion:
    """A round's answers as the store takes them, and what the metrics report."""

    results: dict[EndpointKey, ScrapeResult] = field(default_factory=dict)
    sample_times: dict[EndpointKey, float] = field(default_factory=dict)  # Prometheus time, seconds
    series_matched: int = 0
    series_unmatched: int = 0
    without_series: list[EndpointKey] = field(default_factory=list)


def _key_maker(address_label: str) -> Callable[[str, str | None], str]:
    """`series_key` of {address_label: address, model_name: model} (model None: absent), fast."""
    if address_label < MODEL_LABEL:
        return lambda addr, model: (
            f'"{address_label}":"{addr}"'
            if model is None
            else f'"{address_label}":"{addr}","{MODEL_LABEL}":"{model}"'
        )
    return lambda addr, model: (
        f'"{address_label}":"{addr}"'
        if model is None
        else f'"{MODEL_LABEL}":"{model}","{address_label}":"{addr}"'
    )


def convert(
    answers: Mapping[str, Vector],
    targets: Sequence[EndpointKey],
    address_label: str = "instance",
    delivered: Mapping[EndpointKey, float] | None = None,
) -> Conversion:
    """Turn one round's answers ({query name: Vector}) into a ScrapeResult per endpoint with
    something new. `delivered`: the sample time last delivered per endpoint (a sample no newer
    is left out). A family not asked or not answered for an endpoint leaves its field None.
    Raise PrometheusQueryFailed("invalid") on a value that is not a number."""
    out = Conversion()
    empty = Vector({})
    times = answers.get(SAMPLE_TIME, empty)
    stamps = times.values
    columns = [answers.get(name, empty).values for name in FIELDS]
    histogram, bad_histograms = (
        _histograms(answers[BUCKETS], address_label) if BUCKETS in answers else ({}, set())
    )
    key_of = _key_maker(address_label)
    models_at: dict[str, set[str | None]] | None = None  # built only when an endpoint needs it
    used: list[str] = []
    unlabelled_anywhere = any(v.unlabelled for v in answers.values())
    isfinite = math.isfinite
    results, sample_times, evaluated = out.results, out.sample_times, times.evaluated
    try:
        for key in targets:
            model, addr = key
            mine = key_of(addr, model)
            unlabelled = key_of(addr, None) if unlabelled_anywhere else ""
            labelled: str | None = model
            if mine not in stamps:
                unlabelled = key_of(addr, None)
                if models_at is None:
                    models_at = _models_at(stamps, address_label)
                labelled, failure = _labelled(models_at.get(addr, set()), model, addr)
                if failure is not None:
                    out.results[key] = failure
                    continue
                if labelled is None and unlabelled not in stamps:
                    out.results[key] = _no_series(key, address_label, columns, key_of, out)
                    continue
                if labelled is not None:
                    mine = key_of(addr, labelled)
            # Unlabelled series count too; checked per family, as a server may label only some.
            groups: tuple[str | None, ...]
            if labelled is None:
                groups, keys, mine = (None,), [unlabelled], unlabelled
            elif unlabelled_anywhere and (
                unlabelled in stamps or (addr, None) in histogram or any(unlabelled in c for c in columns)
            ):
                groups, keys = (labelled, None), [mine, unlabelled]
            else:
                groups, keys = (labelled,), [mine]
            ts = float(stamps[mine]) if len(keys) == 1 else max(float(stamps[k]) for k in keys if k in stamps)
            used += keys
            last = delivered.get(key) if delivered is not None else None
            if last is not None and ts <= last:
                continue  # Prometheus has not scraped it again since
            if len(keys) == 1:
                values = [None if (text := column.get(mine)) is None else float(text) for column in columns]
            else:
                values = [_total(column, keys) for column in columns]
            if not isfinite(sum(filter(None, values))):  # one test for NaN and infinities, at C speed
                bad = next(
                    (f"{n}: {v}" for n, v in zip(FIELDS, values, strict=True) if v and not isfinite(v)), None
                )
                if bad is not None:
                    why = f"{bad} is not a finite number"
                    out.results[key] = ScrapeResult(
                        metrics_error=f"Prometheus series for {addr}: {why}", error_reason="unreadable"
                    )
                    continue
            buckets: dict[float, float] | None = None
            if bad_histograms and any((addr, m) in bad_histograms for m in groups):
                why = "a latency bucket count that is not a finite number"
                out.results[key] = ScrapeResult(
                    metrics_error=f"Prometheus series for {addr}: {why}", error_reason="unreadable"
                )
                continue
            if histogram:
                buckets = {}
                for m in groups:
                    for le, c in histogram.get((addr, m), {}).items():
                        buckets[le] = buckets.get(le, 0.0) + c
            sample_times[key] = ts
            age = (evaluated - ts) if evaluated is not None and evaluated > ts else 0.0
            # (health status, health error, page, page error, sample, age): health is not observed.
            results[key] = ScrapeResult(None, None, None, None, _sample(values, buckets), age)
    except ValueError as e:
        raise PrometheusQueryFailed("invalid", f"a value that is not a number: {e}") from None
    matched = set(used)
    total = sum(len(v.values) for v in answers.values())
    used_buckets = sum(len(b) for (addr, m), b in histogram.items() if key_of(addr, m) in matched)
    out.series_matched = used_buckets + sum(
        len(matched.intersection(v.values)) for name, v in answers.items() if name != BUCKETS
    )
    out.series_unmatched = total - out.series_matched
    return out


def _total(column: Mapping[str, str], keys: Sequence[str]) -> float | None:
    present = [float(column[k]) for k in keys if k in column]
    return sum(present) if present else None


def _no_series(
    key: EndpointKey,
    address_label: str,
    columns: Sequence[Mapping[str, str]],
    key_of: Callable[[str, str | None], str],
    out: Conversion,
) -> ScrapeResult:
    """Why an endpoint has no sample: no gauge (so no sample time), or no series at all."""
    model, addr = key
    if any(key_of(addr, m) in c for c in columns for m in (model, None)):
        why = f"Prometheus has no {', '.join(VLLM_GAUGES)} with {address_label}={addr!r}: sample time unknown"
        return ScrapeResult(metrics_error=why, error_reason="no_series")
    out.without_series.append(key)
    return ScrapeResult(
        metrics_error=f"Prometheus has no series with {address_label}={addr!r} "
        "(not scraped, its scrape failing, or labelled otherwise)",
        error_reason="no_series",
    )


def _models_at(stamps: Mapping[str, str], address_label: str) -> dict[str, set[str | None]]:
    """Address -> the model labels its series carry (None: unlabelled)."""
    out: dict[str, set[str | None]] = {}
    for k in stamps:
        labels = dict(_LABEL_PAIR.findall(k))
        addr = labels.get(address_label)
        if addr is not None:
            out.setdefault(addr, set()).add(labels.get(MODEL_LABEL))
    return out


def _labelled(models: set[str | None], model: str, addr: str) -> tuple[str | None, ScrapeResult | None]:
    """The model label that counts for `model` at an address whose series do not label it
    (`models`: the labels of its groups with a sample time): the one other model a server
    may label (its only model, under another name), else None (unlabelled series only).
    Several other models are not guessed."""
    labelled = sorted(m for m in models if m is not None)
    if len(labelled) > 1:
        why = f"labels models {', '.join(labelled)}, none of them {model!r}"
        return None, ScrapeResult(
            metrics_error=f"Prometheus series for {addr}: {why}", error_reason="unreadable"
        )
    return (labelled[0] if labelled else None), None


def _bucket_labels(address_label: str) -> re.Pattern[str]:
    """Reads the label sets `sum by (address, model_name, le)` gives, in Prometheus's (sorted)
    order, model_name optional (it never sorts first: "le" < "model_name"); each label is
    captured in that order."""
    pairs = [
        f'(?:,"{name}":"([^"]*)")?' if name == MODEL_LABEL else f',"{name}":"([^"]*)"'
        for name in sorted((address_label, "le", MODEL_LABEL))
    ]
    return re.compile(pairs[0][1:] + "".join(pairs[1:]))


def _histograms(
    vector: Vector, address_label: str
) -> tuple[dict[tuple[str, str | None], dict[float, float]], set[tuple[str, str | None]]]:
    """(address, model label) -> {upper bound: cumulative count} from the bucket series, and
    the groups with a count that is not a finite number."""
    out: dict[tuple[str, str | None], dict[float, float]] = {}
    bad: set[tuple[str, str | None]] = set()
    order = sorted((address_label, "le", MODEL_LABEL))
    at = (order.index(address_label) + 1, order.index("le") + 1, order.index(MODEL_LABEL) + 1)
    read = _bucket_labels(address_label).fullmatch
    try:
        for k, text in vector.values.items():
            m = read(k)
            if m is not None:
                addr, le_text, model = m.group(*at)
            else:  # other labels too: the general reading
                labels = dict(_LABEL_PAIR.findall(k))
                addr, le_text, model = labels.get(address_label), labels["le"], labels.get(MODEL_LABEL)
                if addr is None:
                    continue
            group = (addr, model)
            le, v = float(le_text), float(text)
            if not math.isfinite(v):
                bad.add(group)
                continue
            counts = out.get(group)
            if counts is None:
                counts = out[group] = {}
            counts[le] = counts.get(le, 0.0) + v
    except (KeyError, ValueError) as e:
        raise PrometheusQueryFailed("invalid", f"query {BUCKETS}: unexpected series: {e!r}") from None
    return out, bad


def _sample(values: list[float | None], buckets: dict[float, float] | None) -> ServerSample:
    running, waiting, kv, lat_sum, lat_count, ok, tpot_sum, tpot_count = values
    if kv is not None and kv > 1.0:
        kv = kv / 100.0  # some exporters report percent
    # Positional: half the cost of keywords, 5,000 times a round (the field order is pinned
    # by a unit test). No failures: vLLM counts none.
    return ServerSample(
        "vllm",
        running,
        waiting,
        kv,
        lat_sum,
        lat_count,
        ok,
        None,
        tpot_sum,
        tpot_count,
        tuple(sorted(buckets.items())) if buckets else (),
    )


class PrometheusSource:
    """The `prometheus` source: one round of queries per interval, over one reused session."""

    def __init__(self, fleet: Fleet, metrics: Metrics, clock: Callable[[], float] = time.monotonic) -> None:
        spec = fleet.signals.prometheus
        if spec is None:
            raise ValueError("signals.source is prometheus but signals.prometheus is not set")
        self.spec: PrometheusSpec = spec
        self.metrics = metrics.prometheus_source
        self.clock = clock
        self.rounds = 0  # rounds that ran, delivered or not
        self.failed_rounds = 0
        self._next_at: float | None = None
        self._delivered: dict[EndpointKey, float] = {}
        self._session: aiohttp.ClientSession | None = None
        self._failing: str | None = None  # why the latest round failed (logged on change)
        # Every query's series from the start, so rate() and increase() see the first error.
        for name in (*FIELDS, SAMPLE_TIME, BUCKETS):
            for outcome in PROMETHEUS_OUTCOMES:
                self.metrics.queries.labels(name, outcome)

    def matches(self, fleet: Fleet) -> bool:
        return fleet.signals.source == "prometheus" and fleet.signals.prometheus == self.spec

    @property
    def failing(self) -> str | None:
        """Why the latest round failed, until a round answers again."""
        return self._failing

    async def collect(
        self, fleet: Fleet, targets: Sequence[EndpointKey], *, first: bool = False
    ) -> dict[EndpointKey, ScrapeResult]:
        """A round's new samples when one is due (at most one query timeout), else nothing."""
        now = self.clock()
        # Due half a weight round early: rounds land a little late, and the interval would
        # otherwise stretch to the next round.
        slack = min(fleet.signals.interval_s, self.spec.interval_s) / 2
        if self._next_at is not None and now < self._next_at - slack:
            return {}
        self._next_at = now + self.spec.interval_s
        self.rounds += 1
        try:
            return await self._round(fleet, targets)
        except Exception as e:  # never out of the weight loop: the signals just age
            log.exception("prometheus round failed", url=self.spec.url)
            self._failed(f"{e.__class__.__name__}: {e}")
            return {}

    async def _round(self, fleet: Fleet, targets: Sequence[EndpointKey]) -> dict[EndpointKey, ScrapeResult]:
        queries = build_queries(self.spec.address_label, analysed_addresses(fleet))
        answers = await asyncio.gather(*(self._query(q) for q in queries))
        failures = [a for a in answers if isinstance(a, PrometheusQueryFailed)]
        if failures:
            self._failed(str(failures[0]))
            return {}
        try:
            conv = convert(
                {q.name: a for q, a in zip(queries, answers, strict=True)},  # type: ignore[misc]
                targets,
                self.spec.address_label,
                self._delivered,
            )
        except PrometheusQueryFailed as e:
            self._failed(str(e))
            return {}
        keep = set(targets)
        self._delivered = {k: t for k, t in self._delivered.items() if k in keep}
        self._delivered.update(conv.sample_times)
        m = self.metrics
        m.series_matched.set(conv.series_matched)
        m.series_unmatched.set(conv.series_unmatched)
        m.endpoints_without_series.set(len(conv.without_series))
        if self._failing is not None:
            log.info("prometheus answers again", url=self.spec.url)
            self._failing = None
        return conv.results

    def _failed(self, why: str) -> None:
        self.failed_rounds += 1
        if why != self._failing:
            log.warning(
                "prometheus round failed; signals age and fade to capacity", url=self.spec.url, error=why
            )
        self._failing = why

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = client_session(
                limit=16,
                # Uncompressed: gzip would cost more CPU here (and in Prometheus) than it saves
                # on a cluster network (about 1 KB per endpoint and round).
                headers={
                    "User-Agent": "inference-controlplane-prometheus-source",
                    "Accept-Encoding": "identity",
                },
            )
        return self._session

    async def _query(self, q: Query) -> Vector | PrometheusQueryFailed:
        """The query's result vector, or why there is none (counted either way)."""
        started = time.perf_counter()
        url = f"{self.spec.url}/api/v1/query"
        timeout = aiohttp.ClientTimeout(total=self.spec.timeout_s)
        try:
            try:
                session = self._client()
                request = (
                    session.post(url, data={"query": q.promql}, timeout=timeout)
                    if len(q.promql) > LONG_QUERY
                    else session.get(url, params={"query": q.promql}, timeout=timeout)
                )
                async with request as resp:
                    status = resp.status
                    body = await _read_bounded(resp, f"query {q.name}")
            except TimeoutError:
                raise PrometheusQueryFailed(
                    "timeout", f"query {q.name} timed out after {self.spec.timeout_s:g}s"
                ) from None
            except (aiohttp.ClientError, OSError) as e:
                raise PrometheusQueryFailed(
                    "unreachable", f"query {q.name}: {e.__class__.__name__}: {e}"
                ) from None
            try:
                result = decode_answer(status, body)
            except PrometheusQueryFailed as e:
                raise PrometheusQueryFailed(e.outcome, f"query {q.name}: {e}") from None
        except PrometheusQueryFailed as e:
            self.metrics.queries.labels(q.name, e.outcome).inc()
            return e
        finally:
            self.metrics.query_seconds.observe(time.perf_counter() - started)
        self.metrics.queries.labels(q.name, "success").inc()
        return result

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


async def _read_bounded(resp: aiohttp.ClientResponse, what: str) -> bytes:
    """The whole body, refused past MAX_ANSWER_BYTES (never buffered beyond it)."""
    if resp.content_length is not None and resp.content_length > MAX_ANSWER_BYTES:
        raise PrometheusQueryFailed(
            "invalid", f"{what}: answer of {resp.content_length} bytes is over the limit"
        )
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_any():
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            raise PrometheusQueryFailed("invalid", f"{what}: answer over the {MAX_ANSWER_BYTES} byte limit")
        chunks.append(chunk)
    return b"".join(chunks)
