"""The README's first command: the demo runs to the end on loopback and exits 0."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.integration.harness import BIN
from tests.ports import free_port


@pytest.fixture(autouse=True)
def demo_logs_in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo keeps its logs in a new folder of the temporary directory (34 MB a run on
    llama.cpp): here, the test's own, which pytest removes after a few runs, not /tmp."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def _weights(line: str) -> dict[str, int]:
    return {k.strip(): int(v) for k, v in (kv.split("=") for kv in line.split(" weights ", 1)[1].split(","))}


def test_demo_runs_to_the_end_with_no_failed_request_and_a_completed_rollout() -> None:
    out = subprocess.run(
        [str(BIN / "controlplane"), "demo", "--duration", "20", "--no-live"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert ", 0 failed" in out.stdout
    assert "rollout: llama-3-8b -> v2: Completed" in out.stdout
    for tier in ("small", "medium", "large"):
        assert f"│ {tier}" in out.stdout  # the summary table has a row per tier
    assert "load-balance degree L per model" in out.stdout
    weights = [_weights(line) for line in out.stdout.splitlines() if " weights " in line]
    assert weights[0]["llama-cold"] == 0  # cold at first: held out
    assert weights[-1]["llama-b"] < weights[-1]["llama-a"] / 2  # the 3x slower L4 gets less
    assert weights[-1]["llama-cold"] > 0  # warm by the end, let in
    assert any("step 2/3, v1 50%, v2 50%" in line for line in out.stdout.splitlines())
    # Without a terminal the events print as they happen: the edits, the rollout, the surge.
    assert "fleet edit refused" in out.stdout and "$ cpctl rollout start" in out.stdout
    events = [line for line in out.stdout.splitlines() if line.startswith("demo: t=")]
    for event in ("fleet edit: add server llama-d", "fleet edit refused", "$ cpctl rollout start", "surge: "):
        assert any(event in line for line in events), event  # as log lines, with their time
    assert "surge: 6 clients on phi-3-mini" in out.stdout
    wanted = [
        int(line.split(" wants ", 1)[1].split()[0]) for line in out.stdout.splitlines() if " wants " in line
    ]
    assert wanted and max(wanted) >= 2, wanted  # the surge scaled phi-3-mini up from zero


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(proc.name))
    return found


def _demo() -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(BIN / "controlplane"), "demo", "--duration", "60", "--no-live"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _until_traffic(p: subprocess.Popen[str]) -> str:
    """Read the demo's output until its traffic starts; return its work directory."""
    work = ""
    seen: list[str] = []
    assert p.stdout is not None
    for line in p.stdout:
        seen.append(line)
        if line.startswith("demo: fleet config "):
            work = str(Path(line.split("demo: fleet config ", 1)[1].strip()).parent)
        if "traffic for" in line:
            return work
    raise AssertionError("the demo ended before its traffic started:\n" + "".join(seen)[-3000:])


def test_ctrl_c_stops_every_process_the_demo_started() -> None:
    p = _demo()
    work = ""
    try:
        work = _until_traffic(p)
        assert work and _processes_mentioning(work), "the control plane and Envoy should be running"
        p.send_signal(signal.SIGINT)
        try:
            rest = p.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            p.kill()  # say where it hung: what it printed after the signal
            raise AssertionError(
                f"the demo did not stop 30 s after SIGINT:\n{p.communicate()[0][-3000:]}"
            ) from None
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    assert p.returncode == 130, rest[-2000:]
    assert "interrupted; stopping everything" in rest
    assert _processes_mentioning(work) == [], "a process the demo started outlived it"
    assert os.path.isdir(work)  # logs kept


def test_a_demo_killed_outright_leaves_no_process_behind() -> None:
    """Issue 16, F13: SIGKILL gives the demo no chance to clean up; the kernel stops its
    control plane and Envoy (parent-death signal) instead of leaving them orphaned."""
    p = _demo()
    work = ""
    try:
        work = _until_traffic(p)
        assert work and len(_processes_mentioning(work)) >= 2, "the control plane and Envoy should be running"
        p.kill()
        p.wait(10)
        deadline = time.monotonic() + 15
        while _processes_mentioning(work) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _processes_mentioning(work) == [], "a process the demo started outlived it"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        for pid in _processes_mentioning(work) if work else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_listener_envoy_cannot_bind_fails_the_demo_at_once_naming_why(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The port the demo chose for its listener taken before Envoy binds it (as a CI run saw):
    Envoy rejects the listener and runs on; the demo stops with Envoy's reason, not after its
    60 s wait for a config that will never serve."""
    from controlplane.sim import demo

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    monkeypatch.setattr(demo, "free_port", lambda: next(ports, None) or free_port())
    try:
        assert demo.run_demo(duration_s=10, live=False) == 1
    finally:
        taken.close()
    err = capsys.readouterr().err
    assert "gave up waiting for Envoy to get its config" in err, err
    assert "failed to bind" in err and "Address already in use" in err, err
