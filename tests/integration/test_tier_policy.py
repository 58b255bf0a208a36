"""Tiers as traffic policy, through a real Envoy in front of emulated servers (`controlplane emulate`).

The issue's "done when": a small and a large model each get their own tier's cluster and
timeout; an endpoint answering 507 is ejected and its requests are retried elsewhere, so
the client sees success; a body over the tier's limit gets 413; a stream that goes quiet
longer than the tier's stream idle timeout is cut; the circuit breaker of the default
priority sheds the request beyond its limit.

One fleet, one control plane and one Envoy serve every test of this module (each test has
its own models, hence its own clusters and stats), which keeps the module well under a
minute.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import EmulatedFleet, Emulator, http_get, wait_until

# Emulated servers: name -> (served model, flags). Models sharing a server are routed by the
# x-model header while the body names the server's model.
SERVERS: dict[str, tuple[str, dict[str, object]]] = {
    "small": ("small-7b", {"decode_ms_per_token": 100}),
    "big": ("big-405b", {"decode_ms_per_token": 100}),
    "good": ("mid-oom", {"decode_ms_per_token": 5}),
    "bad": ("mid-oom", {"decode_ms_per_token": 5, "oom_rate": 1}),
    "drip": ("stream-slow", {"decode_ms_per_token": 900}),
    "flow": ("stream-fast", {"decode_ms_per_token": 50}),
}

FLEET = """\
listener: {{port: {port}}}
tiers:
  small: {{max_params_b: 15, timeout: 1s, max_body_bytes: 2000}}
  mid:
    max_params_b: 100
    timeout: 30s
    stream_idle_timeout: 500ms
    retries: 2
    outlier_detection: {{consecutive_5xx: 2, interval: 1s, base_ejection_time: 30s, max_ejection_percent: 50}}
    circuit_breakers: {{high: {{max_requests: 7, max_pending: 3}}}}
  large: {{timeout: 20s}}
signals: {{interval: 1s}}
models:
  small-7b: {{params_b: 7, stable: v1, versions: {{v1: {{endpoints: ['{small}']}}}}}}
  big-405b: {{params_b: 405, stable: v1, versions: {{v1: {{endpoints: ['{big}']}}}}}}
  mid-oom: {{params_b: 30, stable: v1, versions: {{v1: {{endpoints: ['{good}', '{bad}']}}}}}}
  mid-noretry: {{params_b: 30, retries: 0, stable: v1, versions: {{v1: {{endpoints: ['{good}', '{bad}']}}}}}}
  stream-slow: {{params_b: 30, stable: v1, versions: {{v1: {{endpoints: ['{drip}']}}}}}}
  stream-fast: {{params_b: 30, stable: v1, versions: {{v1: {{endpoints: ['{flow}']}}}}}}
  guarded:
    params_b: 30
    circuit_breakers: {{default: {{max_requests: 1, max_pending: 1}}}}
    stream_idle_timeout: 10s  # the tier's 500 ms would also cut a 2 s non-streamed answer
    stable: v1
    versions: {{v1: {{endpoints: ['{big}']}}}}
"""


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: str
    error: str | None  # how the response broke off, if it did
    seconds: float

    @property
    def server(self) -> str:
        return self.headers.get("x-emulator-server", "")


class Rig(EmulatedFleet):
    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp)
        self._lock = threading.Lock()

    def _start_server(self, name: str) -> None:
        model, flags = SERVERS[name]
        em = Emulator(name, self.tmp, model, **flags)
        with self._lock:
            self.servers[name] = em

    def start(self) -> None:
        with ThreadPoolExecutor(len(SERVERS)) as pool:
            for f in [pool.submit(self._start_server, n) for n in SERVERS]:
                f.result()
        addresses = {n: s.address for n, s in self.servers.items()}
        self.serve(FLEET.format(port=self.listener, **addresses))
        expected = {
            "small-7b@v1": ["small"],
            "big-405b@v1": ["big"],
            "mid-oom@v1": ["good", "bad"],
            "mid-noretry@v1": ["good", "bad"],
            "stream-slow@v1": ["drip"],
            "stream-fast@v1": ["flow"],
            "guarded@v1": ["big"],
        }
        for cluster, names in expected.items():
            want = {self.servers[n].address for n in names}
            wait_until(lambda c=cluster, w=want: self._serving(c, w), 15, f"{cluster}'s endpoints in Envoy")

    def _serving(self, cluster: str, want: set[str]) -> bool:
        assert self.envoy is not None
        seen = self.envoy.endpoints(cluster)
        return set(seen) == want and all("failed" not in flags for _, flags in seen.values())

    def request(
        self,
        model: str,
        *,
        header: str | None = None,
        max_tokens: int = 1,
        stream: bool = False,
        prompt: str = "hi",
        timeout: float = 15,
    ) -> Answer:
        """One completion through Envoy, read to its end or to where it broke off."""
        body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
        if stream:
            body["stream"] = True
        headers = {"content-type": "application/json"}
        if header is not None:
            headers["x-model"] = header
        conn = http.client.HTTPConnection("127.0.0.1", self.listener, timeout=timeout)
        start = time.monotonic()
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(body).encode(), headers=headers)
            r = conn.getresponse()
            got: list[bytes] = []
            error: str | None = None
            try:
                while piece := r.read1(65536):
                    got.append(piece)
            except (http.client.IncompleteRead, ConnectionError) as e:
                error = repr(e)
            return Answer(
                r.status,
                {k.lower(): v for k, v in r.getheaders()},
                b"".join(got).decode(errors="replace"),
                error,
                time.monotonic() - start,
            )
        finally:
            conn.close()

    def stats(self, prefix: str) -> dict[str, int]:
        assert self.envoy is not None
        _, text = http_get(f"http://127.0.0.1:{self.envoy.admin_port}/stats?filter=^{prefix}")
        out: dict[str, int] = {}
        for line in text.splitlines():
            key, _, value = line.partition(": ")
            if value.strip().lstrip("-").isdigit():
                out[key] = int(value)
        return out

    def admin(self, path: str) -> str:
        assert self.envoy is not None
        status, text = http_get(f"http://127.0.0.1:{self.envoy.admin_port}{path}", timeout=5)
        assert status == 200, (path, status, text[:300])
        return text

    def emulator_stats(self, name: str) -> dict[str, Any]:
        status, text = http_get(f"http://{self.servers[name].address}/emulator/stats")
        assert status == 200, text
        return json.loads(text)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    r = Rig(tmp_path_factory.mktemp("tier-policy"))
    try:
        r.start()
        yield r
    finally:
        r.close()


def _routes(rig: Rig) -> dict[str, dict[str, Any]]:
    """Route name -> its `route` action, from Envoy's own config dump."""
    dump = json.loads(rig.admin("/config_dump?resource=dynamic_route_configs"))
    out: dict[str, dict[str, Any]] = {}
    for cfg in dump["configs"]:
        for vh in cfg["route_config"]["virtual_hosts"]:
            for route in vh["routes"]:
                if "route" in route:
                    out[route["name"]] = route["route"]
    return out


def test_each_model_gets_its_tiers_cluster_and_timeout(rig: Rig) -> None:
    routes = _routes(rig)
    for how in ("header", "body"):
        assert routes[f"{how}/small-7b"]["cluster"] == "small-7b@v1"
        assert routes[f"{how}/small-7b"]["timeout"] == "1s"
        assert routes[f"{how}/big-405b"]["cluster"] == "big-405b@v1"
        assert routes[f"{how}/big-405b"]["timeout"] == "20s"
        assert routes[f"{how}/mid-oom"]["timeout"] == "30s"

    # 25 tokens at 100 ms each: about 2.5 s on either server.
    big = rig.request("big-405b", max_tokens=25)
    assert big.status == 200, big
    assert big.server == rig.servers["big"].address
    assert big.seconds >= 2.3, big
    assert json.loads(big.body)["usage"]["completion_tokens"] == 25

    small = rig.request("small-7b", max_tokens=25)
    assert small.status == 504, small
    assert "upstream request timeout" in small.body
    assert 0.9 <= small.seconds < 2.0, small  # the tier's 1 s, not the request's 2.5 s

    # A short request to the small model fits in its tier's timeout and lands on its server.
    quick = rig.request("small-7b", max_tokens=2)
    assert quick.status == 200, quick
    assert quick.server == rig.servers["small"].address

    stats = rig.stats("cluster.")
    assert stats["cluster.small-7b_v1.upstream_rq_timeout"] == 1, stats
    assert stats["cluster.small-7b_v1.upstream_rq_200"] >= 1
    assert stats.get("cluster.big-405b_v1.upstream_rq_timeout", 0) == 0
    assert stats["cluster.big-405b_v1.upstream_rq_200"] >= 1


def test_an_endpoint_answering_507_is_ejected_and_its_requests_retried(rig: Rig) -> None:
    good, bad = rig.servers["good"].address, rig.servers["bad"].address
    before = rig.emulator_stats("bad")["responses_by_status"].get("507", 0)
    answers = [rig.request("mid-oom") for _ in range(40)]
    assert [a.status for a in answers] == [200] * 40, [a for a in answers if a.status != 200][:3]
    assert {a.server for a in answers} == {good}

    stats = rig.stats("cluster.mid-oom_v1.")
    # Every 507 was retried. (previous_hosts re-picks at most 5 times, so now and then a retry
    # lands on the bad server again and one request is retried twice: count 507s, not requests.)
    answered_507 = rig.emulator_stats("bad")["responses_by_status"].get("507", 0) - before
    assert answered_507 >= 2, answered_507
    assert stats["cluster.mid-oom_v1.upstream_rq_retry"] == answered_507, stats
    assert stats["cluster.mid-oom_v1.upstream_rq_retry_success"] >= 1, stats
    assert stats["cluster.mid-oom_v1.outlier_detection.ejections_enforced_total"] >= 1, stats
    assert stats["cluster.mid-oom_v1.outlier_detection.ejections_enforced_consecutive_5xx"] >= 1, stats
    assert rig.envoy is not None
    endpoints = rig.envoy.endpoints("mid-oom@v1")
    assert "failed_outlier_check" in endpoints[bad][1], endpoints
    assert "failed_outlier_check" not in endpoints[good][1], endpoints
    # Ejected after 2 answers in a row: the bad server saw a handful of the 40 requests, not half.
    seen_by_bad = rig.emulator_stats("bad")["responses_by_status"]
    assert set(seen_by_bad) == {"507"}, seen_by_bad
    assert 2 <= seen_by_bad["507"] <= 6, seen_by_bad

    # The same servers under a model whose override turns retries off: its client sees the 507s
    # (until this cluster's own outlier detection ejects the bad server in turn).
    plain = [rig.request("mid-oom", header="mid-noretry") for _ in range(30)]
    statuses = [a.status for a in plain]
    assert set(statuses) == {200, 507}, statuses
    assert 1 <= statuses.count(507) <= 4, statuses
    assert statuses[-10:] == [200] * 10, statuses
    stats = rig.stats("cluster.mid-noretry_v1.")
    assert stats.get("cluster.mid-noretry_v1.upstream_rq_retry", 0) == 0, stats
    assert stats["cluster.mid-noretry_v1.outlier_detection.ejections_enforced_total"] >= 1, stats


def test_a_body_over_the_tiers_limit_gets_413(rig: Rig) -> None:
    prompt = "word " * 1000  # a 5000+ byte body
    assert len(json.dumps({"model": "small-7b", "prompt": prompt, "max_tokens": 1})) > 5000

    received = rig.emulator_stats("small")["requests_total"]
    too_big = rig.request("small-7b", header="small-7b", prompt=prompt)
    assert too_big.status == 413, too_big
    assert rig.emulator_stats("small")["requests_total"] == received  # Envoy refused it itself

    fits = rig.request("small-7b", header="small-7b", prompt="word " * 100)
    assert fits.status == 200, fits
    assert fits.server == rig.servers["small"].address

    # The limit is the small tier's only: the large tier's model takes the same body.
    other = rig.request("big-405b", header="big-405b", prompt=prompt)
    assert other.status == 200, other
    assert json.loads(other.body)["usage"]["prompt_tokens"] == 1000


def test_a_stream_quiet_longer_than_the_idle_timeout_is_cut(rig: Rig) -> None:
    # 50 ms between chunks: well inside the mid tier's 500 ms stream idle timeout.
    fast = rig.request("stream-fast", max_tokens=5, stream=True)
    assert fast.status == 200, fast
    assert fast.error is None, fast
    assert fast.body.count("data: {") == 6, fast.body  # 5 tokens and the finish chunk
    assert fast.body.rstrip().endswith("data: [DONE]"), fast.body

    before = rig.stats("http.inference.downstream_rq_idle_timeout").get(
        "http.inference.downstream_rq_idle_timeout", 0
    )
    # 900 ms between tokens: the first token comes at once, the next one too late.
    slow = rig.request("stream-slow", max_tokens=3, stream=True)
    assert slow.status == 200, slow  # the headers had gone out
    assert "data: [DONE]" not in slow.body, slow
    assert slow.body.count("data: {") == 1, slow.body
    assert slow.error is not None, slow  # the chunked response broke off
    assert slow.seconds < 1.8, slow  # 3 tokens would take 2.7 s
    after = rig.stats("http.inference.downstream_rq_idle_timeout")
    assert after["http.inference.downstream_rq_idle_timeout"] == before + 1, after
    # The cut stream frees the server's slot (the emulator sees the abort).
    wait_until(lambda: rig.emulator_stats("drip")["aborted_total"] == 1, 5, "the emulator to see the abort")


def test_the_default_priority_circuit_breaker_sheds_the_extra_request(rig: Rig) -> None:
    clusters = rig.admin("/clusters")
    thresholds = {
        line.split("::", 1)[1]
        for line in clusters.splitlines()
        if line.startswith("guarded@v1::") and "_priority::" in line
    }
    assert "default_priority::max_requests::1" in thresholds, thresholds
    assert "default_priority::max_pending_requests::1" in thresholds, thresholds
    assert "high_priority::max_requests::7" in thresholds, thresholds  # the tier's, kept
    assert "high_priority::max_pending_requests::3" in thresholds, thresholds

    first: list[Answer] = []
    holder = threading.Thread(
        target=lambda: first.append(rig.request("big-405b", header="guarded", max_tokens=20))
    )
    holder.start()
    try:
        wait_until(lambda: rig.emulator_stats("big")["running"] >= 1, 5, "the first request to run")
        second = rig.request("big-405b", header="guarded", max_tokens=1)
    finally:
        holder.join(15)
    assert second.status == 429, second  # breaker overflow is shed as 429 (docs/traffic.md)
    assert second.headers.get("retry-after") == "1", second
    assert second.headers.get("x-envoy-overloaded") == "true", second
    assert second.seconds < 1.0, second  # shed at once, not queued behind the first
    assert first and first[0].status == 200, first
    stats = rig.stats("cluster.guarded_v1.")
    assert stats["cluster.guarded_v1.upstream_rq_active_overflow"] == 1, stats  # max_requests, not pending
    assert stats.get("cluster.guarded_v1.upstream_rq_pending_overflow", 0) == 0, stats

    # With the first one done, the breaker lets the next through.
    after = rig.request("big-405b", header="guarded", max_tokens=1)
    assert after.status == 200, after
