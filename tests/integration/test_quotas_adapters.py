"""Quotas on LoRA adapters (issue 45) through a real Envoy: an adapter named under
`quotas.models` has limits of its own on top of its base model's. A tenant over the adapter's
own limit gets 429 for that adapter while the base model and another adapter are served, and
the adapter's requests count toward the base model's limit too (one rate-limit service, an
emulated vLLM server holding both adapters, `affinity: false` so the adapters' route exists
for the quotas alone)."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.harness import EmulatedFleet, Emulator, wait_until
from tests.integration.quota_rig import QuotaService
from tests.ports import free_port

pytestmark = pytest.mark.envoy

BASE_LIMIT = 8  # acme's requests a minute on base and its adapters (one back every 7.5 s)
SQL_LIMIT = 3  # acme's own on the sql adapter


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: str


def ask(port: int, model: str, tenant: str, by_header: bool = False) -> Answer:
    """A completion naming `model` in the JSON body, or in x-model (`by_header`)."""
    headers = {"content-type": "application/json", "x-api-key": tenant}
    if by_header:
        headers["x-model"] = model
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 1})
        conn.request("POST", "/v1/completions", body=body, headers=headers)
        r = conn.getresponse()
        return Answer(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode())
    finally:
        conn.close()


@dataclass
class Rig:
    fleet: EmulatedFleet
    limiter: QuotaService


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    fleet = EmulatedFleet(tmp_path)
    limiter: QuotaService | None = None
    try:
        fleet.servers["a"] = Emulator(
            "a",
            tmp_path,
            "base",
            slots=8,
            lora_modules=["sql=/adapters/sql", "chat=/adapters/chat"],
            max_loras=2,
        )
        rl_port = free_port()
        text = (
            "listener: {port: %d}\n"
            "tiers: {small: {timeout: 30s}}\n"
            "quotas:\n"
            "  key: {header: x-api-key}\n"
            f"  service: {{endpoints: ['127.0.0.1:{rl_port}'], timeout: 500ms}}\n"
            "  default: {requests_per_minute: 1000}\n"
            "  models:\n"
            f"    base: {{tenants: {{acme: {{requests_per_minute: {BASE_LIMIT}}}}}}}\n"
            f"    sql: {{tenants: {{acme: {{requests_per_minute: {SQL_LIMIT}}}}}}}\n"
            "models:\n"
            "  base:\n"
            "    params_b: 8\n"
            "    stable: v1\n"
            "    affinity: false\n"
            "    adapters: {sql: {source: /adapters/sql}, chat: {source: /adapters/chat}}\n"
            f"    versions: {{v1: {{endpoints: ['{fleet.servers['a'].address}']}}}}\n"
        ) % fleet.listener
        (tmp_path / "fleet.yaml").write_text(text)
        limiter = QuotaService(tmp_path / "fleet.yaml", tmp_path, port=rl_port).start()
        fleet.serve(text)
        # Served, with a decision (another tenant: acme's buckets stay whole).
        port = fleet.listener
        wait_until(
            lambda: "x-ratelimit-limit-requests" in ask(port, "chat", "warmup").headers, 20, "Envoy to route"
        )
        yield Rig(fleet, limiter)
    finally:
        if limiter is not None:
            limiter.stop()
        fleet.close()


def test_an_adapters_own_limit_refuses_it_alone_and_its_requests_count_toward_the_base_model(
    rig: Rig,
) -> None:
    port = rig.fleet.listener
    sql = [ask(port, "sql", "acme") for _ in range(SQL_LIMIT + 2)]  # by the body's model
    assert [a.status for a in sql] == [200] * SQL_LIMIT + [429] * 2, [a.status for a in sql]
    assert json.loads(sql[0].body)["model"] == "sql"  # the server answered as the adapter
    assert sql[0].headers["x-ratelimit-limit-requests"] == str(SQL_LIMIT)  # the tighter bucket's
    error = json.loads(sql[-1].body)["error"]
    assert error["code"] == "rate_limit_exceeded" and "on sql" in error["message"], error
    assert int(sql[-1].headers["retry-after"]) >= 1
    assert ask(port, "sql", "acme", by_header=True).status == 429  # by x-model: the same bucket
    # The base model and another adapter are still served for acme.
    base = ask(port, "base", "acme")
    assert base.status == 200 and base.headers["x-ratelimit-limit-requests"] == str(BASE_LIMIT)
    # The 3 sql requests served and this one: 4 of acme's 8 on base are gone (the refused ones took none).
    assert base.headers["x-ratelimit-remaining-requests"] == str(BASE_LIMIT - SQL_LIMIT - 1)
    chat = ask(port, "chat", "acme", by_header=True)
    assert chat.status == 200 and json.loads(chat.body)["model"] == "chat"
    # What is left on base goes, then base and every adapter of it are over for acme.
    left = BASE_LIMIT - SQL_LIMIT - 2
    assert [ask(port, "base", "acme").status for _ in range(left)] == [200] * left
    assert [ask(port, m, "acme").status for m in ("base", "chat")] == [429, 429]
    # Another tenant: served on the adapter (its own buckets).
    assert ask(port, "sql", "globex").status == 200
    decisions = 'controlplane_quota_decisions_total{model="%s",result="%s",tenant="acme"}'
    assert rig.limiter.metric(decisions % ("sql", "over_limit")) == 3
    assert rig.limiter.metric(decisions % ("sql", "ok")) == SQL_LIMIT
    assert rig.limiter.metric(decisions % ("base", "over_limit")) == 2
    assert rig.limiter.metric(decisions % ("chat", "ok")) == 0  # chat has no limit of its own: never asked
