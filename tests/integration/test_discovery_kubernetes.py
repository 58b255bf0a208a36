"""Kubernetes discovery against a fake API server (issue 18; no real API server can run here:
tests/integration/fake_kube.py serves the documented JSON shapes and watch semantics),
through a real Envoy with traffic:

- the pods a label selector picks are served, with their GPU from a pod label;
- a terminating pod (serving, not ready) is DRAINING, takes no new request, and nothing fails;
- after the API server compacts its history (410 Gone), the source lists again and follows
  the pods added after it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from controlplane.v1 import endpoint_pb2
from tests.integration.fake_kube import FakeKube, pod, slice_of
from tests.integration.harness import EmulatedFleet, Emulator, Operator, Traffic, free_port, wait_until

pytestmark = pytest.mark.envoy

MODEL = "llama"
NS = "models"
FAST = {"slots": 16, "decode_ms_per_token": 2, "prefill_ms_per_token": 0.01}
LABELS = {"app": "vllm", "model": "llama", "version": "v1"}


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[tuple[EmulatedFleet, FakeKube]]:
    fleet = EmulatedFleet(tmp_path)
    kube = FakeKube(bookmark_s=0.5).start()
    try:
        yield fleet, kube
    finally:
        fleet.close()  # the control plane first: it keeps its watches open
        kube.stop()


def test_pods_are_served_drained_when_terminating_and_followed_after_a_410(
    rig: tuple[EmulatedFleet, FakeKube],
) -> None:
    fleet, kube = rig
    port = free_port()
    for i in (1, 2, 3):
        fleet.servers[f"p{i}"] = Emulator(f"p{i}", fleet.tmp, MODEL, port=port, host=f"127.0.42.{i}", **FAST)
    a1, a2, a3 = (s.address for s in fleet.servers.values())
    kube.put("pods", NS, pod("p1", {**LABELS, "gpu": "A100"}))
    kube.put("pods", NS, pod("p2", {**LABELS, "gpu": "L4"}))
    kube.put("pods", NS, pod("other", {"app": "vllm", "model": "qwen"}))  # not selected
    eps = [
        {"ip": "127.0.42.1", "pod": "p1", "zone": "z1"},
        {"ip": "127.0.42.2", "pod": "p2", "zone": "z1"},
        {"ip": "127.0.42.9", "pod": "other"},
    ]
    kube.put("endpointslices", NS, slice_of("llama-abc", "llama", port, eps))
    kubeconfig = fleet.tmp / "kubeconfig"
    kubeconfig.write_text(kube.kubeconfig())
    spec = {
        "listener": {"port": fleet.listener},
        "discovery": {"kubernetes": {"kubeconfig": str(kubeconfig)}},
        "signals": {"interval": "500ms"},
        "tiers": {"small": {"max_params_b": 15, "timeout": "30s"}},
        "models": {
            MODEL: {
                "params_b": 8,
                "stable": "v1",
                "versions": {
                    "v1": {
                        "discover": {
                            "kubernetes": {
                                "namespace": NS,
                                "selector": "app=vllm,model=llama,version=v1",
                                "port": "http",
                            }
                        }
                    }
                },
            }
        },
    }
    fleet.serve(yaml.safe_dump(spec))
    assert fleet.envoy is not None and fleet.cp is not None
    traffic = Traffic(fleet.listener, MODEL, fleet.tmp, rate=20)
    op = Operator(fleet.cp)

    def listed() -> dict[str, endpoint_pb2.Endpoint]:
        r = op.endpoints.List(endpoint_pb2.ListEndpointsRequest(model=MODEL), metadata=op.md, timeout=5)
        return {e.address: e for e in r.endpoints}

    def served(since: float) -> set[str]:
        return {r["server"] for r in traffic.records() if r["status"] == 200 and r["t"] >= since}

    try:
        wait_until(lambda: {a1, a2} <= served(0), 15, "both selected pods to take traffic")
        got = listed()
        assert set(got) == {a1, a2}  # the unselected pod's address is not served
        assert (got[a1].gpu, got[a2].gpu) == ("A100", "L4")
        assert got[a1].source == f"kubernetes:{NS}/app=vllm,model=llama,version=v1"

        # p1 terminating: serving, not ready -> DRAINING, no new requests.
        eps[0] |= {"ready": False, "serving": True, "terminating": True}
        kube.put("endpointslices", NS, slice_of("llama-abc", "llama", port, eps))
        wait_until(lambda: listed()[a1].state in ("DRAINING", "DRAINED"), 10, "the terminating pod to drain")
        drained_at = time.time()
        time.sleep(1.5)
        assert a1 not in served(drained_at + 0.5)

        # The API server compacts its history: every watch gets 410, the source lists again.
        lists = kube.lists
        kube.compact()
        wait_until(lambda: kube.lists >= lists + 2, 10, "the source to list again after 410")
        kube.put("pods", NS, pod("p3", {**LABELS, "gpu": "A100"}))
        eps.append({"ip": "127.0.42.3", "pod": "p3", "zone": "z2"})
        kube.put("endpointslices", NS, slice_of("llama-abc", "llama", port, eps))
        added = time.time()
        wait_until(lambda: a3 in served(added), 10, "a pod added after the relist to take traffic")
        assert listed()[a3].gpu == "A100"

        # p1 gone from the slice (its pod deleted): it leaves the fleet.
        kube.delete("pods", NS, "p1")
        kube.put("endpointslices", NS, slice_of("llama-abc", "llama", port, eps[1:]))
        wait_until(lambda: a1 not in listed(), 15, "the deleted pod to leave")
    finally:
        op.close()
        records = traffic.stop()
    failed = [r for r in records if r["status"] != 200]
    assert len(records) > 50 and failed == [], failed[:5]
