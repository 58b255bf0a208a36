"""Rollouts and drains through the operator API, with a real Envoy in front of emulated servers.

The issue's "done when": ~100 requests/s through Envoy from a separate process while
- a rollout v1 -> v2 runs through 4 steps, then v1 drains and is removed: zero non-2xx, zero resets;
- a canary answering 500 on 20% of requests is aborted within one analysis interval, and the
  only failures are the canary's own, before the abort;
- the control plane is killed (-9) mid-rollout and restarted: zero failures, same step after.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from controlplane.v1 import autoscaling_pb2, autoscaling_pb2_grpc, endpoint_pb2, rollout_pb2
from tests.integration.harness import (
    BIN,
    ControlPlane,
    EmulatedFleet,
    Emulator,
    Operator,
    Traffic,
    wait_until,
)

pytestmark = pytest.mark.envoy

MODEL = "llama"
# Short requests (4 tokens, ~10 ms) on many slots: 100 req/s is light load for 2 servers.
FAST = {"slots": 32, "decode_ms_per_token": 2, "prefill_ms_per_token": 0.01}


class Rig(EmulatedFleet):
    op: Operator | None = None
    traffic: Traffic | None = None

    def start(self, canary_flags: dict[str, object] | None = None) -> None:
        for name in ("a1", "a2"):
            self.servers[name] = Emulator(name, self.tmp, MODEL, **FAST)
        for name in ("b1", "b2"):
            self.servers[name] = Emulator(name, self.tmp, MODEL, **{**FAST, **(canary_flags or {})})
        a1, a2, b1, b2 = (self.servers[n].address for n in ("a1", "a2", "b1", "b2"))
        self.serve(
            f"listener: {{port: {self.listener}}}\n"
            "tiers: {small: {max_params_b: 15}}\n"
            "signals: {interval: 500ms, timeout: 400ms}\n"
            f"models: {{{MODEL}: {{params_b: 8, stable: v1, versions: {{\n"
            f"  v1: {{endpoints: [{{address: '{a1}'}}, {{address: '{a2}'}}]}},\n"
            f"  v2: {{endpoints: [{{address: '{b1}'}}, {{address: '{b2}'}}]}}}}}}}}\n"
        )
        assert self.cp is not None
        self.op = Operator(self.cp)
        self.traffic = Traffic(self.listener, MODEL, self.tmp)

    def addresses(self, *names: str) -> set[str]:
        return {self.servers[n].address for n in names}

    def rollout(self) -> rollout_pb2.Rollout:
        assert self.op is not None
        return self.op.rollouts.Get(rollout_pb2.GetRolloutRequest(model=MODEL), metadata=self.op.md)

    def start_rollout(self, **kw: Any) -> rollout_pb2.Rollout:
        assert self.op is not None
        return self.op.rollouts.Start(
            rollout_pb2.StartRolloutRequest(model=MODEL, to_version="v2", **kw), metadata=self.op.md
        )

    def command(self, method: str, **kw: Any) -> rollout_pb2.Rollout:
        assert self.op is not None
        rpc = getattr(self.op.rollouts, method)
        return rpc(rollout_pb2.RolloutCommand(model=MODEL, **kw), metadata=self.op.md)  # type: ignore[no-any-return]

    def endpoint_states(self) -> dict[str, str]:
        assert self.op is not None
        eps = self.op.endpoints.List(endpoint_pb2.ListEndpointsRequest(model=MODEL), metadata=self.op.md)
        return {e.address: e.state for e in eps.endpoints}

    def close(self) -> None:
        if self.traffic is not None:
            self.traffic.proc.stop()
        if self.op is not None:
            self.op.close()
        super().close()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    try:
        yield r
    finally:
        r.close()


def _warm(rig: Rig) -> None:
    assert rig.traffic is not None
    wait_until(lambda: len(rig.traffic.records()) > 100, 15, "traffic through Envoy")  # type: ignore[union-attr]


def _failures(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if not 200 <= r["status"] < 300]


def test_full_rollout_then_drain_and_removal_of_v1_drops_nothing(rig: Rig) -> None:
    rig.start()
    _warm(rig)
    assert rig.cp is not None and rig.envoy is not None
    # As an operator would: cpctl with the server's token, and a live watch until the end.
    cpctl = [
        str(BIN / "cpctl"),
        "--server",
        rig.cp.admin,
        "--token-file",
        str(rig.cp.state_dir / "admin-token"),
        "rollout",
    ]
    start = subprocess.run(
        [
            *cpctl,
            "start",
            MODEL,
            "--to",
            "v2",
            "--steps",
            "5,25,50,100",
            *("--interval", "2.5s"),
            "--min-requests",
            "10",
        ],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert start.returncode == 0, start.stderr
    watch = subprocess.run(
        [*cpctl, "status", MODEL, "-w", "-o", "json"], capture_output=True, text=True, timeout=60
    )
    assert watch.returncode == 0, watch.stderr  # 0: it ended Completed
    updates = [json.loads(line) for line in watch.stdout.splitlines() if line.strip()]
    assert updates[-1]["phase"] == "Completed"
    assert {u["weights"]["v2"] for u in updates} >= {5, 25, 50, 100}
    assert [u["step"] for u in updates] == sorted(u["step"] for u in updates)
    # v1 drains (no requests in flight), then its cluster is removed from every proxy.
    wait_until(
        lambda: all(rig.endpoint_states()[a] == "RETIRED" for a in rig.addresses("a1", "a2")),
        20,
        "v1 to be drained and removed",
    )
    wait_until(lambda: not rig.envoy.endpoints(f"{MODEL}@v1"), 10, "Envoy to drop the v1 cluster")  # type: ignore[union-attr]
    time.sleep(1.5)
    assert rig.traffic is not None
    records = rig.traffic.stop()
    assert len(records) > 1500
    assert _failures(records) == []
    done_at = time.time()
    late = [r for r in records if r["t"] > done_at - 1.0]
    assert {r["server"] for r in late} <= rig.addresses("b1", "b2")
    assert {r["server"] for r in records} == rig.addresses("a1", "a2", "b1", "b2")
    history = rig.op.rollouts.History(  # type: ignore[union-attr]
        rollout_pb2.GetRolloutRequest(model=MODEL),
        metadata=rig.op.md,  # type: ignore[union-attr]
    )
    phases = [h.phase for h in history.records]
    assert phases[-3:] == ["Completed", "Draining", "Retired"]
    assert "(admin token" in history.records[0].who  # who started it, as cpctl reported


def test_erroring_canary_is_aborted_within_one_interval_and_only_its_own_failures_show(rig: Rig) -> None:
    rig.start(canary_flags={"error_rate": 0.2, "seed": 3})
    _warm(rig)
    interval = 10.0
    rig.start_rollout(interval_seconds=interval, min_requests=20, max_error_rate=0.05)
    wait_until(lambda: rig.rollout().step >= 1, 10, "step 1")
    step1 = rig.rollout().step_started_at
    wait_until(lambda: rig.rollout().phase == "Aborted", interval + 2, "the automatic abort")
    r = rig.rollout()
    assert r.step == 1 and r.weights["v2"] == 0
    assert "canary error rate" in r.reason
    history = rig.op.rollouts.History(  # type: ignore[union-attr]
        rollout_pb2.GetRolloutRequest(model=MODEL),
        metadata=rig.op.md,  # type: ignore[union-attr]
    )
    aborted_at = next(h.at for h in history.records if h.phase == "Aborted")
    assert aborted_at - step1 <= interval
    time.sleep(3)
    assert rig.traffic is not None
    records = rig.traffic.stop()
    canary = rig.addresses("b1", "b2")
    failures = _failures(records)
    assert failures, "the canary's 500s should show before the abort"
    assert all(f["status"] == 500 and f["server"] in canary for f in failures), failures[:5]
    # Requests sent after the abort reached every proxy (well under a second) all succeed.
    assert [f for f in failures if f["t"] > aborted_at + 1.0] == []
    after = [r for r in records if r["t"] > aborted_at + 1.0]
    assert len(after) > 100
    assert {r["server"] for r in after} <= rig.addresses("a1", "a2")  # stable takes 100%
    wait_until(lambda: all(rig.endpoint_states()[a] == "RETIRED" for a in canary), 15, "the canary to drain")


def test_kill_9_mid_rollout_drops_nothing_and_resumes_at_the_same_step(rig: Rig) -> None:
    rig.start()
    _warm(rig)
    rig.start_rollout(manual=True)
    wait_until(lambda: rig.rollout().step == 1, 10, "step 1")
    rig.command("Promote")
    assert rig.rollout().weights["v2"] == 25
    cp = rig.cp
    assert cp is not None and cp.proc is not None
    canary = rig.addresses("b1", "b2")

    def canary_share(records: list[dict[str, Any]]) -> float:
        return sum(r["server"] in canary for r in records) / max(1, len(records))

    assert rig.traffic is not None
    wait_until(
        lambda: 0.12 < canary_share(rig.traffic.records()[-200:]) < 0.4,  # type: ignore[union-attr]
        10,
        "Envoy to split 75/25",
    )
    cp.proc.kill()  # kill -9: no chance to save anything
    down_at = time.time()
    time.sleep(3)
    restarted = ControlPlane(
        cp.config, cp.log_dir, xds_port=cp.xds_port, metrics_port=cp.metrics_port, admin_port=cp.admin_port
    )
    rig.cp = restarted.start()
    r = rig.rollout()
    assert (r.phase, r.step, dict(r.weights)) == ("Progressing", 2, {"v1": 75, "v2": 25})
    wait_until(lambda: len(restarted.proxies()) == 1, 10, "Envoy to reconnect")
    time.sleep(2)
    rig.command("Promote", full=True)  # 100%: v1 leaves; completed once Envoy's routes left it
    wait_until(lambda: rig.rollout().phase == "Completed", 10, "the rollout to complete")
    time.sleep(2)
    assert rig.traffic is not None
    records = rig.traffic.stop()
    assert _failures(records) == []
    # Envoy kept the 75/25 split while the control plane was down.
    outage = [r for r in records if down_at <= r["t"] <= down_at + 3]
    assert len(outage) > 200
    assert 0.12 < canary_share(outage) < 0.4


# One model, two versions, no signals: what the API and the proxies' ACKs do, nothing else.
TWO_VERSIONS_NO_SERVERS = (
    "listener: {port: 10000}\ntiers: {small: {}}\nsignals: {enabled: false}\n"
    "models: {m: {params_b: 8, stable: v1, versions: {v1: {endpoints: [{address: '127.0.0.1:9'}]},"
    " v2: {endpoints: [{address: '127.0.0.1:10'}]}}}}\n"
)


def test_grpcurl_lists_the_services_and_auth_is_enforced(tmp_path: Path) -> None:
    import shutil
    import sys

    config = tmp_path / "fleet.yaml"
    config.write_text(TWO_VERSIONS_NO_SERVERS)
    ro = tmp_path / "ro-token"
    ro.write_text("read-only-secret\n")
    cp = ControlPlane(config, tmp_path, extra_args=["--admin-readonly-token-file", str(ro)]).start()
    grpcurl = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or "grpcurl"
    try:
        assert (cp.state_dir / "admin-token").stat().st_mode & 0o777 == 0o600
        out = subprocess.run(
            [grpcurl, "-plaintext", cp.admin, "list"], capture_output=True, text=True, timeout=20
        )
        assert out.returncode == 0, out.stderr
        assert {
            "controlplane.v1.RolloutService",
            "controlplane.v1.EndpointService",
            "controlplane.v1.ProxyService",
            "controlplane.v1.AutoscalingService",
            "grpc.health.v1.Health",
        } <= set(out.stdout.split())
        call = [grpcurl, "-plaintext", "-d", '{"model": "m"}', cp.admin, "controlplane.v1.RolloutService/Get"]
        denied = subprocess.run(call, capture_output=True, text=True, timeout=20)
        assert denied.returncode != 0 and "Unauthenticated" in denied.stderr
        token = (cp.state_dir / "admin-token").read_text().strip()
        with_token = subprocess.run(
            [*call[:2], "-H", f"authorization: Bearer {token}", *call[2:]],
            capture_output=True,
            text=True,
            timeout=20,
        )
        assert "NotFound" in with_token.stderr and "has no rollout" in with_token.stderr  # past auth
        op = Operator(cp, token="wrong")
        with pytest.raises(grpc.RpcError) as e:
            op.endpoints.List(endpoint_pb2.ListEndpointsRequest(), metadata=op.md)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        op.close()
        reader = Operator(cp, token="read-only-secret")
        assert (
            len(reader.endpoints.List(endpoint_pb2.ListEndpointsRequest(), metadata=reader.md).endpoints) == 2
        )
        scaling = autoscaling_pb2_grpc.AutoscalingServiceStub(reader.channel)
        scaling.List(autoscaling_pb2.ListAutoscalingRequest(), metadata=reader.md)  # read-only: allowed
        with pytest.raises(grpc.RpcError) as e:
            reader.rollouts.Start(
                rollout_pb2.StartRolloutRequest(model="m", to_version="v2"), metadata=reader.md
            )
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        reader.close()
    finally:
        cp.stop()


def test_drain_stops_new_requests_then_removes_and_undrain_restores(rig: Rig) -> None:
    rig.start()
    _warm(rig)
    assert rig.op is not None and rig.envoy is not None and rig.traffic is not None
    a1 = rig.servers["a1"].address
    drained = rig.op.endpoints.Drain(
        endpoint_pb2.DrainRequest(address=a1, reason="maintenance"), metadata=rig.op.md
    )
    assert drained.state == "DRAINING"
    drain_at = time.time()
    wait_until(lambda: rig.endpoint_states()[a1] == "DRAINED", 15, "the drain to finish")
    wait_until(lambda: a1 not in rig.envoy.endpoints(f"{MODEL}@v1"), 5, "Envoy to drop it")  # type: ignore[union-attr]
    time.sleep(1)
    records = rig.traffic.records()
    assert [r for r in records if r["t"] > drain_at + 1.0 and r["server"] == a1] == []
    rig.op.endpoints.Undrain(endpoint_pb2.DrainRequest(address=a1), metadata=rig.op.md)
    back_at = time.time()
    wait_until(
        lambda: any(r["server"] == a1 and r["t"] > back_at for r in rig.traffic.records()),  # type: ignore[union-attr]
        10,
        "traffic to reach the undrained server",
    )
    assert _failures(rig.traffic.stop()) == []
    with pytest.raises(grpc.RpcError) as e:
        rig.op.endpoints.Drain(endpoint_pb2.DrainRequest(address="127.0.0.1:1"), metadata=rig.op.md)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_proxy_that_never_acks_the_canary_pauses_the_rollout_naming_it(tmp_path: Path) -> None:
    import threading

    from envoy.config.core.v3 import base_pb2
    from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

    config = tmp_path / "fleet.yaml"
    config.write_text(TWO_VERSIONS_NO_SERVERS)
    cp = ControlPlane(config, tmp_path).start()
    op = Operator(cp)
    release = threading.Event()
    channel = grpc.insecure_channel(cp.xds)

    def requests() -> Iterator[discovery_pb2.DiscoveryRequest]:
        # A real gRPC ADS client that subscribes to every cluster and then never ACKs.
        yield discovery_pb2.DiscoveryRequest(
            node=base_pb2.Node(id="stuck-proxy"),
            type_url="type.googleapis.com/envoy.config.cluster.v3.Cluster",
        )
        release.wait(30)

    stream = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources(requests())
    try:
        next(stream)  # the clusters arrived; no ACK follows
        r = op.rollouts.Start(
            rollout_pb2.StartRolloutRequest(model="m", to_version="v2", ack_deadline_seconds=2),
            metadata=op.md,
        )
        assert r.step == 0 and r.weights["v2"] == 0
        get = rollout_pb2.GetRolloutRequest(model="m")
        wait_until(lambda: op.rollouts.Get(get, metadata=op.md).phase == "Paused", 6, "the pause")
        paused = op.rollouts.Get(get, metadata=op.md)
        assert "stuck-proxy" in paused.reason and paused.weights["v2"] == 0
        release.set()
        stream.cancel()
        op.rollouts.Resume(rollout_pb2.RolloutCommand(model="m"), metadata=op.md)
        wait_until(lambda: op.rollouts.Get(get, metadata=op.md).step == 1, 5, "step 1 once it is gone")
    finally:
        release.set()
        channel.close()
        op.close()
        cp.stop()


def test_promote_full_from_the_first_step_drops_nothing(rig: Rig) -> None:
    # The old version's endpoints go DRAINING only after every proxy has the route that no
    # longer sends to it; marking them at once could leave Envoy a moment routing to a
    # cluster whose endpoints all refuse new requests (a 503, seen in ~4 of 10 runs before).
    # A timed rollout (issue 22): promote --full finishes now, not at the end of a step's interval.
    rig.start()
    _warm(rig)
    rig.start_rollout(interval_seconds=300)
    wait_until(lambda: rig.rollout().step == 1, 10, "step 1 (every proxy has the canary)")
    time.sleep(1)
    assert rig.command("Promote", full=True).finishing
    assert rig.endpoint_states()[rig.servers["a1"].address] == "LEAVING"
    took = wait_until(lambda: rig.rollout().phase == "Completed", 3, "the rollout to complete within 3 s")
    print(f"promote --full to Completed: {took:.2f} s")
    wait_until(
        lambda: all(rig.endpoint_states()[a] == "RETIRED" for a in rig.addresses("a1", "a2")),
        20,
        "v1 to leave, drain and be removed",
    )
    assert rig.traffic is not None
    assert _failures(rig.traffic.stop()) == []


class ScriptedAds:
    """A real gRPC ADS client that subscribes like Envoy (CDS and LDS wildcard, then EDS for
    its clusters and RDS for its listener's routes) and ACKs every response, until told to
    stop ACKing one type: then it holds whatever it had of that type, like a stuck proxy."""

    def __init__(self, target: str, node_id: str) -> None:
        import queue
        import threading

        from envoy.config.core.v3 import base_pb2
        from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

        self.pb = discovery_pb2
        self.node = base_pb2.Node(id=node_id, user_agent_name="envoy")
        self.outbox: queue.Queue[Any] = queue.Queue()
        self.frozen: set[str] = set()
        self.responses: dict[str, int] = {}
        self.channel = grpc.insecure_channel(target)
        self._stop = threading.Event()
        self._subscribed: dict[str, tuple[str, ...]] = {}
        self.stream = ads_pb2_grpc.AggregatedDiscoveryServiceStub(self.channel).StreamAggregatedResources(
            self._requests()
        )
        for t in (CDS, LDS):
            self._ask(t, (), "", first=t == CDS)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _requests(self) -> Iterator[Any]:
        import queue

        while not self._stop.is_set():
            try:
                yield self.outbox.get(timeout=0.1)
            except queue.Empty:
                continue

    def _ask(self, type_url: str, names: tuple[str, ...], nonce: str, first: bool = False) -> None:
        req = self.pb.DiscoveryRequest(type_url=type_url, resource_names=names, response_nonce=nonce)
        if first:
            req.node.CopyFrom(self.node)
        self._subscribed[type_url] = names
        self.outbox.put(req)

    def _read(self) -> None:
        from envoy.config.cluster.v3 import cluster_pb2
        from envoy.config.listener.v3 import listener_pb2
        from envoy.extensions.filters.network.http_connection_manager.v3 import (
            http_connection_manager_pb2 as hcm_pb2,
        )

        try:
            for resp in self.stream:
                t = resp.type_url
                self.responses[t] = self.responses.get(t, 0) + 1
                if t in self.frozen:
                    continue  # no ACK, ever: it keeps what it had
                self._ask(t, self._subscribed.get(t, ()), resp.nonce)
                if t == CDS:
                    clusters = (cluster_pb2.Cluster.FromString(a.value) for a in resp.resources)
                    names = tuple(sorted(c.name for c in clusters))
                    if names != self._subscribed.get(EDS):
                        self._ask(EDS, names, "")
                elif t == LDS and ROUTES not in self._subscribed:
                    for a in resp.resources:
                        lst = listener_pb2.Listener.FromString(a.value)
                        hcm = hcm_pb2.HttpConnectionManager()
                        lst.filter_chains[0].filters[0].typed_config.Unpack(hcm)
                        self._ask(ROUTES, (hcm.rds.route_config_name,), "")
        except grpc.RpcError:
            pass

    def close(self) -> None:
        self._stop.set()
        self.stream.cancel()
        self.channel.close()


CDS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
LDS = "type.googleapis.com/envoy.config.listener.v3.Listener"
ROUTES = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"


def test_a_proxy_still_routing_to_the_old_stable_pauses_the_rollout_naming_it(tmp_path: Path) -> None:
    """At 100% the old stable leaves; a proxy whose ACKed routes still name it (it stopped
    ACKing routes) keeps it from draining, and after the deadline the rollout pauses naming
    it. Once it is gone, resume completes the rollout and the old version drains."""
    config = tmp_path / "fleet.yaml"
    config.write_text(TWO_VERSIONS_NO_SERVERS)
    cp = ControlPlane(config, tmp_path).start()
    op = Operator(cp)
    proxy = ScriptedAds(cp.xds, "stuck-proxy")
    get = rollout_pb2.GetRolloutRequest(model="m")
    try:
        wait_until(lambda: cp.proxies()[0]["types"]["route"]["status"] == "SYNCED", 10, "the proxy to sync")
        op.rollouts.Start(
            rollout_pb2.StartRolloutRequest(model="m", to_version="v2", manual=True, ack_deadline_seconds=2),
            metadata=op.md,
        )
        wait_until(lambda: op.rollouts.Get(get, metadata=op.md).step == 1, 10, "step 1")
        wait_until(lambda: cp.proxies()[0]["types"]["route"]["status"] == "SYNCED", 10, "the 95/5 routes")
        proxy.frozen.add(ROUTES)  # from now on it ACKs no route: its routes keep naming m@v1
        sent = proxy.responses.get(ROUTES, 0)
        r = op.rollouts.Promote(rollout_pb2.RolloutCommand(model="m", full=True), metadata=op.md)
        assert (r.phase, r.finishing, r.weights["v2"]) == ("Progressing", True, 100)
        wait_until(lambda: proxy.responses.get(ROUTES, 0) > sent, 5, "the routes without v1 to reach it")
        wait_until(lambda: op.rollouts.Get(get, metadata=op.md).phase == "Paused", 8, "the pause")
        paused = op.rollouts.Get(get, metadata=op.md)
        assert "stuck-proxy" in paused.reason and "still route to v1" in paused.reason, paused.reason
        eps = op.endpoints.List(endpoint_pb2.ListEndpointsRequest(model="m"), metadata=op.md).endpoints
        assert {e.address: e.state for e in eps}["127.0.0.1:9"] == "LEAVING"  # not drained under it
        status = cp.proxies()[0]["types"]["route"]
        assert status["status"] == "STALE" and "not yet ACKed" in status["reason"]
        proxy.close()
        wait_until(lambda: cp.proxies() == [], 5, "the stuck proxy to go")
        op.rollouts.Resume(rollout_pb2.RolloutCommand(model="m"), metadata=op.md)
        wait_until(lambda: op.rollouts.Get(get, metadata=op.md).phase == "Completed", 5, "completion")
    finally:
        proxy.close()
        op.close()
        cp.stop()
