"""Which limit applies (issue 41, item 12): the most specific level that sets one, kind by
kind, so a model's default wins over a tenant's own limit even when the tenant's is tighter.
docs/quotas.md says so plainly, with an example on the README's fleet; this checks that
example against the code, from the page's own snippet and deploy/fleet.yaml."""

from __future__ import annotations

import re
from pathlib import Path

from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2

from controlplane.fleet import parse_fleet
from controlplane.fleet.model import Fleet
from controlplane.quota.service import RateLimitService

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "quotas.md"


def documented_fleet() -> Fleet:
    """deploy/fleet.yaml with the quotas the page's walkthrough appends to it."""
    (snippet,) = re.findall(
        r"cat >> deploy/fleet\.yaml <<'EOF'\n(.*?)^EOF$", DOC.read_text(), flags=re.S | re.M
    )
    return parse_fleet((ROOT / "deploy" / "fleet.yaml").read_text() + snippet)


def test_the_pages_example_fits_the_readmes_fleet_and_says_what_the_code_does() -> None:
    fleet = documented_fleet()
    q = fleet.quotas
    assert q is not None and {m.name for m in fleet.models} >= set(q.models)
    rpm, tpm = "requests_per_minute", "tokens_per_minute"
    assert q.limit("globex", "llama-3-8b", rpm) == 120  # the model's default, over globex's own 100
    assert q.limit("globex", "qwen-2.5-72b", rpm) == 100  # its own, where the model sets none
    assert q.limit("acme", "llama-3-8b", rpm) == 10  # the model's entry for the tenant
    assert q.limit("acme", "llama-3-8b", tpm) == 2000  # kind by kind: the tenant's own tokens
    assert q.limit("acme", "qwen-2.5-72b", rpm) == 600  # acme sets no requests: the default
    assert q.limit("", "llama-3-8b", tpm) == 200_000
    text = " ".join(DOC.read_text().split())
    assert "even when the tenant's is tighter" in text and "x-ratelimit-limit-requests: 120" in text


def test_the_service_answers_globex_with_the_models_default() -> None:
    fleet = documented_fleet()
    assert fleet.quotas is not None
    service = RateLimitService(fleet.quotas)
    d = ratelimit_pb2.RateLimitDescriptor()
    d.entries.add(key="model", value="llama-3-8b")
    d.entries.add(key="tenant", value="globex")
    answer = service.decide(rls_pb2.RateLimitRequest(domain="inference", descriptors=[d]), now=1.0)
    assert {h.key: h.value for h in answer.response_headers_to_add}["x-ratelimit-limit-requests"] == "120"
