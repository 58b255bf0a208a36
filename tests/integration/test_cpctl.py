"""The real `cpctl` console script against a real control plane (`controlplane serve`).

One control plane serves the module: model llama with versions v1 and v2 (for rollouts) and
model mistral (for drains and autoscaling), on addresses where nothing listens. No traffic is needed: with no
Envoy connected, a rollout's first step goes live at the next tick. Every test runs `cpctl`
as a subprocess and checks its exit code, stdout and the one line it prints to stderr on
failure.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.integration.harness import BIN, ControlPlane, free_port, wait_until

FLEET = """\
listener: {{port: {listener}}}
tiers:
  small: {{max_params_b: 15, timeout: 30s}}
models:
  llama:
    params_b: 8
    stable: v1
    versions:
      v1: {{endpoints: ['{a}']}}
      v2: {{endpoints: ['{b}']}}
  mistral:
    params_b: 7
    stable: v1
    versions:
      v1: {{endpoints: ['{c}', {{address: '{d}', gpu: A100}}]}}
"""
USER = "cpctl-tester"
RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


@dataclass
class Run:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


@dataclass
class Cpctl:
    cp: ControlPlane
    addresses: tuple[str, ...]  # llama v1, llama v2, mistral v1 (two)

    @property
    def token_file(self) -> Path:
        return self.cp.state_dir / "admin-token"

    def command(self, *args: str, auth: bool = True) -> list[str]:
        script = BIN / "cpctl"
        command = [str(script)] if script.exists() else [sys.executable, "-m", "controlplane.cli.cpctl"]
        flags = ["--server", self.cp.admin]
        if auth:
            flags += ["--token-file", str(self.token_file)]
        return [*command, *flags, *args]

    @staticmethod
    def env(extra: dict[str, str] | None = None) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("CPCTL_")}
        return {**base, "USER": USER, **(extra or {})}

    def __call__(self, *args: str, auth: bool = True, env: dict[str, str] | None = None) -> Run:
        p = subprocess.run(
            self.command(*args, auth=auth), capture_output=True, text=True, timeout=60, env=self.env(env)
        )
        assert "Traceback" not in p.stderr, p.stderr
        return Run(p.returncode, p.stdout, p.stderr)

    def usage_error(self, *args: str) -> str:
        """Run, expect exit 2 with argparse's usage and error; return the error line."""
        r = self(*args)
        assert r.code == 2 and r.err.startswith("usage: cpctl "), (r.code, r.out, r.err)
        return r.err.splitlines()[-1]

    def fails(self, code: int, status: str, *args: str, **kw: Any) -> str:
        """Run, expect exit `code` and one stderr line `cpctl: STATUS: ...`; return that line."""
        r = self(*args, **kw)
        assert r.code == code, (r.code, r.out, r.err)
        assert r.err.startswith(f"cpctl: {status}: "), r.err
        assert r.err.count("\n") == 1, r.err
        return r.err

    def status(self) -> dict[str, Any]:
        r = self("rollout", "status", "llama", "-o", "json")
        assert r.code == 0, r.err
        return r.json()  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def cpctl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cpctl]:
    tmp = tmp_path_factory.mktemp("cpctl")
    addresses = tuple(f"127.0.0.1:{free_port()}" for _ in range(4))
    a, b, c, d = addresses
    (tmp / "fleet.yaml").write_text(FLEET.format(listener=free_port(), a=a, b=b, c=c, d=d))
    cp = ControlPlane(tmp / "fleet.yaml", tmp).start()
    try:
        wait_until(lambda: (cp.state_dir / "admin-token").exists(), 10, "the admin token file")
        yield Cpctl(cp, addresses)
    finally:
        cp.stop()


def test_rollout_lifecycle(cpctl: Cpctl, request: pytest.FixtureRequest) -> None:
    # Steps out of order: the server's rule, found before any call: a usage error (exit 2).
    line = cpctl.usage_error("rollout", "start", "llama", "--to", "v2", "--steps", "50,25,100")
    assert line == "cpctl rollout start: error: --steps 50,25,100: must increase, each 1-100"
    # What only the server knows (v1 is llama's stable version): its INVALID_ARGUMENT exits 2 too.
    line = cpctl.fails(2, "INVALID_ARGUMENT", "rollout", "start", "llama", "--to", "v1")
    assert "--to v1: that is already the stable version" in line

    r = cpctl("rollout", "start", "llama", "--to", "v2", "--manual", "--max-error-rate", "0.05", "-o", "json")
    assert r.code == 0, r.err
    started = r.json()
    assert (started["phase"], started["step"], started["canary_version"]) == ("Progressing", 0, "v2")
    assert started["step_started_at"] is None or RFC3339.match(started["step_started_at"])
    # A watch without a terminal, left running through the whole rollout: a line per change.
    watch = subprocess.Popen(
        cpctl.command("rollout", "status", "llama", "-w"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cpctl.env(),
    )
    request.addfinalizer(watch.kill)  # a no-op once it has ended
    s = cpctl.status()
    assert s["phase"] == "Progressing" and s["model"] == "llama"
    assert set(s["weights"]) == {"v1", "v2"} and sum(s["weights"].values()) == 100
    assert (s["stable_version"], s["canary_version"], s["steps"]) == ("v1", "v2", [5, 25, 50, 100])
    assert s["manual"] is True and s["max_error_rate"] == 0.05 and s["min_requests"] == 50

    # No proxy is connected, so step 1 goes live at the next tick; the tick after brings the
    # analysis figures (0 requests here: nothing sends traffic).
    def live() -> bool:
        s = cpctl.status()
        return s["step"] == 1 and "canary" in s

    wait_until(live, 10, "step 1 of the rollout with its analysis")
    s = cpctl.status()
    assert s["weights"] == {"v1": 95, "v2": 5}
    assert s["canary"] == {"version": "v2", "requests": 0, "error_rate": 0, "p99_seconds": None}
    assert s["stable"]["version"] == "v1"
    # JSON: counts are integers, times RFC 3339 (UTC).
    raw = cpctl("rollout", "status", "llama", "-o", "json").out
    assert '"requests": 0,' in raw and '"min_requests": 50,' in raw and '"interval_seconds": 0,' in raw
    assert RFC3339.match(s["step_started_at"]), s["step_started_at"]
    table = cpctl("rollout", "status", "llama").out
    assert "Phase:    Progressing" in table and "Weights:  v1 95%, v2 5%" in table

    cpctl.fails(1, "FAILED_PRECONDITION", "rollout", "start", "llama", "--to", "v2")
    assert cpctl("rollout", "pause", "llama", "--reason", "look at the dashboards").out.startswith(
        "llama: Paused, step 1/4"
    )
    assert cpctl.status()["reason"] == "look at the dashboards"
    resumed = cpctl("rollout", "resume", "llama", "-o", "yaml")
    assert resumed.code == 0 and "phase: Progressing" in resumed.out and "model: llama" in resumed.out
    assert (
        cpctl("rollout", "promote", "llama").out.strip()
        == "llama: Progressing, step 2/4 (25%), v1 75%, v2 25%"
    )
    promoted = cpctl("rollout", "promote", "llama", "--full", "-o", "json")
    assert promoted.code == 0 and promoted.json()["model"] == "llama", promoted.err
    # At 100% v1 leaves first; the rollout completes once no proxy's routes name it.
    wait_until(lambda: cpctl.status()["phase"] == "Completed", 10, "the rollout to complete")
    s = cpctl.status()
    assert s["weights"] == {"v1": 0, "v2": 100}
    # The JSON names the parts as the table does: v2 is stable now, and replaced v1.
    assert (s["stable_version"], s["canary_version"], s["previous_version"]) == ("v2", None, "v1")
    assert "Stable:   v2  (replaced v1)" in cpctl("rollout", "status", "llama").out

    # The watch ended with the rollout (exit 0: Completed), one line per change of state,
    # although the server sent the rollout every second.
    out, err = watch.communicate(timeout=20)
    assert watch.returncode == 0, err
    lines = out.splitlines()
    assert all(re.fullmatch(r"\d\d:\d\d:\d\d  llama: .+", x) for x in lines), lines
    states = [x.split("  ", 1)[1] for x in lines]
    assert all(a != b for a, b in itertools.pairwise(states)), lines  # only changes
    assert any(": Paused, step 1/4 (5%)" in x and x.endswith("; look at the dashboards") for x in lines)
    assert "llama: Completed" in lines[-1] and len(lines) < 15, lines

    # Watching a finished rollout prints it once; Completed exits 0.
    w = cpctl("rollout", "status", "llama", "-w", "-o", "json")
    assert w.code == 0 and [json.loads(x)["phase"] for x in w.out.splitlines()] == ["Completed"]

    # Undo: a new rollout back to v1, then abort it; watching it exits 3.
    r = cpctl("rollout", "undo", "llama", "-o", "json")
    assert r.code == 0 and r.json()["phase"] == "Progressing", r
    s = cpctl.status()
    assert (s["stable_version"], s["canary_version"]) == ("v2", "v1")
    aborted = cpctl("rollout", "abort", "llama", "--reason", "cpctl test", "-o", "json")
    assert aborted.code == 0 and aborted.json()["phase"] == "Aborted", aborted.err
    w = cpctl("rollout", "status", "llama", "--watch")
    assert w.code == 3 and w.out.count("\n") == 1, w.out  # one line: it had ended already
    assert "  llama: Aborted, " in w.out and w.out.rstrip().endswith("; cpctl test"), w.out

    listed = cpctl("rollout", "list", "-o", "yaml")
    assert listed.code == 0 and "phase: Aborted" in listed.out and "model: llama" in listed.out
    history = cpctl("rollout", "history", "llama", "-o", "json").json()
    assert all(RFC3339.match(a["at"]) for a in history["records"]), history
    phases = [a["phase"] for a in history["records"]]
    assert phases[0] == "Progressing" and "Paused" in phases and "Completed" in phases
    # The last rollout record; the aborted canary's drain may already follow it.
    assert [x for x in phases if x not in ("Draining", "Drained", "Retired")][-1] == "Aborted", phases
    assert any(a["who"].startswith(f"{USER} (admin token") for a in history["records"])
    assert "look at the dashboards" in cpctl("rollout", "history", "llama").out


def test_credentials(cpctl: Cpctl, tmp_path: Path) -> None:
    line = cpctl.fails(4, "UNAUTHENTICATED", "rollout", "list", auth=False, env={"CPCTL_TOKEN": "wrong"})
    assert "token" in line and "cpctl sent the token from $CPCTL_TOKEN" in line
    # A stale token file (from another run's state dir): the hint names the file read.
    stale = tmp_path / "old-state" / "admin-token"
    stale.parent.mkdir()
    stale.write_text("a-token-from-another-run\n")
    line = cpctl.fails(4, "UNAUTHENTICATED", "proxies", auth=False, env={"CPCTL_TOKEN_FILE": str(stale)})
    assert f"cpctl sent the token from {stale}: is it the one {cpctl.cp.admin} uses?" in line
    line = cpctl.fails(4, "UNAUTHENTICATED", "--token-file", str(stale), "proxies", auth=False)
    assert f"from {stale}:" in line
    cpctl.fails(
        4, "UNAUTHENTICATED", "rollout", "status", "llama", "-w", auth=False, env={"CPCTL_TOKEN": "x"}
    )
    r = cpctl("--token-file", "/nonexistent/admin-token", "proxies", auth=False)
    assert r.code == 4 and "/nonexistent/admin-token" in r.err and r.err.count("\n") == 1
    assert "CPCTL_TOKEN" in r.err
    # The token itself in the environment works.
    ok = cpctl("proxies", auth=False, env={"CPCTL_TOKEN": cpctl.token_file.read_text().strip()})
    assert ok.code == 0, ok.err


def test_unknown_things(cpctl: Cpctl) -> None:
    line = cpctl.fails(1, "NOT_FOUND", "rollout", "status", "gpt-9")
    assert "gpt-9" in line
    cpctl.fails(1, "NOT_FOUND", "rollout", "start", "llama", "--to", "v9")
    cpctl.fails(1, "NOT_FOUND", "endpoints", "list", "--model", "gpt-9")
    cpctl.fails(1, "NOT_FOUND", "endpoints", "drain", "10.255.255.1:9")
    down = f"127.0.0.1:{free_port()}"
    line = cpctl.fails(1, "UNAVAILABLE", "--server", down, "proxies")
    assert f"is the control plane running at {down}?" in line
    r = cpctl("rollout", "start", "llama", "--to", "v2", "--steps", "5,x")
    assert r.code == 2 and "--steps" in r.err


def test_endpoints(cpctl: Cpctl) -> None:
    a, b, c, d = cpctl.addresses
    r = cpctl("endpoints", "list", "-o", "json")
    assert r.code == 0, r.err
    eps = {e["address"]: e for e in r.json()["endpoints"]}
    assert set(eps) == {a, b, c, d}
    assert (eps[a]["model"], eps[a]["version"], eps[b]["version"]) == ("llama", "v1", "v2")
    assert (eps[d]["model"], eps[d]["version"], eps[d]["gpu"]) == ("mistral", "v1", "A100")
    table = cpctl("endpoints", "list", "--model", "mistral").out.splitlines()
    assert table[0].split() == [
        "MODEL",
        "VERSION",
        "ADDRESS",
        "GPU",
        "STATE",
        "WEIGHT",
        "RUNNING",
        "WAITING",
        "IN-FLIGHT",
        "LATENCY",
        "ERRORS",
    ]
    rows = table[1 : table.index("")] if "" in table else table[1:]
    assert [row.split()[:4] for row in rows] == [["mistral", "v1", c, "-"], ["mistral", "v1", d, "A100"]]
    # Under the table, one line per endpoint that is held out or out of sight, saying why.
    notes = table[len(rows) + 2 :]
    assert all(n.startswith("mistral/v1 ") and ("out of sight" in n or "not ready" in n) for n in notes), (
        notes
    )

    # Nothing is in flight at d: it is DRAINED once the drain has settled (a few seconds).
    # (--timeout, the drain's old name for --drain-timeout, still works.)
    r = cpctl("endpoints", "drain", d, "--timeout", "20s", "--reason", "cpctl test", "--wait")
    assert r.code == 0, r.err
    assert r.out.splitlines()[0] == f"{d} (mistral v1): DRAINING"
    assert r.out.splitlines()[-1].startswith(f"{d}: DRAINED after ")
    drained = {e["address"]: e for e in cpctl("endpoints", "list", "-o", "json").json()["endpoints"]}
    assert drained[d]["state"] == "DRAINED" and RFC3339.match(drained[d]["drain_started_at"])
    assert drained[c]["state"] != "DRAINED"
    r = cpctl("endpoints", "undrain", d, "-o", "json")
    assert r.code == 0 and r.json()["address"] == d and r.json()["state"] != "DRAINED", r
    # Again with the new names, as JSON (without --wait: the endpoint as the drain began).
    r = cpctl("--request-timeout", "5s", "endpoints", "drain", d, "--drain-timeout", "20s", "-o", "json")
    assert r.code == 0 and r.json()["state"] == "DRAINING", r
    assert RFC3339.match(r.json()["drain_started_at"]), r.out
    r = cpctl("endpoints", "undrain", d)
    assert r.code == 0 and r.out.startswith(f"{d} (mistral v1): "), r
    back = {e["address"]: e for e in cpctl("endpoints", "list", "-o", "json").json()["endpoints"]}
    assert back[d]["state"] != "DRAINED" and back[d]["drain_started_at"] is None
    cpctl.fails(1, "FAILED_PRECONDITION", "endpoints", "undrain", d)
    history = cpctl("rollout", "history", "mistral", "-o", "json").json()["records"]
    phases = [x["phase"] for x in history]
    # (The second drain may have settled to Drained before the undrain on a busy machine.)
    assert phases[:4] == ["Draining", "Drained", "Undrained", "Draining"] and phases[-1] == "Undrained"


def test_autoscaling_list_shows_desired_replicas_and_why(cpctl: Cpctl) -> None:
    c, d = cpctl.addresses[2:]  # mistral's

    def mistral() -> list[dict[str, Any]]:
        r = cpctl("autoscaling", "list", "mistral", "-o", "json")
        assert r.code == 0, r.err
        return r.json()["scaling"]  # type: ignore[no-any-return]

    wait_until(lambda: bool(mistral()), 10, "the autoscaler's first decision for mistral")
    rows = mistral()
    assert [(x["model"], x["version"]) for x in rows] == [("mistral", ""), ("mistral", "v1")]
    whole = rows[0]
    # No traffic: the stable window wants at most 1, and min (1) holds it there.
    assert (whole["desired"], whole["min"], whole["max"]) == (1, 1, 100), whole
    assert whole["reason"].startswith("stable: the last 60s want "), whole
    assert whole["predicted_demand"] is None and whole["panicking"] is False
    # Whatever serves beyond the one wanted is named, in scale-down's order.
    assert set(whole["remove"]) <= {c, d}
    if not whole["draining"]:
        assert len(whole["remove"]) == max(0, whole["ready"] - whole["desired"]), whole

    table = cpctl("autoscaling", "list").out.splitlines()
    assert table[0].split() == [
        "MODEL",
        "VERSION",
        "DESIRED",
        "READY",
        "DEMAND",
        "TARGET",
        "FORECAST",
        "REASON",
    ]
    row = next(x for x in table if x.split()[:2] == ["mistral", "(all)"])
    assert row.split()[2] == "1" and "stable: the last 60s want " in row
    assert any(x.split()[:2] == ["llama", "(all)"] for x in table)
    # Under it, mistral's lines (to drain next, draining now) name only its endpoints.
    for x in table:
        if x.startswith("  mistral: "):
            assert set(x.split(": ", 1)[1].split(", ")) <= {c, d}, x

    line = cpctl.fails(1, "NOT_FOUND", "autoscaling", "list", "gpt-9")
    assert "gpt-9" in line


class _NackingCds:
    """A CDS (per-type service) stream from node `cpctl-test` that NACKs what it gets."""

    def __init__(self, target: str) -> None:
        from envoy.config.core.v3 import base_pb2
        from envoy.service.cluster.v3 import cds_pb2_grpc
        from envoy.service.discovery.v3 import discovery_pb2
        from google.rpc import status_pb2

        from controlplane.routing.translate import CLUSTER

        self.requests: queue.Queue[Any] = queue.Queue()
        self.channel = grpc.insecure_channel(target)
        node = base_pb2.Node(id="cpctl-test", cluster="tests")
        self.requests.put(discovery_pb2.DiscoveryRequest(node=node, type_url=CLUSTER))
        self.responses = cds_pb2_grpc.ClusterDiscoveryServiceStub(self.channel).StreamClusters(
            iter(self.requests.get, None)
        )
        first = next(self.responses)
        self.requests.put(
            discovery_pb2.DiscoveryRequest(
                type_url=CLUSTER,
                response_nonce=first.nonce,
                error_detail=status_pb2.Status(code=3, message="cpctl test: cluster rejected"),
            )
        )

    def close(self) -> None:
        self.requests.put(None)
        self.responses.cancel()
        self.channel.close()


def test_proxies(cpctl: Cpctl) -> None:
    r = cpctl("proxies")
    assert r.code == 0, r.err
    assert r.out.strip() == "no proxies connected"
    assert cpctl("proxies", "-o", "json").json() == {"proxies": []}

    stream = _NackingCds(cpctl.cp.xds)
    try:

        def nacked() -> bool:
            ps = cpctl("proxies", "-o", "json").json()["proxies"]
            return bool(ps) and ps[0]["types"].get("cds", {}).get("status") == "NACKED"

        wait_until(nacked, 10, "the proxy's NACK to show")
        lines = cpctl("proxies").out.splitlines()
        assert lines[0].split() == ["NODE", "ADDRESS", "TRANSPORT", "CDS", "EDS", "LDS", "RDS"]
        row = lines[1].split()
        assert row[0] == "cpctl-test" and row[2] == "sotw" and row[3:] == ["NACKED", "-", "-", "-"]
        assert "Last NACKs:" in lines
        assert any("CDS: cpctl test: cluster rejected" in line for line in lines)
    finally:
        stream.close()


def test_version(cpctl: Cpctl) -> None:
    from controlplane import __version__

    r = cpctl("version")
    assert r.code == 0, r.err
    assert r.out.splitlines() == [
        f"Client Version: {__version__}",
        f"Server Version: {__version__} ({cpctl.cp.admin})",
    ]
    doc = cpctl("version", "-o", "json").json()
    assert doc == {
        "client": {"version": __version__},
        "server": {"version": __version__, "address": cpctl.cp.admin},
    }
    # No server: the client's version all the same, then the error, exit 1 (as kubectl).
    down = f"127.0.0.1:{free_port()}"
    r = cpctl("--server", down, "version", "-o", "json")
    assert r.code == 1 and r.json() == {"client": {"version": __version__}}, r
    assert r.err.startswith("cpctl: UNAVAILABLE: ") and r.err.count("\n") == 1


def test_completion_names_come_from_the_control_plane(cpctl: Cpctl) -> None:
    assert cpctl("__complete", "models").out.split() == ["llama", "mistral"]
    assert cpctl("__complete", "versions", "llama").out.split() == ["v1", "v2"]
    assert cpctl("__complete", "addresses").out.split() == list(cpctl.addresses)
    r = cpctl("__complete", "models", auth=False, env={"CPCTL_TOKEN": "wrong"})
    assert (r.code, r.out, r.err) == (1, "", "")  # nothing lands in the user's command line
