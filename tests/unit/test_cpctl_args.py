"""`cpctl` without a server: argument parsing, token lookup, error lines, output shapes and
the completion script."""

from __future__ import annotations

import argparse
import json
import re
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

from controlplane.cli import argtypes, cpctl
from controlplane.cli import cpctl_output as out
from controlplane.cli.cpctl_commands import autoscaling, client, command, completion, endpoints, rollout
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
    assert argtypes.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "x", "3x", "s", "-1s", "0", "0ms", "1e3", "2 minutes", "nan"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        argtypes.parse_duration(text)


def test_steps() -> None:
    assert argtypes.parse_steps("5,25,50,100") == [5, 25, 50, 100]
    assert argtypes.parse_steps(" 10, 100") == [10, 100]
    # Parsing takes any percents; their order is judged with the rest (start_problem).
    assert argtypes.parse_steps("50,25") == [50, 25]


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
    before = p.parse_args(["--server", "a:1", "--request-timeout", "2s", "rollout", "status", "m"])
    assert (before.server, before.request_timeout, before.model) == ("a:1", 2.0, "m")
    after = p.parse_args(["rollout", "status", "m", "--server", "b:2", "--token-file", "/t"])
    assert (after.server, after.token_file) == ("b:2", Path("/t"))
    late = p.parse_args(["proxies", "--request-timeout", "500ms"])
    assert late.request_timeout == 0.5
    unset = p.parse_args(["proxies"])
    assert not hasattr(unset, "server") and not hasattr(unset, "request_timeout")


@pytest.mark.parametrize(
    "argv",
    [
        ["--timeout", "3", "proxies"],
        ["proxies", "--timeout", "3"],
        ["rollout", "status", "m", "--timeout", "3s"],
        ["--timeout", "3", "endpoints", "drain", "127.0.0.1:80"],
    ],
)
def test_timeout_is_still_the_request_timeout_outside_drain(argv: list[str]) -> None:
    args = cpctl.build_parser().parse_args(argv)
    assert args.request_timeout == 3.0
    assert getattr(args, "drain_timeout", None) is None


def test_the_rpc_deadline_and_the_drain_timeout_have_their_own_names() -> None:
    p = cpctl.build_parser()
    args = p.parse_args(
        ["endpoints", "drain", "127.0.0.1:80", "--request-timeout", "3", "--drain-timeout", "2m", "--wait"]
    )
    assert (args.request_timeout, args.drain_timeout, args.wait) == (3.0, 120.0, True)
    # The old spelling on drain is still the drain's own timeout; before `endpoints` it is
    # the call deadline.
    old = p.parse_args(["--timeout", "3", "endpoints", "drain", "127.0.0.1:80", "--timeout", "2m"])
    assert (old.request_timeout, old.drain_timeout) == (3.0, 120.0)
    default = p.parse_args(["endpoints", "drain", "127.0.0.1:80"])
    assert default.drain_timeout is None and not hasattr(default, "request_timeout")


def test_help_names_the_new_flags_and_the_old_one_as_deprecated(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cpctl.main(["endpoints", "drain", "-h"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--request-timeout DURATION" in text and "--drain-timeout DURATION" in text
    assert "--timeout, its old name, still works but is deprecated" in text
    assert "--timeout DURATION" not in text  # hidden: kept only for old scripts


def test_start_sets_only_the_fields_given() -> None:
    sent: list[rollout_pb2.StartRolloutRequest] = []

    class Stub:
        def Start(self, req: rollout_pb2.StartRolloutRequest, **kw: Any) -> rollout_pb2.Rollout:
            sent.append(req)
            return _rollout()

    p = cpctl.build_parser()
    for argv in (["--manual"], ["--steps", "10,100", "--interval", "2m", "--max-error-rate", "0.05"]):
        args = p.parse_args(["rollout", "start", "llama", "--to", "v2", *argv])
        assert rollout.cmd_start(_FakeClient(rollouts=Stub()), args) == 0  # type: ignore[arg-type]
    manual, timed = sent
    assert manual.manual and manual.interval_seconds == 0 and list(manual.steps) == []
    for field in ("max_error_rate", "max_latency_ratio", "min_requests", "ack_deadline_seconds"):
        assert not manual.HasField(field)
    assert not timed.manual and timed.interval_seconds == 120.0 and list(timed.steps) == [10, 100]
    assert timed.HasField("max_error_rate") and timed.max_error_rate == 0.05
    assert not timed.HasField("min_requests")


# ---- token and errors ---------------------------------------------------------------------


def _token(token_file: Path | None, env: dict[str, str]) -> str:
    return client.resolve_token(token_file, env).token


def test_token_sources(tmp_path: Path) -> None:
    f = tmp_path / "tok"
    f.write_text("  from-file\n")
    assert client.resolve_token(f, {"CPCTL_TOKEN": "from-env"}) == client.Credential("from-file", str(f))
    assert client.resolve_token(None, {"CPCTL_TOKEN": " from-env "}) == client.Credential(
        "from-env", "$CPCTL_TOKEN"
    )
    with pytest.raises(command.CliError) as e:
        client.resolve_token(tmp_path / "missing", {})
    assert e.value.code == 4
    assert str(tmp_path / "missing") in str(e.value) and "--token-file" in str(e.value)
    with pytest.raises(command.CliError):
        client.resolve_token(None, {"CPCTL_TOKEN": "two words"})
    other = tmp_path / "state" / "admin-token"  # serve --state-dir DIR
    other.parent.mkdir()
    other.write_text("from-state-dir\n")
    assert client.resolve_token(None, {"CPCTL_TOKEN_FILE": str(other)}) == client.Credential(
        "from-state-dir", str(other)
    )
    assert _token(f, {"CPCTL_TOKEN_FILE": str(other)}) == "from-file"  # the flag wins
    assert _token(None, {"CPCTL_TOKEN_FILE": str(other), "CPCTL_TOKEN": "t"}) == "t"
    with pytest.raises(command.CliError) as e:
        client.resolve_token(None, {"CPCTL_TOKEN_FILE": str(tmp_path / "nope")})
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
        (grpc.StatusCode.INVALID_ARGUMENT, 2),  # a bad argument, found by the server
        (grpc.StatusCode.FAILED_PRECONDITION, 1),
    ],
)
def test_rpc_error_lines(code: grpc.StatusCode, exit_code: int) -> None:
    line, got = client.rpc_error_line(_Failed(code, "it went\nwrong"), "h:1")
    assert line == f"cpctl: {code.name}: it went wrong"
    assert got == exit_code


def test_rpc_error_hints() -> None:
    line, code = client.rpc_error_line(_Failed(grpc.StatusCode.UNAVAILABLE, "refused"), "h:1")
    assert code == 1 and "is the control plane running at h:1? (--server" in line
    line, _ = client.rpc_error_line(_Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "slow"), "h:1")
    assert "(raise --request-timeout?)" in line


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
    assert rollout.cmd_status(_FakeClient(rollouts=Stub()), args) == exit_code  # type: ignore[arg-type]
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["phase"] for line in lines] == ["Progressing", last]
    assert stream.cancelled


def test_watch_table_without_a_tty_prints_a_line_per_change(capsys: pytest.CaptureFixture[str]) -> None:
    later = _rollout()
    later.canary.requests = 180  # the figures moved, the state did not: no line
    paused = _rollout("Paused")
    paused.reason = "look at the dashboards"

    class Stub:
        def Watch(self, req: rollout_pb2.GetRolloutRequest) -> _FakeStream:
            return _FakeStream([_rollout(), later, paused, paused, _rollout("Completed", 4, analysis=False)])

    args = cpctl.build_parser().parse_args(["rollout", "status", "llama", "--watch"])
    assert rollout.cmd_status(_FakeClient(rollouts=Stub()), args) == 0  # type: ignore[arg-type]
    text = capsys.readouterr().out
    assert rollout.CLEAR_SCREEN not in text
    lines = text.splitlines()
    assert len(lines) == 3, lines
    assert all(re.fullmatch(r"\d\d:\d\d:\d\d  llama: .*", line) for line in lines), lines
    assert lines[0].endswith("llama: Progressing, step 2/4 (25%), v1 75%, v2 25%; promoted by operator")
    assert lines[1].endswith("llama: Paused, step 2/4 (25%), v1 75%, v2 25%; look at the dashboards")
    assert "llama: Completed, step 4/4 (100%)" in lines[2]


def test_watch_table_on_a_tty_redraws(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    class Stub:
        def Watch(self, req: rollout_pb2.GetRolloutRequest) -> _FakeStream:
            return _FakeStream([_rollout(), _rollout("Aborted", 2, analysis=False)])

    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    args = cpctl.build_parser().parse_args(["rollout", "status", "llama", "-w"])
    assert rollout.cmd_status(_FakeClient(rollouts=Stub()), args) == 3  # type: ignore[arg-type]
    screens = capsys.readouterr().out.split(rollout.CLEAR_SCREEN)
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


def test_a_figure_never_read_is_unknown_in_the_table_and_null_in_json_and_yaml() -> None:
    e = endpoint_pb2.Endpoint(
        model="llama", version="v1", address="10.0.0.1:8000", state="SERVING", weight=100
    )
    row = out.endpoints_table([e]).splitlines()[1].split()
    assert row[6:] == ["unknown", "unknown", "0", "unknown", "unknown"]
    figures = ("running", "waiting", "kv_use", "latency_seconds", "error_rate")
    doc = json.loads(out.dump(out.endpoint_to_dict(e), "json"))
    assert [doc[k] for k in figures] == [None] * 5
    assert [yaml.safe_load(out.dump(out.endpoint_to_dict(e), "yaml"))[k] for k in figures] == [None] * 5
    # Read as 0, a figure is 0: idle is not unknown.
    idle = endpoint_pb2.Endpoint(
        model="llama", version="v1", address="10.0.0.2:8000", state="SERVING", running=0, waiting=0,
        kv_use=0, error_rate=0,
    )  # fmt: skip
    assert out.endpoints_table([idle]).splitlines()[1].split()[6:] == ["0", "0", "0", "unknown", "0.00%"]
    doc = json.loads(out.dump(out.endpoint_to_dict(idle), "json"))
    assert (doc["running"], doc["waiting"], doc["kv_use"], doc["error_rate"]) == (0, 0, 0, 0)


def test_why_the_last_scrape_read_no_load_is_shown_for_an_endpoint_in_sight() -> None:
    why = (
        "unreadable metrics page: no vLLM, SGLang, TGI, Triton or llama.cpp metrics on the page (15 samples)"
    )
    e = endpoint_pb2.Endpoint(
        model="llama", version="v1", address="10.0.0.1:8000", state="SERVING", weight=100, sight="SEEN",
        scrape_error=why, scrape_error_reason="no_dialect",
    )  # fmt: skip
    text = out.endpoints_table([e])
    assert text.splitlines()[-1] == f"llama/v1 10.0.0.1:8000: last scrape read no load (no_dialect): {why}"
    d = out.endpoint_to_dict(e)
    assert (d["scrape_error"], d["scrape_error_reason"]) == (why, "no_dialect")
    assert out.endpoint_to_dict(endpoint_pb2.Endpoint())["scrape_error"] is None
    # No answer is for the sight to tell (out of sight after 3): the table does not say it per
    # scrape; JSON has it.
    silent = endpoint_pb2.Endpoint(
        model="llama", version="v1", address="10.0.0.1:8000", state="SERVING", sight="SEEN",
        scrape_error="GET /metrics failed: refused", scrape_error_reason="unreachable",
    )  # fmt: skip
    assert "refused" not in out.endpoints_table([silent])
    assert out.endpoint_to_dict(silent)["scrape_error_reason"] == "unreachable"
    # A note that already names the error does not get it twice.
    held = endpoint_pb2.Endpoint(
        model="llama", version="v1", address="10.0.0.1:8000", state="HELD_OUT",
        note="not ready: GET /metrics answered HTTP 503",
        scrape_error="GET /metrics answered HTTP 503", scrape_error_reason="http_error",
    )  # fmt: skip
    assert out.endpoints_table([held]).count("HTTP 503") == 1


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
        assert autoscaling.cmd_autoscaling(_FakeClient(autoscaling=Stub()), args) == 0  # type: ignore[arg-type]
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
        "rollout endpoints autoscaling quota proxies version completion",
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
        ("cpctl ", "rollout endpoints autoscaling quota proxies version completion"),
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


# ---- usage errors found before any call (exit 2) ------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "50,25,100"], "--steps 50,25,100: must increase, each 1-100"),
        (["--steps", "25,25,100"], "--steps 25,25,100: must increase, each 1-100"),
        (["--steps", "10,50"], "--steps: the last step must be 100, got 50"),
        (["--steps", "100,50"], "--steps 100,50: must increase, each 1-100"),
        (["--max-error-rate", "1.5"], "--max-error-rate: must be between 0 and 1"),
        (["--max-latency-ratio", "0.5"], "--max-latency-ratio: must be at least 1"),
    ],
)
def test_start_settings_the_server_would_refuse_exit_2_first(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # No token and no server are needed to find a usage error.
    monkeypatch.setenv("CPCTL_TOKEN_FILE", "/nonexistent/admin-token")
    monkeypatch.setenv("CPCTL_SERVER", f"127.0.0.1:{free_port()}")
    err = _usage_error(["rollout", "start", "llama", "--to", "v2", *argv], capsys)
    assert err.startswith("usage: cpctl rollout start ")
    assert err.splitlines()[-1] == f"cpctl rollout start: error: {message}"


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--steps", "100"],
        ["--steps", "1,2,3,100", "--manual"],
        ["--max-error-rate", "0", "--max-latency-ratio", "1", "--min-requests", "0"],
        ["--interval", "500ms", "--ack-deadline", "1s", "--shadow", "100"],
    ],
)
def test_start_settings_the_server_accepts_pass(argv: list[str]) -> None:
    args = cpctl.build_parser().parse_args(["rollout", "start", "llama", "--to", "v2", *argv])
    assert rollout.start_problem(args) is None


def test_the_client_check_is_the_servers_rule() -> None:
    """Whatever start_problem lets through, the server's RolloutSpec check takes, and the
    reverse, over the request cpctl would send (the same defaults on both sides)."""
    from controlplane.admin.service import _start_request
    from controlplane.rollout.machine import RolloutRejected

    p = cpctl.build_parser()
    for argv in (
        ["--steps", "50,25,100"],
        ["--steps", "5,100"],
        ["--steps", "10,50"],
        ["--max-error-rate", "3"],
        ["--max-latency-ratio", "0.9"],
        ["--manual", "--min-requests", "0"],
        [],
    ):
        args = p.parse_args(["rollout", "start", "llama", "--to", "v2", *argv])
        spec = _start_request(rollout.start_request(args))
        try:
            spec.check()
            server = None
        except RolloutRejected as e:
            server = str(e)
        assert rollout.start_problem(args) == server, argv


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["rollout", "status", ""], "argument MODEL: must not be empty"),
        (["rollout", "start", "llama", "--to", ""], "argument --to: must not be empty"),
        (["rollout", "history", "m" * 257], "argument MODEL: at most 256 characters, got 257"),
        (["endpoints", "drain", "x" * 300], "argument ADDRESS: at most 256 characters, got 300"),
        (["endpoints", "list", "--model", "m" * 257], "argument --model: at most 256 characters, got 257"),
        (["rollout", "pause", "llama", "--reason", "r" * 1025], "argument --reason: at most 1024"),
        (["autoscaling", "list", "m" * 257], "argument MODEL: at most 256 characters"),
        (["version", "-o", "xml"], "argument -o/--output: invalid choice"),
        (["rollout", "promote", "llama", "-o", "csv"], "argument -o/--output: invalid choice"),
    ],
)
def test_names_and_reasons_beyond_the_apis_bounds_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in _usage_error(argv, capsys)


def test_a_server_without_a_port_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--server: expected HOST:PORT" in _usage_error(["--server", "localhost", "proxies"], capsys)


def test_subcommand_parser_finds_the_leaf() -> None:
    p = cpctl.build_parser()
    assert cpctl.subcommand_parser(p, p.parse_args(["rollout", "start", "m", "--to", "v"])).prog == (
        "cpctl rollout start"
    )
    assert cpctl.subcommand_parser(p, p.parse_args(["proxies"])).prog == "cpctl proxies"


def test_every_command_that_prints_data_takes_output() -> None:
    """-o table|json|yaml (and --output) on every command but `completion`."""
    p = cpctl.build_parser()
    for path, sub, subs in out._walk(p):
        if subs or path in ("completion",):
            continue
        flags = {o for a in sub._actions for o in a.option_strings if a.dest == "output"}
        assert flags == {"-o", "--output"}, path
        action = next(a for a in sub._actions if a.dest == "output")
        assert tuple(action.choices or ()) == ("table", "json", "yaml"), path


# ---- JSON: RFC 3339 times and integer counts ----------------------------------------------


@pytest.mark.parametrize(
    ("unix", "text"),
    [
        (1796194800.0, "2026-12-02T07:00:00Z"),
        (1796194800.75, "2026-12-02T07:00:00Z"),
        (1700000000.0, "2023-11-14T22:13:20Z"),
        (0.0, None),
        (float("nan"), None),
    ],
)
def test_rfc3339(unix: float, text: str | None) -> None:
    assert out.rfc3339(unix) == text


def test_plain_makes_whole_numbers_integers() -> None:
    doc = {"a": 12.0, "b": [1.5, 2.0, {"c": 0.0}], "d": True, "e": "12.0", "f": float("inf"), "g": 3}
    assert out.plain(doc) == {"a": 12, "b": [1.5, 2, {"c": 0}], "d": True, "e": "12.0", "f": None, "g": 3}
    assert type(out.plain(doc)["a"]) is int and out.plain(doc)["d"] is True
    assert json.dumps(out.plain((1.0, 2.5))) == "[1, 2.5]"


def test_rollout_json_has_rfc3339_times_and_integer_counts() -> None:
    r = _rollout()
    r.step_started_at = 1796194800.25
    text = out.dump(out.rollout_to_dict(r), "json")
    doc = json.loads(text)
    assert doc["step_started_at"] == "2026-12-02T07:00:00Z"
    assert doc["canary"]["requests"] == 120 and '"requests": 120,' in text
    assert '"requests": 900,' in text and ".0," not in text and ".0\n" not in text
    assert doc["ack_deadline_seconds"] == 30 and doc["max_latency_ratio"] == 1.5
    never = out.rollout_to_dict(rollout_pb2.Rollout(model="m"))
    assert never["step_started_at"] is None
    assert "step_started_at: '2026-12-02T07:00:00Z'" in out.dump(out.rollout_to_dict(r), "yaml")


def test_history_json_gives_rfc3339_utc() -> None:
    a = rollout_pb2.AuditRecord(
        model="llama", at=1796194800.0, who="ann", phase="Paused", step=2, weight=25, reason="x"
    )
    assert out.record_to_dict(a) == {
        "at": "2026-12-02T07:00:00Z",
        "who": "ann",
        "phase": "Paused",
        "step": 2,
        "weight": 25,
        "reason": "x",
    }


def test_endpoint_json_counts_are_integers_and_drain_time_rfc3339() -> None:
    e = endpoint_pb2.Endpoint(
        model="llama", version="v1", address="127.0.0.1:8000", running=3, waiting=1.5, in_flight=4,
        capacity=8, drain_started_at=1796194800.0, signal_age_seconds=0.5,
    )  # fmt: skip
    doc = json.loads(out.dump(out.endpoint_to_dict(e), "json"))
    assert (doc["running"], doc["waiting"], doc["in_flight"], doc["capacity"]) == (3, 1.5, 4, 8)
    assert all(type(doc[k]) is int for k in ("running", "in_flight", "capacity", "weight"))
    assert doc["drain_started_at"] == "2026-12-02T07:00:00Z" and doc["signal_age_seconds"] == 0.5


def test_scaling_and_proxy_json_counts_are_integers() -> None:
    text = out.dump({"scaling": [out.scaling_to_dict(s) for s in _scaling()]}, "json")
    rows = json.loads(text)["scaling"]
    assert type(rows[0]["target_per_replica"]) is int and rows[0]["demand"] == 2.5
    assert type(rows[3]["demand"]) is int and rows[3]["predicted_demand"] == 5.2
    p = proxy_pb2.Proxy(node_id="n", connected_seconds=12.0)
    p.types.add(type="cds", status="SYNCED", resources=3)
    doc = json.loads(out.dump(out.proxy_to_dict(p), "json"))
    assert type(doc["connected_seconds"]) is int and doc["types"]["cds"]["resources"] == 3


# ---- output of the commands that change something -----------------------------------------


class _RolloutStub:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def __getattr__(self, method: str) -> Any:
        def call(req: Any) -> rollout_pb2.Rollout:
            self.calls.append((method, req))
            return _rollout()

        return call


@pytest.mark.parametrize(
    "argv",
    [
        ["rollout", "start", "llama", "--to", "v2"],
        ["rollout", "pause", "llama", "--reason", "x"],
        ["rollout", "resume", "llama"],
        ["rollout", "promote", "llama", "--full"],
        ["rollout", "abort", "llama"],
        ["rollout", "undo", "llama"],
    ],
)
@pytest.mark.parametrize("fmt", ["table", "json", "yaml"])
def test_rollout_commands_print_the_rollout_in_each_format(
    argv: list[str], fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = cpctl.build_parser().parse_args([*argv, "-o", fmt])
    assert args.func(_FakeClient(rollouts=_RolloutStub()), args) == 0
    text = capsys.readouterr().out
    if fmt == "table":
        assert text == "llama: Progressing, step 2/4 (25%), v1 75%, v2 25%\n"
    else:
        doc = json.loads(text) if fmt == "json" else yaml.safe_load(text)
        assert doc["model"] == "llama" and doc["weights"] == {"v1": 75, "v2": 25}
        assert doc["step_started_at"] == "2023-11-14T22:13:20Z"


class _EndpointStub:
    def __init__(self, states: list[str]) -> None:
        self.states = states

    def _endpoint(self) -> endpoint_pb2.Endpoint:
        state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        return endpoint_pb2.Endpoint(
            model="mistral", version="v1", address="127.0.0.1:9", state=state, in_flight=0
        )

    def Drain(self, req: endpoint_pb2.DrainRequest) -> endpoint_pb2.Endpoint:
        assert req.timeout_seconds == 20.0 and req.address == "127.0.0.1:9"
        return self._endpoint()

    def Undrain(self, req: endpoint_pb2.DrainRequest) -> endpoint_pb2.Endpoint:
        return self._endpoint()

    def List(self, req: endpoint_pb2.ListEndpointsRequest) -> endpoint_pb2.ListEndpointsResponse:
        return endpoint_pb2.ListEndpointsResponse(endpoints=[self._endpoint()])


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_drain_wait_as_a_document_prints_the_drained_endpoint_once(
    fmt: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(endpoints, "DRAIN_POLL_S", 0.0)
    stub = _EndpointStub(["DRAINING", "DRAINING", "DRAINED"])
    args = cpctl.build_parser().parse_args(
        ["endpoints", "drain", "127.0.0.1:9", "--drain-timeout", "20s", "--wait", "-o", fmt]
    )
    assert endpoints.cmd_drain(_FakeClient(endpoints=stub), args) == 0  # type: ignore[arg-type]
    text = capsys.readouterr().out
    doc = json.loads(text) if fmt == "json" else yaml.safe_load(text)
    assert doc["state"] == "DRAINED" and doc["address"] == "127.0.0.1:9"


def test_drain_and_undrain_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    p = cpctl.build_parser()
    args = p.parse_args(["endpoints", "drain", "127.0.0.1:9", "--timeout", "20s", "-o", "json"])
    assert endpoints.cmd_drain(_FakeClient(endpoints=_EndpointStub(["DRAINING"])), args) == 0  # type: ignore[arg-type]
    assert json.loads(capsys.readouterr().out)["state"] == "DRAINING"
    args = p.parse_args(["endpoints", "undrain", "127.0.0.1:9", "-o", "json"])
    assert endpoints.cmd_undrain(_FakeClient(endpoints=_EndpointStub(["SERVING"])), args) == 0  # type: ignore[arg-type]
    assert json.loads(capsys.readouterr().out)["state"] == "SERVING"


# ---- watching -----------------------------------------------------------------------------


def test_watch_state_ignores_the_figures_but_not_the_reason() -> None:
    a, b = _rollout(), _rollout()
    b.canary.requests, b.stable.error_rate = 999, 0.5
    assert out.watch_state(a) == out.watch_state(b)
    b.reason = "holding: 12/50 canary requests"
    assert out.watch_state(a) != out.watch_state(b)
    c = _rollout(step=3)
    c.weights["v2"], c.weights["v1"] = 50, 50
    assert out.watch_state(a) != out.watch_state(c)


def test_watch_line() -> None:
    assert out.watch_line(_rollout(), "07:00:01") == (
        "07:00:01  llama: Progressing, step 2/4 (25%), v1 75%, v2 25%; promoted by operator"
    )
    quiet = _rollout()
    quiet.reason = ""
    assert out.watch_line(quiet, "07:00:01").endswith("v2 25%")


@pytest.mark.parametrize("tty", [False, True])
def test_watch_json_prints_a_document_per_change_on_one_line(tty: bool) -> None:
    watch = rollout.RolloutWatch("json", tty)
    same = [watch.text(_rollout(), 0.0), watch.text(_rollout(), 1.0)]
    assert same[0] is not None and "\n" not in same[0] and same[1] is None
    moved = _rollout()
    moved.canary.requests = 121  # a document shows the figures: a change
    assert json.loads(watch.text(moved, 2.0) or "")["canary"]["requests"] == 121


def test_watch_yaml_separates_documents() -> None:
    watch = rollout.RolloutWatch("yaml", False)
    text = watch.text(_rollout(), 0.0)
    assert text is not None and text.startswith("---\n")
    assert yaml.safe_load(text)["phase"] == "Progressing"


def test_watch_on_a_tty_redraws_every_time() -> None:
    watch = rollout.RolloutWatch("table", True)
    first, second = watch.text(_rollout(), 0.0), watch.text(_rollout(), 1.0)
    assert first is not None and second is not None
    assert first.startswith(rollout.CLEAR_SCREEN) and "Phase:    Progressing" in first
    assert "(watching; updated " in second


# ---- version ------------------------------------------------------------------------------


def test_version_client_only(capsys: pytest.CaptureFixture[str]) -> None:
    from controlplane import __version__

    assert cpctl.main(["version", "--client"]) == 0
    assert capsys.readouterr().out == f"Client Version: {__version__}\n"
    assert cpctl.main(["version", "--client", "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"client": {"version": __version__}}


def test_version_text_and_doc() -> None:
    assert out.version_text("1.0", "0.9", "h:1") == "Client Version: 1.0\nServer Version: 0.9 (h:1)"
    assert out.version_doc("1.0", "0.9", "h:1") == {
        "client": {"version": "1.0"},
        "server": {"version": "0.9", "address": "h:1"},
    }
    assert out.version_text("1.0", None, "h:1") == "Client Version: 1.0"


def test_version_with_no_server_prints_the_client_then_the_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CPCTL_TOKEN", "t")
    down = f"127.0.0.1:{free_port()}"
    assert cpctl.main(["--server", down, "--request-timeout", "5", "version", "-o", "json"]) == 1
    captured = capsys.readouterr()
    assert list(json.loads(captured.out)) == ["client"]
    assert captured.err.startswith("cpctl: UNAVAILABLE: ") and captured.err.count("\n") == 1


def test_version_without_a_token_prints_the_client_then_exits_4(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("CPCTL_TOKEN", raising=False)
    assert cpctl.main(["--token-file", str(tmp_path / "none"), "version"]) == 4
    captured = capsys.readouterr()
    assert captured.out.startswith("Client Version: ") and "Server" not in captured.out
    assert str(tmp_path / "none") in captured.err


# ---- a refused token names where it came from ---------------------------------------------


def test_unauthenticated_names_the_token_file() -> None:
    e = _Failed(grpc.StatusCode.UNAUTHENTICATED, "the token is not valid")
    line, code = client.rpc_error_line(e, "127.0.0.1:18001", "/tmp/state/admin-token")
    assert code == 4
    assert line.startswith("cpctl: UNAUTHENTICATED: the token is not valid; cpctl sent the token from ")
    assert "/tmp/state/admin-token: is it the one 127.0.0.1:18001 uses?" in line
    assert "DIR/admin-token" in line and "\n" not in line
    line, _ = client.rpc_error_line(e, "h:1", "$CPCTL_TOKEN")
    assert "from $CPCTL_TOKEN" in line
    denied = _Failed(grpc.StatusCode.PERMISSION_DENIED, "Pause changes state")
    assert client.rpc_error_line(denied, "h:1", "/ro-token")[0].endswith("(the token from /ro-token)")


# ---- completion of names through the API --------------------------------------------------


def test_completion_names() -> None:
    eps = [
        endpoint_pb2.Endpoint(model="llama", version="v1", address="127.0.0.1:1"),
        endpoint_pb2.Endpoint(model="llama", version="v2", address="127.0.0.1:2"),
        endpoint_pb2.Endpoint(model="mistral", version="v1", address="127.0.0.1:3"),
        endpoint_pb2.Endpoint(model="llama", version="v1", address="127.0.0.1:4"),
    ]

    class Stub:
        def List(self, req: endpoint_pb2.ListEndpointsRequest) -> endpoint_pb2.ListEndpointsResponse:
            return endpoint_pb2.ListEndpointsResponse(endpoints=eps)

    c = _FakeClient(endpoints=Stub())
    assert completion.completion_names(c, "models", "") == ["llama", "mistral"]  # type: ignore[arg-type]
    assert completion.completion_names(c, "versions", "llama") == ["v1", "v2"]  # type: ignore[arg-type]
    assert completion.completion_names(c, "versions", "gpt-9") == []  # type: ignore[arg-type]
    assert completion.completion_names(c, "addresses", "")[-1] == "127.0.0.1:4"  # type: ignore[arg-type]


def test_complete_prints_nothing_when_it_cannot_ask(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CPCTL_TOKEN", "t")
    assert cpctl.main(["--server", f"127.0.0.1:{free_port()}", "__complete", "models"]) == 1
    assert capsys.readouterr() == ("", "")
    monkeypatch.delenv("CPCTL_TOKEN")
    assert cpctl.main(["--token-file", "/nonexistent", "__complete", "versions", "llama"]) == 1
    assert capsys.readouterr() == ("", "")


def test_the_complete_command_is_hidden(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cpctl.main(["--help"])
    assert "__complete" not in capsys.readouterr().out
    script = out.completion_script(cpctl.build_parser(), "bash")
    assert '"__complete' not in script  # no case for it: the shell never offers it


def _complete_with_fake_cpctl(line: str) -> tuple[str, str]:
    """Run the bash completion for `line` with `cpctl` a shell function that records its
    arguments and answers like `cpctl __complete`; (COMPREPLY, the arguments it got)."""
    script = out.completion_script(cpctl.build_parser(), "bash")
    words = line.split(" ")
    fake = """
cpctl() {
    echo "$*" > "$ASKED"
    case "$*" in
        *"__complete models"*) printf 'llama\\nmistral\\n' ;;
        *"__complete versions llama"*) printf 'v1\\nv2\\n' ;;
        *"__complete addresses"*) printf '127.0.0.1:8001\\n127.0.0.1:8002\\n' ;;
    esac
}
"""
    program = (
        f"{script}\n{fake}\nASKED=$(mktemp)\n"
        f"COMP_WORDS=({' '.join(shlex.quote(w) for w in words)}); COMP_CWORD={len(words) - 1}\n"
        '_cpctl; echo "${COMPREPLY[*]}"; cat "$ASKED"; rm -f "$ASKED"'
    )
    got = subprocess.run(["bash", "-c", program], capture_output=True, text=True, check=True).stdout
    reply, _, asked = got.partition("\n")
    return reply, asked.strip()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize(
    ("line", "expected", "asked"),
    [
        ("cpctl rollout status ", "llama mistral", "__complete models"),
        ("cpctl rollout status m", "mistral", "__complete models"),
        ("cpctl rollout start llama --to ", "v1 v2", "__complete versions llama"),
        ("cpctl rollout start --manual llama --to v", "v1 v2", "__complete versions llama"),
        ("cpctl autoscaling list ", "llama mistral", "__complete models"),
        ("cpctl endpoints list --model ", "llama mistral", "__complete models"),
        ("cpctl endpoints drain ", "127.0.0.1:8001 127.0.0.1:8002", "__complete addresses"),
        ("cpctl endpoints undrain 127.0.0.1:8002 --reason x ", "", ""),
        (
            "cpctl --server 127.0.0.1:9 rollout pause ",
            "llama mistral",
            "--server 127.0.0.1:9 __complete models",
        ),
        (
            "cpctl rollout history --token-file /t/admin-token ",
            "llama mistral",
            "--token-file /t/admin-token __complete models",
        ),
        ("cpctl rollout status llama ", "", ""),  # the model is given: nothing more to name
        ("cpctl rollout status llama -o ", "table json yaml", ""),
        ("cpctl rollout pause llama --reason ", "", ""),
        ("cpctl proxies ", "", ""),
    ],
)
def test_bash_completion_asks_the_control_plane_for_names(line: str, expected: str, asked: str) -> None:
    assert _complete_with_fake_cpctl(line) == (expected, asked)


def test_lora_adapters_in_the_table_and_in_json() -> None:
    held = endpoint_pb2.Endpoint(
        model="llama", version="v1", address="127.0.0.1:8000", state="SERVING", weight=7,
        running_adapters=["sql", "chat"], max_adapters=2,
    )  # fmt: skip
    waiting = endpoint_pb2.Endpoint(
        model="llama", version="v1", address="127.0.0.2:8000", state="SERVING", weight=7,
        running_adapters=["a", "b", "c", "d", "e"], waiting_adapters=["f"], max_adapters=1,
    )  # fmt: skip
    idle = endpoint_pb2.Endpoint(model="llama", version="v1", address="127.0.0.3:8000", max_adapters=4)
    # A vLLM 0.32 names every adapter in flight in both lists: the waiting part adds nothing.
    both = endpoint_pb2.Endpoint(
        model="llama", version="v1", address="127.0.0.5:8000", state="SERVING",
        running_adapters=["a", "b"], waiting_adapters=["a", "b", "c"], max_adapters=2,
    )  # fmt: skip
    unknown = endpoint_pb2.Endpoint(model="llama", version="v1", address="127.0.0.4:8000", state="SERVING")
    lines = out.endpoints_table([held, waiting, idle, unknown, both]).splitlines()
    assert lines[0].split()[-1] == "ADAPTERS"
    column = lines[0].index("ADAPTERS")
    assert [line[column:] for line in lines[1:6]] == [
        "sql,chat (2 slots)",
        "a,b,c+2 (1 slot); waiting f",
        "none (4 slots)",
        "-",
        "a,b (2 slots); waiting c",
    ]
    assert out.endpoint_to_dict(both)["waiting_adapters"] == ["a", "b", "c"]  # JSON: as listed
    # No endpoint with adapters known: no column (a fleet without LoRA gets no dashes).
    assert "ADAPTERS" not in out.endpoints_table([unknown])
    assert out.endpoints_table([unknown]).splitlines()[0].split()[-1] == "ERRORS"
    doc = json.loads(
        out.dump({"endpoints": [out.endpoint_to_dict(e) for e in (held, idle, unknown)]}, "json")
    )
    rows = doc["endpoints"]
    assert [(r["running_adapters"], r["waiting_adapters"], r["max_adapters"]) for r in rows] == [
        (["sql", "chat"], [], 2),
        ([], [], 4),
        (None, None, None),
    ]
    assert yaml.safe_load(out.dump(out.endpoint_to_dict(held), "yaml"))["running_adapters"] == ["sql", "chat"]
