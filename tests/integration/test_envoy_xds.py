"""The real Envoy binary against the real control plane, over SotW and delta ADS."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from controlplane.routing.translate import CLUSTER, ENDPOINT
from tests.integration.conftest import Stack
from tests.integration.harness import Client, ControlPlane, Reply, TrafficLoop, wait_until

pytestmark = pytest.mark.envoy

MODELS = {"llama": {"v1": ["l1", "l2"], "v2": ["l3"]}, "qwen": {"v1": ["q1"]}}


def alternate(client: Client, i: int) -> Reply:
    """Half by header, half by JSON body."""
    return client.post(header="llama") if i % 2 else client.post("llama")


def test_routes_by_header_and_by_body(stack: Stack) -> None:
    stack.write(MODELS)
    stack.start()
    c = stack.client()
    by_header = {c.post(header="llama").backend for _ in range(20)}
    assert by_header == {"l1", "l2"}  # the stable version's endpoints, balanced
    assert {c.post("llama").backend for _ in range(20)} == {"l1", "l2"}
    assert c.post("qwen").backend == "q1"
    assert c.post(header="qwen").backend == "q1"
    # The header wins over the body.
    assert c.post("llama", header="qwen").backend == "q1"
    unknown = c.post("gpt-9")
    assert unknown.status == 404 and json.loads(unknown.body)["error"]["code"] == "model_not_found"
    assert c.post(header="gpt-9").status == 404
    missing = c.post(None)
    assert missing.status == 400 and json.loads(missing.body)["error"]["code"] == "model_required"
    listed = c.request("GET", "/v1/models", None, {})
    assert listed.status == 200
    assert [m["id"] for m in json.loads(listed.body)["data"]] == ["llama", "qwen"]
    # The gateway's own health, as a model server's (benchmark tools check it first).
    health = c.request("GET", "/health", None, {})
    assert (health.status, json.loads(health.body)) == (200, {"status": "ok"})
    head = c.request("HEAD", "/health", None, {})
    assert (head.status, head.body) == (200, "")
    # With x-model, the model's own server answers (the emulator counts it as its request).
    assert c.request("GET", "/health", None, {"x-model": "qwen"}).backend == "q1"


def test_live_edits_apply_within_two_seconds_with_zero_failed_requests(stack: Stack) -> None:
    stack.write(MODELS)
    stack.start()
    assert stack.cp is not None
    with TrafficLoop(stack.listener_port, alternate) as loop:
        wait_until(lambda: loop.total() > 20, 5, "traffic to flow")

        # 1. Add an endpoint: it takes traffic within 3 s (once the probes have heard it say it
        # is ready: one or two signals rounds; no request goes to a server no one has seen ready).
        stack.write({**MODELS, "llama": {"v1": ["l1", "l2", "l4"], "v2": ["l3"]}})
        took = wait_until(lambda: loop.backends["l4"] > 0, 4.0, "the new endpoint to get traffic")
        print(f"new endpoint live after {took:.2f}s")

        # 2. Add a model: it answers 404 until it is live, never 503 (make-before-break).
        probe = stack.client()
        seen: list[int] = []

        def mistral_live() -> bool:
            r = probe.post("mistral")
            seen.append(r.status)
            return r.status == 200 and r.backend == "m1"

        stack.write({**MODELS, "llama": {"v1": ["l1", "l2", "l4"], "v2": ["l3"]}, "mistral": {"v1": ["m1"]}})
        took = wait_until(mistral_live, 2.0, "the new model to route", interval=0.01)
        print(f"new model live after {took:.2f}s; probe statuses {sorted(set(seen))}")
        assert set(seen) <= {404, 200}

        # 3. Change stable: all traffic moves to v2's endpoint within 2 s.
        models = {**MODELS, "llama": {"v1": ["l1", "l2", "l4"], "v2": ["l3"]}, "mistral": {"v1": ["m1"]}}
        stack.write(models, stable={"llama": "v2"})
        took = wait_until(
            lambda: [r.backend for r in loop.last(10)] == ["l3"] * 10, 2.0, "traffic to move to v2"
        )
        print(f"stable change live after {took:.2f}s")

        # 4. A broken edit changes nothing and is reported.
        before = stack.cp.metric("controlplane_config_reloads_total", result="invalid")
        stack.write_text(stack.config.read_text().replace("stable: v2", "stable: v7"))
        wait_until(
            lambda: (
                stack.cp is not None
                and stack.cp.metric("controlplane_config_reloads_total", result="invalid") == before + 1
            ),
            2.0,
            "the invalid edit to be counted",
        )
        assert stack.cp.metric("controlplane_config_valid") == 0
        assert "fleet config refused" in stack.cp.proc.log()  # type: ignore[union-attr]
        assert "names version 'v7'" in stack.cp.proc.log()  # type: ignore[union-attr]
        time.sleep(0.5)
        assert {r.backend for r in loop.last(10)} == {"l3"}
        assert probe.post("mistral").status == 200
    assert loop.failures == [], loop.failures[:5]
    assert loop.total() > 100


@pytest.mark.parametrize("stack", ["sotw"], indirect=True)  # the file watcher's rule: one transport
def test_a_file_caught_half_written_is_not_served_and_a_real_removal_lands_once_it_holds_still(
    stack: Stack,
) -> None:
    """Issue 16, F7: a writer that pauses mid-file (here 1.5 s, a valid 1-model prefix) took
    the other models to 404. A removal is now served only once the file holds still."""
    from controlplane import limits

    stack.write(MODELS)
    stack.start()
    c = stack.client()
    full = stack.config.read_text()
    cut = full.index("  qwen:")
    assert {c.post(m).status for m in ("llama", "qwen")} == {200}
    stack.config.write_text(full[:cut])  # in place, not atomic: the writer pauses here
    statuses = []
    pause_ends = time.monotonic() + 1.5
    while time.monotonic() < pause_ends:
        statuses += [c.post(m).status for m in ("llama", "qwen")]
        time.sleep(0.05)
    stack.config.write_text(full)  # the writer finishes
    assert set(statuses) == {200}, sorted(set(statuses))
    # A real removal: served once the file has held still for the settle time.
    stack.write({"qwen": MODELS["qwen"]})
    removed_at = time.monotonic()
    took = wait_until(lambda: c.post("llama").status == 404, limits.FILE_SETTLE_S + 3, "llama to be removed")
    assert took >= limits.FILE_SETTLE_S - 0.3, f"removed {took:.2f}s after the edit"
    assert c.post("qwen").status == 200
    print(f"removal served {time.monotonic() - removed_at:.2f}s after the edit")


def test_control_plane_restart_drops_no_request_and_envoy_resyncs(stack: Stack) -> None:
    stack.write(MODELS)
    stack.start()
    cp = stack.cp
    assert cp is not None and cp.proc is not None
    with TrafficLoop(stack.listener_port, alternate) as loop:
        wait_until(lambda: loop.total() > 20, 5, "traffic to flow")
        cp.proc.kill()  # SIGKILL: no goodbye to Envoy
        served = loop.total()
        wait_until(lambda: loop.total() > served + 50, 5, "traffic to keep flowing without a control plane")
        # Edit while the control plane is down, then bring it back on the same ports.
        stack.write({**MODELS, "llama": {"v1": ["l1", "l2", "l5"], "v2": ["l3"]}})
        restarted = ControlPlane(
            cp.config,
            cp.log_dir,
            xds_port=cp.xds_port,
            metrics_port=cp.metrics_port,
            admin_port=cp.admin_port,
        )
        stack.cp = restarted.start()
        took = wait_until(
            lambda: loop.backends["l5"] > 0, 10, "Envoy to resync from the restarted control plane"
        )
        print(f"resynced {took:.2f}s after restart")

        def synced() -> bool:
            [proxy] = restarted.proxies()
            return proxy["node_id"] == "envoy-1" and all(
                t["status"] == "SYNCED" for t in proxy["types"].values()
            )

        wait_until(synced, 5, "the proxy to show SYNCED on every type")
    assert loop.failures == [], loop.failures[:5]


def test_rejected_config_keeps_envoy_on_the_previous_one_and_is_not_resent(stack: Stack) -> None:
    stack.write(MODELS)
    stack.start()
    cp, envoy = stack.cp, stack.envoy
    assert cp is not None and envoy is not None
    with TrafficLoop(stack.listener_port, alternate) as loop:
        wait_until(lambda: loop.total() > 20, 5, "traffic to flow")
        # Valid for our schema, rejected by Envoy's validation (connect_timeout must be > 0).
        stack.write(MODELS, extra_model_keys={"llama": "cluster_overrides: {connect_timeout: -1s}"})
        wait_until(lambda: cp.metric("controlplane_xds_nacks_total", type="cluster") >= 1, 3, "the NACK")
        # The NACK names no resource: both changed clusters are probed one at a time (a
        # bisection, a few pushes within milliseconds) before it settles on what Envoy holds.
        pushes = -1.0

        def settled() -> bool:
            nonlocal pushes
            before, pushes = pushes, cp.metric("controlplane_xds_pushes_total", type="cluster")
            return pushes == before

        wait_until(settled, 5, "the bisection to settle", interval=0.5)
        rejected = envoy.stat("cluster_manager.cds.update_rejected")
        time.sleep(2.0)
        # Not re-sent in a loop: no new cluster push, no new rejection.
        assert cp.metric("controlplane_xds_pushes_total", type="cluster") == pushes
        assert envoy.stat("cluster_manager.cds.update_rejected") == rejected
        assert cp.metric("controlplane_xds_proxies_nacked", type="cluster") == 1
        [proxy] = cp.proxies()
        assert proxy["types"]["cluster"]["status"] == "NACKED"
        assert "Expected positive duration" in proxy["types"]["cluster"]["last_nack"]
        log = cp.proc.log()  # type: ignore[union-attr]
        assert "xds nack" in log and "Expected positive duration" in log
        assert {r.status for r in loop.last(10)} == {200}

        # Fixing the file clears it.
        stack.write({**MODELS, "llama": {"v1": ["l1", "l2", "l6"], "v2": ["l3"]}})
        wait_until(lambda: loop.backends["l6"] > 0, 6, "the fixed config to go live (l6 serves once probed)")
        wait_until(
            lambda: cp.metric("controlplane_xds_proxies_nacked", type="cluster") == 0, 3, "NACK to clear"
        )
    assert loop.failures == [], loop.failures[:5]


def test_metrics_report_streams_pushes_acks_and_convergence(stack: Stack) -> None:
    stack.write(MODELS)
    stack.start()
    cp = stack.cp
    assert cp is not None
    transport = "delta" if stack.delta else "sotw"
    assert cp.metric("controlplane_xds_streams", service="ads", transport=transport) == 1
    for t in ("cluster", "endpoint", "listener", "route"):
        assert cp.metric("controlplane_xds_pushes_total", type=t, transport=transport) >= 1
        assert cp.metric("controlplane_xds_acks_total", type=t) >= 1
        assert cp.metric("controlplane_xds_convergence_seconds_count", type=t) >= 1
    assert cp.metric("controlplane_snapshot_resources", type="cluster") == 4  # 3 models + the holding service
    assert cp.metric("controlplane_snapshot_generation") == 1
    assert cp.metric("controlplane_config_reloads_total", result="success") == 1


def test_a_proxy_that_stops_reading_does_not_delay_the_others(stack: Stack) -> None:
    """A stuck client holds at most one response per type; Envoy keeps converging."""
    stack.write(MODELS)
    stack.start()
    cp = stack.cp
    assert cp is not None
    channel = grpc.insecure_channel(cp.xds)
    requests = [
        discovery_pb2.DiscoveryRequest(type_url=CLUSTER, node={"id": "stuck"}),
        discovery_pb2.DiscoveryRequest(type_url=ENDPOINT, resource_names=["llama@v1", "llama@v2", "qwen@v1"]),
    ]
    done = threading.Event()

    def keep_open() -> Iterator[discovery_pb2.DiscoveryRequest]:
        yield from requests
        done.wait(60)  # never half-closes, like a real proxy

    stuck = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources(keep_open())
    try:
        wait_until(lambda: any(p["node_id"] == "stuck" for p in cp.proxies()), 5, "the stuck stream")
        endpoints = ["l1", "l2"]
        c = stack.client()
        assert stack.envoy is not None
        for i in range(8):  # eight edits, each must reach Envoy within 2 s
            endpoints.append(f"x{i}")
            stack.write({**MODELS, "llama": {"v1": endpoints, "v2": ["l3"]}})
            address = stack.backend(f"x{i}", "llama").address
            wait_until(lambda a=address: a in stack.envoy.endpoints("llama@v1"), 2, f"x{i} in Envoy's EDS")  # type: ignore[union-attr]
        # ... and each serves once the signals have heard from it.
        wait_until(
            lambda: {c.post(header="llama").backend for _ in range(40)} >= {f"x{i}" for i in range(8)},
            10,
            "x0-x7 serving",
        )
        [stuck_view] = [p for p in cp.proxies() if p["node_id"] == "stuck"]
        # It never read or ACKed: exactly one response per type was written to it.
        assert stuck_view["types"]["cluster"]["responses_sent"] == 1
        assert stuck_view["types"]["endpoint"]["responses_sent"] == 1
        assert stuck_view["types"]["endpoint"]["status"] == "STALE"
        [envoy_view] = [p for p in cp.proxies() if p["node_id"] == "envoy-1"]
        assert envoy_view["types"]["endpoint"]["status"] == "SYNCED"
    finally:
        done.set()
        stuck.cancel()
        channel.close()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def test_a_client_that_asks_for_too_much_is_refused_and_envoy_is_unaffected(stack: Stack) -> None:
    """Delta clients subscribing to 20 x 20,000 names that do not exist are refused at once,
    at a bounded cost (this took 180 s of CPU and 700 MB before the bound); one flooding
    requests is read at its own pace (bounded read-ahead); Envoy keeps serving."""
    from controlplane import limits

    stack.write(MODELS)
    stack.start()
    assert stack.cp is not None and stack.cp.proc is not None
    pid = stack.cp.proc.popen.pid
    channel = grpc.insecure_channel(stack.cp.xds, options=[("grpc.max_send_message_length", 16 << 20)])
    stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
    try:
        cpu_before, rss_before = _cpu_seconds(pid), _rss_mb(pid)
        for n in range(20):
            names = [f"x{n}-{i}" for i in range(20_000)]
            big = discovery_pb2.DeltaDiscoveryRequest(type_url=ENDPOINT, resource_names_subscribe=names)
            big.node.id = f"greedy-{n}"
            with pytest.raises(grpc.RpcError) as e:
                for _ in stub.DeltaAggregatedResources(iter([big]), timeout=20):
                    pass
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "do not exist" in (e.value.details() or "")
            assert str(limits.XDS_MAX_UNKNOWN_NAMES) in (e.value.details() or "")
        cpu, grown = _cpu_seconds(pid) - cpu_before, _rss_mb(pid) - rss_before
        assert cpu < 15, f"refusing 20 greedy streams cost {cpu:.1f} s of CPU"
        assert grown < 200, f"refusing 20 greedy streams grew the control plane by {grown:.0f} MB"

        def flood() -> Iterator[discovery_pb2.DiscoveryRequest]:
            first = discovery_pb2.DiscoveryRequest(type_url=CLUSTER)
            first.node.id = "flood"
            yield first
            for i in range(20000):  # re-subscriptions, as fast as the client can write them
                yield discovery_pb2.DiscoveryRequest(
                    type_url=ENDPOINT, resource_names=[f"llama@v{i % 2 + 1}"]
                )

        responses = stub.StreamAggregatedResources(flood(), timeout=60)
        next(responses)
        c = stack.client()
        assert [c.post(header="llama").status for _ in range(20)] == [200] * 20
        wait_until(
            lambda: any(p["node_id"] == "flood" for p in stack.cp.proxies()),  # type: ignore[union-attr]
            5,
            "the flooding client to be served, not refused",
        )
        responses.cancel()
    finally:
        channel.close()
