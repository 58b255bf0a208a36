"""The rate-limit service (thin I/O shell around quota/limiter.py): Envoy's
`envoy.service.ratelimit.v3.RateLimitService`, which every proxy's rate-limit filter asks
before each request of a model, and again when its response ends to charge its tokens
(routing/quotas.py gives it the descriptors: the model, then the tenant when the key header
is sent, and what kind of call it is); and `controlplane.v1.QuotaService` for `cpctl quota
status` (quota/status.py).

Counters are in this process's memory (bounded: quota/limiter.py), or on Redis. The fleet
file is watched as the control plane watches it (fleet/watch.py: an edit that removes a
limit waits until the file holds still; a bad edit keeps the last good quotas, logged).
Answers: OK or OVER_LIMIT with the x-ratelimit-* headers for either, and over the limit
`retry-after` and an OpenAI-style error body, which Envoy sends with its 429. A descriptor
this service cannot read (another domain, no model) is OK: never a refusal of its making.
A descriptor with an adapter (routing/quotas.py, on the routes that take adapters' names) is
checked against the adapter's own limits when quotas.models names it, and is OK otherwise
(the base model's descriptor in the same call decides); a request with both takes from
neither bucket unless both have room.
Every name it keeps or labels is bounded (limiter.bounded_name); metric labels are names the
fleet file has, else `other`. Metrics on --metrics-listen (docs/metrics.md#quotas).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grpc
import structlog
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from controlplane.fleet import FleetConfigInvalid
from controlplane.fleet.errors import ConfigError
from controlplane.fleet.model import Fleet, QuotaSpec
from controlplane.fleet.watch import FleetFileWatcher
from controlplane.net.tls import SIDE_FLAGS, ServerTls, server_credentials
from controlplane.obs.outage import Outage
from controlplane.process.side_service import serve_until_signalled
from controlplane.quota.charge import charged_tokens
from controlplane.quota.limiter import INVALID, KINDS, Decision, Limiter, bounded_name, decision, needed
from controlplane.quota.redis_store import RedisStore, RedisUnavailable
from controlplane.quota.status import QuotaStatus
from controlplane.routing.quotas import (
    ADAPTER_KEY,
    BEARER_KEY,
    DOMAIN,
    KIND_KEY,
    MODEL_KEY,
    REFUSED_KEY,
    TENANT_KEY,
    limited_adapters,
)
from controlplane.v1 import quota_pb2_grpc

log = structlog.get_logger("controlplane.quota")

OTHER = "other"  # the label of every model or tenant the fleet file does not name
MAX_DESCRIPTORS = 64  # per call; Envoy sends one to four. The rest are answered OK, unread
MAX_MESSAGE_BYTES = 1 << 20  # a call larger than this is refused by gRPC before it is read
STATUS_SERVICE = "controlplane.v1.QuotaService"


class QuotaMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.decisions = Counter(
            "controlplane_quota_decisions",
            "Rate-limit decisions by model and tenant (those the fleet file names; the rest are "
            "'other') and result: ok, over_limit, unlimited (no limit applies), crowded (no room "
            "for a new tenant's bucket: refused) for requests; tokens_ok, tokens_over_limit, "
            "tokens_unlimited, tokens_crowded for the token check; unreadable (not ours to read: "
            "another domain, no model, past the descriptors a call may carry: allowed)",
            ["model", "tenant", "result"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "controlplane_quota_tokens",
            "Tokens charged to tenants' quotas when responses ended, by model, tenant and how "
            "they were known: usage (the server's usage.total_tokens, a JSON answer's or a "
            "stream's usage event's) or estimate (none, or one not a sane number: the request's "
            "bytes / 4 plus its largest output limit times its completions)",
            ["model", "tenant", "how"],
            registry=self.registry,
        )
        self.charges_dropped = Counter(
            "controlplane_quota_charges_dropped",
            "Charges not recorded: no room for the token bucket (the memory store full of "
            "buckets that are not full)",
            registry=self.registry,
        )
        self.names_capped = Counter(
            "controlplane_quota_names_capped",
            "Model names and tenants longer than 256 bytes, each counted as the one name "
            "'invalid', by field (model, tenant)",
            ["field"],
            registry=self.registry,
        )
        self.buckets = Gauge(
            "controlplane_quota_buckets",
            "Buckets held in memory (--store memory), at most 100,000",
            registry=self.registry,
        )
        self.bucket_bytes = Gauge(
            "controlplane_quota_bucket_bytes",
            "Bytes the buckets in memory are counted for, at most 64 MiB",
            registry=self.registry,
        )
        self.evictions = Counter(
            "controlplane_quota_bucket_evictions",
            "Buckets dropped to make room for another, each full at the time (no allowance lost)",
            registry=self.registry,
        )
        self.decision_time = Histogram(
            "controlplane_quota_decision_seconds",
            "Time to decide one rate-limit request",
            buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01),
            registry=self.registry,
        )
        self.store_ops = Counter(
            "controlplane_quota_store_operations",
            "Bucket operations on Redis (--store redis://...), by result: ok, error (Redis down "
            "or slow: the request is served without a limit, fail open)",
            ["result"],
            registry=self.registry,
        )
        self.reloads = Counter(
            "controlplane_quota_reloads",
            "Reads of the fleet file's quotas by result (ok, error: the last good ones stay)",
            ["result"],
            registry=self.registry,
        )


def _named_tenants(spec: QuotaSpec) -> frozenset[str]:
    names = set(spec.tenants)
    for _, tenants in spec.models.values():
        names.update(tenants)
    return frozenset(names)


class RateLimitService(rls_pb2_grpc.RateLimitServiceServicer):  # type: ignore[misc]
    def __init__(
        self,
        spec: QuotaSpec,
        metrics: QuotaMetrics | None = None,
        store: RedisStore | None = None,
        models: frozenset[str] = frozenset(),
        adapters: Mapping[str, str] | None = None,
    ) -> None:
        # the quotas, and the buckets when store is None
        self.limiter = Limiter(spec, models, dict(adapters or {}))
        self.metrics = metrics or QuotaMetrics()
        self.store = store  # Redis: buckets shared by every service using it
        self.token: str | None = None  # the bearer token cpctl quota status must send
        self._tenants = _named_tenants(spec)
        self._evicted = 0
        self._store_outage = Outage(
            log,
            "redis unreachable; requests served without a limit",
            "redis reachable again",
            error_chars=300,
        )

    def set_spec(
        self, spec: QuotaSpec, models: frozenset[str] | None = None, adapters: Mapping[str, str] | None = None
    ) -> None:
        """New quotas (and the fleet's models, and its adapters with limits of their own, each
        to its base model); the buckets in use stay (each refills to its new limit)."""
        self.limiter.spec = spec
        self._tenants = _named_tenants(spec)
        if models is not None:
            self.limiter.models = models
        if adapters is not None:
            self.limiter.adapters = dict(adapters)

    def set_fleet(self, fleet: Fleet) -> None:
        """The quotas and model names of a fleet; FleetConfigInvalid if it has no quotas (the
        last good ones stay)."""
        if fleet.quotas is None:
            raise FleetConfigInvalid(
                [ConfigError("", "quotas", "removed; this service keeps the last quotas it had")]
            )
        self.set_spec(fleet.quotas, frozenset(m.name for m in fleet.models), limited_adapters(fleet))

    def model_label(self, model: str) -> str:
        """The model's name, or an adapter's with limits of its own; else OTHER (bounded: the
        fleet's names)."""
        return model if model in self.limiter.models or model in self.limiter.adapters else OTHER

    def tenant_label(self, tenant: str) -> str:
        return tenant if tenant in self._tenants else OTHER

    async def ShouldRateLimit(
        self, request: rls_pb2.RateLimitRequest, context: Any
    ) -> rls_pb2.RateLimitResponse:
        t0 = time.perf_counter()
        try:
            return await self.decide_async(request, time.monotonic())
        finally:
            self.metrics.decision_time.observe(time.perf_counter() - t0)
            if self.store is None:
                self._memory_gauges()

    def _memory_gauges(self) -> None:
        limiter = self.limiter
        self.metrics.buckets.set(len(limiter.buckets))
        self.metrics.bucket_bytes.set(limiter.bytes)
        if limiter.evicted != self._evicted:
            self.metrics.evictions.inc(limiter.evicted - self._evicted)
            self._evicted = limiter.evicted

    def decide(self, request: rls_pb2.RateLimitRequest, now: float) -> rls_pb2.RateLimitResponse:
        """decide_async, outside an event loop (in memory only: the tests, the benchmark)."""
        assert self.store is None
        try:
            return asyncio.run(self.decide_async(request, now))
        finally:
            self._memory_gauges()

    async def _check(
        self, tenant: str, model: str, now: float, hits: int, kind: str, take: bool = True
    ) -> Decision:
        """One bucket's answer; `take` false: whether it has room, nothing taken."""
        if self.store is None:
            return self.limiter.check(tenant, model, now, hits=hits, kind=kind, take=take)
        limit = self.limiter.limit(tenant, model, KINDS[kind])
        if limit is None:
            return Decision(True, None, kind=kind)
        mode = "peek" if kind != "requests" else "take" if take else "read"
        try:
            allowed, level = await self.store.apply(kind, model, tenant, limit, hits, mode)
        except RedisUnavailable as e:
            self._store_failed(e)
            return Decision(True, None, kind=kind)  # fail open: no limit known, none applied
        self._store_ok()
        if mode == "read":
            allowed = level >= hits
        return decision(kind, limit, level, allowed, needed(kind, hits))

    async def _charge(self, tenant: str, model: str, tokens: int, now: float) -> None:
        limit = self.limiter.limit(tenant, model, "tokens_per_minute")
        if limit is None:
            return
        if self.store is None:
            if self.limiter.charge(tenant, model, tokens, now) is None:
                self.metrics.charges_dropped.inc()
            return
        try:
            await self.store.apply("tokens", model, tenant, limit, tokens, "charge")
        except RedisUnavailable as e:
            self._store_failed(e)
        else:
            self._store_ok()

    def _store_ok(self) -> None:
        self.metrics.store_ops.labels("ok").inc()
        self._store_outage.ok()

    def _store_failed(self, e: Exception) -> None:
        self.metrics.store_ops.labels("error").inc()
        self._store_outage.failed(e)

    def _name(self, value: str, field: str) -> str:
        name, capped = bounded_name(value)
        if capped:
            self.metrics.names_capped.labels(field).inc()
        return name

    async def decide_async(self, request: rls_pb2.RateLimitRequest, now: float) -> rls_pb2.RateLimitResponse:
        Status = rls_pb2.RateLimitResponse.DescriptorStatus
        ok = Status(code=rls_pb2.RateLimitResponse.OK)
        statuses: list[Any] = []  # a Status each, None for a check decided below
        # (where in statuses, tenant, model, kind, hits, labels) of each check
        checks: list[tuple[int, str, str, str, int, tuple[str, str]]] = []
        for descriptor in request.descriptors[:MAX_DESCRIPTORS]:
            entries = {e.key: e.value for e in descriptor.entries}
            if request.domain != DOMAIN or not entries.get(MODEL_KEY):
                self.metrics.decisions.labels(OTHER, "", "unreadable").inc()
                statuses.append(ok)
                continue
            model = self._name(entries[MODEL_KEY], "model")
            of_adapter = ADAPTER_KEY in entries
            if of_adapter:
                # An adapter's own limits, by its name. One without any (or not this model's)
                # counts as its base model only: the base model's descriptor decides.
                if self.limiter.adapters.get(entries[ADAPTER_KEY]) != model:
                    statuses.append(ok)
                    continue
                model = entries[ADAPTER_KEY]
            tenant = entries.get(TENANT_KEY, "")
            if BEARER_KEY in entries:
                tenant = bearer_tenant(entries[BEARER_KEY])
            tenant = self._name(tenant, "tenant")
            labels = (self.model_label(model), self.tenant_label(tenant))
            kind = entries.get(KIND_KEY, "requests")
            if kind == "charge":  # the response ended: its tokens (Envoy ignores this answer)
                if entries.get(REFUSED_KEY) == "yes":  # our own 429: no tokens were used
                    statuses.append(ok)
                    continue
                tokens, how = charged_tokens(entries)
                await self._charge(tenant, model, tokens, now)
                if not of_adapter:  # each response's tokens counted once, under its base model
                    self.metrics.tokens.labels(*labels, how).inc(tokens)
                statuses.append(ok)
                continue
            if kind not in KINDS:
                self.metrics.decisions.labels(*labels, "unreadable").inc()
                statuses.append(ok)
                continue
            hits = descriptor.hits_addend.value if descriptor.HasField("hits_addend") else request.hits_addend
            checks.append((len(statuses), tenant, model, kind, max(1, hits), labels))
            statuses.append(None)
        # Several request checks (an adapter's and its base model's): a request one of them
        # refuses takes from none of the buckets.
        take = True
        requests = [c for c in checks if c[3] == "requests"]
        if len(requests) > 1:
            for _, tenant, model, kind, hits, _ in requests:
                if not (await self._check(tenant, model, now, hits, kind, take=False)).allowed:
                    take = False
                    break
        decided: list[tuple[str, Decision]] = []
        for where, tenant, model, kind, hits, labels in checks:
            got = await self._check(tenant, model, now, hits, kind, take=take)
            result = (
                "unlimited"
                if got.limit is None
                else "ok"
                if got.allowed
                else "crowded"
                if got.crowded
                else "over_limit"
            )
            self.metrics.decisions.labels(*labels, result if kind == "requests" else f"tokens_{result}").inc()
            code = rls_pb2.RateLimitResponse.OK if got.allowed else rls_pb2.RateLimitResponse.OVER_LIMIT
            statuses[where] = Status(code=code)
            if got.limit is not None:
                decided.append((model, got))
        extra = len(request.descriptors) - MAX_DESCRIPTORS
        if extra > 0:
            self.metrics.decisions.labels(OTHER, "", "unreadable").inc(extra)
            statuses += [ok] * extra
        refused = [(model, d) for model, d in decided if not d.allowed]
        response = rls_pb2.RateLimitResponse(
            overall_code=rls_pb2.RateLimitResponse.OVER_LIMIT if refused else rls_pb2.RateLimitResponse.OK,
            statuses=statuses,
        )
        # Per kind, the headers of the bucket that refused, else of the one with the least left
        # (an adapter's and its base model's); retry-after: the longest wait of those refused.
        shown: dict[str, Decision] = {}
        for _, d in decided:
            seen = shown.get(d.kind)
            if seen is None or (d.allowed, d.remaining) < (seen.allowed, seen.remaining):
                shown[d.kind] = d
        headers: dict[str, str] = {}
        for d in shown.values():
            headers.update((k, v) for k, v in d.headers().items() if k != "retry-after")
        if refused:
            headers["retry-after"] = str(max(int(d.headers()["retry-after"]) for _, d in refused))
        for key, value in headers.items():
            response.response_headers_to_add.add(key=key, value=value)
        if refused:
            response.dynamic_metadata.fields[REFUSED_KEY].string_value = "yes"
            response.raw_body = error_body(*refused[0]).encode()
            response.response_headers_to_add.add(key="content-type", value="application/json")
        return response


def bearer_tenant(authorization: str) -> str:
    """The tenant of a request by its bearer token (quotas.key.bearer): key-<the first 16 hex
    digits of the token's SHA-256>, what `printf %s "$TOKEN" | sha256sum | cut -c1-16` prints
    after "key-". An Authorization header that is not a bearer token is the tenant "" (the
    default limits)."""
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return ""
    return "key-" + hashlib.sha256(token.strip().encode("utf-8", "surrogatepass")).hexdigest()[:16]


def error_body(model: str, d: Decision) -> str:
    """OpenAI's 429 error, as its SDK parses it; `type` is what ran out: requests or tokens.
    Refused for want of room (`crowded`), the message says so."""
    wait = d.headers().get("retry-after", "1")
    if d.crowded:
        message = (
            f"Rate limit reached for {d.kind} on {model}: the rate-limit service holds as many "
            f"tenants as it may, and none of them has its whole allowance. Please try again in {wait}s."
        )
    else:
        message = (
            f"Rate limit reached for {d.kind} on {model}: limit {d.limit} per minute, "
            f"{d.remaining} left. Please try again in {wait}s."
        )
    return json.dumps(
        {"error": {"message": message, "type": d.kind, "param": None, "code": "rate_limit_exceeded"}}
    )


class QuotaReloads:
    """What the fleet file watcher hands the service: each valid fleet's quotas (a fleet
    without quotas is refused: the last good ones stay), and each refused file, counted."""

    def __init__(self, service: RateLimitService, metrics: QuotaMetrics) -> None:
        self.service = service
        self.metrics = metrics

    def fleet(self, fleet: Fleet) -> None:
        try:
            self.service.set_fleet(fleet)
        except FleetConfigInvalid as e:
            self.invalid(e)
            return
        self.metrics.reloads.labels("ok").inc()
        log.info("quotas reloaded")

    def invalid(self, e: FleetConfigInvalid) -> None:
        self.metrics.reloads.labels("error").inc()
        log.warning("quotas not reloaded; the last good ones stay", error=str(e)[:500])


def first_fleet(config: Path) -> tuple[Fleet, FleetFileWatcher]:
    """The fleet file as the service starts on it (FleetConfigInvalid naming every error, or
    naming `quotas` when it has none), and the watcher that follows it from there."""
    seen: list[Fleet | FleetConfigInvalid] = []
    watcher = FleetFileWatcher(config, seen.append, seen.append)
    watcher.check()  # the first read is never held
    got = seen[0]
    if isinstance(got, FleetConfigInvalid):
        raise got
    if got.quotas is None:
        raise FleetConfigInvalid(
            [ConfigError(str(config), "quotas", "missing: this service counts the fleet's quotas")]
        )
    return got, watcher


async def serve(
    config: Path,
    listen: str,
    metrics_listen: str | None = None,
    store_url: str = "memory",
    token: str | None = None,
    tls: ServerTls | None = None,
) -> None:
    """Run the service until SIGINT or SIGTERM; buckets in memory, or on Redis
    (`redis://HOST:PORT[/DB]`), shared with every other service using it. With `tls`, the
    port speaks TLS (mutual TLS with its client CA)."""
    fleet, watcher = first_fleet(config)
    assert fleet.quotas is not None
    credentials = server_credentials(tls, SIDE_FLAGS) if tls is not None else None
    metrics = QuotaMetrics()
    store = None if store_url == "memory" else RedisStore(store_url)
    service = RateLimitService(
        fleet.quotas, metrics, store, frozenset(m.name for m in fleet.models), limited_adapters(fleet)
    )
    service.token = token
    reloads = QuotaReloads(service, metrics)
    watcher.on_fleet, watcher.on_invalid = reloads.fleet, reloads.invalid
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ]
    )
    rls_pb2_grpc.add_RateLimitServiceServicer_to_server(service, server)
    quota_pb2_grpc.add_QuotaServiceServicer_to_server(QuotaStatus(service), server)

    def started() -> None:
        log.info(
            "rate-limit service listening",
            listen=listen,
            config=str(config),
            metrics=metrics_listen,
            store=store_url,
            tls="mutual" if tls is not None and tls.client_ca else "server" if tls is not None else "off",
        )

    try:
        await serve_until_signalled(
            server,
            listen,
            metrics_listen,
            metrics.registry,
            [watcher.run()],
            started,
            credentials=credentials,
        )
    finally:
        if store is not None:
            await store.close()


__all__ = [
    "INVALID",
    "OTHER",
    "STATUS_SERVICE",
    "QuotaMetrics",
    "RateLimitService",
    "bearer_tenant",
    "charged_tokens",
    "serve",
]
