"""Autoscaling end to end on one machine (issue 17): the `emulator` provider starts and stops
emulated servers following desired replicas, with real Envoy in front.

A model with `min: 0` starts with no server. Four requests are held, wake it (desired 1+),
and are answered 200 once the new server is warm. A surge raises the replicas; when it ends
the servers are drained, then stopped, down to zero, with no failed request."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.integration.harness import ControlPlane, Envoy, LoadLoop, free_port, wait_until
from tests.integration.test_holding import _concurrently

pytestmark = pytest.mark.envoy

COLD_START_S = 2.0


def test_scale_from_zero_up_a_surge_and_back_to_zero_without_a_failed_request(tmp_path: Path) -> None:
    listener = free_port()
    config = tmp_path / "fleet.yaml"
    config.write_text(
        f"listener: {{port: {listener}}}\n"
        f"autoscaling: {{provider: emulator, emulator: {{cold_start: {COLD_START_S:g}s, slots: 2, "
        "decode_ms_per_token: 20}}\n"
        "tiers: {small: {autoscaling: {min: 0, max: 4, idle_grace: 4s, stable_window: 6s, panic_window: 2s,\n"
        "                              target_per_replica: 2}}}\n"
        "models: {llama: {params_b: 8, stable: v1, versions: {v1: {endpoints: []}}}}\n"
    )
    cp = ControlPlane(config, tmp_path)
    envoy = Envoy("envoy-1", cp.xds, tmp_path, listener)

    def servers() -> int:
        return len(envoy.endpoints("llama@v1"))

    try:  # everything started inside: a failed start stops the rest
        cp.start()
        envoy.start()
        assert servers() == 0 and cp.metric("controlplane_model_desired_replicas", model="llama") == 0
        replies = _concurrently(listener, "llama", 4)
        assert [r.status for _, r in replies] == [200] * 4, [(r.status, r.body[:200]) for _, r in replies]
        first = min(t for t, _ in replies)
        print(f"scale from zero: first answer after {first:.1f}s (cold start {COLD_START_S:g}s)")
        assert first <= COLD_START_S + 3.0

        with LoadLoop(listener, "llama", threads=8, max_tokens=20) as load:
            peak = 0
            ends = time.monotonic() + 7
            while time.monotonic() < ends:
                peak = max(peak, servers())
                time.sleep(0.5)
        assert load.failures == [], load.failures[:5]
        print(f"surge: up to {peak} servers, {len(load.records)} requests")
        assert peak >= 3
        took = wait_until(lambda: servers() == 0, 40, "every server drained and stopped")
        print(f"back to zero {took:.1f}s after the surge")
        assert cp.metric("controlplane_model_desired_replicas", model="llama") == 0
        log = cp.proc.log() if cp.proc else ""
        assert "emulated server stopped" in log and "endpoint draining" in log
    finally:
        envoy.stop()
        cp.stop()
