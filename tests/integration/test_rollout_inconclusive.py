"""A rollout whose analysis cannot see a failure says so, with a real Envoy and emulated servers.

The issue's "done when": a canary behind an Envoy without load reports, on servers that
do not count every failed request (the emulator speaks vLLM's dialect), pauses as inconclusive within
its step interval, with a reason naming the missing signal. Before, it held step 1 forever,
saying nothing, while the canary failed every request it got.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.v1 import rollout_pb2
from tests.integration.harness import BIN, ControlPlane, Envoy, wait_until
from tests.integration.test_rollouts import MODEL, Rig, _failures, _warm

pytestmark = pytest.mark.envoy


class BlindRig(Rig):
    """The rollouts rig behind an Envoy whose bootstrap has no load_stats_config."""

    def serve(self, fleet_yaml: str) -> None:
        (self.tmp / "fleet.yaml").write_text(fleet_yaml)
        self.cp = ControlPlane(self.tmp / "fleet.yaml", self.tmp).start()
        self.envoy = Envoy("envoy-1", self.cp.xds, self.tmp, self.listener, load_reports=False).start()

    def cpctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        assert self.cp is not None
        token = str(self.cp.state_dir / "admin-token")
        return subprocess.run(
            [str(BIN / "cpctl"), "--server", self.cp.admin, "--token-file", token, *args],
            capture_output=True,
            text=True,
            timeout=20,
        )


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[BlindRig]:
    r = BlindRig(tmp_path)
    try:
        yield r
    finally:
        r.close()


def test_a_failing_canary_without_load_reports_pauses_as_inconclusive_within_its_interval(
    rig: BlindRig,
) -> None:
    rig.start(canary_flags={"error_rate": 1.0, "seed": 3})  # v2 answers 500 to every request
    _warm(rig)
    assert "load_stats_config" not in (rig.tmp / "envoy-1-bootstrap.yaml").read_text()
    interval = 20.0
    rig.start_rollout(interval_seconds=interval)  # the default --min-requests 50
    wait_until(lambda: rig.rollout().step >= 1, 10, "step 1")
    step1 = rig.rollout().step_started_at
    wait_until(lambda: rig.rollout().phase == "Paused", interval + 5, "the inconclusive pause")
    r = rig.rollout()
    assert (r.step, r.weights["v2"]) == (1, 5)  # held where it was
    assert r.reason.startswith(f"inconclusive: no load reports from proxies for {MODEL}/v2"), r.reason
    assert "(vllm) do not count every failed request" in r.reason and "load_stats_config" in r.reason
    assert rig.op is not None
    history = rig.op.rollouts.History(rollout_pb2.GetRolloutRequest(model=MODEL), metadata=rig.op.md)
    paused_at = next(h.at for h in history.records if h.phase == "Paused")
    assert interval <= paused_at - step1 <= interval + 2.5  # at the tick the interval elapsed
    # What the analysis saw: stable's successes, and nothing of the canary's failures.
    assert r.stable.requests > 100 and r.canary.requests == 0
    assert rig.traffic is not None
    failures = _failures(rig.traffic.records())
    assert len(failures) > 20 and {f["server"] for f in failures} <= rig.addresses("b1", "b2")
    # `cpctl rollout status` shows it as it is.
    status = rig.cpctl("rollout", "status", MODEL)
    assert status.returncode == 0, status.stderr
    assert "Phase:    Paused" in status.stdout
    assert f"Reason:   inconclusive: no load reports from proxies for {MODEL}/v2" in status.stdout
    # Resume starts the step over (a fresh interval); abort sends everything back to stable.
    rig.command("Resume")
    wait_until(lambda: rig.rollout().step_started_at > paused_at, 5, "the step to start over")
    assert rig.rollout().phase == "Progressing"
    assert rig.command("Abort").weights["v2"] == 0


def test_a_manual_step_without_an_error_signal_says_so_and_holds(rig: BlindRig) -> None:
    rig.start()
    _warm(rig)
    rig.start_rollout(manual=True)
    wait_until(lambda: rig.rollout().step >= 1, 10, "step 1")
    # The control plane gives proxies 12 s after it starts to open their load-report
    # streams, then the window needs 5 s without any.
    wait_until(
        lambda: "analysis so far inconclusive: no load reports" in rig.rollout().reason,
        30,
        "the status to say the analysis is inconclusive",
    )
    r = rig.rollout()
    assert (r.phase, r.step, r.weights["v2"]) == ("Progressing", 1, 5)  # manual gates never pause
    status = rig.cpctl("rollout", "status", MODEL)
    assert "analysis so far inconclusive: no load reports" in status.stdout, status.stdout
    assert rig.command("Promote").weights["v2"] == 25
