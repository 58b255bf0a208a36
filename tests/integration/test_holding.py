"""Requests held, not refused, while a model has no ready server (issue 17): real Envoy, the
control plane's holding service, emulated servers with a cold start.

Before: four requests for a model whose only server was loading got 503 in 0.0 s. Now they
wait in the holding service and are answered 200 by that server once it is warm. Past the
model's `hold_max` a request gets 429 with Retry-After, and one that waits longer than its
route timeout gets 503 with Retry-After, both in OpenAI's error shape."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from tests.integration.harness import Client, ControlPlane, Emulator, Envoy, Reply, free_port, wait_until

pytestmark = pytest.mark.envoy

COLD_START_S = 6.0


def _concurrently(port: int, model: str, n: int) -> list[tuple[float, Reply]]:
    """n requests at once; (seconds until answered, reply) each."""
    out: list[tuple[float, Reply]] = []
    lock = threading.Lock()

    def one() -> None:
        started = time.monotonic()
        c = Client(port)
        c.conn = None
        import http.client

        c.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        reply = c.post(model)
        with lock:
            out.append((time.monotonic() - started, reply))
        c.close()

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    return out


def test_requests_for_a_loading_model_wait_and_are_answered_once_it_is_warm(tmp_path: Path) -> None:
    # Loading until the stack is up; then restarted to load for COLD_START_S from then on, so a
    # slow start on a busy machine does not eat the time the requests are meant to wait.
    warm = Emulator("warm", tmp_path, "llama", cold_start=1000, decode_ms_per_token=2)
    never = Emulator("never", tmp_path, "qwen", cold_start=1000, decode_ms_per_token=2)
    listener = free_port()
    config = tmp_path / "fleet.yaml"
    config.write_text(
        f"listener: {{port: {listener}}}\n"
        "tiers: {small: {}}\n"
        "models:\n"
        f"  llama: {{params_b: 8, stable: v1, versions: {{v1: {{endpoints: ['{warm.address}']}}}}}}\n"
        "  qwen: {params_b: 8, stable: v1, timeout: 3s, autoscaling: {hold_max: 2},\n"
        f"         versions: {{v1: {{endpoints: ['{never.address}']}}}}}}\n"
    )
    cp = ControlPlane(config, tmp_path)
    envoy = Envoy("envoy-1", cp.xds, tmp_path, listener)
    try:  # everything started inside: a failed start stops the rest
        cp.start()
        envoy.start()
        started = time.monotonic()
        warm.stop()
        warm = Emulator(
            "warm", tmp_path, "llama", port=warm.port, cold_start=COLD_START_S, decode_ms_per_token=2
        )
        assert time.monotonic() - started < COLD_START_S - 1, "too slow to start: the test proves nothing"
        held: list[float] = []
        watcher = threading.Thread(
            target=lambda: held.extend(
                cp.metric("controlplane_held_requests", model="llama")
                for _ in range(20)
                if not time.sleep(0.1)
            )
        )
        watcher.start()
        replies = _concurrently(listener, "llama", 4)
        watcher.join()
        ready_at = started + COLD_START_S
        assert [r.status for _, r in replies] == [200] * 4, [(r.status, r.body[:200]) for _, r in replies]
        assert all(r.backend for _, r in replies)
        assert max(held) == 4  # all four waited in the holding service
        waited = max(t for t, _ in replies)
        print(
            f"4 held requests answered after {waited:.1f}s (server warm {ready_at - time.monotonic():+.1f}s)"
        )
        assert cp.metric("controlplane_hold_requests_total", model="llama", outcome="forwarded") == 4
        assert cp.metric("controlplane_held_requests", model="llama") == 0

        # Once the signals have heard the server ready, the model's route goes straight to it
        # again (no holding hop): within a signals round or two.
        def direct() -> bool:
            before = envoy.stat("cluster.controlplane-hold.upstream_rq_total")
            assert Client(listener).post("llama").status == 200
            return envoy.stat("cluster.controlplane-hold.upstream_rq_total") == before

        wait_until(direct, 5, "the route to go straight to the server")
        before = envoy.stat("cluster.controlplane-hold.upstream_rq_total")
        for _ in range(5):
            assert Client(listener).post("llama").status == 200
        assert envoy.stat("cluster.controlplane-hold.upstream_rq_total") == before

        # A model whose server never warms: two held until the 3 s timeout, the third refused.
        t0 = time.monotonic()
        replies = _concurrently(listener, "qwen", 3)
        statuses = sorted(r.status for _, r in replies)
        assert statuses == [429, 503, 503], [(r.status, r.body[:200]) for _, r in replies]
        for took, r in replies:
            err = json.loads(r.body)["error"]
            assert {"message", "type", "code"} <= set(err) and "qwen" in err["message"]
            if r.status == 429:
                assert took < 1.0 and err["code"] == "model_warming"
            else:
                assert 2.0 < took < 4.5, took
        print(f"qwen: {statuses} in {time.monotonic() - t0:.1f}s")
    finally:
        envoy.stop()
        cp.stop()
        warm.stop()
        never.stop()


def test_a_server_whose_port_is_closed_at_start_gets_no_request_and_its_requests_are_held(
    tmp_path: Path,
) -> None:
    """A vLLM keeps its port closed while it loads (no 503, unlike llama.cpp). Before, a
    control plane started beside it kept it in service, "out of sight, serving on its last
    verdict" though no verdict had ever been given, and requests failed with 503 upstream
    connect error after two retries. Now it is not ready yet: requests are held and answered
    once it listens and says it is ready."""
    port = free_port()
    listener = free_port()
    config = tmp_path / "fleet.yaml"
    config.write_text(
        f"listener: {{port: {listener}}}\n"
        "tiers: {small: {}}\n"
        "models:\n"
        f"  llama: {{params_b: 8, stable: v1, versions: {{v1: {{endpoints: ['127.0.0.1:{port}']}}}}}}\n"
    )
    cp = ControlPlane(config, tmp_path)
    envoy = Envoy("envoy-1", cp.xds, tmp_path, listener)
    server: Emulator | None = None
    try:
        cp.start()
        envoy.start()
        result: list[list[tuple[float, Reply]]] = []
        asker = threading.Thread(target=lambda: result.append(_concurrently(listener, "llama", 3)))
        asker.start()
        time.sleep(3.0)  # the requests wait; nothing listens yet
        assert asker.is_alive(), "the requests were answered before any server listened"
        assert cp.metric("controlplane_held_requests", model="llama") == 3
        assert (
            cp.metric("controlplane_endpoints_out_of_sight", model="llama", version="v1", decision="kept")
            == 0
        )
        server = Emulator("late", tmp_path, "llama", port=port, decode_ms_per_token=2)
        asker.join(40)
        [replies] = result
        assert [r.status for _, r in replies] == [200] * 3, [(r.status, r.body[:200]) for _, r in replies]
        assert all(t > 3.0 for t, _ in replies), [t for t, _ in replies]
        print(f"3 requests held {min(t for t, _ in replies):.1f}-{max(t for t, _ in replies):.1f}s")
    finally:
        envoy.stop()
        cp.stop()
        if server is not None:
            server.stop()
