"""Per-tenant request quotas (issue 34, first part) through two real Envoys: one rate-limit
service (`controlplane ratelimit`) counts every proxy's requests; a tenant over its limit gets
429 with OpenAI's headers and error body while another tenant on the same model is served;
the service gone, requests are served (fail open), and the limit is back with it."""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from controlplane.quota.service import bearer_tenant
from tests.integration.harness import BIN, EmulatedFleet, Emulator, Envoy, Proc, http_get, wait_until
from tests.integration.quota_rig import QuotaService
from tests.integration.test_dashboard_metrics import dashboard_names, page_names
from tests.ports import free_port
from tests.unit.test_deploy_prometheus import ENVOY_QUOTA_STATS

pytestmark = pytest.mark.envoy

MODEL = "chat"
LIMIT = 6  # acme's requests per minute; refills at one per 10 s, so a test sees no refill
ACME_TOKEN = "sk-acme-0123456789"  # with the bearer mark, acme is this token's hash


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: str


def ask(
    port: int, tenant: str | None, max_tokens: int = 1, stream: bool = False, bearer: str | None = None
) -> Answer:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        return ask_on(conn, tenant, max_tokens, stream, bearer)
    finally:
        conn.close()


def ask_on(
    conn: http.client.HTTPConnection,
    tenant: str | None,
    max_tokens: int = 1,
    stream: bool = False,
    bearer: str | None = None,
) -> Answer:
    """One request on `conn`, kept open for the next."""
    headers = {"content-type": "application/json"}
    if tenant is not None:
        headers["x-api-key"] = tenant
    if bearer is not None:
        headers["authorization"] = f"Bearer {bearer}"
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": max_tokens, "stream": stream})
    conn.request("POST", "/v1/completions", body=body, headers=headers)
    r = conn.getresponse()
    return Answer(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode())


class RedisServer:
    """A real redis-server on a free loopback port, nothing saved to disk."""

    def __init__(self, log_dir: Path) -> None:
        from tests.peers import required

        self.binary = required(
            shutil.which("redis-server"),
            missing="redis-server is not installed (Debian: apt-get install redis-server, as .ci/run does)",
            env="CONTROLPLANE_REQUIRE_REDIS",
        )
        self.log_dir = log_dir
        self.port = free_port()
        self.proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.proc = Proc(
            "redis",
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            self.log_dir,
        )
        wait_until(self._up, 10, "redis-server to answer")
        return self

    def _up(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


@dataclass
class Rig:
    fleet: EmulatedFleet
    second: Envoy
    limiter: QuotaService
    more: list[QuotaService]  # with the `redis` mark: a second service on the same Redis
    redis: RedisServer | None


@pytest.fixture
def rig(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Rig]:
    """An emulated server, a control plane, two Envoys on one port and a rate-limit service;
    acme's limits: LIMIT requests a minute, and the test's `tokens` mark's tokens a minute."""
    mark = request.node.get_closest_marker("tokens")
    tokens = f", tokens_per_minute: {mark.args[0]}" if mark else ""
    on_redis = request.node.get_closest_marker("redis") is not None
    bearer = request.node.get_closest_marker("bearer") is not None  # the tenant: acme's hashed token
    key = "{bearer: true}" if bearer else "{header: x-api-key}"
    acme = bearer_tenant(f"Bearer {ACME_TOKEN}") if bearer else "acme"
    fleet = EmulatedFleet(tmp_path)
    second: Envoy | None = None
    limiter: QuotaService | None = None
    more: list[QuotaService] = []
    redis = RedisServer(tmp_path).start() if on_redis else None
    try:
        fleet.servers["a"] = Emulator("a", tmp_path, MODEL, slots=8)
        rl_port, rl_port_2 = free_port(), free_port()
        services = [f"127.0.0.1:{rl_port}"] + ([f"127.0.0.1:{rl_port_2}"] if redis else [])
        address = fleet.servers["a"].address
        text = (
            "listener: {port: %d}\n"
            "tiers: {small: {timeout: 30s}}\n"
            "quotas:\n"
            f"  key: {key}\n"
            f"  service: {{endpoints: {json.dumps(services)}, timeout: 500ms}}\n"
            "  default: {requests_per_minute: 1000}\n"
            f"  tenants: {{{acme}: {{requests_per_minute: {LIMIT}{tokens}}}}}\n"
            "models:\n"
            f"  {MODEL}: {{params_b: 8, stable: v1, versions: {{v1: {{endpoints: ['{address}']}}}}}}\n"
        )
        (tmp_path / "fleet.yaml").write_text(text % fleet.listener)
        store = redis.url if redis else "memory"
        limiter = QuotaService(tmp_path / "fleet.yaml", tmp_path, "--store", store, port=rl_port).start()
        if redis:
            more.append(
                QuotaService(
                    tmp_path / "fleet.yaml", tmp_path, "--store", store, name="ratelimit-2", port=rl_port_2
                ).start()
            )
        fleet.serve(text % fleet.listener)
        assert fleet.cp is not None
        # A second Envoy on the same listener port (SO_REUSEPORT): the kernel spreads
        # connections over both, as an L4 balancer spreads clients over gateway replicas.
        second = Envoy("envoy-2", fleet.cp.xds, tmp_path, fleet.listener).start()
        yield Rig(fleet, second, limiter, more, redis)
    finally:
        if second is not None:
            second.stop()
        for service in [*([limiter] if limiter else []), *more]:
            service.stop()
        if redis is not None:
            redis.stop()
        fleet.close()


def test_a_tenant_over_its_limit_gets_429_with_openais_headers_and_others_are_served(rig: Rig) -> None:
    port = rig.fleet.listener
    answers = [ask(port, "acme") for _ in range(LIMIT + 4)]
    statuses = [a.status for a in answers]
    assert statuses == [200] * LIMIT + [429] * 4, statuses
    first = answers[0].headers
    assert first["x-ratelimit-limit-requests"] == str(LIMIT)
    assert first["x-ratelimit-remaining-requests"] == str(LIMIT - 1)
    assert first["x-ratelimit-reset-requests"].endswith("s")
    assert answers[LIMIT - 1].headers["x-ratelimit-remaining-requests"] == "0"
    over = answers[LIMIT]
    assert over.headers["x-ratelimit-remaining-requests"] == "0"
    assert 1 <= int(over.headers["retry-after"]) <= 60
    error = json.loads(over.body)["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests", over.body
    assert over.headers["content-type"].startswith("application/json")
    # Another tenant on the same model, and a request with no key (the default limits).
    other = ask(port, "globex")
    assert other.status == 200 and other.headers["x-ratelimit-limit-requests"] == "1000"
    assert ask(port, None).status == 200
    # Both proxies took requests, and the limit held for the sum: one service counted all.
    took = [e.stat("http.inference.downstream_rq_total") for e in (rig.fleet.envoy, rig.second) if e]
    assert all(n > 0 for n in took), took
    assert (
        rig.limiter.metric(
            'controlplane_quota_decisions_total{model="chat",result="over_limit",tenant="acme"}'
        )
        == 4
    )
    # The dashboard reads the service's own page: every name it uses there is on it.
    _, page = http_get(f"http://127.0.0.1:{rig.limiter.metrics_port}/metrics")
    used, exported = dashboard_names("controlplane_quota_"), page_names(page)
    assert len(used) >= 3 and used <= exported, sorted(used - exported)


def cpctl_status(rig: Rig, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "cpctl"), "quota", "status", *args, "--quota-service", f"127.0.0.1:{rig.limiter.port}"],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_cpctl_quota_status_shows_use_and_what_is_left(rig: Rig) -> None:
    port = rig.fleet.listener
    assert [ask(port, "acme").status for _ in range(LIMIT + 1)] == [200] * LIMIT + [429]
    assert ask(port, "globex").status == 200
    token = ["--token-file", str(rig.limiter.token_file)]
    got = cpctl_status(rig, "acme", *token, "-o", "json")
    assert got.returncode == 0, got.stderr
    (row,) = json.loads(got.stdout)["buckets"]
    assert (row["tenant"], row["model"], row["kind"]) == ("acme", MODEL, "requests")
    assert row["limit_per_minute"] == LIMIT and row["remaining"] == 0 and 0 < row["reset_seconds"] <= 60
    table = cpctl_status(rig, *token)
    assert table.returncode == 0 and "acme" in table.stdout and "globex" in table.stdout, table
    # The status needs the service's token: another one is refused, and says where it came from.
    (rig.fleet.tmp / "wrong-token").write_text("not-it\n")
    refused = cpctl_status(rig, "--token-file", str(rig.fleet.tmp / "wrong-token"))
    assert refused.returncode == 4 and "UNAUTHENTICATED" in refused.stderr, refused


def test_the_service_gone_requests_are_served_and_the_limit_returns_with_it(rig: Rig) -> None:
    port = rig.fleet.listener
    assert [ask(port, "acme").status for _ in range(LIMIT + 1)] == [200] * LIMIT + [429]
    rig.limiter.kill()
    served = [ask(port, "acme") for _ in range(10)]
    assert [a.status for a in served] == [200] * 10  # fail open: no limit, and no failure
    assert all("x-ratelimit-limit-requests" not in a.headers for a in served)
    assert rig.fleet.envoy is not None
    envoys = (rig.fleet.envoy, rig.second)
    allowed = sum(e.stat("cluster.chat_v1.ratelimit.quota.failure_mode_allowed") for e in envoys)
    assert allowed == 10, allowed  # each counted: served without a decision
    assert sum(e.stat("cluster.chat_v1.ratelimit.quota.over_limit") for e in envoys) == 1
    # What Prometheus scrapes from the Envoys has the quota stats the deploy kit keeps (each
    # Envoy makes one when it first counts it).
    exported = set()
    for e in envoys:
        _, page = http_get(f"http://127.0.0.1:{e.admin_port}/stats/prometheus")
        exported |= {line.split("{")[0].split()[0] for line in page.splitlines() if line and line[0] != "#"}
    assert set(ENVOY_QUOTA_STATS.values()) <= exported, sorted(set(ENVOY_QUOTA_STATS.values()) - exported)
    rig.limiter.start()  # a new process: its counters start full
    wait_until(lambda: ask(port, "acme").status == 429, 20, "the limit to be back")


@pytest.mark.tokens(100)
def test_a_tenant_over_its_tokens_gets_429_and_each_response_is_charged_its_usage(rig: Rig) -> None:
    """Tokens are charged when a response ends, from its usage (a JSON answer's
    usage.total_tokens, read by Envoy) and, for a stream, estimated; the next request of a
    tenant whose tokens ran out gets 429 with the x-ratelimit-*-tokens headers."""
    port = rig.fleet.listener
    first = ask(port, "acme", max_tokens=40)
    assert first.status == 200
    assert first.headers["x-ratelimit-limit-tokens"] == "100"
    assert first.headers["x-ratelimit-remaining-tokens"] == "100"  # checked before, charged after
    used = json.loads(first.body)["usage"]["total_tokens"]
    charged = 'controlplane_quota_tokens_total{how="usage",model="chat",tenant="acme"}'
    wait_until(lambda: rig.limiter.metric(charged) == used, 5, "the first answer's usage to be charged")
    # A stream's usage is in its last event, which Envoy does not read: estimated, never free.
    streamed = ask(port, "acme", max_tokens=40, stream=True)
    assert streamed.status == 200
    estimated = 'controlplane_quota_tokens_total{how="estimate",model="chat",tenant="acme"}'
    wait_until(lambda: rig.limiter.metric(estimated) > 40, 5, "the stream to be charged an estimate")
    answers = [ask(port, "acme", max_tokens=40) for _ in range(3)]
    assert answers[-1].status == 429, [a.status for a in answers]
    over = answers[-1]
    assert over.headers["x-ratelimit-remaining-tokens"] == "0"
    assert json.loads(over.body)["error"]["type"] == "tokens"
    assert int(over.headers["retry-after"]) >= 1
    # A 429 of ours uses no tokens: refused requests are not charged an estimate. Envoy makes a
    # charge call as each ends, before it reads the next request on the same connection (one
    # Envoy worker, on its connection to the one service): once a later request's own charge
    # is counted, a charge of theirs would have been.
    spent = rig.limiter.metric(charged) + rig.limiter.metric(estimated)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        refused = [ask_on(conn, "acme", max_tokens=40)]
        path = conn.sock
        refused += [ask_on(conn, "acme", max_tokens=40) for _ in range(2)]
        other = ask_on(conn, "globex", max_tokens=40)
        assert conn.sock is path, "the connection was not kept: another Envoy may have taken the rest"
    finally:
        conn.close()
    assert [a.status for a in refused] == [429] * 3
    assert other.status == 200 and "x-ratelimit-limit-tokens" not in other.headers  # no token limit
    later = 'controlplane_quota_tokens_total{how="usage",model="chat",tenant="other"}'
    used_by_other = json.loads(other.body)["usage"]["total_tokens"]
    wait_until(lambda: rig.limiter.metric(later) == used_by_other, 5, "the later request to be charged")
    assert rig.limiter.metric(charged) + rig.limiter.metric(estimated) == spent


@pytest.mark.redis
def test_two_services_on_redis_hold_the_limit_for_the_sum(rig: Rig) -> None:
    """Two rate-limit services (one per control-plane replica) on one real redis-server, both
    listed for both Envoys: each Envoy spreads its calls over the two, and the limit holds for
    the sum. Redis killed under traffic: served (fail open); back: the limit is back."""
    port = rig.fleet.listener
    statuses = [ask(port, "acme").status for _ in range(LIMIT + 4)]
    assert statuses == [200] * LIMIT + [429] * 4, statuses
    ok = 'controlplane_quota_decisions_total{model="chat",result="ok",tenant="acme"}'
    over = 'controlplane_quota_decisions_total{model="chat",result="over_limit",tenant="acme"}'
    services = [rig.limiter, *rig.more]
    decided = [s.metric(ok) + s.metric(over) for s in services]
    assert all(n > 0 for n in decided), decided  # both services counted, one limit
    assert sum(s.metric(ok) for s in services) == LIMIT
    assert rig.redis is not None
    # Redis killed under traffic (a tenant with room, another over its limit, both sending):
    # no request fails; acme's are served while Redis is down.
    stop = threading.Event()
    seen: list[tuple[str, int]] = []

    def traffic() -> None:
        while not stop.is_set():
            for tenant in ("globex", "acme"):
                try:
                    seen.append((tenant, ask(port, tenant).status))
                except OSError as e:
                    seen.append((tenant, -1))
                    print(e)

    sender = threading.Thread(target=traffic, daemon=True)
    sender.start()
    try:
        wait_until(lambda: len(seen) >= 10, 10, "traffic before the kill")
        rig.redis.kill()
        killed_at = len(seen)
        wait_until(lambda: len(seen) >= killed_at + 20, 20, "traffic with Redis down")
    finally:
        stop.set()
        sender.join(15)
    assert {s for _, s in seen} <= {200, 429}, sorted(set(seen))
    assert all(s == 200 for _, s in seen[killed_at + 2 :]), seen[killed_at:]  # fail open
    served = [ask(port, "acme").status for _ in range(10)]
    assert served == [200] * 10, served  # fail open: Redis down costs no request
    errors = sum(s.metric('controlplane_quota_store_operations_total{result="error"}') for s in services)
    assert errors >= 10, errors
    rig.redis.start()  # empty: full buckets
    wait_until(lambda: ask(port, "acme").status == 429, 20, "the limit to be back")


@pytest.mark.bearer
def test_the_tenant_can_be_the_bearer_token_hashed(rig: Rig) -> None:
    """key: {bearer: true}: the fleet names acme by its token's hash, never the token; the
    same token over its limit gets 429, another token is served."""
    port = rig.fleet.listener
    statuses = [ask(port, None, bearer=ACME_TOKEN).status for _ in range(LIMIT + 1)]
    assert statuses == [200] * LIMIT + [429], statuses
    assert ACME_TOKEN not in (rig.fleet.tmp / "fleet.yaml").read_text()
    assert ask(port, None, bearer="sk-globex").status == 200
    assert ask(port, "acme").status == 200  # the x-api-key header means nothing here
    tenant = bearer_tenant(f"Bearer {ACME_TOKEN}")
    over = f'controlplane_quota_decisions_total{{model="chat",result="over_limit",tenant="{tenant}"}}'
    assert rig.limiter.metric(over) == 1
