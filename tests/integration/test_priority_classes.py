"""Priority classes through a real Envoy in front of emulated servers.

Two mechanisms, both real Envoy: circuit breakers per routing priority (premium is HIGH with
its own budget; the DEFAULT budget leaves a slot free for it, and its overflow is answered
429 with Retry-After), and signal-driven shedding (a saturated model's lower classes get a
429 route pushed by the control plane while premium is still routed).
"""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import ControlPlane, Emulator, Envoy, free_port, http_get, wait_until

MODEL = "chat"
FLAGS = {"slots": 4, "decode_ms_per_token": 20, "prefill_ms_per_token": 0.1, "phantom_output_tokens": 50}


class Rig:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.listener = free_port()
        self.servers: list[Emulator] = []
        self.cp: ControlPlane | None = None
        self.envoy: Envoy | None = None

    def close(self) -> None:
        for p in (self.envoy, self.cp, *self.servers):
            if p is not None:
                p.stop()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    r.servers = [Emulator(f"s{i}", tmp_path, MODEL, **FLAGS) for i in range(2)]
    eps = ", ".join(f"'{s.address}'" for s in r.servers)
    (tmp_path / "fleet.yaml").write_text(
        f"listener: {{port: {r.listener}}}\n"
        "tiers:\n"
        "  small:\n"
        "    max_params_b: 15\n"
        # Equal weights: Envoy's least request scans every server and finds the free slot. With
        # adaptive (unequal) weights Envoy uses EDF, which may queue premium behind a request.
        "    balancing: least_request\n"
        # 4 slots per server: standard (DEFAULT) may hold 3 in all, so every server keeps a slot
        # for premium wherever Envoy sends it (a hard reservation; see docs/traffic.md).
        "    circuit_breakers: {default: {max_requests: 3, max_pending: 1}, high: {max_requests: 16}}\n"
        "priority_classes:\n"
        "  premium: {routing_priority: high}\n"
        "  standard: {shed_at: 1.0}\n"
        "default_priority_class: standard\n"
        f"models: {{{MODEL}: {{params_b: 8, stable: v1, versions: {{v1: {{endpoints: [{eps}]}}}}}}}}\n"
    )
    try:
        r.cp = ControlPlane(tmp_path / "fleet.yaml", tmp_path).start()
        r.envoy = Envoy("envoy-1", r.cp.xds, tmp_path, r.listener).start()
        yield r
    finally:
        r.close()


class Clients:
    """Closed-loop clients of one priority class; records (start, latency, status)."""

    def __init__(self, port: int, klass: str | None, threads: int) -> None:
        self.port, self.klass = port, klass
        self.results: list[tuple[float, float, int]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=15)
        body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 10})
        headers = {"content-type": "application/json"}
        if self.klass:
            headers["x-priority"] = self.klass
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                conn.request("POST", "/v1/completions", body=body, headers=headers)
                r = conn.getresponse()
                r.read()
                status = r.status
            except Exception:
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=15)
                status = 0
            with self._lock:
                self.results.append((started, time.monotonic() - started, status))
            if status == 429:
                time.sleep(0.05)  # a polite client backs off (Retry-After says 1 s; keep load on)
        conn.close()

    def between(self, t0: float, t1: float) -> list[tuple[float, float, int]]:
        with self._lock:
            return [r for r in self.results if t0 <= r[0] < t1]

    def __enter__(self) -> Clients:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(20)


def p90(latencies: list[float]) -> float:
    """With one premium client, a few dozen samples: p99 is one sample (one descheduling on a
    busy CI machine failed it), p90 is the premium requests' latency under the load."""
    return statistics.quantiles(latencies, n=10)[8] if len(latencies) > 1 else latencies[0]


def test_premium_keeps_its_latency_while_standard_is_shed(rig: Rig) -> None:
    with Clients(rig.listener, "premium", threads=1) as premium:
        time.sleep(3)
        t0 = time.monotonic()
        with Clients(rig.listener, None, threads=10) as standard:
            time.sleep(6)
            t1 = time.monotonic()
        unloaded = [lat for _, lat, s in premium.between(0, t0) if s == 200]
        loaded = premium.between(t0 + 1, t1)
    assert all(s == 200 for _, _, s in loaded), [s for _, _, s in loaded if s != 200]
    std = standard.between(t0, t1)
    statuses = {s for _, _, s in std}
    assert statuses <= {200, 429}, statuses
    assert sum(1 for _, _, s in std if s == 429) > 20  # overload is shed...
    assert sum(1 for _, _, s in std if s == 200) > 20  # ...while standard keeps its share
    base, hot = p90(unloaded), p90([lat for _, lat, _ in loaded])
    assert hot <= 1.5 * base + 0.05, (base, hot, sorted(round(lat, 2) for _, lat, _ in loaded)[-5:])
    assert rig.envoy is not None
    assert rig.envoy.stat("cluster.chat_v1.upstream_rq_active_overflow") > 0  # the breaker shed them


def test_a_saturated_model_sheds_standard_with_a_pushed_429_route_but_not_premium(rig: Rig) -> None:
    assert rig.cp is not None and rig.envoy is not None
    cp = rig.cp
    for s in rig.servers:
        s.set_faults(backlog=12)  # both servers queue: saturation 8 waiting / 4 running = 2
    wait_until(
        lambda: cp.metric("controlplane_priority_class_shed", model=MODEL, **{"class": "standard"}) == 1,
        10,
        "standard to be shed",
    )
    conn = http.client.HTTPConnection("127.0.0.1", rig.listener, timeout=15)
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 2})

    def post(headers: dict[str, str]) -> tuple[int, dict[str, str], str]:
        conn.request(
            "POST", "/v1/completions", body=body, headers={"content-type": "application/json", **headers}
        )
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode()

    def shed_at_proxy() -> bool:
        dump = json.loads(
            http_get(f"http://127.0.0.1:{rig.envoy.admin_port}/config_dump?resource=dynamic_route_configs")[1]
        )  # type: ignore[union-attr]
        for rc in dump["configs"]:
            for vh in rc["route_config"].get("virtual_hosts", []):
                for route in vh["routes"]:
                    if route.get("name") == f"header/{MODEL}":
                        return "direct_response" in route
        return False

    wait_until(shed_at_proxy, 5, "the 429 route to reach Envoy")
    assert post({})[0] == 429  # no x-priority: the default class, standard
    status, headers, text = post({"x-priority": "standard"})
    assert status == 429 and headers["retry-after"] == "1"
    assert json.loads(text)["error"]["code"] == "rate_limit_exceeded"
    status, _, _ = post({"x-priority": "premium"})
    assert status == 200  # queued behind the backlog, but admitted
    for s in rig.servers:
        s.set_faults(backlog=0)
    wait_until(lambda: not shed_at_proxy(), 15, "standard to be admitted again")
    assert post({})[0] == 200
    conn.close()
