"""What the control plane knows about each endpoint's load, and how old it is (pure).

Two sources feed it: scrapes of each server's `/metrics` and `/health`, and Envoy load
reports (LRS), summed over every proxy. `SignalStore.load` turns the latest of both into
one `EndpointLoad` for the balancing policies. Time is an input (`now`, monotonic
seconds), so every rule here is unit-tested without sleeping.

Rules (docs/signals.md):
- Readiness is the server's own word: a health answer 2xx is ready (HTTP 404: the server
  has no health endpoint, ready), any other answer (or gRPC NOT_SERVING) is not ready at
  once. No answer at all (refused, timeout) is not a verdict: the last one stands, and
  after `UNREACHABLE_AFTER` such scrapes in a row the endpoint is *out of sight*
  (`EndpointLoad.in_sight`). Whether an endpoint out of sight is held out is decided per
  cluster (balancing/sight.py): the control plane losing sight of servers must not take
  them out of the proxies' hands. An endpoint never scraped yet is assumed ready. One
  refusal is a verdict: an endpoint never seen ready whose serving port refuses connections
  (`ScrapeResult.serving_refused`) is not ready, and in sight: it is not up yet.
- An answer to either probe (health or metrics, even an HTTP error) brings it back in sight.
- A ready endpoint seen turning ready (not at first sight) gets `ready_for_s` from that
  moment, for the slow-start ramp.
- A page that cannot be parsed counts a scrape error and leaves the last good sample in
  place, so its age grows and the policy fades it towards capacity only. Every scrape error
  is counted by its reason class (`SCRAPE_ERROR_REASONS`), and the last scrape's error stays
  shown (`EndpointSignals.scrape_error`) until a page is read again.
- A figure never read is None in the load, never 0: no sample, or a sample without it (a
  dialect that has no KV gauge), and for running no proxy's report either. The policies
  weigh it as 0 (`load.counted`), as they did before unknown was told apart.
- vLLM's LoRA adapters (running, waiting, slots) come with the newest sample, as running
  and waiting do, and are as old (`age_s`); a newer page without them makes them unknown.
- Latency and error rate are EWMAs over scrape intervals with completions. The error rate
  is the worse of the server's own counters and the proxies' LRS error share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from controlplane.signals.load import EndpointLoad
from controlplane.signals.parse import MetricsPageInvalid, ServerSample, derive, parse_metrics

UNREACHABLE_AFTER = 3  # unanswered scrapes in a row before an endpoint is out of sight
EWMA_ALPHA = 0.3  # weight of the newest interval in latency and error-rate averages
LRS_MAX_AGE_S = 10.0  # a proxy's report older than this no longer counts
PEAK_HALF_LIFE_S = 30.0  # the most requests seen running fades by half in this long
PEAK_GROWTH_FLOOR = 8.0  # ...and grows per sample to at most twice itself, or this

EndpointKey = tuple[str, str]  # (model, address)

# Why a scrape read no load (ScrapeResult.error_reason, controlplane_version_scrape_errors_total):
# unreachable: /metrics gave no HTTP answer (refused, timed out); http_error: it answered a
# status other than 200; no_dialect: a page with none of the known servers' metrics (a
# server of no supported kind, or a wrong metrics path that serves another exporter);
# unreadable: any other page refused (not Prometheus text, a value refused, none of the
# model's figures, over the size limit); no_series: the Prometheus source has no usable
# series for the endpoint. A source that does not say counts as "other".
SCRAPE_ERROR_REASONS = ("unreachable", "http_error", "no_dialect", "unreadable", "no_series")


@dataclass(frozen=True)
class ScrapeError:
    """Why a scrape read no load: the text shown (`ScrapeResult.metrics_error`) and its class
    (`ScrapeResult.error_reason`, one of SCRAPE_ERROR_REASONS)."""

    text: str
    reason: str


def fetch_error(metrics_path: str, status: int | None, error: str | None) -> ScrapeError | None:
    """Why a metrics fetch (its HTTP status, and the probe's error) brought no page to read;
    None when it brought one. No HTTP answer is unreachable; an answer refused (a page over
    the size limit) unreadable; any status but 200 http_error."""
    if error is not None:
        return ScrapeError(error, "unreachable" if status is None else "unreadable")
    if status is not None and status != 200:
        return ScrapeError(f"GET {metrics_path} answered HTTP {status}", "http_error")
    return None


def page_error(e: MetricsPageInvalid) -> ScrapeError:
    """Why a page parse_metrics refused gave no load: no_dialect or unreadable."""
    # parse.py says "no vLLM, SGLang, ... metrics on the page (N samples; ...)" (a test holds it).
    text = str(e)
    reason = "no_dialect" if text.startswith("no ") and " metrics on the page (" in text else "unreadable"
    return ScrapeError(f"unreadable metrics page: {text}", reason)


@dataclass(frozen=True)
class ScrapeResult:
    """One observation of one endpoint: /health status (or why it failed) and its load, as
    a /metrics page to parse here or as a sample already parsed (by a collector process or
    from Prometheus). No health status and no health error: health was not observed."""

    health_status: int | None = None
    health_error: str | None = None
    metrics_text: str | None = None
    metrics_error: str | None = None
    sample: ServerSample | None = None
    # How old the observation already is when it arrives (Prometheus: now - sample time).
    age_s: float = 0.0
    # Whether any probe got an answer (an HTTP error status counts): the server is in sight.
    # None: the source cannot tell (Prometheus); then only the health probe says.
    reached: bool | None = None
    # The class of metrics_error (SCRAPE_ERROR_REASONS); None with an error: "other".
    error_reason: str | None = None
    # The probe of the port requests go to was refused: nothing listens there yet.
    serving_refused: bool = False


@dataclass
class _LrsEntry:
    in_progress: float
    issued: float
    succeeded: float
    failed: float
    at: float


@dataclass(frozen=True)
class EndpointCounters:
    """Cumulative counts for one endpoint, to compare against an earlier reading (a rollout
    step's analysis): the server's own counters and latency histogram, and the proxies'
    load reports summed since the control plane started."""

    server_ok: float = 0.0
    server_failed: float = 0.0
    buckets: tuple[tuple[float, float], ...] = ()
    lrs_ok: float = 0.0
    lrs_failed: float = 0.0
    dialect: str | None = None  # of the server's metrics page; None: not scraped yet
    # Whether the server's metrics count failed requests (TGI, Triton). vLLM and SGLang count
    # only successes: without load reports, a server failing every request looks idle.
    server_counts_failures: bool = False
    # When the newest load report naming the endpoint arrived (the store's clock), from any
    # proxy still reporting; None: none. A report with zero counts still shows a proxy reports.
    lrs_reported_at: float | None = None


@dataclass
class EndpointSignals:
    """Mutable state of one endpoint's signals."""

    sample: ServerSample | None = None
    sample_at: float | None = None
    latency_s: float | None = None
    token_latency_s: float | None = None  # time per output token: how fast a request runs here
    prefill_s_per_token: float | None = None  # prefill seconds per prompt token not cached
    decode_s_per_request: float | None = None  # decode seconds per request (first token to end)
    error_rate: float = 0.0  # EWMA from 0, as the weights always took it...
    error_rate_read: bool = False  # ...but unknown (None in the load) until a figure came
    throughput: float | None = None  # learnt: completions/s per running request x peak running
    peak_running: float = 0.0
    slots: float | None = None  # the most seen running while requests also waited (autoscaling)
    ready: bool | None = None  # the server's last verdict; None: none yet
    seen_ready: bool = False  # it has answered ready at least once
    health_probed: bool = False  # a health probe was ever sent (answered or not)
    ready_since: float | None = None  # when it was seen turning ready
    unreachable: int = 0  # scrapes in a row that got no answer from any probe
    out_of_sight_since: float | None = None  # when it went out of sight (None: in sight)
    scrape_errors: int = 0
    scrape_errors_by_reason: dict[str, int] = field(default_factory=dict)
    # The last scrape's error while it is the last outcome (cleared when a page is read):
    # what an operator needs to know why the signals age (cpctl endpoints list, explain).
    scrape_error: str | None = None
    scrape_error_reason: str | None = None
    last_error: str | None = None
    lrs: dict[str, _LrsEntry] = field(default_factory=dict)  # by proxy node id
    lrs_ok_total: float = 0.0  # summed over every report of every proxy
    lrs_failed_total: float = 0.0
    completed_total: float = 0.0  # requests the server's own counters say it finished
    # The sample the next time per output token is measured from, when not the last one: its
    # counters have not yet moved enough to be read precisely (parse.LoadDelta).
    token_base: ServerSample | None = None


class SignalStore:
    """Latest signals per (model, address)."""

    def __init__(self) -> None:
        self.endpoints: dict[EndpointKey, EndpointSignals] = {}

    def _get(self, key: EndpointKey) -> EndpointSignals:
        sig = self.endpoints.get(key)
        if sig is None:
            sig = self.endpoints[key] = EndpointSignals()
        return sig

    def retain(self, keys: set[EndpointKey]) -> None:
        """Forget endpoints that are no longer in the fleet."""
        for key in [k for k in self.endpoints if k not in keys]:
            del self.endpoints[key]

    def record_scrape(self, key: EndpointKey, result: ScrapeResult, now: float) -> None:
        """Fold one scrape into the endpoint's state."""
        sig = self._get(key)
        self._record_health(sig, result, now)
        if result.metrics_error is not None:
            self._scrape_failed(sig, result.metrics_error, result.error_reason or "other")
            return
        sample = result.sample
        if sample is None:
            if result.metrics_text is None:
                return
            try:
                sample = parse_metrics(result.metrics_text, key[0])
            except MetricsPageInvalid as e:
                error = page_error(e)
                self._scrape_failed(sig, error.text, error.reason)
                return
        sig.scrape_error = sig.scrape_error_reason = None
        now -= max(0.0, result.age_s)
        if sig.sample_at is not None and now <= sig.sample_at:
            return  # not newer than what is held (a source that answers with the same sample)
        delta = derive(sig.sample, sample)
        sig.completed_total += max(0.0, delta.completed)
        self._learn_throughput(sig, sample, delta.completed, now)
        if delta.mean_latency_s is not None:
            sig.latency_s = _ewma(sig.latency_s, delta.mean_latency_s)
        tokens = delta if sig.token_base is None else derive(sig.token_base, sample)
        if tokens.mean_token_latency_s is not None:
            sig.token_latency_s = _ewma(sig.token_latency_s, tokens.mean_token_latency_s)
        if not tokens.token_latency_pending:
            sig.token_base = None
        elif sig.token_base is None:
            sig.token_base = sig.sample
        if delta.prefill_s_per_token is not None:
            sig.prefill_s_per_token = _ewma(sig.prefill_s_per_token, delta.prefill_s_per_token)
        if delta.decode_s_per_request is not None:
            sig.decode_s_per_request = _ewma(sig.decode_s_per_request, delta.decode_s_per_request)
        if delta.error_rate is not None:
            sig.error_rate = _ewma(sig.error_rate, delta.error_rate) or 0.0
            sig.error_rate_read = True
        if sample.waiting and sample.running:
            # Requests wait only when every slot is taken: what runs then is its slot count.
            sig.slots = max(sig.slots or 0.0, sample.running)
        sig.sample = sample
        sig.sample_at = now
        sig.last_error = None

    @staticmethod
    def _scrape_failed(sig: EndpointSignals, error: str, reason: str) -> None:
        sig.scrape_errors += 1
        sig.scrape_errors_by_reason[reason] = sig.scrape_errors_by_reason.get(reason, 0) + 1
        sig.scrape_error, sig.scrape_error_reason = error, reason
        sig.last_error = error

    @staticmethod
    def _learn_throughput(sig: EndpointSignals, sample: ServerSample, completed: float, now: float) -> None:
        """Learn what the server can do from what it did while busy: completions per second per
        running request (1 / service time) times the most requests it has been seen running
        (its slots, once it has been full). Only intervals with at least one request running
        throughout count, so an idle server's low throughput is not mistaken for low capacity."""
        prev = sig.sample
        if prev is None or sig.sample_at is None or prev.running is None or sample.running is None:
            return
        dt = now - sig.sample_at
        # The peak fades (half-life PEAK_HALF_LIFE_S) unless seen again: a server's slots are
        # seen again whenever it is full, and one spike (a bug, or a lie) must not scale its
        # learnt throughput for ever.
        # It also grows at most twofold per sample (or to PEAK_GROWTH_FLOOR), so a spike of a
        # few samples moves it a few doublings, while a real server's slots are learnt within
        # seconds.
        faded = sig.peak_running * 0.5 ** (max(0.0, dt) / PEAK_HALF_LIFE_S)
        seen = min(max(sample.running, prev.running), max(2.0 * sig.peak_running, PEAK_GROWTH_FLOOR))
        sig.peak_running = max(faded, seen)
        busy = min(prev.running, sample.running)
        if dt <= 0 or busy < 1 or completed <= 0:
            return
        rate = completed / (dt * (prev.running + sample.running) / 2)
        sig.throughput = _ewma(sig.throughput, rate * sig.peak_running, alpha=0.2)

    def completed(self, key: EndpointKey) -> float:
        """Requests the endpoint has finished since the control plane started: by its own
        counters once scraped, else by the proxies' load reports (never both: no double count)."""
        sig = self.endpoints.get(key)
        if sig is None:
            return 0.0
        if sig.sample is not None:
            return sig.completed_total
        return sig.lrs_ok_total + sig.lrs_failed_total

    def sample(self, key: EndpointKey) -> ServerSample | None:
        """The endpoint's newest sample (its TTFT/TPOT histograms: None when a collector found
        them unchanged since its previous record)."""
        sig = self.endpoints.get(key)
        return sig.sample if sig is not None else None

    def slots(self, key: EndpointKey) -> float | None:
        """How many requests the endpoint runs at once, once seen full (requests waiting)."""
        sig = self.endpoints.get(key)
        return sig.slots if sig is not None else None

    def learnt_throughput(self, key: EndpointKey) -> float | None:
        """Requests/s the endpoint has shown it can complete at its peak concurrency, if learnt."""
        sig = self.endpoints.get(key)
        return sig.throughput if sig is not None else None

    def _record_health(self, sig: EndpointSignals, result: ScrapeResult, now: float) -> None:
        answered = result.reached
        if result.health_status is not None or result.health_error is not None:
            sig.health_probed = True
        if answered is None:
            if result.health_status is None and result.health_error is None:
                return  # nothing about reachability (probes off, or Prometheus without health)
            answered = result.health_status is not None
        if not answered and result.serving_refused and not sig.seen_ready:
            # Never seen ready, and its serving port refuses: it is not up yet (a vLLM
            # loading), and the proxies' connections would be refused too. Not ready, in sight.
            sig.unreachable = 0
            sig.out_of_sight_since = None
            sig.ready = False
            sig.ready_since = None
            why = result.health_error or result.metrics_error
            sig.last_error = f"not serving yet (never seen ready): {why}"
            return
        if answered:
            sig.unreachable = 0
            sig.out_of_sight_since = None
        else:
            sig.unreachable += 1
            sig.last_error = f"no answer: {result.health_error or result.metrics_error}"
            if sig.unreachable >= UNREACHABLE_AFTER and sig.out_of_sight_since is None:
                sig.out_of_sight_since = now
        if result.health_status is None:
            return  # no verdict from the server: the last one stands
        was = sig.ready
        ready = 200 <= result.health_status < 300 or result.health_status == 404
        sig.ready = ready
        sig.seen_ready = sig.seen_ready or ready
        if ready and was is False:
            sig.ready_since = now
        elif not ready:
            sig.ready_since = None
            sig.last_error = f"health check answered {result.health_status}"

    def heard(self, key: EndpointKey) -> bool:
        """Whether the probes have had any answer from the endpoint (a health verdict or a
        metrics page)."""
        sig = self.endpoints.get(key)
        return sig is not None and (sig.ready is not None or sig.sample_at is not None)

    def seen_ready(self, key: EndpointKey) -> bool:
        """Whether the server has been seen ready: a ready health answer at least once, or,
        for a server whose health is not probed (health off, the Prometheus source), a page
        read. A page read while the health probe goes unanswered is not enough: a server
        loading its model may serve /metrics before its API (a separate metrics port, the
        emulator), and its health probe may time out on a loaded machine."""
        sig = self.endpoints.get(key)
        if sig is None:
            return False
        if sig.health_probed:
            return sig.seen_ready
        return sig.seen_ready or sig.sample_at is not None

    def out_of_sight(self, key: EndpointKey) -> bool:
        """Whether the endpoint's probes have gone unanswered UNREACHABLE_AFTER times in a row."""
        sig = self.endpoints.get(key)
        return sig is not None and sig.out_of_sight_since is not None

    def record_lrs(
        self,
        key: EndpointKey,
        node: str,
        *,
        in_progress: float,
        issued: float,
        succeeded: float,
        failed: float,
        now: float,
    ) -> None:
        """One proxy's load report for one endpoint (counts are for the report interval)."""
        sig = self._get(key)
        sig.lrs[node] = _LrsEntry(in_progress, issued, succeeded, failed, now)
        sig.lrs_ok_total += succeeded
        sig.lrs_failed_total += failed

    def counters(self, key: EndpointKey) -> EndpointCounters:
        """The endpoint's cumulative counts now (zeros for one never seen)."""
        sig = self.endpoints.get(key)
        if sig is None:
            return EndpointCounters()
        s = sig.sample
        return EndpointCounters(
            server_ok=(s.successes or 0.0) if s is not None else 0.0,
            server_failed=(s.failures or 0.0) if s is not None else 0.0,
            buckets=s.latency_buckets if s is not None else (),
            lrs_ok=sig.lrs_ok_total,
            lrs_failed=sig.lrs_failed_total,
            dialect=s.dialect if s is not None else None,
            # TGI and Triton count failures even before the page has the counter (TGI's
            # appears with the first failure). vLLM's finished_reason="error" counts only
            # requests that failed inside the engine, not those answered 500 before (a
            # crash, a refused body, an emulated fault): a failing canary can still go
            # unseen, so it is not a failure count the rollout may rely on.
            server_counts_failures=s is not None
            and s.dialect != "vllm"
            and (s.failures is not None or s.dialect in ("tgi", "triton")),
            lrs_reported_at=max((e.at for e in sig.lrs.values()), default=None),
        )

    def forget_node(self, node: str) -> None:
        """A proxy's LRS stream ended: its in-flight counts no longer hold."""
        for sig in self.endpoints.values():
            sig.lrs.pop(node, None)

    def lrs_totals(self, key: EndpointKey, now: float) -> tuple[float, float, float, float]:
        """(in progress, issued, succeeded, failed) summed over proxies with recent reports."""
        sig = self.endpoints.get(key)
        if sig is None:
            return (0.0, 0.0, 0.0, 0.0)
        live = [e for e in sig.lrs.values() if now - e.at <= LRS_MAX_AGE_S]
        return (
            sum(e.in_progress for e in live),
            sum(e.issued for e in live),
            sum(e.succeeded for e in live),
            sum(e.failed for e in live),
        )

    def load(self, key: EndpointKey, capacity: float, now: float) -> EndpointLoad:
        """The endpoint's load as the policies see it; a figure never read is None."""
        sig = self.endpoints.get(key) or EndpointSignals()
        in_progress, _, ok, failed = self.lrs_totals(key, now)
        s = sig.sample
        reported = any(now - e.at <= LRS_MAX_AGE_S for e in sig.lrs.values())
        running = s.running if s is not None and s.running is not None else in_progress if reported else None
        rates = [sig.error_rate] if sig.error_rate_read else []
        if ok + failed:
            rates.append(failed / (ok + failed))
        ready_for = math.inf if sig.ready_since is None else max(0.0, now - sig.ready_since)
        return EndpointLoad(
            address=key[1],
            ready=sig.ready is not False,
            running=running,
            waiting=s.waiting if s is not None else None,
            kv_use=s.kv_use if s is not None else None,
            latency_s=sig.latency_s,
            token_latency_s=sig.token_latency_s,
            prefill_s_per_token=sig.prefill_s_per_token,
            decode_s_per_request=sig.decode_s_per_request,
            error_rate=max(rates, default=None),
            age_s=math.inf if sig.sample_at is None else max(0.0, now - sig.sample_at),
            capacity=capacity,
            ready_for_s=ready_for,
            in_sight=sig.out_of_sight_since is None,
            lora_running=s.lora_running if s is not None else None,
            lora_waiting=s.lora_waiting if s is not None else None,
            max_lora=s.max_lora if s is not None else None,
        )


def _ewma(old: float | None, new: float, alpha: float = EWMA_ALPHA) -> float:
    return new if old is None else old + alpha * (new - old)
