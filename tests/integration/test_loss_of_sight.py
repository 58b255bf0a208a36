"""Losing sight of the servers never takes traffic down; probes where each server has them.

Real peers: `controlplane serve` (collector processes), emulated servers on their own
loopback addresses (so that, as on a real fleet, every server has the same serving and
metrics ports), a real Envoy, the traffic generator. Issue 15's "done when":
- every scrape of a model's servers hanging, or refused at the metrics port while the
  serving port works: 0 failed requests over 12 s (30 s under -m soak) at 20 req/s, and the
  status shows the loss of sight;
- a Triton-style server with metrics on a separate port is read and weighted.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controlplane.v1 import endpoint_pb2
from tests.integration.harness import (
    OUTAGES,
    EmulatedFleet,
    Emulator,
    Operator,
    Traffic,
    free_port,
    wait_until,
)

pytestmark = pytest.mark.envoy

MODEL = "llama"
FAST = {"slots": 16, "decode_ms_per_token": 2, "prefill_ms_per_token": 0.01}


class SightRig(EmulatedFleet):
    """Servers on 127.0.<net>.1..n, all on one serving port (and one metrics port)."""

    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp)
        self.port = free_port()
        self.metrics_port = free_port()
        self.op: Operator | None = None
        self.traffic: Traffic | None = None

    def servers_on(self, net: int, n: int, **flags: object) -> list[Emulator]:
        for i in range(1, n + 1):
            name = f"s{i}"
            self.servers[name] = Emulator(
                name, self.tmp, MODEL, port=self.port, host=f"127.0.{net}.{i}", **flags
            )
        return list(self.servers.values())

    def start(self, model_keys: str = "") -> None:
        addrs = ", ".join(repr(s.address) for s in self.servers.values())
        self.serve(
            f"listener: {{port: {self.listener}}}\n"
            "tiers: {small: {max_params_b: 15}}\n"
            "signals: {interval: 500ms, timeout: 300ms}\n"
            f"models: {{{MODEL}: {{params_b: 8, stable: v1, {model_keys}\n"
            f"  versions: {{v1: {{endpoints: [{addrs}]}}}}}}}}\n"
        )
        assert self.cp is not None
        self.op = Operator(self.cp)

    def endpoints(self) -> list[Any]:
        assert self.op is not None
        r = self.op.endpoints.List(
            endpoint_pb2.ListEndpointsRequest(model=MODEL), metadata=self.op.md, timeout=5
        )
        return list(r.endpoints)

    def close(self) -> None:
        if self.traffic is not None:
            self.traffic.proc.stop()
        if self.op is not None:
            self.op.close()
        super().close()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[SightRig]:
    r = SightRig(tmp_path)
    try:
        yield r
    finally:
        r.close()


def _blind(rig: SightRig, outage_s: float, **fault: object) -> None:
    """Steady traffic; every server's probes fail (`fault`); `outage_s` later nothing has
    failed and the control plane says it has lost sight and kept serving."""
    assert rig.envoy is not None and rig.cp is not None
    wait_until(
        lambda: all(e.sight == "SEEN" and e.state == "SERVING" for e in rig.endpoints()), 15, "all seen"
    )
    rig.traffic = Traffic(rig.listener, MODEL, rig.tmp, rate=20)
    wait_until(lambda: len(rig.traffic.records()) > 20, 15, "traffic")  # type: ignore[union-attr]
    for s in rig.servers.values():
        s.set_faults(**fault)
    blind_at = time.time()
    # Out of sight after 3 unanswered scrapes (1.5 s here): the status says so, every server
    # still serves, and a loss-of-sight episode is counted.
    wait_until(
        lambda: all(e.sight == "OUT_OF_SIGHT" and e.state == "SERVING" for e in rig.endpoints()),
        10,
        "every server out of sight and still serving",
    )
    notes = {e.note for e in rig.endpoints()}
    assert all("kept serving" in n for n in notes), notes
    assert rig.cp.metric("controlplane_endpoints_out_of_sight", model=MODEL, decision="kept") == 3
    assert rig.cp.metric("controlplane_loss_of_sight_episodes_total", model=MODEL) == 1
    time.sleep(max(0.0, blind_at + outage_s - time.time()))
    weights = rig.envoy.endpoints(f"{MODEL}@v1")
    assert len(weights) == 3 and all(w > 0 for w, _ in weights.values()), weights
    records = rig.traffic.stop()  # type: ignore[union-attr]
    during = [r for r in records if r["t"] >= blind_at]
    assert len(during) >= 18 * outage_s  # 20 req/s
    failed = [r for r in records if not 200 <= r["status"] < 300]
    assert failed == [], failed[:5]
    served = {r["server"] for r in during}
    assert served == {s.address for s in rig.servers.values()}  # all three kept their share


@pytest.mark.parametrize("outage_s", OUTAGES)
def test_every_scrape_hanging_fails_no_request(rig: SightRig, outage_s: int) -> None:
    rig.servers_on(31, 3, **FAST)
    rig.start()
    _blind(rig, outage_s, probes_hang=True)


@pytest.mark.parametrize("outage_s", OUTAGES)
def test_metrics_port_refused_while_the_serving_port_works_fails_no_request(
    rig: SightRig, outage_s: int
) -> None:
    # Health and metrics both on the management port (as a firewall rule would cut both).
    rig.servers_on(32, 3, metrics_port=rig.metrics_port, **FAST)
    mp = rig.metrics_port
    rig.start(f"health: {{http: {{port: {mp}}}}}, metrics: {{port: {mp}}},")
    _blind(rig, outage_s, metrics_port_down=True)


def test_a_minority_out_of_sight_is_held_out_while_the_rest_is_seen(rig: SightRig) -> None:
    rig.servers_on(33, 3, **FAST)
    rig.start()
    wait_until(lambda: all(e.sight == "SEEN" for e in rig.endpoints()), 15, "all seen")
    rig.servers["s3"].set_faults(probes_hang=True)
    wait_until(
        lambda: {e.address: e.state for e in rig.endpoints()}[rig.servers["s3"].address] == "HELD_OUT",
        10,
        "the one out of sight held out",
    )
    s3 = next(e for e in rig.endpoints() if e.address == rig.servers["s3"].address)
    assert s3.sight == "OUT_OF_SIGHT" and "held out: the rest of its version is seen and ready" in s3.note
    assert rig.cp is not None
    assert rig.cp.metric("controlplane_endpoints_out_of_sight", model=MODEL, decision="held_out") == 1
    assert rig.cp.metric("controlplane_loss_of_sight_episodes_total", model=MODEL) == 0
    # It answers again: back in sight and serving.
    rig.servers["s3"].set_faults(probes_hang=False)
    wait_until(lambda: all(e.sight == "SEEN" and e.state == "SERVING" for e in rig.endpoints()), 40, "back")


def test_a_triton_style_server_is_read_on_its_metrics_port_and_weighted(rig: SightRig) -> None:
    mp = rig.metrics_port
    rig.servers_on(34, 2, metrics_port=mp, metrics_page="triton", **FAST)
    rig.start(f"health: {{http: {{path: /health}}}}, metrics: {{port: {mp}}},")
    assert rig.cp is not None
    rig.servers["s2"].set_faults(slow=6)
    rig.traffic = Traffic(rig.listener, MODEL, rig.tmp, rate=20)

    def weighted() -> bool:
        eps = {e.address: e for e in rig.endpoints()}
        fast, slow = eps[rig.servers["s1"].address], eps[rig.servers["s2"].address]
        read = all(0 <= e.signal_age_seconds < 5 and e.HasField("latency_seconds") for e in (fast, slow))
        return read and slow.weight < fast.weight / 2

    wait_until(weighted, 30, "the slow Triton server weighted below the fast one")
    assert rig.cp.metric("controlplane_signals_scrapes_total", outcome="ok") > 0
    records = rig.traffic.stop()
    assert [r for r in records if not 200 <= r["status"] < 300] == []
