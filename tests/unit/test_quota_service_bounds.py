"""The rate-limit service's answers to input no proxy sends (issue 41, finding 4; docs/quotas.md
"Hostile input"): names past 256 bytes are the one name `invalid`, counted; metric labels are
names the fleet file has, else `other`; a call reads at most MAX_DESCRIPTORS descriptors; a
crowded store answers OpenAI's 429 saying why. And `controlplane ratelimit`'s flags, checked
before anything starts."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2
from prometheus_client import generate_latest

from controlplane.cli.commands import ratelimit
from controlplane.fleet import parse_fleet
from controlplane.quota.service import MAX_DESCRIPTORS, RateLimitService
from controlplane.routing.quotas import DOMAIN

FLEET = """\
listener: {port: 10000}
tiers: {small: {max_params_b: 20}}
models:
  chat: {params_b: 8, stable: v1, versions: {v1: {endpoints: ['127.0.0.1:9001']}}}
quotas:
  service: {endpoints: ['127.0.0.1:18081']}
  default: {requests_per_minute: 600, tokens_per_minute: 1000}
  tenants: {acme: {requests_per_minute: 6}}
  models: {chat: {tenants: {initech: {requests_per_minute: 2}}}}
"""


def service() -> RateLimitService:
    fleet = parse_fleet(FLEET)
    assert fleet.quotas is not None
    svc = RateLimitService(fleet.quotas)
    svc.set_fleet(fleet)
    return svc


def request(*descriptors: dict[str, str], domain: str = DOMAIN) -> rls_pb2.RateLimitRequest:
    out = rls_pb2.RateLimitRequest(domain=domain)
    for entries in descriptors:
        d = ratelimit_pb2.RateLimitDescriptor()
        for k, v in entries.items():
            d.entries.add(key=k, value=v)
        out.descriptors.append(d)
    return out


def sample(svc: RateLimitService, name: str, **labels: str) -> float:
    return svc.metrics.registry.get_sample_value(name, labels) or 0.0


def test_long_names_are_one_name_and_labels_are_the_fleets() -> None:
    svc = service()
    for i in range(50):
        svc.decide(request({"model": f"{i}" + "m" * 100_000, "tenant": "t" * 300}), now=1.0)
    assert set(svc.limiter.buckets) == {("invalid", "invalid", "requests")}
    assert sample(svc, "controlplane_quota_names_capped_total", field="model") == 50
    assert sample(svc, "controlplane_quota_names_capped_total", field="tenant") == 50
    assert sample(svc, "controlplane_quota_decisions_total", model="other", tenant="other", result="ok") == 50
    svc.decide(request({"model": "chat", "tenant": "acme"}), now=1.0)
    svc.decide(request({"model": "chat", "tenant": "initech"}), now=1.0)  # named in a model's tenants
    svc.decide(request({"model": "unknown-model", "tenant": "acme"}), now=1.0)
    assert sample(svc, "controlplane_quota_decisions_total", model="chat", tenant="acme", result="ok") == 1
    assert sample(svc, "controlplane_quota_decisions_total", model="chat", tenant="initech", result="ok") == 1
    assert sample(svc, "controlplane_quota_decisions_total", model="other", tenant="acme", result="ok") == 1
    page = generate_latest(svc.metrics.registry)
    assert len(page) < 32 << 10 and b"mmmm" not in page


def test_a_call_reads_at_most_max_descriptors_and_unreadable_ones_are_allowed() -> None:
    svc = service()
    many = [{"model": "chat", "tenant": f"t{i}"} for i in range(MAX_DESCRIPTORS + 100)]
    answer = svc.decide(request(*many), now=1.0)
    assert answer.overall_code == rls_pb2.RateLimitResponse.OK and len(answer.statuses) == len(many)
    assert len(svc.limiter.buckets) == MAX_DESCRIPTORS
    assert (
        sample(svc, "controlplane_quota_decisions_total", model="other", tenant="", result="unreadable")
        == 100
    )
    for odd in (request({"model": "chat"}, domain="elsewhere"), request({"tenant": "acme"})):
        assert svc.decide(odd, now=1.0).overall_code == rls_pb2.RateLimitResponse.OK
    weird = request({"model": "chat", "tenant": "acme", "kind": "bogus"})
    assert svc.decide(weird, now=1.0).overall_code == rls_pb2.RateLimitResponse.OK


def test_absurd_hits_are_refused_without_taking_anything() -> None:
    svc = service()
    req = request({"model": "chat", "tenant": "acme"})
    req.hits_addend = 2**32 - 1
    over = svc.decide(req, now=1.0)
    assert over.overall_code == rls_pb2.RateLimitResponse.OVER_LIMIT
    assert (
        svc.decide(request({"model": "chat", "tenant": "acme"}), now=1.0).overall_code
        == rls_pb2.RateLimitResponse.OK
    )
    charge = request(
        {"model": "chat", "tenant": "acme", "kind": "charge", "usage": "1e400", "max_tokens": "1e400"}
    )
    assert svc.decide(charge, now=1.0).overall_code == rls_pb2.RateLimitResponse.OK  # estimated, no crash
    assert sample(svc, "controlplane_quota_tokens_total", model="chat", tenant="acme", how="estimate") == 256


def test_a_crowded_store_answers_429_and_says_why() -> None:
    svc = service()
    svc.limiter.max_buckets = 1
    svc.decide(request({"model": "chat", "tenant": "a", "kind": "tokens"}), now=0.0)
    svc.decide(request({"model": "chat", "tenant": "a", "kind": "charge", "usage": "900"}), now=0.0)
    refused = svc.decide(request({"model": "chat", "tenant": "b"}), now=1.0)
    assert refused.overall_code == rls_pb2.RateLimitResponse.OVER_LIMIT
    error = json.loads(refused.raw_body)["error"]
    assert error["code"] == "rate_limit_exceeded" and "as many tenants as it may" in error["message"]
    assert (
        sample(svc, "controlplane_quota_decisions_total", model="chat", tenant="other", result="crowded") == 1
    )
    svc.decide(request({"model": "chat", "tenant": "c", "kind": "charge", "usage": "5"}), now=1.0)
    assert sample(svc, "controlplane_quota_charges_dropped_total") == 1
    assert sample(svc, "controlplane_quota_buckets") == 1


def args(tmp_path: Path, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    ratelimit.add_parser(parser.add_subparsers())
    return parser.parse_args(["ratelimit", "--config", str(tmp_path / "fleet.yaml"), *argv])


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--store", "mysql://x"], "--store: expected memory or redis://"),
        (["--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
        (["--tls-client-ca", "ca.pem"], "--tls-cert and --tls-key go together"),
        (["--tls-cert", "missing.pem", "--tls-key", "missing.key"], "--tls-cert missing.pem: cannot read"),
        (["--listen", "0.0.0.0:18081"], "--listen 0.0.0.0:18081 is reachable from other machines"),
        (["--listen", "[::]:18081"], "is reachable from other machines"),
        (["--listen", "nonsense"], "--listen:"),
        (["--token-file", "/nonexistent/token"], "--token-file: /nonexistent/token: cannot read"),
    ],
)
def test_bad_flags_are_one_line_naming_the_flag(tmp_path: Path, argv: list[str], words: str) -> None:
    with pytest.raises(ValueError) as got:
        ratelimit.check(args(tmp_path, *argv))
    assert words in str(got.value) and "\n" not in str(got.value)


def test_loopback_and_the_opt_out_pass_the_check(tmp_path: Path) -> None:
    assert ratelimit.check(args(tmp_path)) == (None, None)
    assert ratelimit.check(args(tmp_path, "--listen", "127.0.0.2:1")) == (None, None)
    assert ratelimit.check(args(tmp_path, "--listen", "0.0.0.0:1", "--allow-unauthenticated-clients")) == (
        None,
        None,
    )
