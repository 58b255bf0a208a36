"""Proxyless gRPC as users run it: grpcio's own xDS client (`xds:///` and a bootstrap) in its
own process, against real grpcio servers, with the control plane in between. Each test
checks one thing gRPC does differently from Envoy (docs/xds.md#proxyless-grpc)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.config.endpoint.v3 import endpoint_pb2 as eds_pb2
from envoy.config.route.v3 import route_pb2
from envoy.service.status.v3 import csds_pb2, csds_pb2_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from controlplane.v1 import endpoint_pb2, rollout_pb2
from controlplane.xds.bootstrap import grpc_bootstrap
from tests.integration.grpc_xds_load import READY_PROBE
from tests.integration.harness import ControlPlane, Operator, wait_until

CLIENT = Path(__file__).with_name("grpc_xds_load.py")
MODEL = "embed"
LOADING = "model still loading"


class WhoServer:
    """A real gRPC server for one model: /inference.Who/Call answers its name. `loading`:
    NOT_SERVING on grpc.health.v1 and UNAVAILABLE on every call, as a server still loading
    its model; `fail`: INTERNAL on every call; `fail_every_other`: UNAVAILABLE on every
    other call; `sleep_s`: each call takes that long, except the client's readiness probes (a
    probe that waited on the slow server past its 5-s deadline made the client give up as
    "never ready" when its picks kept landing there)."""

    def __init__(self, name: str, *, loading: bool = False) -> None:
        self.name = name
        self.fail = False
        self.fail_every_other = False
        self.sleep_s = 0.0
        self.calls = 0  # calls answered with the name
        self.refused = 0  # calls answered with an error
        self.while_loading = 0  # calls that arrived while loading
        self.in_flight = 0
        self._lock = threading.Lock()
        self.health = health.HealthServicer()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        handler = grpc.unary_unary_rpc_method_handler(self._call)
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("inference.Who", {"Call": handler}),)
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.set_loading(loading)
        self.server.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set_loading(self, loading: bool) -> None:
        self.loading = loading
        status = (
            health_pb2.HealthCheckResponse.NOT_SERVING if loading else health_pb2.HealthCheckResponse.SERVING
        )
        self.health.set("", status)

    def _call(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        with self._lock:
            self.in_flight += 1
            n = self.calls + self.refused
        try:
            if self.loading:
                with self._lock:
                    self.while_loading += 1
                    self.refused += 1
                context.abort(grpc.StatusCode.UNAVAILABLE, LOADING)
            if self.fail or (self.fail_every_other and n % 2 == 0):
                with self._lock:
                    self.refused += 1
                context.abort(
                    grpc.StatusCode.INTERNAL if self.fail else grpc.StatusCode.UNAVAILABLE, "refused"
                )
            if self.sleep_s and request != READY_PROBE:
                time.sleep(self.sleep_s)
            with self._lock:
                self.calls += 1
            return self.name.encode()
        finally:
            with self._lock:
                self.in_flight -= 1

    def stop(self) -> None:
        self.server.stop(0)


@dataclass
class Rig:
    """A control plane serving `embed` (HTTP/2, probed over grpc.health.v1) from a fleet file."""

    tmp: Path
    servers: dict[str, WhoServer] = field(default_factory=dict)
    cp: ControlPlane | None = None
    op: Operator | None = None
    clients: list[subprocess.Popen[str]] = field(default_factory=list)

    @property
    def config(self) -> Path:
        return self.tmp / "fleet.yaml"

    def server(self, name: str, **kw: Any) -> WhoServer:
        if name not in self.servers:
            self.servers[name] = WhoServer(name, **kw)
        return self.servers[name]

    def write(
        self,
        versions: dict[str, list[str]],
        *,
        capacity: dict[str, float] | None = None,
        tier: str = "",
        stable: str | None = None,
        interval: str = "300ms",
        model_keys: str = "",
    ) -> None:
        lines = [
            "listener: {port: 10000}",
            f"signals: {{interval: {interval}, timeout: 250ms}}",
            f"tiers: {{small: {{{tier}}}}}",
            "models:",
            f"  {MODEL}:",
            "    params_b: 1",
            "    protocol: http2",
            *([f"    {model_keys}"] if model_keys else []),
            f"    stable: {stable or next(iter(versions))}",
            "    versions:",
        ]
        for version, names in versions.items():
            lines.append(f"      {version}:")
            lines.append("        endpoints:")
            for n in names:
                cap = f", capacity: {capacity[n]}" if capacity and n in capacity else ""
                lines.append(f"          - {{address: '{self.servers[n].address}'{cap}}}")
        tmp = self.config.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(self.config)

    def start(self) -> Rig:
        self.cp = ControlPlane(self.config, self.tmp).start()
        self.op = Operator(self.cp)
        (self.tmp / "grpc-bootstrap.json").write_text(
            grpc_bootstrap(f"grpc-{len(self.clients)}", self.cp.xds)
        )
        return self

    def client(self, *args: str, node: str = "grpc-client") -> subprocess.Popen[str]:
        assert self.cp is not None
        boot = self.tmp / f"{node}.json"
        boot.write_text(grpc_bootstrap(node, self.cp.xds))
        p = subprocess.Popen(
            [sys.executable, str(CLIENT), f"xds:///{MODEL}", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "GRPC_XDS_BOOTSTRAP": str(boot)},
        )
        self.clients.append(p)
        return p

    def run(self, *args: str, timeout: float = 60) -> dict[str, Any]:
        """One client run to its end: its JSON result."""
        p = self.client(*args)
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, out + err
        return result(out.splitlines()[-1])

    def endpoints(self) -> dict[str, endpoint_pb2.Endpoint]:
        assert self.op is not None
        r = self.op.endpoints.List(
            endpoint_pb2.ListEndpointsRequest(model=MODEL), metadata=self.op.md, timeout=5
        )
        return {e.address: e for e in r.endpoints}

    def weight_of(self, name: str) -> int:
        return self.endpoints()[self.servers[name].address].weight

    def close(self) -> None:
        for p in self.clients:
            if p.poll() is None:
                p.kill()
                p.wait()
        if self.op is not None:
            self.op.close()
        if self.cp is not None:
            self.cp.stop()
        for s in self.servers.values():
            s.stop()


def result(line: str) -> dict[str, Any]:
    got: dict[str, Any] = json.loads(line)
    return got


def expect_line(p: subprocess.Popen[str], prefix: str) -> str:
    assert p.stdout is not None
    line = p.stdout.readline().strip()
    assert line.startswith(prefix), (
        f"expected {prefix!r}, got {line!r}; stderr: {p.stderr and p.stderr.read()}"
    )
    return line


def client_view(port: int, type_name: str) -> dict[str, Any]:
    """What a client started with --csds (on `port`) holds of one resource type, by name, from
    gRPC's own CSDS: the config its channel uses, not what the control plane sent."""
    cls = {
        "RouteConfiguration": route_pb2.RouteConfiguration,
        "ClusterLoadAssignment": eds_pb2.ClusterLoadAssignment,
    }
    out: dict[str, Any] = {}
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        r = csds_pb2_grpc.ClientStatusDiscoveryServiceStub(ch).FetchClientStatus(
            csds_pb2.ClientStatusRequest(), timeout=5
        )
    for cfg in r.config:
        for g in cfg.generic_xds_configs:
            if g.type_url.rsplit(".", 1)[-1] == type_name and g.xds_config.type_url:
                msg = cls[type_name]()
                g.xds_config.Unpack(msg)
                out[g.name] = msg
    return out


def route_retries(port: int) -> set[int]:
    """The retries of every route the client holds (0: no retry policy)."""
    return {
        r.route.retry_policy.num_retries.value if r.route.HasField("retry_policy") else 0
        for rc in client_view(port, "RouteConfiguration").values()
        for vh in rc.virtual_hosts
        for r in vh.routes
    }


def route_split(port: int) -> dict[str, int]:
    """The clusters the client's routes send to, with their weights (a plain route: 100)."""
    out: dict[str, int] = {}
    for rc in client_view(port, "RouteConfiguration").values():
        for vh in rc.virtual_hosts:
            for r in vh.routes:
                if r.route.cluster:
                    out[r.route.cluster] = 100
                for wc in r.route.weighted_clusters.clusters:
                    out[wc.name] = wc.weight.value
    return out


def assigned(port: int) -> set[str]:
    """Every endpoint address in the client's assignments, whatever its health status."""
    return {
        f"{a.address}:{a.port_value}"
        for cla in client_view(port, "ClusterLoadAssignment").values()
        for loc in cla.endpoints
        for a in (lb.endpoint.address.socket_address for lb in loc.lb_endpoints)
    }


def finish(p: subprocess.Popen[str]) -> str:
    """Let a --csds client exit (it waits for a line once its calls are done); its output."""
    out, _ = p.communicate("done\n", timeout=60)
    return out


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    try:
        yield r
    finally:
        r.close()


def test_endpoint_weights_reach_grpc_clients_as_locality_weights(rig: Rig) -> None:
    """gRPC's xds_wrr_locality ignores endpoint weights: capacities 3:1 used to split 50/50.
    As locality weights, the split is 3:1."""
    rig.server("fast")
    rig.server("slow")
    rig.write({"v1": ["fast", "slow"]}, capacity={"fast": 3, "slow": 1})
    rig.start()
    wait_until(lambda: rig.weight_of("fast") >= 3 * rig.weight_of("slow") - 3 > 0, 10, "weights 3:1")
    got = rig.run("--wait-ready", "--calls", "800", "--concurrency", "4")
    assert not got["codes"], got["details"]
    share = got["backends"]["fast"] / 800
    assert 0.70 <= share <= 0.80, got["backends"]


def test_a_rollouts_split_reaches_grpc_clients_and_their_load_reports_count(rig: Rig) -> None:
    """A rollout at 20% sends a fifth of proxyless calls to the canary (it used to send none),
    and the rollout's analysis sees them: gRPC reports load to the xDS server itself."""
    rig.server("stable")
    rig.server("canary")
    rig.write({"v1": ["stable"], "v2": ["canary"]})
    rig.start()
    assert rig.op is not None
    warm = rig.client("--csds", "--wait-ready", "--seconds", "3", "--rate", "50", node="grpc-warm")
    csds = int(expect_line(warm, "csds").split()[1])
    expect_line(warm, "ready")
    assert route_split(csds) == {f"{MODEL}@v1": 100}
    rig.op.rollouts.Start(
        rollout_pb2.StartRolloutRequest(model=MODEL, to_version="v2", steps=[20, 100], manual=True),
        metadata=rig.op.md,
        timeout=10,
    )

    def rollout() -> rollout_pb2.Rollout:
        assert rig.op is not None
        return rig.op.rollouts.Get(rollout_pb2.GetRolloutRequest(model=MODEL), metadata=rig.op.md, timeout=5)

    wait_until(lambda: rollout().step == 1, 15, "step 1 (20%)")
    # The step is the rollout's state; clients have it once the route with the split reaches
    # them (after the canary's cluster: make-before-break).
    split = {f"{MODEL}@v1": 80, f"{MODEL}@v2": 20}
    wait_until(lambda: route_split(csds) == split, 15, "clients to get the 80/20 route")
    finish(warm)
    # Long enough for several load reports (one a second; the last part-second is not sent).
    got = rig.run("--seconds", "4", "--rate", "300", "--concurrency", "4", "--wait-ready")
    assert not got["codes"], got["details"]
    share = got["backends"].get("canary", 0) / len(got["trace"])
    assert 0.15 <= share <= 0.25, got["backends"]
    # The canary's requests come from the client's load reports (these servers have no
    # /metrics): the analysis counts proxyless traffic.
    wait_until(lambda: rollout().canary.requests >= 100, 10, "canary requests in the analysis")
    assert rollout().stable.requests >= 400


def test_the_tier_timeout_is_a_grpc_deadline(rig: Rig) -> None:
    """gRPC ignores a route's `timeout` and reads max_stream_duration (gRFC A31): a call to a
    server slower than the tier's timeout ends DEADLINE_EXCEEDED instead of waiting for it.
    (grpcio 1.85 ends it early by a constant of its process, seen between 1 and 2 s: the
    deadline is at most the timeout, never later; docs/xds.md says so.)"""
    slow = rig.server("slow")
    rig.write({"v1": ["slow"]}, tier="timeout: 5s")
    rig.start()
    got = rig.run("--wait-ready", "--calls", "1")
    assert got["backends"] == {"slow": 1}
    slow.sleep_s = 8.0
    got = rig.run("--calls", "2", "--concurrency", "2", "--deadline", "30")
    assert got["codes"] == {"DEADLINE_EXCEEDED": 2}, got
    took = [t for _, t, _ in got["trace"]]
    assert all(2.5 <= t <= 5.3 for t in took), took


def test_unavailable_is_retried_for_grpc_clients_as_the_tier_says(rig: Rig) -> None:
    flaky = rig.server("flaky")
    rig.write({"v1": ["flaky"]}, tier="retries: 2")
    rig.start()
    # A client that stays connected shows, through gRPC's own CSDS, the route clients get.
    watcher = rig.client("--csds", "--wait-ready", "--calls", "1", node="grpc-watch")
    csds = int(expect_line(watcher, "csds").split()[1])
    expect_line(watcher, "ready")
    expect_line(watcher, "{")  # its call made: the server may fail from now on
    assert route_retries(csds) == {2}
    flaky.fail_every_other = True
    got = rig.run("--calls", "40")
    assert got["codes"] == {} and got["backends"] == {"flaky": 40}, got
    assert flaky.refused >= 20  # half the attempts failed and were retried
    # Without retries, the same server's refusals reach the client.
    rig.write({"v1": ["flaky"]}, tier="retries: 0")
    wait_until(lambda: route_retries(csds) == {0}, 15, "clients to get the route without a retry policy")
    got = rig.run("--calls", "40", "--wait-ready")
    assert got["codes"].get("UNAVAILABLE", 0) >= 15, got
    finish(watcher)


def test_a_failing_server_is_ejected_by_grpc_clients(rig: Rig) -> None:
    """gRPC implements only success-rate and failure-percentage ejection (gRFC A50): the
    failure share ejects a server that fails every call."""
    rig.server("good")
    bad = rig.server("bad")
    rig.write(
        {"v1": ["good", "bad"]},
        tier="retries: 0, outlier_detection: {interval: 1s, failure_percentage: 50,"
        " failure_percentage_min_requests: 5, base_ejection_time: 60s}",
    )
    rig.start()
    wait_until(lambda: rig.weight_of("bad") > 0 and rig.weight_of("good") > 0, 10, "both weighed")
    bad.fail = True
    got = rig.run("--wait-ready", "--seconds", "5", "--rate", "40")
    late = [o for at, _, o in got["trace"] if at >= 3.0]
    assert late and all(o == "good" for o in late), got["codes"]
    assert got["codes"].get("INTERNAL", 0) > 0  # it did fail before it was ejected


def test_a_server_added_while_loading_gets_no_call_until_it_is_ready(rig: Rig) -> None:
    """A fleet edit that adds a server still loading its model: no client picks it before
    the probes have seen it ready (it used to get 4 to 8 calls, each failing)."""
    a = rig.server("a")
    rig.write({"v1": ["a"]})
    rig.start()
    c = rig.client("--csds", "--wait-ready", "--seconds", "9", "--rate", "100", "--concurrency", "4")
    csds = int(expect_line(c, "csds").split()[1])
    expect_line(c, "ready")
    added: list[WhoServer] = []
    for i in range(3):
        s = rig.server(f"new{i}", loading=True)
        added.append(s)
        rig.write({"v1": ["a", *(x.name for x in added)]})
        # Once the client has the server in its assignment (held out), any pick of it would
        # show within the next 100 calls (1 s of them; seen: 1 in 100 when it was sent
        # callable at weight 1, its weight while loading).
        wait_until(lambda x=s.address: x in assigned(csds), 15, f"the client to get {s.name}")  # type: ignore[misc]
        since = a.calls
        wait_until(lambda n=since + 100: a.calls >= n, 15, "100 calls after the client had it")  # type: ignore[misc]
        assert s.while_loading == 0, f"{s.name} got {s.while_loading} calls while loading"
        s.set_loading(False)
    got = result(finish(c).splitlines()[-1])
    assert not got["codes"], got["details"]
    assert all(s.while_loading == 0 for s in added)
    # Once ready they serve.
    assert all(got["backends"].get(s.name, 0) > 0 for s in added), got["backends"]


def test_the_clients_csds_and_ours_report_the_same_versions(rig: Rig) -> None:
    rig.server("a")
    rig.write({"v1": ["a"]})
    rig.start()
    assert rig.cp is not None
    c = rig.client("--csds", "--wait-ready", "--calls", "1", node="grpc-csds")
    port = int(expect_line(c, "csds").split()[1])
    expect_line(c, "ready")

    def configs(address: str) -> dict[tuple[str, str], str]:
        with grpc.insecure_channel(address) as ch:
            r = csds_pb2_grpc.ClientStatusDiscoveryServiceStub(ch).FetchClientStatus(
                csds_pb2.ClientStatusRequest(), timeout=5
            )
        return {
            (g.type_url.rsplit(".", 1)[-1], g.name): g.version_info
            for cfg in r.config
            if cfg.node.id in ("", "grpc-csds")
            for g in cfg.generic_xds_configs
        }

    theirs = configs(f"127.0.0.1:{port}")
    assert {t for t, _ in theirs} >= {"Listener", "RouteConfiguration", "Cluster", "ClusterLoadAssignment"}
    ours: list[dict[tuple[str, str], str]] = []
    with contextlib.suppress(AssertionError):
        wait_until(lambda: ours.append(configs(rig.cp.xds)) or ours[-1] == theirs, 5, "the same versions")
    assert ours[-1] == theirs
    assert c.stdin is not None
    c.stdin.write("done\n")
    c.stdin.flush()
    c.communicate(timeout=10)


def test_a_drain_waits_for_the_calls_grpc_clients_report_in_flight(rig: Rig) -> None:
    """Drained means no request in flight, for proxyless clients too: their load reports say
    how many they have on the server (it used to say 'no requests in flight' regardless)."""
    slow = rig.server("slow")
    rig.server("other")
    rig.write({"v1": ["slow", "other"]})
    rig.start()
    assert rig.op is not None
    wait_until(lambda: rig.weight_of("slow") > 0 and rig.weight_of("other") > 0, 10, "both weighed")
    slow.sleep_s = 6.0
    # Both backends answered before the calls: gRPC's round robin sends calls only to the
    # backends it has connected to, and with one connected the 8 calls all went to the other
    # and ended at once (a CI run waited 10 s for a call on the slow server).
    c = rig.client(
        "--wait-ready", "--ready-backends", "2", "--calls", "8", "--concurrency", "8", "--deadline", "20"
    )
    expect_line(c, "ready")
    wait_until(lambda: slow.in_flight >= 1, 10, "calls in flight on the slow server")
    started = time.monotonic()
    rig.op.endpoints.Drain(
        endpoint_pb2.DrainRequest(address=slow.address, timeout_seconds=30), metadata=rig.op.md, timeout=10
    )
    in_flight_when_drained: list[int] = []

    def drained() -> bool:
        if rig.endpoints()[slow.address].state != "DRAINED":
            return False
        in_flight_when_drained.append(slow.in_flight)
        return True

    wait_until(drained, 30, "the drain to finish")
    assert in_flight_when_drained == [0], "drained with calls still in flight"
    assert time.monotonic() - started >= 3.0
    out, _ = c.communicate(timeout=30)
    assert not result(out.splitlines()[-1])["codes"]


def test_ring_hash_affinity_keeps_a_grpc_clients_key_on_one_server(rig: Rig) -> None:
    """gRPC implements ring_hash (not maglev): with it, a header's value keeps its server."""
    for n in ("a", "b", "c"):
        rig.server(n)
    rig.write({"v1": ["a", "b", "c"]}, model_keys="affinity: {header: x-session, algorithm: ring_hash}")
    rig.start()
    wait_until(lambda: all(rig.weight_of(n) > 0 for n in ("a", "b", "c")), 10, "all weighed")
    got = rig.run("--wait-ready", "--calls", "240", "--key-header", "x-session", "--keys", "24")
    assert not got["codes"] and len(got["by_key"]) == 24, got["details"]
    # Each key on one server (10 calls each); the keys spread over the servers (all 24 on
    # one of three would be a 1 in 3^23 chance).
    assert all(len(servers) == 1 for servers in got["by_key"].values()), got["by_key"]
    assert len(got["backends"]) >= 2, got["backends"]
