"""docs/quotas.md shows what the rate-limit service sends: its 429 body is the one
`error_body()` makes, byte for byte, so the page cannot drift from the code."""

from __future__ import annotations

import json
import re
from pathlib import Path

from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2

from controlplane.fleet.model import QuotaLimit, QuotaSpec
from controlplane.quota.limiter import decision, needed
from controlplane.quota.service import RateLimitService, error_body
from controlplane.routing.quotas import DOMAIN

DOC = Path(__file__).resolve().parents[2] / "docs" / "quotas.md"


def documented_body() -> str:
    """The one JSON block of the page with an error body in it (its example 429)."""
    blocks: list[str] = re.findall(r"```json\n(.*?)```", DOC.read_text(), flags=re.S)
    bodies = [b.strip() for b in blocks if '"rate_limit_exceeded"' in b]
    assert len(bodies) == 1, bodies
    return bodies[0]


def test_the_documented_429_body_is_what_error_body_sends() -> None:
    """The page's example: a tenant allowed 6 requests a minute on `chat`, refused its seventh
    in a burst (its bucket at 0)."""
    body = documented_body()
    refused = decision("requests", 6, 0.0, False, needed("requests", 1))
    assert body == error_body("chat", refused)
    # And the service sends exactly that, for the same burst.
    service = RateLimitService(
        QuotaSpec(default=QuotaLimit(requests_per_minute=6), endpoints=(("127.0.0.1", 1),))
    )
    d = ratelimit_pb2.RateLimitDescriptor()
    d.entries.add(key="model", value="chat")
    d.entries.add(key="tenant", value="acme")
    request = rls_pb2.RateLimitRequest(domain=DOMAIN, descriptors=[d])
    answers = [service.decide(request, now=100.0) for _ in range(7)]
    assert [a.overall_code for a in answers] == [rls_pb2.RateLimitResponse.OK] * 6 + [
        rls_pb2.RateLimitResponse.OVER_LIMIT
    ]
    assert answers[-1].raw_body.decode() == body
    assert json.loads(body)["error"]["code"] == "rate_limit_exceeded"
