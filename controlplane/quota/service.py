"""The rate-limit service (thin I/O shell around quota/limiter.py): Envoy's
`envoy.service.ratelimit.v3.RateLimitService`, which every proxy's rate-limit filter asks
before each request of a model, and again when its response ends to charge its tokens
(routing/quotas.py gives it the descriptors: the model, then the tenant when the key header
is sent, and what kind of call it is).

Counters are in this process's memory: one service counts for every proxy that asks it. The
fleet file is read at start and again whenever it changes (a bad edit keeps the last good
quotas, logged). Answers: OK or OVER_LIMIT with the x-ratelimit-* headers for either, and over
the limit `retry-after` and an OpenAI-style error body, which Envoy sends with its 429.
A descriptor this service cannot read (another domain, no model) is OK: never a refusal of
its making. Metrics on --metrics-listen (docs/metrics.md#quotas).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import grpc
import structlog
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

from controlplane.fleet import FleetConfigInvalid, load_fleet
from controlplane.fleet.errors import ConfigError
from controlplane.fleet.model import QuotaSpec
from controlplane.obs.outage import Outage
from controlplane.process.side_service import serve_until_signalled
from controlplane.quota.limiter import KINDS, Decision, Limiter, decision, needed
from controlplane.quota.redis_store import RedisStore, RedisUnavailable
from controlplane.routing.quotas import (
    BEARER_KEY,
    DOMAIN,
    KIND_KEY,
    MAX_TOKENS_KEY,
    MODEL_KEY,
    PROMPT_BYTES_KEY,
    REFUSED_KEY,
    TENANT_KEY,
    USAGE_KEY,
)

log = structlog.get_logger("controlplane.quota")

RELOAD_EVERY_S = 2.0
MAX_TENANT_BYTES = 256  # a longer key value is not a tenant name: it is counted as one tenant, "invalid"
OTHER = "other"  # the tenant label of every tenant the fleet file does not name
STATUS_SERVICE = "controlplane.quota.v1.Quotas"  # cpctl quota status: JSON in and out


class QuotaMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.decisions = Counter(
            "controlplane_quota_decisions",
            "Rate-limit decisions by model, tenant (those the fleet names; the rest are 'other') "
            "and result: ok, over_limit, unlimited (no limit applies) for requests; tokens_ok, "
            "tokens_over_limit, tokens_unlimited for the token check; unreadable (a descriptor "
            "without a model: allowed)",
            ["model", "tenant", "result"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "controlplane_quota_tokens",
            "Tokens charged to tenants' quotas when responses ended, by model, tenant and how "
            "they were known: usage (the server's usage.total_tokens) or estimate (none, or one "
            "not a sane number: the request's bytes / 4 plus its max_tokens)",
            ["model", "tenant", "how"],
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


class RateLimitService(rls_pb2_grpc.RateLimitServiceServicer):  # type: ignore[misc]
    def __init__(
        self, spec: QuotaSpec, metrics: QuotaMetrics | None = None, store: RedisStore | None = None
    ) -> None:
        self.limiter = Limiter(spec)  # the quotas, and the buckets when store is None
        self.metrics = metrics or QuotaMetrics()
        self.store = store  # Redis: buckets shared by every service using it
        self.token: str | None = None  # the bearer token cpctl quota status must send
        self._store_outage = Outage(
            log,
            "redis unreachable; requests served without a limit",
            "redis reachable again",
            error_chars=300,
        )

    def set_spec(self, spec: QuotaSpec) -> None:
        """New quotas; the buckets in use stay (each refills to its new limit)."""
        self.limiter.spec = spec

    async def ShouldRateLimit(
        self, request: rls_pb2.RateLimitRequest, context: Any
    ) -> rls_pb2.RateLimitResponse:
        t0 = time.perf_counter()
        try:
            return await self.decide_async(request, time.monotonic())
        finally:
            self.metrics.decision_time.observe(time.perf_counter() - t0)

    def decide(self, request: rls_pb2.RateLimitRequest, now: float) -> rls_pb2.RateLimitResponse:
        """decide_async, outside an event loop (in memory only: the tests, the benchmark)."""
        assert self.store is None
        return asyncio.run(self.decide_async(request, now))

    async def _check(self, tenant: str, model: str, now: float, hits: int, kind: str) -> Decision:
        if self.store is None:
            return self.limiter.check(tenant, model, now, hits=hits, kind=kind)
        limit = self.limiter.spec.limit(tenant, model, KINDS[kind])
        if limit is None:
            return Decision(True, None, kind=kind)
        mode = "take" if kind == "requests" else "peek"
        try:
            allowed, level = await self.store.apply(kind, model, tenant, limit, hits, mode)
        except RedisUnavailable as e:
            self._store_failed(e)
            return Decision(True, None, kind=kind)  # fail open: no limit known, none applied
        self._store_ok()
        return decision(kind, limit, level, allowed, needed(kind, hits))

    async def _charge(self, tenant: str, model: str, tokens: int, now: float) -> None:
        if self.store is None:
            self.limiter.charge(tenant, model, tokens, now)
            return
        limit = self.limiter.spec.limit(tenant, model, "tokens_per_minute")
        if limit is None:
            return
        try:
            await self.store.apply("tokens", model, tenant, limit, tokens, "charge")
        except RedisUnavailable as e:
            self._store_failed(e)
        else:
            self._store_ok()

    # ---- status (cpctl quota status) ---------------------------------------------------------

    async def status(self, tenant: str | None, now: float) -> list[dict[str, Any]]:
        """Every bucket in use (or one tenant's): its limit, what is left, when it is whole."""
        rows = []
        if self.store is None:
            keys = [(k, m, t) for (t, m, k) in self.limiter.buckets if tenant is None or t == tenant]
        else:
            keys = await self.store.buckets(tenant)
        for kind, model, who in sorted(keys):
            limit = self.limiter.spec.limit(who, model, KINDS.get(kind, ""))
            if limit is None:
                continue
            if self.store is None:
                got = self.limiter.use(who, model, now, kind=kind)
                assert got is not None
                level = float(got[0])
            else:
                _, level = await self.store.apply(kind, model, who, limit, 0, "read")
            d = decision(kind, limit, level, level > 0, needed(kind, 1))
            rows.append(
                {"tenant": who, "model": model, "kind": kind, "limit_per_minute": limit,
                 "remaining": d.remaining, "reset_seconds": round(d.reset_s, 3)}
            )  # fmt: skip
        return rows

    async def _status_rpc(self, request: bytes, context: Any) -> bytes:
        """STATUS_METHOD: JSON {"tenant": "..."} in, {"buckets": [...]} out; needs the token."""
        import hmac

        given = dict(context.invocation_metadata()).get("authorization", "")
        if self.token is None:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "status needs a token: start controlplane ratelimit with --token-file",
            )
        if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a wrong or missing bearer token")
        try:
            asked = json.loads(request or b"{}")
            tenant = asked.get("tenant") if isinstance(asked, dict) else None
        except ValueError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the request is not JSON")
        if tenant is not None and not isinstance(tenant, str):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "tenant: expected a string")
        try:
            rows = await self.status(tenant or None, time.monotonic())
        except RedisUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"Redis: {e}")
        return json.dumps({"buckets": rows}).encode()

    def status_handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            STATUS_SERVICE, {"Status": grpc.unary_unary_rpc_method_handler(self._status_rpc)}
        )

    def _store_ok(self) -> None:
        self.metrics.store_ops.labels("ok").inc()
        self._store_outage.ok()

    def _store_failed(self, e: Exception) -> None:
        self.metrics.store_ops.labels("error").inc()
        self._store_outage.failed(e)

    async def decide_async(self, request: rls_pb2.RateLimitRequest, now: float) -> rls_pb2.RateLimitResponse:
        statuses = []
        decisions: list[Decision] = []
        model = ""
        for descriptor in request.descriptors:
            entries = {e.key: e.value for e in descriptor.entries}
            model = entries.get(MODEL_KEY, "") or model
            ok = rls_pb2.RateLimitResponse.DescriptorStatus(code=rls_pb2.RateLimitResponse.OK)
            if request.domain != DOMAIN or not entries.get(MODEL_KEY):
                self.metrics.decisions.labels(entries.get(MODEL_KEY, ""), "", "unreadable").inc()
                statuses.append(ok)
                continue
            tenant = entries.get(TENANT_KEY, "")
            if BEARER_KEY in entries:
                tenant = bearer_tenant(entries[BEARER_KEY])
            if len(tenant.encode()) > MAX_TENANT_BYTES:
                tenant = "invalid"
            label = tenant if tenant in self.limiter.spec.tenants else OTHER
            kind = entries.get(KIND_KEY, "requests")
            if kind == "charge":  # the response ended: its tokens (Envoy ignores this answer)
                if entries.get(REFUSED_KEY) == "yes":  # our own 429: no tokens were used
                    statuses.append(ok)
                    continue
                tokens, how = charged_tokens(entries)
                await self._charge(tenant, entries[MODEL_KEY], tokens, now)
                self.metrics.tokens.labels(entries[MODEL_KEY], label, how).inc(tokens)
                statuses.append(ok)
                continue
            if kind not in KINDS:
                self.metrics.decisions.labels(entries[MODEL_KEY], label, "unreadable").inc()
                statuses.append(ok)
                continue
            hits = descriptor.hits_addend.value if descriptor.HasField("hits_addend") else request.hits_addend
            got = await self._check(tenant, entries[MODEL_KEY], now, max(1, hits), kind)
            result = "unlimited" if got.limit is None else "ok" if got.allowed else "over_limit"
            self.metrics.decisions.labels(
                entries[MODEL_KEY], label, result if kind == "requests" else f"tokens_{result}"
            ).inc()
            code = rls_pb2.RateLimitResponse.OK if got.allowed else rls_pb2.RateLimitResponse.OVER_LIMIT
            statuses.append(rls_pb2.RateLimitResponse.DescriptorStatus(code=code))
            if got.limit is not None:
                decisions.append(got)
        refused = [d for d in decisions if not d.allowed]
        response = rls_pb2.RateLimitResponse(
            overall_code=rls_pb2.RateLimitResponse.OVER_LIMIT if refused else rls_pb2.RateLimitResponse.OK,
            statuses=statuses,
        )
        headers: dict[str, str] = {}
        for d in decisions:
            for key, value in d.headers().items():
                if key == "retry-after" and key in headers:
                    value = str(max(int(value), int(headers[key])))
                headers[key] = value
        for key, value in headers.items():
            response.response_headers_to_add.add(key=key, value=value)
        if refused:
            response.dynamic_metadata.fields[REFUSED_KEY].string_value = "yes"
            response.raw_body = error_body(model, refused[0]).encode()
            response.response_headers_to_add.add(key="content-type", value="application/json")
        return response


def bearer_tenant(authorization: str) -> str:
    """The tenant of a request by its bearer token (quotas.key.bearer): key-<the first 16 hex
    digits of the token's SHA-256>, what `printf %s "$TOKEN" | sha256sum | cut -c1-16` prints
    after "key-". An Authorization header that is not a bearer token is the tenant "" (the
    default limits)."""
    import hashlib

    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return ""
    return "key-" + hashlib.sha256(token.strip().encode()).hexdigest()[:16]


MAX_USAGE = 10_000_000  # tokens one response may report; more is not a usage, it is a bug
DEFAULT_OUTPUT_ESTIMATE = 256  # output tokens charged when neither usage nor max_tokens says


def charged_tokens(entries: dict[str, str]) -> tuple[int, str]:
    """The tokens a response costs: its `usage.total_tokens` when the server sent a sane one
    (a whole number, 0 to MAX_USAGE), else an estimate: the request's bytes / 4 for the prompt
    plus its max_tokens (else DEFAULT_OUTPUT_ESTIMATE) for the output. Never free: a usage that
    is negative, absurd or not a number is estimated too. (tokens, "usage" or "estimate")."""
    raw = entries.get(USAGE_KEY, "").strip()
    try:
        usage = int(float(raw)) if raw else -1
    except ValueError:
        usage = -1
    if 0 <= usage <= MAX_USAGE:
        return usage, "usage"
    try:
        prompt = int(entries.get(PROMPT_BYTES_KEY, "0") or 0) // 4
    except ValueError:
        prompt = 0
    try:
        output = int(float(entries.get(MAX_TOKENS_KEY, "") or DEFAULT_OUTPUT_ESTIMATE))
    except ValueError:
        output = DEFAULT_OUTPUT_ESTIMATE
    return max(1, min(MAX_USAGE, max(0, prompt) + max(0, min(output, MAX_USAGE)))), "estimate"


def error_body(model: str, d: Decision) -> str:
    """OpenAI's 429 error, as its SDK parses it; `type` is what ran out: requests or tokens."""
    return json.dumps(
        {
            "error": {
                "message": (
                    f"Rate limit reached for {d.kind} on {model}: limit {d.limit} per minute, "
                    f"{d.remaining} left. Please try again in {d.headers().get('retry-after', '1')}s."
                ),
                "type": d.kind,
                "param": None,
                "code": "rate_limit_exceeded",
            }
        }
    )


async def serve(
    config: Path,
    listen: str,
    metrics_listen: str | None = None,
    store_url: str = "memory",
    token: str | None = None,
) -> None:
    """Run the service until SIGINT or SIGTERM; buckets in memory, or on Redis
    (`redis://HOST:PORT[/DB]`), shared with every other service using it."""
    fleet = load_fleet(config)
    if fleet.quotas is None:
        raise FleetConfigInvalid(
            [ConfigError(str(config), "quotas", "missing: this service counts the fleet's quotas")]
        )
    metrics = QuotaMetrics()
    store = None if store_url == "memory" else RedisStore(store_url)
    service = RateLimitService(fleet.quotas, metrics, store)
    service.token = token
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    rls_pb2_grpc.add_RateLimitServiceServicer_to_server(service, server)
    server.add_generic_rpc_handlers((service.status_handler(),))

    async def reload() -> None:
        seen = os.stat(config).st_mtime_ns
        while True:
            await asyncio.sleep(RELOAD_EVERY_S)
            try:
                mtime = os.stat(config).st_mtime_ns
                if mtime == seen:
                    continue
                seen = mtime
                new = load_fleet(config)
                if new.quotas is None:
                    raise FleetConfigInvalid(
                        [ConfigError(str(config), "quotas", "removed; the last quotas stay")]
                    )
            except (OSError, FleetConfigInvalid) as e:
                metrics.reloads.labels("error").inc()
                log.warning("quotas not reloaded; the last good ones stay", error=str(e)[:500])
                continue
            service.set_spec(new.quotas)
            metrics.reloads.labels("ok").inc()
            log.info("quotas reloaded")

    def started() -> None:
        log.info(
            "rate-limit service listening",
            listen=listen,
            config=str(config),
            metrics=metrics_listen,
            store=store_url,
        )

    try:
        await serve_until_signalled(server, listen, metrics_listen, metrics.registry, [reload()], started)
    finally:
        if store is not None:
            await store.close()
