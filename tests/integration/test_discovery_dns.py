"""DNS discovery against a real DNS server (issue 18): dnsmasq on a loopback port, its hosts
file rewritten by the test and reloaded with SIGHUP; emulated servers on their own loopback
addresses, all on one port (as pods behind a headless Service); a real Envoy with traffic.

- the version's endpoints are the names' A records, served through Envoy;
- an address added to the hosts file takes traffic within the TTL + 2 s;
- an address removed is drained first: 0 failed requests;
- dnsmasq stopped: traffic goes on, unaffected, on the last known set, and the status and
  metrics say the source fails.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from controlplane.v1 import endpoint_pb2
from tests.integration.harness import (
    EmulatedFleet,
    Emulator,
    Operator,
    Traffic,
    free_port,
    http_get,
    wait_until,
)
from tests.peers import required

pytestmark = pytest.mark.envoy

MODEL = "llama"
NAME = "llama-v1.models.test"
TTL_S = 1
FAST = {"slots": 16, "decode_ms_per_token": 2, "prefill_ms_per_token": 0.01}


def dnsmasq_binary() -> str:
    """Debian's dnsmasq-base (`.ci/run` installs it); skip without it unless CI says it must be there."""
    found = shutil.which("dnsmasq") or next(
        (p for p in ("/usr/sbin/dnsmasq", "/sbin/dnsmasq") if os.path.exists(p)), None
    )
    return required(
        found,
        missing="dnsmasq is not installed (Debian: apt-get install dnsmasq-base, as .ci/run does)",
        env="CONTROLPLANE_REQUIRE_DNSMASQ",
    )


class Dnsmasq:
    """A real dnsmasq answering for *.test from a hosts file, nothing forwarded."""

    def __init__(self, tmp: Path) -> None:
        self.hosts = tmp / "dns-hosts"
        self.hosts.write_text("")
        self.port = free_port()
        self.log_path = tmp / "dnsmasq.log"
        self.log = self.log_path.open("ab")
        self.proc: subprocess.Popen[bytes] | None = None
        self.binary = dnsmasq_binary()

    def start(self) -> Dnsmasq:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--keep-in-foreground",
                f"--port={self.port}",
                "--listen-address=127.0.0.1",
                "--bind-interfaces",
                "--no-resolv",
                "--no-hosts",
                f"--addn-hosts={self.hosts}",
                "--local=/test/",
                # Started as root, dnsmasq would drop to `nobody`, who cannot read pytest's tmp dir.
                f"--user={pwd.getpwuid(os.getuid()).pw_name}",
                f"--local-ttl={TTL_S}",
                "--pid-file=",
                "--log-facility=-",
                "--log-queries",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        # Ready (its SIGHUP handler set) once it says it read the hosts file: a SIGHUP before
        # that would kill it.
        wait_until(lambda: f"read {self.hosts}" in self.log_path.read_text(), 10, "dnsmasq to start")
        return self

    def names(self, *hosts: str) -> None:
        """Make NAME resolve to `hosts` (SIGHUP: dnsmasq rereads its hosts file)."""
        self.hosts.write_text("".join(f"{h} {NAME}\n" for h in hosts))
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(5)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[tuple[EmulatedFleet, Dnsmasq]]:
    fleet = EmulatedFleet(tmp_path)
    dns = Dnsmasq(tmp_path)
    try:
        yield fleet, dns
    finally:
        dns.stop()
        fleet.close()


def test_dns_discovered_servers_come_and_go_without_a_failed_request(
    rig: tuple[EmulatedFleet, Dnsmasq],
) -> None:
    fleet, dns = rig
    port = free_port()
    for i in (1, 2, 3):
        fleet.servers[f"s{i}"] = Emulator(f"s{i}", fleet.tmp, MODEL, port=port, host=f"127.0.41.{i}", **FAST)
    a1, a2, a3 = (s.address for s in fleet.servers.values())
    dns.hosts.write_text(f"127.0.41.1 {NAME}\n127.0.41.2 {NAME}\n")
    dns.start()
    spec = {
        "listener": {"port": fleet.listener},
        "discovery": {"dns": {"nameservers": [f"127.0.0.1:{dns.port}"], "min_interval": "500ms"}},
        "signals": {"interval": "500ms"},
        "tiers": {"small": {"max_params_b": 15, "timeout": "30s"}},
        "models": {
            MODEL: {
                "params_b": 8,
                "stable": "v1",
                "versions": {"v1": {"discover": {"dns": NAME, "port": port, "gpu": "A100"}}},
            }
        },
    }
    fleet.serve(yaml.safe_dump(spec))
    assert fleet.envoy is not None and fleet.cp is not None
    traffic = Traffic(fleet.listener, MODEL, fleet.tmp, rate=20)
    try:
        served = lambda: {r["server"] for r in traffic.records() if r["status"] == 200}  # noqa: E731
        wait_until(lambda: {a1, a2} <= served(), 15, "both resolved servers to take traffic")
        op = Operator(fleet.cp)
        eps = op.endpoints.List(
            endpoint_pb2.ListEndpointsRequest(model=MODEL), metadata=op.md, timeout=5
        ).endpoints
        assert {e.address: e.source for e in eps} == {a1: f"dns:{NAME}", a2: f"dns:{NAME}"}
        assert all(e.gpu == "A100" and e.HasField("last_seen_seconds") for e in eps)

        # A new address takes traffic within the TTL + 2 s.
        dns.names("127.0.41.1", "127.0.41.2", "127.0.41.3")
        added = time.monotonic()
        wait_until(
            lambda: a3 in {r["server"] for r in traffic.records() if r["t"] >= time.time() - 0.5},
            TTL_S + 2,
            "the added address to take traffic",
        )
        print(f"added address took traffic after {time.monotonic() - added:.1f}s (TTL {TTL_S}s)")

        # A removed one is drained (no new requests), then leaves the fleet.
        dns.names("127.0.41.2", "127.0.41.3")
        wait_until(
            lambda: a1 not in fleet.envoy.endpoints(f"{MODEL}@v1"), 15, "the removed address to leave EDS"
        )  # type: ignore[union-attr]
        # EDS drops it when the drain ends; discovery says so after its next round.
        wait_until(
            lambda: (
                "discovered endpoint drained and removed" in (fleet.cp.proc.log() if fleet.cp.proc else "")
            ),  # type: ignore[union-attr]
            5,
            "discovery to remove the drained address",
        )
        assert "endpoint draining" in fleet.cp.proc.log()  # type: ignore[union-attr]
        gone = time.time()
        time.sleep(1.0)
        assert a1 not in {r["server"] for r in traffic.records() if r["t"] >= gone}

        # dnsmasq stopped: the last known set keeps serving.
        dns.stop()
        stopped = time.time()
        wait_until(
            lambda: fleet.cp.metric("controlplane_discovery_source_healthy", model=MODEL, version="v1") == 0,  # type: ignore[union-attr]
            10,
            "the source to be reported failing",
        )
        time.sleep(2)
        during = [r for r in traffic.records() if r["t"] >= stopped]
        assert {r["server"] for r in during if r["status"] == 200} == {a2, a3}
        assert (fleet.cp.metric("controlplane_discovery_failures_total", model=MODEL, version="v1") or 0) >= 1
        status, body = http_get(f"http://127.0.0.1:{fleet.cp.metrics_port}/debug/discovery")
        (source,) = json.loads(body)["sources"]
        assert status == 200 and source["source"] == f"dns:{NAME}" and not source["healthy"], source
        assert source["error"] and sorted(source["endpoints"]) == sorted([a2, a3])
        eps = op.endpoints.List(
            endpoint_pb2.ListEndpointsRequest(model=MODEL), metadata=op.md, timeout=5
        ).endpoints
        assert {e.address for e in eps} == {a2, a3}
        op.close()
    finally:
        records = traffic.stop()
    failed = [r for r in records if r["status"] != 200]
    assert len(records) > 100 and failed == [], failed[:5]
