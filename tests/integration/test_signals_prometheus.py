"""The Prometheus signal source against a real Prometheus server, through a real Envoy.

Issue 14's "done when": with `signals.source: prometheus`, a backlogged server is
down-weighted through Envoy (Prometheus scrapes the emulated servers every second; the
control plane reads them back with instant queries); stopping Prometheus fades the weights
to capacity (equal for equal servers), and no weight drops to zero at any time.

Prometheus is Debian's `prometheus` package (`.ci/run` installs it). Without it the test
is skipped, unless CONTROLPLANE_REQUIRE_PROMTOOL=1 (CI), where it fails.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import Emulator, wait_until
from tests.integration.prometheus import Prometheus, PrometheusFleet, prometheus_binary

pytestmark = pytest.mark.envoy

MODEL = "chat"
CLUSTER = f"{MODEL}@v1"
# As test_adaptive_weights: phantom requests of 40 tokens hold one of 4 slots 0.4 s, so a
# backlog of 24 is a real queue.
FAST = {"slots": 4, "decode_ms_per_token": 10, "prefill_ms_per_token": 0.1, "phantom_output_tokens": 40}
SIGNALS = (
    "{{source: prometheus, interval: 1s, stale_after: 3s, stale_full: 8s, "
    "prometheus: {{url: 'http://127.0.0.1:{port}', interval: 1s, timeout: 500ms}}}}"
)


class Rig(PrometheusFleet):
    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp)
        self.seen: list[tuple[float, dict[str, int]]] = []  # Envoy's weights, sampled throughout
        self._sampling = threading.Event()
        self._sampler: threading.Thread | None = None

    def start(self, names: list[str]) -> None:
        assert self.prometheus is not None
        lines = [
            f"listener: {{port: {self.listener}}}",
            "tiers: {small: {max_params_b: 15, timeout: 60s}}",
            f"signals: {SIGNALS.format(port=self.prometheus.port)}",
            f"models: {{{MODEL}: {{params_b: 8, stable: v1, versions: {{v1: {{endpoints: [",
            *(f"  {{address: '{self.servers[n].address}'}}," for n in names),
            "]}}}}",
        ]
        self.serve("\n".join(lines) + "\n")
        self._sampling.set()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def weights(self) -> dict[str, int]:
        """Server name -> the weight Envoy has (0 when Envoy marks it unhealthy)."""
        assert self.envoy is not None
        by_addr = self.names()
        return {
            by_addr[a]: (0 if "failed_eds_health" in flags else w)
            for a, (w, flags) in self.envoy.endpoints(CLUSTER).items()
            if a in by_addr
        }

    def _sample(self) -> None:
        while self._sampling.is_set():
            with contextlib.suppress(Exception):  # Envoy's admin busy a moment: the next counts
                self.seen.append((time.monotonic(), self.weights()))
            time.sleep(0.2)

    def close(self) -> None:
        self._sampling.clear()
        if self._sampler is not None:
            self._sampler.join(5)
        super().close()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    binary = prometheus_binary()
    r = Rig(tmp_path)
    try:
        for name in ("a", "b", "d"):
            r.servers[name] = Emulator(name, tmp_path, MODEL, **FAST)
        r.prometheus = Prometheus.scraping(binary, tmp_path, [s.address for s in r.servers.values()])
        yield r
    finally:
        r.close()


def test_a_backlogged_server_is_down_weighted_from_prometheus_and_fades_when_it_stops(rig: Rig) -> None:
    prom = rig.prometheus
    assert prom is not None
    wait_until(
        lambda: prom.alive() and len(prom.query("vllm:num_requests_running")) == 3,
        20,
        "Prometheus to scrape the three servers",
    )
    rig.start(["a", "b", "d"])
    assert rig.cp is not None
    cp = rig.cp
    wait_until(
        lambda: cp.metric("controlplane_signals_prometheus_series_matched") >= 3 * 8,
        10,
        "the control plane to match Prometheus's series to its endpoints",
    )
    assert cp.metric("controlplane_signals_prometheus_endpoints_without_series") == 0
    # The signals come from Prometheus, not from scraping the servers: an age of its samples.
    d = rig.servers["d"].address
    assert 0 < cp.metric("controlplane_endpoint_signal_age_seconds", endpoint=d) < 3

    rig.servers["d"].set_faults(backlog=24)
    wait_until(
        lambda: cp.metric("controlplane_endpoint_waiting", endpoint=d) >= 10,
        10,
        "d's queue to reach the control plane through Prometheus",
    )
    wait_until(
        lambda: 0 < rig.weights()["d"] < min(rig.weights()["a"], rig.weights()["b"]) / 3,
        10,
        "d's weight in Envoy to drop below a third of the others'",
    )
    low = rig.weights()

    prom.stop()
    stopped = time.monotonic()
    # Weights fade to capacity: the three equal servers end equal, d's backlog forgotten.
    wait_until(
        lambda: len(set(rig.weights().values())) == 1 and rig.weights()["d"] > 3 * low["d"],
        20,
        "the weights to fade back to capacity (equal) after Prometheus stopped",
    )
    faded_in = time.monotonic() - stopped
    assert cp.metric("controlplane_signals_prometheus_queries_total", outcome="unreachable") >= 1
    # Not at once: the last samples still counted until stale_after (3 s), then faded.
    assert faded_in > 2.0, faded_in
    assert all(
        cp.metric("controlplane_endpoint_ready", endpoint=s.address) == 1 for s in rig.servers.values()
    )

    # No weight ever went to zero, nor an endpoint missing from Envoy, from start to end.
    assert len(rig.seen) > 20
    for at, weights in rig.seen:
        assert set(weights) == {"a", "b", "d"}, (at, weights)
        assert min(weights.values()) > 0, (at - stopped, weights)
    during_fade = [w["d"] for at, w in rig.seen if at > stopped]
    assert len(set(during_fade)) >= 2, during_fade  # it moved from low to equal
