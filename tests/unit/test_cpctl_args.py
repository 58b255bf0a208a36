"""`cpctl` without a server: argument parsing, token lookup, error lines, output shapes and
the completion script."""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from controlplane.cli import cpctl
from controlplane.cli import cpctl_output as out
from controlplane.v1 import autoscaling_pb2, endpoint_pb2, proxy_pb2, rollout_pb2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- durations and steps ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30s", 30.0),
        ("2m", 120.0),
        ("500ms", 0.5),
        ("1h", 3600.0),
        ("45", 45.0),
        ("1.5", 1.5),
        (".25s", 0.25),
    ],
)
def test_durations(text: str, seconds: float) -> None:
    assert cpctl.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "x", "3x", "s", "-1s", "0", "0ms", "1e3", "2 minutes", "nan"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        cpctl.parse_duration(text)


def test_steps() -> None:
    assert cpctl.parse_steps("5,25,50,100") == [5, 25, 50, 100]
    assert cpctl.parse_steps(" 10, 100") == [10, 100]
    # The order is the server's to judge (INVALID_ARGUMENT), not a parse error.
    assert cpctl.parse_steps("50,25") == [50, 25]


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        cpctl.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--steps", "5,x"], "--steps"),
        (["--steps", "5,,100"], "--steps"),
        (["--steps", "0,100"], "--steps"),
        (["--steps", "5,101"], "--steps"),
        (["--interval", "3x"], "--interval"),
        (["--interval", "0s"], "--interval"),
        (["--ack-deadline", "soon"], "--ack-deadline"),
        (["--max-error-rate", "lots"], "--max-error-rate"),
        (["--min-requests", "-1"], "--min-requests"),
    ],
)
def test_start_parse_errors_name_the_flag(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _usage_error(["rollout", "start", "llama", "--to", "v2", *argv], capsys)
    assert f"argument {flag}:" in err
    assert "Traceback" not in err


def test_interval_and_manual_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage_error(["rollout", "start", "llama", "--to", "v2", "--interval", "30s", "--manual"], capsys)
    assert "not allowed with" in err


def test_start_needs_to(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--to" in _usage_error(["rollout", "start", "llama"], capsys)


def test_bad_output_format_and_shell(capsys: pytest.CaptureFixture[str]) -> None:
    assert "invalid choice" in _usage_error(["rollout", "status", "llama", "-o", "xml"], capsys)
    assert "invalid choice" in _usage_error(["completion", "fish"], capsys)


def test_global_flags_before_or_after_the_subcommand() -> None:
    p = cpctl.build_parser()
    before = p.parse_args(["--server", "a:1", "--timeout", "2s", "rollout", "status", "m"])
    assert (before.server, before.timeout, before.model) == ("a:1", 2.0, "m")
    after = p.parse_args(["rollout", "status", "m", "--server", "b:2", "--token-file", "/t"])
    assert (after.server, after.token_file) == ("b:2", Path("/t"))
    unset = p.parse_args(["proxies"])
    assert not hasattr(unset, "server") and not hasattr(unset, "timeout")


def test_drain_timeout_is_the_drains_own() -> None:
    args = cpctl.build_parser().parse_args(
        ["--timeout", "3", "endpoints", "drain", "10.0.0.1:80", "--timeout", "2m", "--wait"]
    )
    assert args.timeout == 3.0  # the call deadline, given before the subcommand
    assert args.drain_timeout == 120.0
    assert args.wait


def test_start_sets_only_the_fields_given() -> None:
    sent: list[rollout_pb2.StartRolloutRequest] = []

    class Stub:
        def Start(self, req: rollout_pb2.StartRolloutRequest, **kw: Any) -> rollout_pb2.Rollout:
            sent.append(req)
            return _rollout()

    p = cpctl.build_parser()
    for argv in (["--manual"], ["--steps", "10,100", "--interval", "2m", "--max-error-rate", "0.05"]):
        args = p.parse_args(["rollout", "start", "llama", "--to", "v2", *argv])
        assert cpctl.cmd_start(_FakeClient(rollouts=Stub()), args) == 0  # type: ignore[arg-type]
    manual, timed = sent
    assert manual.manual and manual.interval_seconds == 0 and list(manual.steps) == []
    for field in ("max_error_rate", "max_latency_ratio", "min_requests", "ack_deadline_seconds"):
        assert not manual.HasField(field)
    assert not timed.manual and timed.interval_seconds == 120.0 and list(timed.steps) == [10, 100]
    assert timed.HasField("max_error_rate") and timed.max_error_rate == 0.05
    assert not timed.HasField("min_requests")


# ---- token and errors ---------------------------------------------------------------------


def test_token_sources(tmp_path: Path) -> None:
    f = tmp_path / "tok"
    f.write_text("  from-file\n")
    assert cpctl.resolve_token(f, {"CPCTL_TOKEN": "from-env"}) == "from-file"  # the flag wins
    assert cpctl.resolve_token(None, {"CPCTL_TOKEN": " from-env "}) == "from-env"
    with pytest.raises(cpctl.CliError) as e:
        cpctl.resolve_token(tmp_path / "missing", {})
    assert e.value.code == 4
    assert str(tmp_path / "missing") in str(e.value) and "--token-file" in str(e.value)
    with pytest.raises(cpctl.CliError):
        cpctl.resolve_token(None, {"CPCTL_TOKEN": "two words"})
    other = tmp_path / "state" / "admin-token"  # serve --state-dir DIR
    other.parent.mkdir()
    other.write_text("from-state-dir\n")
    assert cpctl.resolve_token(None, {"CPCTL_TOKEN_FILE": str(other)}) == "from-state-dir"
    assert cpctl.resolve_token(f, {"CPCTL_TOKEN_FILE": str(other)}) == "from-file"  # the flag wins
    assert cpctl.resolve_token(None, {"CPCTL_TOKEN_FILE": str(other), "CPCTL_TOKEN": "t"}) == "t"
    with pytest.raises(cpctl.CliError) as e:
        cpctl.resolve_token(None, {"CPCTL_TOKEN_FILE": str(tmp_path / "nope")})
    assert str(tmp_path / "nope") in str(e.value)


def test_missing_token_file_is_one_line_exit_4(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("CPCTL_TOKEN", raising=False)
    missing = tmp_path / "nope" / "admin-token"
    assert cpctl.main(["--token-file", str(missing), "rollout", "list"]) == 4
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("cpctl: ") and str(missing) in err


def test_server_down_is_unavailable_with_a_hint(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CPCTL_TOKEN", "t")
    server = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("CPCTL_SERVER", server)
    assert cpctl.main(["--timeout", "5", "proxies"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("cpctl: UNAVAILABLE: ") and err.count("\n") == 1
    assert f"is the control plane running at {server}?" in err


class _Failed(grpc.RpcError, grpc.Call):  # type: ignore[misc]
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def initial_metadata(self) -> None: ...
    def trailing_metadata(self) -> None: ...
    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> None: ...
    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Any) -> bool:
        return False


@pytest.mark.parametrize(
    ("code", "exit_code"),
    [
        (grpc.StatusCode.UNAUTHENTICATED, 4),
        (grpc.StatusCode.PERMISSION_DENIED, 4),
        (grpc.StatusCode.NOT_FOUND, 1),
        (grpc.StatusCode.INVALID_ARGUMENT, 1),
        (grpc.StatusCode.FAILED_PRECONDITION, 1),
    ],
)
def test_rpc_error_lines(code: grpc.StatusCode, exit_code: int) -> None:
    line, got = cpctl.rpc_error_line(_Failed(code, "it went\nwrong"), "h:1")
    assert line == f"cpctl: {code.name}: it went wrong"
    assert got == exit_code


def test_rpc_error_hints() -> None:
    line, code = cpctl.rpc_error_line(_Failed(grpc.StatusCode.UNAVAILABLE, "refused"), "h:1")
    assert code == 1 and "is the control plane running at h:1? (--server" in line
    line, _ = cpctl.rpc_error_line(_Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "slow"), "h:1")
    assert "--timeout" in line


# ---- rollouts -----------------------------------------------------------------------------


def _rollout(phase: str = "Progressing", step: int = 2, analysis: bool = True) -> rollout_pb2.Rollout:
    r = rollout_pb2.Rollout(
        model="llama",
        stable_version="v1",
        canary_version="v2",
        phase=phase,
        step=step,
        steps=[5, 25, 50, 100],
        weights={"v2": 25, "v1": 75},
        reason="promoted by operator",
        manual=True,
        max_error_rate=0.01,
        max_latency_ratio=1.5,
        min_requests=50,
        ack_deadline_seconds=30,
        step_started_at=1700000000.0,
    )
    if analysis:
        r.canary.version, r.canary.requests, r.canary.error_rate, r.canary.p99_seconds = "v2", 120, 0.025, 0.3
        r.stable.version, r.stable.requests, r.stable.error_rate = "v1", 900, 0.0
    return r


def test_rollout_to_dict() -> None:
    d = out.rollout_to_dict(_rollout())
    assert list(d["weights"].items()) == [("v1", 75), ("v2", 25)]  # stable first
    assert d["model"] == "llama" and d["phase"] == "Progressing" and d["step"] == 2
    assert d["steps"] == [5, 25, 50, 100]
    assert (d["stable_version"], d["canary_version"], d["reason"]) == ("v1", "v2", "promoted by operator")
    assert d["canary"] == {"version": "v2", "requests": 120, "error_rate": 0.025, "p99_seconds": 0.3}
    assert d["stable"] == {"version": "v1", "requests": 900, "error_rate": 0.0, "p99_seconds": None}
    finished = out.rollout_to_dict(_rollout("Completed", 4, analysis=False))
    assert "canary" not in finished and "stable" not in finished


def test_a_completed_rollout_shows_the_new_stable_and_no_canary() -> None:
    done = _rollout("Completed", 4, analysis=False)
    text = out.rollout_table(done)
    assert "Stable:   v2  (replaced v1)" in text and "Canary:   -" in text
    head, row = out.rollouts_table([done]).splitlines()[:2]
    at = head.index("STABLE")
    assert row[at:].split()[:2] == ["v2", "-"]  # STABLE, CANARY
    running = out.rollout_table(_rollout())
    assert "Stable:   v1\n" in running and "Canary:   v2" in running


def test_rollout_json_and_yaml_shape() -> None:
    r = _rollout()
    doc = json.loads(out.dump(out.rollout_to_dict(r), "json"))
    assert {k: doc[k] for k in ("model", "phase", "step", "weights")} == {
        "model": "llama",
        "phase": "Progressing",
        "step": 2,
        "weights": {"v1": 75, "v2": 25},
    }
    one = out.dump(out.rollout_to_dict(r), "json", one_line=True)
    assert "\n" not in one and json.loads(one) == doc
    assert yaml.safe_load(out.dump(out.rollout_to_dict(r), "yaml")) == doc


def test_rollout_table() -> None:
    text = out.rollout_table(_rollout(), now=1700000012.0)
    assert "Phase:    Progressing" in text
    assert "Step:     2/4 (25%)" in text
    assert "Weights:  v1 75%, v2 25%" in text
    assert "(12s ago)" in text
    canary = next(line for line in text.splitlines() if line.split()[:2] == ["v2", "canary"])
    assert canary.split()[2:] == ["120", "2.50%", "300ms"]
    stable = next(line for line in text.splitlines() if line.split()[:2] == ["v1", "stable"])
    assert stable.split()[2:] == ["900", "0.00%", "-"]
    waiting = out.rollout_table(_rollout(step=0, analysis=False))
    assert "0/4 (waiting for every proxy" in waiting and "Analysis" not in waiting


def test_summary_and_list() -> None:
    assert out.summary_line(_rollout()) == "llama: Progressing, step 2/4 (25%), v1 75%, v2 25%"
    rows = out.rollouts_table([_rollout(), _rollout("Aborted")]).splitlines()
    assert rows[0].split() == ["MODEL", "PHASE", "STEP", "WEIGHTS", "STABLE", "CANARY", "REASON"]
    assert rows[2].split()[:3] == ["llama", "Aborted", "2/4"]


class _FakeStream:
    def __init__(self, items: list[rollout_pb2.Rollout]) -> None:
        self.items = items
        self.cancelled = False

    def __iter__(self) -> Iterator[rollout_pb2.Rollout]:
        return iter(self.items)

    def cancel(self) -> None:
        self.cancelled = True


class _FakeClient:
    def __init__(self, **stubs: Any) -> None:
        self.__dict__.update(stubs)

    def call(self, method: Any, request: Any) -> Any:
        return method(request)

    def stream(self, method: Any, request: Any) -> Any:
        return method(request)


@pytest.mark.parametrize(("last", "exit_code"), [("Aborted", 3), ("Completed", 0), ("Progressing", 0)])
def test_watch_exit_codes_and_json_lines(
    last: str, exit_code: int, capsys: pytest.CaptureFixture[str]
) -> None:
    stream = _FakeStream([_rollout(), _rollout(last, 4, analysis=False)])

    class Stub:
        def Watch(self, req: rollout_pb2.GetRolloutRequest) -> _FakeStream:
            assert req.model == "llama"
            return stream

    args = cpctl.build_parser().parse_args(["rollout", "status", "llama", "-w", "-o", "json"])
    assert cpctl.cmd_status(_FakeClient(rollouts=Stub()), args) == exit_code  # type: ignore[arg-type]
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["phase"] for line in lines] == ["Progressing", last]
    assert stream.cancelled


def test_watch_table_without_a_tty_separates_updates(capsys: pytest.CaptureFixture[str]) -> None:
    class Stub:
        def Watch(self, req: rollout_pb2.GetRolloutRequest) -> _FakeStream:
            return _FakeStream([_rollout(), _rollout("Completed", 4, analysis=False)])

    args = cpctl.build_parser().parse_args(["rollout", "status", "llama", "--watch"])
    assert cpctl.cmd_status(_FakeClient(rollouts=Stub()), args) == 0  # type: ignore[arg-type]
    text = capsys.readouterr().out
    assert cpctl.CLEAR_SCREEN not in text
    first, second = text.split("\n\n")
    assert "Phase:    Progressing" in first and "Phase:    Completed" in second


def test_watch_table_on_a_tty_redraws(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    class Stub:
        def Watch(self, req: rollout_pb2.GetRolloutRequest) -> _FakeStream:
            return _FakeStream([_rollout(), _rollout("Aborted", 2, analysis=False)])

    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    args = cpctl.build_parser().parse_args(["rollout", "status", "llama", "-w"])
    assert cpctl.cmd_status(_FakeClient(rollouts=Stub()), args) == 3  # type: ignore[arg-type]
    screens = capsys.readouterr().out.split(cpctl.CLEAR_SCREEN)
    assert screens[0] == "" and len(screens) == 3
    assert "Phase:    Aborted" in screens[2] and "Phase:    Aborted" not in screens[1]


def test_history_table_uses_local_iso_time() -> None:
    a = rollout_pb2.AuditRecord(
        model="llama", at=1700000000.0, who="ann", phase="Paused", step=2, weight=25, reason="x"
    )
    text = out.history_table([a])
    assert out.local_time(1700000000.0) in text
    assert out.local_time(1700000000.0).startswith("2023-11-1")
    assert text.splitlines()[1].split()[1:5] == ["Paused", "2", "25%", "ann"]


# ---- endpoints and proxies ----------------------------------------------------------------


def test_endpoints_table_and_dict() -> None:
    e = endpoint_pb2.Endpoint(
        model="llama",
        version="v1",
        address="10.0.0.1:8000",
        gpu="A100",
        state="SERVING",
        weight=7,
        running=3,
        waiting=1.5,
        in_flight=4,
        error_rate=0.5,
        latency_seconds=0.12,
        signal_age_seconds=-1,
    )
    head, row = out.endpoints_table([e]).splitlines()
    assert head.split() == [
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
    assert row.split() == [
        "llama",
        "v1",
        "10.0.0.1:8000",
        "A100",
        "SERVING",
        "7",
        "3",
        "1.5",
        "4",
        "120ms",
        "50.00%",
    ]
    d = out.endpoint_to_dict(e)
    assert d["latency_seconds"] == 0.12 and d["signal_age_seconds"] is None and d["drain_started_at"] is None
    assert out.endpoint_to_dict(endpoint_pb2.Endpoint(address="a:1"))["latency_seconds"] is None


def test_an_endpoint_out_of_sight_is_marked_and_explained() -> None:
    note = (
        "out of sight for 12s (no answer: GET /health timed out after 0.5s); kept serving on its last verdict"
    )
    e = endpoint_pb2.Endpoint(
        model="llama", version="v1", address="127.0.0.1:8000", state="SERVING", weight=5,
        sight="OUT_OF_SIGHT", note=note,
    )  # fmt: skip
    text = out.endpoints_table([e])
    assert "SERVING (out of sight)" in text.splitlines()[1]
    assert text.splitlines()[-1] == f"llama/v1 127.0.0.1:8000: {note}"
    assert out.endpoint_to_dict(e)["sight"] == "OUT_OF_SIGHT"


def test_proxies_table() -> None:
    envoy = proxy_pb2.Proxy(node_id="envoy-1", address="ipv4:127.0.0.1:5000", transport="sotw", service="ads")
    for t, status in (("cds", "SYNCED"), ("eds", "SYNCED"), ("lds", "NACKED"), ("rds", "STALE")):
        envoy.types.add(type=t, status=status, last_nack="bad listener: port taken" if t == "lds" else "")
    grpc_client = proxy_pb2.Proxy(node_id="", address="ipv4:127.0.0.1:5001", transport="delta")
    grpc_client.types.add(type="lds", status="SYNCED")
    lines = out.proxies_table([envoy, grpc_client]).splitlines()
    assert lines[0].split() == ["NODE", "ADDRESS", "TRANSPORT", "CDS", "EDS", "LDS", "RDS"]
    assert lines[1].split() == [
        "envoy-1",
        "ipv4:127.0.0.1:5000",
        "sotw",
        "SYNCED",
        "SYNCED",
        "NACKED",
        "STALE",
    ]
    assert lines[2].split() == ["-", "ipv4:127.0.0.1:5001", "delta", "-", "-", "SYNCED", "-"]
    assert lines[3] == "" and lines[4] == "Last NACKs:"
    assert lines[5].strip() == "envoy-1 (ipv4:127.0.0.1:5000) LDS: bad listener: port taken"
    assert len(lines) == 6
    assert out.proxies_table([]) == "no proxies connected"
    assert out.proxy_to_dict(envoy)["types"]["lds"]["status"] == "NACKED"


# ---- autoscaling --------------------------------------------------------------------------


def _scaling() -> list[autoscaling_pb2.ModelScaling]:
    whole = autoscaling_pb2.ModelScaling(
        model="llama", desired=1, ready=3, demand=2.5, target_per_replica=8, active=True,
        reason="stable: the last 60s want 1", min=1, max=4,
        remove=["127.0.0.2:8000"], draining=["127.0.0.3:8000"],
    )  # fmt: skip
    stable = autoscaling_pb2.ModelScaling(
        model="llama", version="v1", desired=1, ready=2, demand=2.5, target_per_replica=8,
        reason="stable: the last 60s want 1", remove=["127.0.0.2:8000"],
    )  # fmt: skip
    canary = autoscaling_pb2.ModelScaling(
        model="llama", version="v2", desired=1, ready=1, target_per_replica=8,
        reason="stable: the last 60s want 0; raised to min 1", draining=["127.0.0.3:8000"],
    )  # fmt: skip
    warm = autoscaling_pb2.ModelScaling(
        model="qwen", desired=3, ready=1, demand=4, target_per_replica=2, predicted_demand=5.2,
        forecast_method="holt", lead_seconds=30, reason="pre-warm: holt forecasts demand 5.2",
    )  # fmt: skip
    return [whole, stable, canary, warm]


def test_scaling_table_names_what_scale_down_drains_next_and_what_drains() -> None:
    lines = out.scaling_table(_scaling()).splitlines()
    head = ["MODEL", "VERSION", "DESIRED", "READY", "DEMAND", "TARGET", "FORECAST", "REASON"]
    assert lines[0].split() == head
    assert lines[1].split()[:7] == ["llama", "(all)", "1", "3", "2.5", "8", "-"]
    assert lines[1].endswith("stable: the last 60s want 1")
    assert lines[2].split()[:2] == ["llama", "v1"] and lines[3].split()[:2] == ["llama", "v2"]
    assert "5.2 (holt, 30s ahead)" in lines[4]
    # The stable version's list repeats the model's: shown once.
    assert lines[5:] == [
        "",
        "Scale-down would drain next:",
        "  llama: 127.0.0.2:8000",
        "",
        "Draining now:",
        "  llama: 127.0.0.3:8000",
    ]
    assert out.scaling_table([]).startswith("no autoscaling decisions yet")


def test_scaling_dict_keeps_no_forecast_apart_from_zero() -> None:
    whole, _, _, warm = _scaling()
    d = out.scaling_to_dict(whole)
    assert d["version"] == "" and d["predicted_demand"] is None and d["min"] == 1 and d["max"] == 4
    assert d["remove"] == ["127.0.0.2:8000"] and d["draining"] == ["127.0.0.3:8000"] and d["active"] is True
    assert out.scaling_to_dict(warm)["predicted_demand"] == 5.2
    zero = autoscaling_pb2.ModelScaling(model="m", predicted_demand=0.0)
    assert out.scaling_to_dict(zero)["predicted_demand"] == 0.0 and out.forecast_text(zero) == "0"


@pytest.mark.parametrize("fmt", ["table", "json"])
def test_autoscaling_list_asks_for_the_model_given(fmt: str, capsys: pytest.CaptureFixture[str]) -> None:
    asked: list[str] = []

    class Stub:
        def List(
            self, req: autoscaling_pb2.ListAutoscalingRequest
        ) -> autoscaling_pb2.ListAutoscalingResponse:
            asked.append(req.model)
            return autoscaling_pb2.ListAutoscalingResponse(scaling=_scaling()[:1])

    for argv in (["autoscaling", "list", "llama", "-o", fmt], ["autoscaling", "list", "-o", fmt]):
        args = cpctl.build_parser().parse_args(argv)
        assert cpctl.cmd_autoscaling(_FakeClient(autoscaling=Stub()), args) == 0  # type: ignore[arg-type]
        text = capsys.readouterr().out
        if fmt == "json":
            rows = json.loads(text)["scaling"]
            assert [(s["model"], s["version"], s["desired"]) for s in rows] == [("llama", "", 1)]
        else:
            assert text.splitlines()[1].split()[:3] == ["llama", "(all)", "1"]
    assert asked == ["llama", ""]


# ---- completion ---------------------------------------------------------------------------


def test_completion_script_mentions_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert cpctl.main(["completion", "bash"]) == 0
    script = capsys.readouterr().out
    assert "complete -F _cpctl cpctl" in script
    for words in (
        "rollout endpoints autoscaling proxies completion",
        "start status pause resume abort undo promote list history",
        "list drain undrain",
    ):
        assert f'echo "{words}"' in script
    for flag in ("--steps", "--interval", "--manual", "--ack-deadline", "--wait", "--token-file"):
        assert flag in script
    assert cpctl.main(["completion", "zsh"]) == 0
    zsh = capsys.readouterr().out
    assert "bashcompinit" in zsh and "complete -F _cpctl cpctl" in zsh


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("cpctl ", "rollout endpoints autoscaling proxies completion"),
        ("cpctl autoscaling list llama -o ", "table json yaml"),
        ("cpctl rollout st", "start status"),
        ("cpctl --server h:1 endpoints ", "list drain undrain"),
        ("cpctl rollout status llama -o ", "table json yaml"),
        ("cpctl rollout promote llama --f", "--full"),
        ("cpctl completion ", "bash zsh"),
    ],
)
def test_bash_completion_completes(line: str, expected: str) -> None:
    script = out.completion_script(cpctl.build_parser(), "bash")
    words = line.split(" ")
    program = (
        f"{script}\nCOMP_WORDS=({' '.join(shlex.quote(w) for w in words)}); COMP_CWORD={len(words) - 1}\n"
        '_cpctl; echo "${COMPREPLY[*]}"'
    )
    got = subprocess.run(["bash", "-c", program], capture_output=True, text=True, check=True).stdout
    assert got.strip() == expected
