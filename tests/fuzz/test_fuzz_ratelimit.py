"""Minutes of seeded random input against a real `controlplane ratelimit` (issue 41), in
memory: ShouldRateLimit calls with random domains, descriptor counts, entry keys and values of
any size up to megabytes (past the 1 MiB a call may be, now and then), tenants from a space of
millions (eviction pressure on the bounded store), random kinds, usages, output limits and
hits up to 2^32; and status calls with random tenants, page sizes, page tokens and tokens
(right, wrong, none).

Meanwhile probes must keep being answered correctly: a named tenant with room is allowed with
its own limit's headers every PROBE_EVERY_S; a named tenant spent at the start (1 request a
minute) is never allowed more than its refill gives, whatever pressure the fuzz puts on the
store; the status lists the probe's bucket. The service's RSS must stay under
RSS_BOUND_BYTES, and its /metrics page small.

    .venv/bin/pytest -m fuzz tests/fuzz/test_fuzz_ratelimit.py -s   # FUZZ_SECONDS, FUZZ_SEED
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

from controlplane.v1 import quota_pb2, quota_pb2_grpc
from tests.integration.quota_rig import TOKEN, QuotaService

SECONDS = float(os.environ.get("FUZZ_SECONDS", "180"))
SEED = int(os.environ.get("FUZZ_SEED", str(random.SystemRandom().randrange(1 << 32))))
pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(int(SECONDS) + 300)]
WORKERS = 8
PROBE_EVERY_S = 0.5
# The service's memory: its baseline (about 70 MB), the store at its bound (100,000 buckets,
# 64 MiB as counted, about 60 MB as Python holds them), the calls in flight (WORKERS of up to
# 1 MiB, which gRPC and protobuf hold a few times over), and the allocator's slack.
RSS_BOUND_BYTES = 320 << 20
PROBE_LIMIT = 600
POOL = random.Random(0).randbytes(3 << 20).hex()  # characters to slice values from

FLEET = f"""\
listener: {{port: 10000}}
tiers: {{small: {{timeout: 30s}}}}
quotas:
  key: {{header: x-api-key}}
  service: {{endpoints: ['127.0.0.1:18081']}}
  default: {{requests_per_minute: 30, tokens_per_minute: 5000}}
  tenants:
    acme: {{requests_per_minute: 6, tokens_per_minute: 2000}}
  models:
    chat:
      default: {{requests_per_minute: 60}}
      tenants: {{probe: {{requests_per_minute: {PROBE_LIMIT}}}, spent: {{requests_per_minute: 1}}}}
models:
  chat: {{params_b: 8, stable: v1, versions: {{v1: {{endpoints: ['127.0.0.1:9001']}}}}}}
  'llama3:8b': {{params_b: 8, stable: v1, versions: {{v1: {{endpoints: ['127.0.0.1:9002']}}}}}}
"""
KEYS = ["model", "tenant", "bearer", "kind", "usage", "prompt_bytes", "max_tokens", "max_completion_tokens",
        "n", "best_of", "refused", "hits", "", "\x00", "model\x00"]  # fmt: skip
KINDS = ["requests", "tokens", "charge", "", "bogus", "charge\x00"]


def size(rng: random.Random) -> int:
    """Mostly small, sometimes large, now and then megabytes (past the bound on a call)."""
    r = rng.random()
    if r < 0.9:
        return rng.randrange(0, 64)
    if r < 0.99:
        return rng.randrange(64, 20_000)
    return rng.randrange(20_000, int(1.3 * (1 << 20)))


def text(rng: random.Random, n: int) -> str:
    start = rng.randrange(0, max(1, len(POOL) - n))
    chunk = POOL[start : start + n]
    r = rng.random()
    if r < 0.05:
        return chunk[: n // 2] + "\u20ac\x00é:%*?[" * 3
    if r < 0.1:
        return str(rng.choice([-1, 0, 1e400, "nan", "-inf", 2**64, "1e12", "3000.000000"]))
    return chunk


def value(rng: random.Random, key: str) -> str:
    r = rng.random()
    if key == "model" and r < 0.5:
        return rng.choice(["chat", "llama3:8b", "llama3", "invalid", "other", ""])
    if key == "tenant" and r < 0.6:
        # A space of millions: most are new, and the store fills.
        return rng.choice(["acme", "globex", "", "8b:acme"]) if r < 0.1 else f"t{rng.randrange(3_000_000)}"
    if key == "kind" and r < 0.8:
        return rng.choice(KINDS)
    return text(rng, size(rng))


def descriptor(rng: random.Random) -> ratelimit_pb2.RateLimitDescriptor:
    d = ratelimit_pb2.RateLimitDescriptor()
    if rng.random() < 0.9:
        d.entries.add(key="model", value=value(rng, "model"))
    if rng.random() < 0.85:
        d.entries.add(key="tenant", value=value(rng, "tenant"))
    for _ in range(rng.choice([0, 0, 1, 2, 5, 20])):
        key = rng.choice(KEYS) if rng.random() < 0.9 else text(rng, size(rng))
        d.entries.add(key=key, value=value(rng, key))
    if rng.random() < 0.1:
        d.hits_addend.value = rng.choice([0, 1, 2, 1000, 2**32 - 1])
    return d


def flood_call(rng: random.Random) -> rls_pb2.RateLimitRequest:
    """64 new tenants on a model at once, as a flood of made-up keys through Envoy would be:
    the pressure that evicted spent buckets before."""
    kind = rng.choice(["requests", "requests", "tokens", "charge"])
    model = rng.choice(["chat", "llama3:8b"])
    request = rls_pb2.RateLimitRequest(domain="inference")
    for _ in range(64):
        d = request.descriptors.add()
        d.entries.add(key="model", value=model)
        d.entries.add(key="tenant", value=f"t{rng.randrange(3_000_000)}")
        if kind != "requests":
            d.entries.add(key="kind", value=kind)
        if kind == "charge":
            d.entries.add(key="usage", value=str(rng.randrange(0, 100_000)))
    return request


def rate_limit_call(rng: random.Random) -> rls_pb2.RateLimitRequest:
    if rng.random() < 0.25:
        return flood_call(rng)
    domain = "inference" if rng.random() < 0.85 else text(rng, size(rng))
    n = rng.choice([0, 1, 1, 2, 2, 3, 3, 3, 10, 10, 64, 65, 300])
    request = rls_pb2.RateLimitRequest(domain=domain, descriptors=[descriptor(rng) for _ in range(n)])
    if rng.random() < 0.1:
        request.hits_addend = rng.choice([0, 2, 2**32 - 1])
    return request


def status_call(rng: random.Random) -> tuple[quota_pb2.QuotaStatusRequest, str]:
    n = min(size(rng), 8000)  # a header value: printable ASCII, within gRPC's metadata bound
    token = rng.choice([TOKEN, TOKEN, TOKEN, "", "wrong", POOL[:n]])
    page_token = rng.choice(["", "", "", text(rng, size(rng)), "eyJhZnRlciI6IFsxLCAyLCAzXX0="])
    tenant = rng.choice(["", "", "acme", "probe", text(rng, size(rng))])
    return quota_pb2.QuotaStatusRequest(
        tenant=tenant, page_size=rng.choice([0, 1, 10, 1000, 2**32 - 1]), page_token=page_token
    ), token


def headers(response: rls_pb2.RateLimitResponse) -> dict[str, str]:
    return {h.key: h.value for h in response.response_headers_to_add}


def ask(model: str, tenant: str) -> rls_pb2.RateLimitRequest:
    d = ratelimit_pb2.RateLimitDescriptor()
    d.entries.add(key="model", value=model)
    d.entries.add(key="tenant", value=tenant)
    return rls_pb2.RateLimitRequest(domain="inference", descriptors=[d])


def test_random_calls_keep_the_service_bounded_and_correct(tmp_path: Path) -> None:
    print(f"\nFUZZ_SEED={SEED} FUZZ_SECONDS={SECONDS:g}")
    config = tmp_path / "fleet.yaml"
    config.write_text(FLEET)
    service = QuotaService(config, tmp_path).start()
    counts: Counter[str] = Counter()
    peak = [0]
    try:
        asyncio.run(run(service, counts, peak))
        page = service.page(most=1 << 20)
        assert len(page) < 256 << 10, len(page)
        for name in ("controlplane_quota_buckets", "controlplane_quota_bucket_evictions_total"):
            counts[name] = int(service.metric(name))
        counts["crowded"] = int(
            sum(float(line.split()[-1]) for line in page.decode().splitlines() if 'result="crowded"' in line)
        )
        assert service.proc is not None and service.proc.alive(), service.log()[-3000:]
    finally:
        service.stop()
    print(
        f"FUZZ_RESULT: {SECONDS:g} s, {counts['calls']:,} rate-limit calls "
        f"({counts['refused_by_grpc']:,} refused by gRPC as too large), {counts['status']:,} status calls, "
        f"{counts['probes']:,} probes right, {counts['controlplane_quota_buckets']:,} buckets held at "
        f"the end ({counts['controlplane_quota_bucket_evictions_total']:,} full ones evicted, "
        f"{counts['crowded']:,} new tenants refused), peak RSS {peak[0] / (1 << 20):.0f} MB "
        f"(bound {RSS_BOUND_BYTES >> 20} MB), seed {SEED}"
    )
    print(dict(counts))


async def run(service: QuotaService, counts: Counter[str], peak: list[int]) -> None:
    deadline = time.monotonic() + SECONDS
    async with grpc.aio.insecure_channel(
        service.address, options=[("grpc.max_send_message_length", 8 << 20)]
    ) as channel:
        rls = rls_pb2_grpc.RateLimitServiceStub(channel)
        status = quota_pb2_grpc.QuotaServiceStub(channel)
        # The spent tenant: its one request a minute, taken.
        first = await rls.ShouldRateLimit(ask("chat", "spent"), timeout=30)
        assert first.overall_code == rls_pb2.RateLimitResponse.OK
        spent_since = time.monotonic()
        spent_allowed = 0

        async def fuzz(worker: int) -> None:
            rng = random.Random(SEED * 1000 + worker)
            while time.monotonic() < deadline:
                if rng.random() < 0.05:
                    request, token = status_call(rng)
                    metadata = (("authorization", f"Bearer {token}"),) if token else ()
                    try:
                        await status.Status(request, timeout=30, metadata=metadata)
                    except grpc.aio.AioRpcError as e:
                        assert e.code() in (
                            grpc.StatusCode.UNAUTHENTICATED,
                            grpc.StatusCode.INVALID_ARGUMENT,
                            grpc.StatusCode.RESOURCE_EXHAUSTED,
                        ), e
                    counts["status"] += 1
                    continue
                request = rate_limit_call(rng)
                try:
                    answer = await rls.ShouldRateLimit(request, timeout=30)
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e  # over 1 MiB, unread
                    counts["refused_by_grpc"] += 1
                else:
                    assert len(answer.statuses) == len(request.descriptors)
                counts["calls"] += 1

        async def probe() -> None:
            nonlocal spent_allowed
            while time.monotonic() < deadline:
                answer = await rls.ShouldRateLimit(ask("chat", "probe"), timeout=30)
                h = headers(answer)
                assert answer.overall_code == rls_pb2.RateLimitResponse.OK, answer
                assert h["x-ratelimit-limit-requests"] == str(PROBE_LIMIT)
                assert 0 <= int(h["x-ratelimit-remaining-requests"]) < PROBE_LIMIT
                spent = await rls.ShouldRateLimit(ask("chat", "spent"), timeout=30)
                spent_allowed += spent.overall_code == rls_pb2.RateLimitResponse.OK
                # Its refill gives one a minute: a store that dropped its bucket would give more.
                assert spent_allowed <= 1 + (time.monotonic() - spent_since) / 60, spent_allowed
                rows = await status.Status(
                    quota_pb2.QuotaStatusRequest(tenant="probe"),
                    timeout=30,
                    metadata=(("authorization", f"Bearer {TOKEN}"),),
                )
                assert [(b.tenant, b.model, b.limit_per_minute) for b in rows.buckets] == [
                    ("probe", "chat", PROBE_LIMIT)
                ]
                rss = int(service.rss_mb() * (1 << 20))
                peak[0] = max(peak[0], rss)
                assert rss < RSS_BOUND_BYTES, f"RSS {rss >> 20} MB over the bound"
                counts["probes"] += 1
                await asyncio.sleep(PROBE_EVERY_S)

        await asyncio.gather(probe(), *(fuzz(w) for w in range(WORKERS)))
