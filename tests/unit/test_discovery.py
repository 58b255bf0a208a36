"""Discovery's pure parts: a failing source never empties a version (state.py), and a
discovered version's endpoints are filled in like listed ones (manager.augment)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest

from controlplane.discovery.manager import Discovery
from controlplane.discovery.state import Found, SourceState
from controlplane.fleet import parse_fleet
from controlplane.fleet.errors import FleetConfigInvalid
from controlplane.obs.metrics import Metrics

A, B, C = Found("127.0.0.11", 8000), Found("127.0.0.12", 8000), Found("127.0.0.13", 8000)


def test_an_answer_with_servers_replaces_the_known_set() -> None:
    s = SourceState("dns:x")
    assert s.known is None and not s.healthy
    assert s.answer((A, B), 0.0, 5.0) and s.known == (A, B) and s.healthy
    assert not s.answer((B, A), 1.0, 5.0)  # the same set in another order: no change
    assert s.answer((B, C), 2.0, 5.0) and s.known == (B, C)
    assert set(s.seen_at) == {B.address, C.address}


def test_an_error_keeps_the_last_known_set() -> None:
    s = SourceState("dns:x")
    s.answer((A, B), 0.0, 5.0)
    s.failed("SERVFAIL")
    s.failed("SERVFAIL")
    assert s.known == (A, B) and s.error == "SERVFAIL" and s.failures == 2 and not s.healthy
    s.answer((A, B), 3.0, 5.0)
    assert s.healthy and s.failures == 2


def test_an_empty_answer_empties_only_after_a_whole_hold() -> None:
    s = SourceState("dns:x")
    s.answer((A,), 0.0, 5.0)
    assert not s.answer((), 10.0, 5.0) and s.known == (A,) and "answered empty" in (s.error or "")
    assert not s.answer((), 14.9, 5.0) and s.known == (A,)
    assert s.answer((), 15.0, 5.0) and s.known == () and s.healthy
    # A server between two empty answers starts the hold again.
    s.answer((B,), 16.0, 5.0)
    s.answer((), 17.0, 5.0)
    s.answer((B,), 18.0, 5.0)
    assert not s.answer((), 19.0, 5.0) and s.known == (B,)


def test_a_source_that_never_had_servers_is_empty_at_once() -> None:
    s = SourceState("dns:x")
    assert s.answer((), 0.0, 5.0) and s.known == () and s.healthy


FLEET = """
listener: {port: 10000}
tiers: {small: {max_params_b: 15}}
models:
  m:
    params_b: 8
    stable: v2
    versions:
      v1: {endpoints: ["127.0.0.11:8000"]}
      v2: {discover: {dns: m.models.test, port: 8000, gpu: A100, zone: z1}}
"""


def test_a_discovered_version_gets_what_its_source_found_with_its_defaults() -> None:
    fleet = parse_fleet(FLEET)
    d = Discovery(None, Metrics(), lambda: None)  # type: ignore[arg-type]
    assert d.augment(fleet).models[0].version("v2").endpoints == ()  # nothing found yet
    changes = []
    d.on_change = lambda: changes.append(1)
    d.answered(("m", "v2"), (A, B, Found("127.0.0.14", 8000, zone="z2", gpu="H100")), 5.0)
    assert changes == [1]
    eps = d.augment(fleet).models[0].version("v2").endpoints
    # 127.0.0.11:8000 is the file's (v1): the first one wins, it is not served twice.
    assert [(e.address, e.gpu, e.zone) for e in eps] == [
        ("127.0.0.12:8000", "A100", "z1"),
        ("127.0.0.14:8000", "H100", "z2"),
    ]
    assert d.source_of("m", "v2", "127.0.0.12:8000")[0] == "dns:m.models.test"
    assert d.source_of("m", "v1", "127.0.0.11:8000") == ("file", None)


def test_a_server_that_leaves_its_source_stays_until_drained() -> None:
    fleet = parse_fleet(FLEET)
    d = Discovery(None, Metrics(), lambda: None)  # type: ignore[arg-type]
    d.augment(fleet)
    d.answered(("m", "v2"), (B, C), 5.0)
    d.answered(("m", "v2"), (C,), 5.0)
    eps = {e.address for e in d.augment(fleet).models[0].version("v2").endpoints}
    assert eps == {B.address, C.address} and B.address in d.leaving
    assert "gone" in d.source_of("m", "v2", B.address)[0]
    d.answered(("m", "v2"), (B, C), 5.0)  # back before it was drained
    assert B.address not in d.leaving


def test_a_failing_source_is_said_and_counted_and_keeps_serving() -> None:
    fleet = parse_fleet(FLEET)
    m = Metrics()
    d = Discovery(None, m, lambda: None)  # type: ignore[arg-type]
    d.augment(fleet)
    d.answered(("m", "v2"), (B,), 5.0)
    d.failed(("m", "v2"), "timeout")
    assert [e.address for e in d.augment(fleet).models[0].version("v2").endpoints] == [B.address]
    assert d.source_of("m", "v2", B.address)[0] == "dns:m.models.test (kept: the source fails: timeout)"
    assert d.status[0]["healthy"] is False and d.status[0]["error"] == "timeout"
    assert d.status[0]["endpoints"] == [B.address]
    assert (
        m.registry.get_sample_value("controlplane_discovery_source_healthy", {"model": "m", "version": "v2"})
        == 0
    )
    assert (
        m.registry.get_sample_value("controlplane_discovery_failures_total", {"model": "m", "version": "v2"})
        == 1
    )


def test_a_discovery_round_is_counted_and_a_source_gone_from_the_file_leaves_no_series() -> None:
    m = Metrics()
    d = Discovery(None, m, lambda: None)  # type: ignore[arg-type]
    d.augment(parse_fleet(FLEET))  # outside a loop: no source task asks DNS
    d.failed(("m", "v2"), "timeout")
    loop = {"loop": "discovery"}

    def sample(name: str, **labels: str) -> float | None:
        return m.registry.get_sample_value(name, {**loop, **labels})

    async def body() -> None:
        await d.one_round(0.5)
        assert sample("controlplane_loop_rounds_total", result="ok") == 1
        assert sample("controlplane_loop_interval_seconds") == 0.5
        # v2 no longer discovered: its series go at the next round, its failures counter too.
        discover = "discover: {dns: m.models.test, port: 8000, gpu: A100, zone: z1}"
        listed = FLEET.replace(discover, "endpoints: []")
        d.augment(parse_fleet(listed))
        await d.one_round(0.5)
        assert "controlplane_discovery_failures_total{" not in generate_latest(m.registry).decode()
        last = sample("controlplane_loop_last_success_timestamp_seconds")

        async def broken() -> None:
            raise RuntimeError("drain refused")

        d.step = broken  # type: ignore[method-assign]
        await d.one_round(0.5)
        assert sample("controlplane_loop_rounds_total", result="error") == 1
        assert sample("controlplane_loop_last_success_timestamp_seconds") == last

    asyncio.run(body())


@pytest.mark.parametrize(
    ("discover", "error"),
    [
        ("{dns: m.test}", "discover.port: missing"),
        ("{srv: _http._tcp.m.test, port: 80}", "not allowed with srv"),
        ("{dns: 'bad name!', port: 80}", "expected a DNS name"),
        ("{dns: a.test, srv: b.test, port: 1}", "expected exactly one of dns, srv, kubernetes"),
        ("{kubernetes: {namespace: models, selector: 'app=x'}}", "kubernetes.port: missing"),
        ("{kubernetes: {namespace: models, selector: '', port: 80}}", "kubernetes.selector"),
        ("{kubernetes: {namespace: models, selector: 'app=x', port: 'Not_A_Name'}}", "kubernetes.port"),
        ("{dns: a.test, port: 70000}", "discover.port"),
    ],
)
def test_a_bad_discover_names_the_field(discover: str, error: str) -> None:
    text = FLEET.replace("{dns: m.models.test, port: 8000, gpu: A100, zone: z1}", discover)
    with pytest.raises(FleetConfigInvalid) as e:
        parse_fleet(text)
    assert error in str(e.value), str(e.value)


# ---- Kubernetes: the selected pods' endpoints in the namespace's slices


def _k8s_inputs() -> tuple[dict[str, object], dict[str, object]]:
    from tests.integration.fake_kube import pod, slice_of

    pods = {
        "p1": pod("p1", {"app": "vllm"}, {"gpu": "A100", "gpu-memory-gb": "80", "capacity": "2"}),
        "p2": pod("p2", {"app": "vllm", "gpu": "L4"}),
        "p3": pod("p3", {"app": "vllm"}),
        "p4": pod("p4", {"app": "vllm"}),
    }
    eps = [
        {"ip": "127.0.50.1", "pod": "p1", "zone": "z1"},
        {"ip": "127.0.50.2", "pod": "p2", "ready": False, "serving": True, "terminating": True},
        {"ip": "127.0.50.3", "pod": "p3", "ready": False, "serving": False},  # starting: left out
        {"ip": "127.0.50.9", "pod": "not-selected"},
    ]
    slices = {"s": slice_of("s", "svc", 8000, eps), "other": slice_of("other", "svc", 9000, [])}
    return pods, slices


def test_kubernetes_servers_are_the_selected_pods_ready_or_terminating() -> None:
    from controlplane.discovery.kubernetes import servers
    from controlplane.fleet.model import Discover, DiscoverySettings

    pods, slices = _k8s_inputs()
    d = Discover("kubernetes", namespace="models", selector="app=vllm", port_name="http")
    found = {f.address: f for f in servers(d, DiscoverySettings(), pods, slices)}
    assert set(found) == {"127.0.50.1:8000", "127.0.50.2:8000"}
    p1, p2 = found["127.0.50.1:8000"], found["127.0.50.2:8000"]
    assert (p1.gpu, p1.gpu_memory_gb, p1.capacity, p1.zone, p1.terminating) == (
        "A100",
        80.0,
        2.0,
        "z1",
        False,
    )
    assert (p2.gpu, p2.terminating) == ("L4", True)
    # A port by number instead of name; a port name no slice has gives nothing.
    assert {
        f.port for f in servers(Discover("kubernetes", port=8443), DiscoverySettings(), pods, slices)
    } == {8443}
    assert servers(Discover("kubernetes", port_name="grpc"), DiscoverySettings(), pods, slices) == ()
    # Label keys are configurable.
    keyed = DiscoverySettings(gpu_label="nvidia.com/gpu.product")
    pods["p1"]["metadata"]["labels"]["nvidia.com/gpu.product"] = "H100"  # type: ignore[index]
    assert {f.gpu for f in servers(d, keyed, pods, slices) if f.host == "127.0.50.1"} == {"H100"}
