"""Parse an inference server's /metrics page into one sample of its load (pure, no I/O).

Five dialects are understood, detected from the metric names on the page: vLLM
(`vllm:*`), SGLang (`sglang:*`), TGI (`tgi_*`), Triton (`nv_inference_*`) and llama.cpp
(`llamacpp:*`, llama-server's `--metrics`). `_FIELDS` maps each dialect's metric names to
running, waiting, KV use (0-1), latency sum/count, success/failure and token counters; a
dialect that does not export a quantity leaves it None (unknown, never 0: llama.cpp has no
KV gauge since its PR #13660, and no per-request counts). Series are summed over their label
sets (a data-parallel vLLM's engines, say), except KV use, a share of each series' own pool:
averaged. Counters are cumulative; `derive` turns two samples into interval rates.

The time-to-first-token and time-per-output-token histograms are read whole (`_HISTOGRAMS`:
cumulative buckets, _count, _sum, summed over the model's label sets) into `ServerHistogram`s,
which the control plane merges per model version (signals/model_latency.py). vLLM and SGLang
export both; TGI only a per-request mean time per token (read as TPOT); Triton and llama.cpp
neither.

vLLM's LoRA adapters are read from `vllm:lora_requests_info` (`_adapters`): its labels name
the adapters of the requests running and waiting and the adapter slots (--max-loras); its
value is the Unix time that label set was last set. Every combination shown stays on the page
as a series of its own, so the newest (the greatest value) is the server's state now. A
series out of bounds (limits.METRICS_LORA_*) leaves the adapters unknown, not the page.

Only the lines of the families read are parsed (`_select`): plain lines with string
operations, any other with prometheus_client's own text parser, so the text format's
semantics are prometheus_client's (a property test checks both paths agree). A line whose
`name{labels}` head was parsed before costs a split and a float() (`_HEADS`): a server's
page repeats its heads every scrape, only the values change. On a 33 KB vLLM page that is
about 20x cheaper than prometheus_client's parse of the whole page.
"""

from __future__ import annotations

import math
import operator
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice

from prometheus_client.parser import text_string_to_metric_families

from controlplane import limits

DIALECTS = ("vllm", "sglang", "tgi", "triton", "llamacpp")


class MetricsPageInvalid(ValueError):
    """The page is not Prometheus text, or carries none of the metrics a dialect needs."""


@dataclass(frozen=True)
class ServerHistogram:
    """A server's cumulative histogram as its page gives it (summed over the model's label
    sets): the finite bucket bounds (ascending) with their cumulative counts, the total count
    (_count, else the +Inf bucket) and the sum (None: not on the page)."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    count: float
    sum: float | None = None
    # Set by the collector process: which counting lifetime of the server this is. Two
    # histograms of one endpoint with the same non-zero `life` are `same_life`, and so is
    # everything the collector read between them: the control plane may keep only the
    # newer. 0: not known.
    life: int = 0


def continues(prev: ServerHistogram, cur: ServerHistogram) -> bool:
    """Whether `cur` continues `prev` (the same server's, later): the same bounds, a sum that
    did not go down, and an increase that is itself a histogram (each bucket's at least 0 and
    at least the one below it, the count's at least the top bucket's), as the new requests'
    observations always are. Otherwise the server was restarted (or reconfigured) in between:
    all of `cur` is new, as Prometheus' rate() takes a counter reset. (A restarted server that
    counted past its old counts by the next scrape is told by the shape of the increase.)"""
    if not (cur.bounds is prev.bounds or cur.bounds == prev.bounds):
        return False
    if cur.sum is not None and prev.sum is not None and cur.sum < prev.sum:
        return False
    rise = list(map(operator.sub, cur.counts, prev.counts))
    rise.append(cur.count - prev.count)
    return rise[0] >= 0 and all(map(operator.le, rise, islice(rise, 1, None)))


def same_life(prev: ServerHistogram, cur: ServerHistogram) -> bool:
    """`continues`, with the same parts (a sum, or none). Along a run of histograms each
    `same_life` with the one before, the increase from the first to the last is the sum of
    the steps': the ones between can be skipped."""
    return (cur.sum is None) == (prev.sum is None) and continues(prev, cur)


@dataclass(frozen=True)
class ServerSample:
    """One scrape of one server (for one model when the page labels models)."""

    dialect: str
    running: float | None = None
    waiting: float | None = None
    kv_use: float | None = None
    latency_sum_s: float | None = None
    latency_count: float | None = None
    successes: float | None = None
    failures: float | None = None
    token_latency_sum_s: float | None = None  # time per output token histogram
    token_latency_count: float | None = None
    # The request latency histogram: (upper bound, cumulative count), for quantiles (p99).
    latency_buckets: tuple[tuple[float, float], ...] = ()
    # Time to first token and time per output token, whole (None: not on the page; from a
    # collector process also: unchanged since that endpoint's last record, see
    # collector_worker.py).
    ttft: ServerHistogram | None = None
    tpot: ServerHistogram | None = None
    # Prefill counters: prompt tokens processed (cached ones excluded) and the seconds spent
    # on them (llama.cpp's counters; vLLM's prompt tokens less its prefix-cache hits, and its
    # prefill-time histogram's sum; None elsewhere, and where the page lacks them).
    prompt_tokens: float | None = None
    prompt_seconds: float | None = None
    # vLLM's decode-time histogram (first token to the end of each request): sum and count.
    decode_sum_s: float | None = None
    decode_count: float | None = None
    # vLLM's LoRA adapters (`_adapters`): its running and waiting lists as it prints them (a
    # vLLM 0.32 names every adapter with a request in flight in both), in its order, and its
    # adapter slots (--max-loras). None, all three together: the page has no
    # `vllm:lora_requests_info` (not vLLM, or started without --enable-lora), or its series
    # were refused. An empty tuple is known: no adapter.
    lora_running: tuple[str, ...] | None = None
    lora_waiting: tuple[str, ...] | None = None
    max_lora: int | None = None


@dataclass(frozen=True)
class LoadDelta:
    """What happened between two samples of the same server."""

    mean_latency_s: float | None
    error_rate: float | None
    completed: float
    mean_token_latency_s: float | None = None
    # The token counters moved by less than their printing can tell (llama.cpp): no mean
    # yet; measure the next one from the same earlier sample.
    token_latency_pending: bool = False
    # Seconds of prefill per prompt token not cached, and of decode per request (vLLM): what
    # a cached prompt saves a request here (the picker's KV credit, docs/kv-events.md).
    prefill_s_per_token: float | None = None
    decode_s_per_request: float | None = None


# name -> (field, scale); summed over the samples that match the model.
_FIELDS: dict[str, dict[str, tuple[str, float]]] = {
    "vllm": {
        "vllm:num_requests_running": ("running", 1.0),
        "vllm:num_requests_waiting": ("waiting", 1.0),
        "vllm:kv_cache_usage_perc": ("kv_use", 1.0),
        "vllm:gpu_cache_usage_perc": ("kv_use_legacy", 1.0),
        "vllm:e2e_request_latency_seconds_sum": ("latency_sum_s", 1.0),
        "vllm:e2e_request_latency_seconds_count": ("latency_count", 1.0),
        "vllm:request_success_total": ("successes", 1.0),  # by finished_reason: _BY_LABEL
        "vllm:time_per_output_token_seconds_sum": ("token_latency_sum_s", 1.0),
        "vllm:time_per_output_token_seconds_count": ("token_latency_count", 1.0),
        "vllm:inter_token_latency_seconds_sum": ("token_latency_sum_itl", 1.0),
        "vllm:inter_token_latency_seconds_count": ("token_latency_count_itl", 1.0),
        "vllm:request_time_per_output_token_seconds_sum": ("token_latency_sum_alt", 1.0),
        "vllm:request_time_per_output_token_seconds_count": ("token_latency_count_alt", 1.0),
        # Prefill: the tokens computed (every prompt token less those found cached) and the
        # seconds from scheduling to the first token; decode: the seconds after it.
        "vllm:prompt_tokens_total": ("prompt_tokens", 1.0),
        "vllm:prefix_cache_hits_total": ("prompt_tokens", -1.0),
        "vllm:request_prefill_time_seconds_sum": ("prompt_seconds", 1.0),
        "vllm:request_decode_time_seconds_sum": ("decode_sum_s", 1.0),
        "vllm:request_decode_time_seconds_count": ("decode_count", 1.0),
    },
    "sglang": {
        "sglang:num_running_reqs": ("running", 1.0),
        "sglang:num_queue_reqs": ("waiting", 1.0),
        "sglang:token_usage": ("kv_use", 1.0),
        "sglang:e2e_request_latency_seconds_sum": ("latency_sum_s", 1.0),
        "sglang:e2e_request_latency_seconds_count": ("latency_count", 1.0),
        "sglang:time_per_output_token_seconds_sum": ("token_latency_sum_s", 1.0),
        "sglang:time_per_output_token_seconds_count": ("token_latency_count", 1.0),
    },
    "tgi": {
        "tgi_batch_current_size": ("running", 1.0),
        "tgi_queue_size": ("waiting", 1.0),
        "tgi_request_duration_sum": ("latency_sum_s", 1.0),
        "tgi_request_duration_count": ("latency_count", 1.0),
        "tgi_request_success_total": ("successes", 1.0),
        "tgi_request_success": ("successes", 1.0),
        "tgi_request_failure_total": ("failures", 1.0),
        "tgi_request_failure": ("failures", 1.0),
        "tgi_request_mean_time_per_token_duration_sum": ("token_latency_sum_s", 1.0),
        "tgi_request_mean_time_per_token_duration_count": ("token_latency_count", 1.0),
    },
    "triton": {
        "nv_inference_pending_request_count": ("waiting", 1.0),
        "nv_inference_request_duration_us": ("latency_sum_s", 1e-6),
        "nv_inference_request_duration_us_total": ("latency_sum_s", 1e-6),
        "nv_inference_request_success": ("successes", 1.0),
        "nv_inference_request_success_total": ("successes", 1.0),
        "nv_inference_request_failure": ("failures", 1.0),
        "nv_inference_request_failure_total": ("failures", 1.0),
    },
    # llama-server (tools/server/server-task.cpp, to_metrics): unlabelled, one series each.
    # Its generation counters time each request from its prompt's end to its last token, so
    # seconds over tokens is the time per output token (TPOT) of the requests finished: a
    # request's counts are added when its slot is released. (A request's first token costs no
    # decode step but is counted: on short answers the mean reads a little low.) No request
    # count (so no mean latency, no successes) and no slot count: unknown. KV use only from
    # servers older than llama.cpp PR #13660, which removed `kv_cache_usage_ratio` (used
    # cells over the context): unknown on newer ones. Its `prompt_tokens_seconds` and
    # `predicted_tokens_seconds` gauges are not read: each scrape of /metrics resets them,
    # so two scrapers would each see half a window.
    "llamacpp": {
        "llamacpp:requests_processing": ("running", 1.0),
        "llamacpp:requests_deferred": ("waiting", 1.0),
        "llamacpp:kv_cache_usage_ratio": ("kv_use", 1.0),
        "llamacpp:tokens_predicted_seconds_total": ("token_latency_sum_s", 1.0),
        "llamacpp:tokens_predicted_total": ("token_latency_count", 1.0),
        "llamacpp:prompt_tokens_total": ("prompt_tokens", 1.0),
        "llamacpp:prompt_seconds_total": ("prompt_seconds", 1.0),
    },
}
# Families whose series a label splits between fields: name -> (the label, its value -> the
# field instead of `_FIELDS`', None: not counted). vLLM counts every request that leaves its
# engine in `request_success_total`, whatever `finished_reason` (vllm/v1/engine/__init__.py,
# FinishReason: stop, length, abort, error, repetition): "error" is a request-level internal
# error, answered 500, so a failure; "abort" is a request its client (or the proxy, on a
# timeout) gave up on, neither a success nor the server's failure (a chat client's stop
# button would otherwise count against the server). Any other reason is a completion.
_BY_LABEL: dict[str, tuple[str, dict[str, str | None]]] = {
    "vllm:request_success_total": ("finished_reason", {"abort": None, "error": "failures"}),
}
# Fields that are each series' share of its own capacity (a 0-1 fraction): averaged over the
# series read, not summed. A data-parallel vLLM prints one series per engine, each engine
# with its own KV pool (of one size): two engines at 0.6 are 0.6 of the server's KV, not 1.2.
_MEAN_FIELDS = frozenset({"kv_use", "kv_use_legacy"})
_DETECT = {
    "vllm": "vllm:",
    "sglang": "sglang:",
    "tgi": "tgi_",
    "triton": "nv_inference_",
    "llamacpp": "llamacpp:",
}
_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "tgi": "TGI", "triton": "Triton", "llamacpp": "llama.cpp"}
# vLLM's LoRA gauge (vllm/v1/metrics/loggers.py, `gauge_lora_info`): labels max_lora,
# running_lora_adapters and waiting_lora_adapters (names joined by commas), value the time
# the label set was last set (set_to_current_time). Read by `_adapters`, not summed.
_LORA_FAMILY = "vllm:lora_requests_info"


# The histograms read whole, per dialect: which -> the family's name. "e2e" is the request
# latency histogram: only its buckets (its sum and count are `_FIELDS`), for
# `latency_buckets`; "ttft" and "tpot" are read with their _count and _sum into
# `ServerHistogram`s. "tpot_alt" stands in for "tpot" when that is not on the page (vLLM
# 0.11 renamed the per-token histogram inter_token_latency). TGI has no first-token
# histogram; its per-token one is each request's mean time per token (one observation per
# request, not per token). Triton exports neither.
_HISTOGRAMS: dict[str, dict[str, str]] = {
    "vllm": {
        "e2e": "vllm:e2e_request_latency_seconds",
        "ttft": "vllm:time_to_first_token_seconds",
        "tpot": "vllm:time_per_output_token_seconds",
        "tpot_alt": "vllm:inter_token_latency_seconds",
    },
    "sglang": {
        "e2e": "sglang:e2e_request_latency_seconds",
        "ttft": "sglang:time_to_first_token_seconds",
        "tpot": "sglang:time_per_output_token_seconds",
    },
    "tgi": {
        "e2e": "tgi_request_duration",
        "tpot": "tgi_request_mean_time_per_token_duration",
    },
    "triton": {},
    "llamacpp": {},
}

# What a sample name feeds: (a `_FIELDS` field or None, its scale, a histogram or None, the
# histogram's part: bucket, count or sum). One lookup per sample. `_LORA_READ`: the LoRA
# gauge's series, kept for `_adapters`.
_Read = tuple[str | None, float, str | None, str | None]
_LORA_READ: _Read = (None, 1.0, "lora", None)


def _read_table(dialect: str) -> dict[str, _Read]:
    out: dict[str, _Read] = {name: (f, scale, None, None) for name, (f, scale) in _FIELDS[dialect].items()}
    for which, base in _HISTOGRAMS[dialect].items():
        for part in ("bucket",) if which == "e2e" else ("bucket", "count", "sum"):
            name = f"{base}_{part}"
            f, scale = _FIELDS[dialect].get(name, (None, 1.0))
            out[name] = (f, scale, which, part)
    if dialect == "vllm":
        out[_LORA_FAMILY] = _LORA_READ
    return out


_READ: dict[str, dict[str, _Read]] = {d: _read_table(d) for d in DIALECTS}


Sample = tuple[str, dict[str, str], float]


# Per dialect, the shortest distinct prefixes of the names read (a name that extends
# another is found with it).
_PREFIXES: dict[str, tuple[str, ...]] = {
    d: tuple(n for n in sorted(_READ[d]) if not any(n != o and n.startswith(o) for o in _READ[d]))
    for d in DIALECTS
}


# The same, without the dialect's prefix (what follows it on a line).
_RESTS: dict[str, tuple[str, ...]] = {
    d: tuple(n[len(_DETECT[d]) :] for n in prefixes) for d, prefixes in _PREFIXES.items()
}


def _by_start(rests: tuple[str, ...]) -> tuple[int, dict[str, tuple[str, ...]]]:
    """(n, the rests by their first n characters), n the shortest rest's length: most lines
    of a page are ruled out by one slice and one lookup, not a startswith per name read."""
    n = min((len(r) for r in rests), default=0)
    out: dict[str, tuple[str, ...]] = {}
    for r in rests:
        out[r[:n]] = (*out.get(r[:n], ()), r)
    return n, out


_RESTS_BY_START = {d: _by_start(rests) for d, rests in _RESTS.items()}


def _select(text: str) -> tuple[list[str], str | None]:
    """(the lines of the families read, the dialect with most of them).

    A vLLM page is 30-60 KB of a dozen histograms; what is read is about 100 of its lines.
    For each dialect whose prefix the page has, the page is split (in C) at every line
    that starts with the prefix, and only the pieces that go on with a name read are
    kept, cut at their line's end, before any per-sample parsing. Comments (HELP/TYPE)
    are dropped: sample names are all `parse_metrics` matches on. A malformed line in a
    family that is not read no longer matters."""
    out: list[str] = []
    best, best_n = None, 0
    for dialect, mark in _DETECT.items():
        if mark not in text:
            continue
        rests = _RESTS[dialect]
        n, by_start = _RESTS_BY_START[dialect]
        found: list[str] = []
        pieces = text.split("\n" + mark)
        head = pieces[0]
        if head.startswith(mark) and head.startswith(rests, len(mark)):
            found.append(head.partition("\n")[0])
        for piece in pieces[1:]:
            candidates = by_start.get(piece[:n])
            if candidates is not None and piece.startswith(candidates):
                end = piece.find("\n")
                found.append(mark + (piece if end == -1 else piece[:end]))
        out += found
        if len(found) > best_n:
            best, best_n = dialect, len(found)
    return [line.rstrip("\r") for line in out], best


# Heads (`name{labels}`, what precedes the value) of plain lines parsed before, with their
# name and labels. A server's page repeats the same heads every scrape, only the values
# change, so after its first page a line costs a split, a lookup and a float(). The labels
# dicts are shared between samples and never mutated. Bounded: cleared when full. A vLLM page
# has about 95 heads per model read (the model is a label): 32,768 heads are some 340 models
# per collector process, about 400 bytes each (13 MB full); past that, pages cost up to
# twice as much.
_Heads = dict[str, tuple[str, dict[str, str]]]
_HEADS: _Heads = {}
HEADS_MAX = 32768
# The LoRA gauge's heads, apart: a long-running vLLM's page carries a series for every
# combination of adapters it has shown (a new head each), which must not crowd the heads of
# the load figures out of `_HEADS`. A head is up to a few hundred bytes: 8,192 are some 4 MB.
_LORA_HEADS: _Heads = {}
LORA_HEADS_MAX = 8192


def _selected_samples(lines: list[str], heads: _Heads = _HEADS, heads_max: int = HEADS_MAX) -> list[Sample]:
    """Samples of the selected lines. A plain line is split with string operations (label
    values without a backslash are literal and cannot hold a quote, so `",` and `"}` only
    end them: this is exactly what the text format says); any other line (escapes, odd
    spacing, anything unexpected) is given to prometheus_client's parser. `heads`: the head
    cache to use, of at most `heads_max` heads."""
    out: list[Sample] = []
    for line in lines:
        sample = _plain(line, heads, heads_max)
        if sample is None:
            out += _parsed(line + "\n")
        else:
            out.append(sample)
    return out


def _plain(line: str, heads: _Heads = _HEADS, heads_max: int = HEADS_MAX) -> Sample | None:
    head, _, value = line.rpartition(" ")
    known = heads.get(head)
    # A known head ends its line's labels (or is a bare name): `value` is the one field after
    # one space, exactly what the full parse below accepts when it caches the head.
    if known is not None and value and "_" not in value and "\t" not in value:
        try:
            return known[0], known[1], float(value)
        except ValueError:
            return None
    return _plain_uncached(line, heads, heads_max)


def _plain_uncached(line: str, heads: _Heads = _HEADS, heads_max: int = HEADS_MAX) -> Sample | None:
    if "\\" in line or " # " in line or "__name__" in line:
        return None
    brace = line.find("{")
    labels: dict[str, str] = {}
    if brace == -1:
        name, sep, rest = line.partition(" ")
        if not sep:
            return None
    else:
        name = line[:brace]
        end = line.find('"}', brace)
        if line.startswith("{}", brace):
            rest = line[brace + 2 :]
        elif end == -1:
            return None
        else:
            for part in line[brace + 1 : end].split('",'):
                key, sep, value = part.partition('="')
                if not sep or not key.isidentifier() or not key.isascii() or '"' in value:
                    return None
                labels[key] = value
            rest = line[end + 2 :]
        if not rest.startswith(" "):
            return None
    if not name or not name.replace(":", "_").isidentifier() or not name.isascii():
        return None
    fields = rest.split(" ")
    fields = [f for f in fields if f]
    if len(fields) not in (1, 2) or "\t" in rest:
        return None
    if (len(fields) == 2 and not fields[1].lstrip("-").isdigit()) or "_" in fields[0]:
        return None
    try:
        number = float(fields[0])
    except ValueError:
        return None
    if len(fields) == 1 and rest == " " + fields[0]:
        if len(heads) >= heads_max:
            heads.clear()
        # Names, label names and values repeat across heads: one string each.
        name = sys.intern(name)
        labels = {sys.intern(k): sys.intern(v) for k, v in labels.items()}
        heads[line[: len(line) - len(rest)]] = (name, labels)
    return name, labels, number


def _parsed(text: str) -> list[Sample]:
    try:
        return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]
    except (ValueError, IndexError, KeyError, TypeError) as e:
        raise MetricsPageInvalid(f"not Prometheus text format: {e}") from None


def parse_metrics(text: str, model: str | None = None, *, select: bool = True) -> ServerSample:
    """Parse a /metrics page. With `model`, count only samples labelled with that model
    (or unlabelled ones); a page that labels one other model is taken as that server's only
    model. Raise MetricsPageInvalid with the reason. `select`: read only the lines of the
    families read (`_select`, then `_selected_samples`); a page with none of them is
    parsed whole by prometheus_client, for the precise reason."""
    chosen, hint = _select(text) if select else ([], None)
    # The LoRA gauge's series are bounded on their own (a long-running vLLM's page grows
    # them), parsed with their own head cache, and past their bound not parsed at all.
    lora_lines: list[str] = []
    if _LORA_FAMILY in text:
        rest: list[str] = []
        for line in chosen:
            (lora_lines if line.startswith(_LORA_FAMILY) else rest).append(line)
        chosen = rest
    if len(chosen) > limits.METRICS_MAX_SERIES:
        raise MetricsPageInvalid(
            f"{len(chosen)} series of the families read, over the {limits.METRICS_MAX_SERIES} limit "
            "(docs/limits.md)"
        )
    lora_over = len(lora_lines) > limits.METRICS_LORA_MAX_SERIES
    if not chosen:
        samples = _parsed(text)
    elif lora_lines and not lora_over:
        samples = _selected_samples(chosen) + _selected_samples(lora_lines, _LORA_HEADS, LORA_HEADS_MAX)
    else:
        samples = _selected_samples(chosen)
    dialect = hint if chosen else _detect(name for name, _, _ in samples)
    if dialect is None:
        names = [_NAMES[d] for d in DIALECTS]
        raise MetricsPageInvalid(
            f"no {', '.join(names[:-1])} or {names[-1]} metrics on the page "
            f"({len(samples)} samples; expected names starting with "
            f"{', '.join(repr(p) for p in _DETECT.values())})"
        )
    fields = _FIELDS[dialect]
    labelled_models: set[str] = set()
    for name, labels, _ in samples:
        if name in fields:
            labelled = labels.get("model_name")
            if labelled is None:
                labelled = labels.get("model")
            if labelled is not None:
                labelled_models.add(labelled)
    if model is not None and model not in labelled_models:
        if len(labelled_models) > 1:
            raise MetricsPageInvalid(
                f"the page labels models {', '.join(sorted(labelled_models))}, none of them {model!r}"
            )
        # One model on the page under another name (vLLM's --served-model-name is often the
        # Hugging Face id, the fleet's name a short one): the server serves just that model.
        model = None
    values: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}  # histogram -> le -> cumulative count
    totals: dict[tuple[str, str | None], float] = {}  # (histogram, count or sum) -> value
    series: dict[str, int] = {}  # a _MEAN_FIELDS field -> the series summed into it
    lora: list[tuple[dict[str, str], float]] = []  # the LoRA gauge's series, for `_adapters`
    read = _READ[dialect]
    for name, labels, value in samples:
        what = read.get(name)
        if what is None:
            continue
        if what is _LORA_READ:
            lora.append((labels, value))
            continue
        # The model label: model_name, else model.
        labelled = labels.get("model_name")
        if labelled is None:
            labelled = labels.get("model")
        if model is not None and labelled is not None and labelled != model:
            continue
        if not math.isfinite(value):
            raise MetricsPageInvalid(f"{name}: value {value} is not a finite number")
        field, scale, which, part = what
        if field in ("running", "waiting") and value > limits.METRICS_MAX_QUEUE:
            raise MetricsPageInvalid(f"{name}: value {value:g} is over the {limits.METRICS_MAX_QUEUE} limit")
        if value < 0:
            # Every family read is a count, a duration or a share: a negative one is a lie or
            # a bug, and would steer the weights (a negative latency wins every comparison).
            raise MetricsPageInvalid(f"{name}: value {value:g} is negative")
        if field is not None:
            split = _BY_LABEL.get(name)
            if split is not None:
                label, fields_by_value = split
                field = fields_by_value.get(labels.get(label, ""), field)
            if field is not None:
                values[field] = values.get(field, 0.0) + value * scale
                if field in _MEAN_FIELDS:
                    series[field] = series.get(field, 0) + 1
        if which is None:
            continue
        if part == "bucket":
            try:
                le = float(labels["le"])
            except (KeyError, ValueError):
                raise MetricsPageInvalid(f"{name}: a bucket without a numeric 'le' label") from None
            if le != le:
                raise MetricsPageInvalid(f"{name}: a bucket without a numeric 'le' label (NaN)")
            counts = buckets.get(which)
            if counts is None:
                counts = buckets[which] = {}
            counts[le] = counts.get(le, 0.0) + value
        else:
            totals[which, part] = totals.get((which, part), 0.0) + value
    for field, n in series.items():
        values[field] /= n
    if "kv_use" not in values and "kv_use_legacy" in values:
        values["kv_use"] = values["kv_use_legacy"]
    values.pop("kv_use_legacy", None)
    # vLLM 0.11 renamed the per-token histogram inter_token_latency (one observation per gap
    # between tokens, as before); its request_time_per_output_token is each request's mean
    # (one per request), the last resort. The first on the page is used, never a blend.
    for suffix in ("_itl", "_alt"):
        alt_sum = values.pop("token_latency_sum" + suffix, None)
        alt_count = values.pop("token_latency_count" + suffix, None)
        if "token_latency_count" not in values and alt_sum is not None and alt_count is not None:
            values["token_latency_sum_s"], values["token_latency_count"] = alt_sum, alt_count
    if dialect == "triton" and "successes" in values:
        values["latency_count"] = values["successes"]
    if "kv_use" in values and values["kv_use"] > 1.0:
        values["kv_use"] = values["kv_use"] / 100.0  # some exporters report percent
    if not values:
        raise MetricsPageInvalid(f"{dialect} page has none of its load metrics for model {model!r}")
    running, waiting, slots = _NO_ADAPTERS if lora_over else _adapters(lora, model)
    return ServerSample(
        dialect=dialect,
        latency_buckets=tuple(sorted(buckets.get("e2e", {}).items())),
        ttft=_histogram("ttft", buckets, totals),
        tpot=_histogram("tpot", buckets, totals) or _histogram("tpot_alt", buckets, totals),
        lora_running=running,
        lora_waiting=waiting,
        max_lora=slots,
        **values,
    )


# What `_adapters` gives: (running, waiting, slots), all None when unknown.
_Adapters = tuple[tuple[str, ...] | None, tuple[str, ...] | None, int | None]
_NO_ADAPTERS: _Adapters = (None, None, None)
# The longest adapter list a label may hold: METRICS_LORA_MAX_ADAPTERS names of the longest
# length, joined by commas. A longer one is refused before it is split.
_ADAPTERS_MAX_CHARS = limits.METRICS_LORA_MAX_ADAPTERS * (limits.API_NAME_MAX_CHARS + 1)


def _adapters(series: list[tuple[dict[str, str], float]], model: str | None) -> _Adapters:
    """The LoRA adapters the page says the server holds: those of its newest
    `vllm:lora_requests_info` series (the greatest value, the Unix time its labels were last
    set; a tie, two label sets set in one microsecond, goes to the greater labels, so the
    answer never depends on the order of the lines). Unknown, all three: no series (of the
    model), more than limits.METRICS_LORA_MAX_SERIES, a value not finite (a series claiming
    +Inf would be the newest for ever, NaN cannot be ordered), or a newest series whose labels
    are refused (`_slots`, `_adapter_names`). Only the time orders the series: it need not be
    recent (the server's clock is its own)."""
    if not series or len(series) > limits.METRICS_LORA_MAX_SERIES:
        return _NO_ADAPTERS
    newest: dict[str, str] | None = None
    newest_at = -math.inf
    for labels, value in series:
        if model is not None and ("model_name" in labels or "model" in labels):
            labelled = labels.get("model_name")
            if (labelled if labelled is not None else labels["model"]) != model:
                continue
        if not math.isfinite(value):
            return _NO_ADAPTERS
        if newest is None or value > newest_at or (value == newest_at and _order(labels) > _order(newest)):
            newest, newest_at = labels, value
    if newest is None:
        return _NO_ADAPTERS
    slots = _slots(newest.get("max_lora"))
    running = _adapter_names(newest.get("running_lora_adapters"))
    waiting = _adapter_names(newest.get("waiting_lora_adapters"))
    if slots is None or running is None or waiting is None:
        return _NO_ADAPTERS
    return running, waiting, slots


def _order(labels: dict[str, str]) -> tuple[str, str, str]:
    """What breaks a tie between two LoRA series set at the same time."""
    return (
        labels.get("running_lora_adapters", ""),
        labels.get("waiting_lora_adapters", ""),
        labels.get("max_lora", ""),
    )


def _slots(text: str | None) -> int | None:
    """The `max_lora` label as a number of slots: a whole number in decimal digits (as vLLM
    prints its --max-loras), 0 to limits.METRICS_LORA_MAX_SLOTS; else (or missing) None."""
    if text is None or not (0 < len(text) <= 4 and text.isascii() and text.isdigit()):
        return None
    n = int(text)
    return n if n <= limits.METRICS_LORA_MAX_SLOTS else None


def _adapter_names(text: str | None) -> tuple[str, ...] | None:
    """An adapter list label as names: split at commas, each stripped, empty ones dropped,
    repeats removed (the first kept, in order). None (refused) when the label is missing,
    longer than any list within the bounds could be, or names more than
    limits.METRICS_LORA_MAX_ADAPTERS adapters, one longer than limits.API_NAME_MAX_CHARS or
    one with a character that cannot be printed (a control character, a line break)."""
    if text is None or len(text) > _ADAPTERS_MAX_CHARS:
        return None
    if not text:
        return ()
    names = dict.fromkeys(name.strip() for name in text.split(","))
    names.pop("", None)
    if len(names) > limits.METRICS_LORA_MAX_ADAPTERS:
        return None
    for name in names:
        if len(name) > limits.API_NAME_MAX_CHARS or not name.isprintable():
            return None
    return tuple(names)


# Bucket bounds tuples, one object per distinct value: a batch of records pickles each
# distinct tuple once (pickle's memo), and the control plane compares them by identity first.
_BOUNDS: dict[tuple[float, ...], tuple[float, ...]] = {}


def _histogram(
    which: str, buckets: dict[str, dict[float, float]], totals: dict[tuple[str, str | None], float]
) -> ServerHistogram | None:
    """The histogram `which` of the page, or None if the page has neither its _count nor a
    +Inf bucket."""
    counts = buckets.get(which, {})
    count = totals.get((which, "count"), counts.get(math.inf))
    if count is None:
        return None
    finite = tuple(sorted(le for le in counts if le != math.inf))
    bounds = _BOUNDS.get(finite)
    if bounds is None:
        if len(_BOUNDS) >= 256:
            _BOUNDS.clear()
        bounds = _BOUNDS[finite] = finite
    return ServerHistogram(bounds, tuple(counts[le] for le in bounds), count, totals.get((which, "sum")))


def _detect(names: Iterable[str]) -> str | None:
    counts = dict.fromkeys(DIALECTS, 0)
    for name in names:
        for dialect, prefix in _DETECT.items():
            if name.startswith(prefix):
                counts[dialect] += 1
    best = max(counts, key=lambda d: counts[d])
    return best if counts[best] else None


# llama-server prints its values with 6 significant digits (a C++ stream's default), so a
# reading is within half a step of the truth, the step being 1e-5 of its leading digit's place
# (100 tokens past ten million, a second past 100,000 s). A mean is taken from deltas of at
# least PRINTED_STEPS steps (so within 5%); smaller ones (a long-running server scraped every
# second) wait for more: an unchanged sum over new tokens would otherwise read as infinitely fast.
_SIX_DIGITS = frozenset({"llamacpp"})
PRINTED_STEPS = 20


def printed_step(x: float) -> float:
    """The step between neighbouring values near `x` printed with 6 significant digits."""
    return 10.0 ** (math.floor(math.log10(x)) - 5) if x > 0 and math.isfinite(x) else 0.0


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None  # a count delta of almost nothing: no mean to take


def derive(previous: ServerSample | None, current: ServerSample) -> LoadDelta:
    """Rates between two samples: mean latency of the requests completed in between, and
    their error rate. A counter that went backwards (a restarted server) starts afresh."""
    if previous is None or previous.dialect != current.dialect:
        return LoadDelta(None, None, 0.0)

    def delta(a: float | None, b: float | None) -> float | None:
        if a is None or b is None:
            return None
        return b - a if b >= a else b  # a reset: the new value is all since the restart

    def pair(
        a: tuple[float | None, float | None], b: tuple[float | None, float | None]
    ) -> tuple[float | None, float | None]:
        """A histogram's (sum, count) deltas, reset together: a sum that went down while its
        count went up is a reset of both (or a lie), never a negative duration."""
        if None in a or None in b:
            return None, None
        (s0, c0), (s1, c1) = a, b
        assert s0 is not None and c0 is not None and s1 is not None and c1 is not None
        if s1 < s0 or c1 < c0:
            return s1, c1
        return s1 - s0, c1 - c0

    d_sum, d_count = pair(
        (previous.latency_sum_s, previous.latency_count), (current.latency_sum_s, current.latency_count)
    )
    mean = _finite(d_sum / d_count) if d_sum is not None and d_count else None
    t_sum, t_count = pair(
        (previous.token_latency_sum_s, previous.token_latency_count),
        (current.token_latency_sum_s, current.token_latency_count),
    )
    token_mean = _finite(t_sum / t_count) if t_sum is not None and t_count else None
    pending = False
    if current.dialect in _SIX_DIGITS and t_sum is not None and t_count is not None:
        assert current.token_latency_sum_s is not None and current.token_latency_count is not None
        if t_sum < PRINTED_STEPS * printed_step(current.token_latency_sum_s) or (
            t_count < PRINTED_STEPS * printed_step(current.token_latency_count)
        ):
            token_mean, pending = None, True
    d_ok = delta(previous.successes, current.successes) or 0.0
    d_fail = delta(previous.failures, current.failures) or 0.0
    done = d_ok + d_fail
    error_rate = d_fail / done if done else None
    # Not from llama.cpp's prefill counters: printed with 6 digits, a scrape's growth is often
    # below what they can show (and its page has no decode figure to weigh it against).
    p_sum, p_tokens = (
        pair(
            (previous.prompt_seconds, previous.prompt_tokens), (current.prompt_seconds, current.prompt_tokens)
        )
        if current.dialect not in _SIX_DIGITS
        else (None, None)
    )
    prefill = _finite(p_sum / p_tokens) if p_sum is not None and p_tokens and p_tokens >= 1 else None
    dec_sum, dec_count = pair(
        (previous.decode_sum_s, previous.decode_count), (current.decode_sum_s, current.decode_count)
    )
    decode = _finite(dec_sum / dec_count) if dec_sum is not None and dec_count else None
    return LoadDelta(
        mean, error_rate, done if done else (d_count or 0.0), token_mean, pending, prefill, decode
    )
