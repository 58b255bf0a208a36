"""`cpctl`: the operator CLI of the control plane's API (rollouts, endpoint drains, autoscaling,
proxies).

A thin gRPC client of `controlplane.v1` on the control plane's --admin-listen address. Every
call carries `authorization: Bearer <token>` and `x-cpctl-user` (recorded in the audit trail).
Exit codes: 0 ok, 1 server error, 2 bad arguments (found here, or refused by the server as
INVALID_ARGUMENT), 3 a watched rollout ended Aborted, 4 no usable credential (missing token,
UNAUTHENTICATED, PERMISSION_DENIED).
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from controlplane import __version__, limits
from controlplane.admin.defaults import DEFAULT_ADMIN_LISTEN, DEFAULT_STATE_DIR, TOKEN_FILE_NAME
from controlplane.cli import cpctl_output as out

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_ABORTED, EXIT_AUTH = 0, 1, 2, 3, 4
DEFAULT_TOKEN_FILE = DEFAULT_STATE_DIR / TOKEN_FILE_NAME
DEFAULT_RPC_TIMEOUT_S = 10.0
COMPLETION_TIMEOUT_S = 1.0  # `__complete` answers the shell quickly, or with nothing
DEFAULT_DRAIN_TIMEOUT_S = 120.0  # the server's default (rollout.controller.DRAIN_TIMEOUT_S)
DRAIN_POLL_S = 0.5
DRAIN_GRACE_S = 30.0  # --wait gives up this long after the drain's own timeout
CLEAR_SCREEN = "\x1b[H\x1b[2J"

_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


class CliError(Exception):
    """An expected failure: printed as one line, exit with `code`."""

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.code = code


# ---- argument types -----------------------------------------------------------------------


def parse_duration(text: str) -> float:
    """`30s`, `2m`, `500ms`, `1h` or a bare number of seconds -> seconds (> 0)."""
    m = _DURATION.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a duration like 30s, 2m, 500ms or seconds, got {text!r}")
    seconds = float(m.group(1)) * _UNIT_S[m.group(2)]
    if not math.isfinite(seconds) or seconds <= 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text!r}")
    return seconds


def parse_steps(text: str) -> list[int]:
    """`5,25,50,100` -> [5, 25, 50, 100]: integer percents 1-100 (their order is judged with
    the rest of the rollout, by the server's own rule: `start_problem`)."""
    steps = []
    for part in text.split(","):
        try:
            value = int(part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated percents like 5,25,50,100, got {text!r}"
            ) from None
        if not 1 <= value <= 100:
            raise argparse.ArgumentTypeError(f"each step is a percent 1-100, got {value} in {text!r}")
        steps.append(value)
    return steps


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def _percent(text: str) -> int:
    value = _count(text)
    if value > 100:
        raise argparse.ArgumentTypeError(f"must be a percent, 0-100, got {text!r}")
    return value


def _name(text: str) -> str:
    """A model, version or address: not empty, and within the operator API's bound."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return _name_or_all(text)


def _name_or_all(text: str) -> str:
    """A name as a filter, where empty means every one."""
    if len(text) > limits.API_NAME_MAX_CHARS:
        raise argparse.ArgumentTypeError(f"at most {limits.API_NAME_MAX_CHARS} characters, got {len(text)}")
    return text


def _reason(text: str) -> str:
    """An operator's reason for the audit trail, within the operator API's bound."""
    if len(text) > limits.API_REASON_MAX_CHARS:
        raise argparse.ArgumentTypeError(f"at most {limits.API_REASON_MAX_CHARS} characters, got {len(text)}")
    return text


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


# ---- the parser ---------------------------------------------------------------------------

EPILOG = f"""\
examples:
  cpctl rollout start llama --to v2 --steps 10,50,100 --interval 2m
  cpctl rollout status llama -w
  cpctl rollout promote llama --full
  cpctl endpoints drain 10.0.0.7:8000 --drain-timeout 5m --wait
  cpctl autoscaling list llama -o json
  cpctl proxies
  cpctl version
  source <(cpctl completion bash)

server: --server, else $CPCTL_SERVER, else {DEFAULT_ADMIN_LISTEN}
token:  --token-file, else $CPCTL_TOKEN (the token itself), else $CPCTL_TOKEN_FILE,
        else {DEFAULT_TOKEN_FILE} (serve --state-dir DIR writes DIR/admin-token)
output: -o table|json|yaml on every command that prints data; JSON and YAML give times
        in RFC 3339 (UTC) and whole numbers as integers
exit codes: 0 ok, 1 server error, 2 bad arguments (also the server's INVALID_ARGUMENT),
            3 watched rollout ended Aborted,
            4 no valid token (missing, UNAUTHENTICATED, PERMISSION_DENIED)
"""


class _Formatter(argparse.HelpFormatter):
    """Wraps one-paragraph descriptions; keeps text with line breaks (the examples) as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def _connection_flags(legacy_timeout: bool) -> argparse.ArgumentParser:
    """The global flags; SUPPRESS keeps a subcommand's unset flag from hiding one set before
    it. `--timeout` is the old spelling of --request-timeout, except on `endpoints drain`,
    where it always was the drain's own timeout."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("connection")
    g.add_argument(
        "--server",
        metavar="HOST:PORT",
        default=argparse.SUPPRESS,
        help=f"the control plane's operator API (--admin-listen); default: $CPCTL_SERVER or "
        f"{DEFAULT_ADMIN_LISTEN}",
    )
    g.add_argument(
        "--token-file",
        metavar="FILE",
        type=Path,
        default=argparse.SUPPRESS,
        help=f"file holding the bearer token; default: the token in $CPCTL_TOKEN, else the file "
        f"$CPCTL_TOKEN_FILE, else {DEFAULT_TOKEN_FILE}",
    )
    g.add_argument(
        "--request-timeout",
        metavar="DURATION",
        type=parse_duration,
        default=argparse.SUPPRESS,
        help="deadline of each call to the server, e.g. 5s (default: 10s; a watch has none); "
        "--timeout, its old name, still works but is deprecated",
    )
    if legacy_timeout:
        g.add_argument(
            "--timeout",
            dest="request_timeout",
            metavar="DURATION",
            type=parse_duration,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,  # deprecated: the old name of --request-timeout
        )
    return p


def _output_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-o", "--output", choices=out.FORMATS, default="table", help="output format (default: %(default)s)"
    )


def build_parser() -> argparse.ArgumentParser:
    conn = _connection_flags(legacy_timeout=True)
    conn_drain = _connection_flags(legacy_timeout=False)
    fmt = _Formatter
    root = argparse.ArgumentParser(
        prog="cpctl",
        description="Operate the inference control plane: roll model versions out in canary steps, "
        "drain endpoints, see what autoscaling wants and which proxies are in sync.",
        epilog=EPILOG,
        formatter_class=fmt,
        parents=[conn],
    )
    groups = root.add_subparsers(dest="group", required=True, metavar="COMMAND")

    def leaf(
        sub: Any, name: str, summary: str, description: str, example: str, *, drain: bool = False
    ) -> argparse.ArgumentParser:
        return sub.add_parser(  # type: ignore[no-any-return]
            name,
            help=summary,
            description=description,
            epilog=f"example:\n  {example}",
            formatter_class=fmt,
            parents=[conn_drain if drain else conn],
        )

    # rollout ...
    rollout = groups.add_parser(
        "rollout",
        help="move a model's traffic to a new version in steps",
        description="Canary rollouts: start, watch, pause, resume, promote, abort, undo, history.",
        epilog="example:\n  cpctl rollout start llama --to v2 --manual",
        formatter_class=fmt,
    )
    rs = rollout.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = leaf(
        rs,
        "start",
        "start moving MODEL's traffic to --to VERSION",
        "Start a rollout: the canary VERSION gets each --steps percent in turn, holding each step "
        "for --interval (or until `cpctl rollout promote` with --manual) while its error rate and "
        "p99 latency are compared with the stable version's; a failed analysis aborts at once. "
        "Unset options take the server's defaults. The settings are checked here with the "
        "server's own rules (steps increase and end at 100, ...): a bad one exits 2.",
        "cpctl rollout start llama --to v2 --steps 5,25,50,100 --interval 30s",
    )
    s.add_argument("model", metavar="MODEL", type=_name, help="the model, as clients name it")
    s.add_argument(
        "--to", dest="to_version", required=True, metavar="VERSION", type=_name, help="the version to roll to"
    )
    s.add_argument(
        "--steps",
        type=parse_steps,
        metavar="P,P,...",
        help="canary percents, increasing, ending at 100 (default: 5,25,50,100)",
    )
    gate = s.add_mutually_exclusive_group()
    gate.add_argument(
        "--interval", type=parse_duration, metavar="DURATION", help="hold each step this long (default: 30s)"
    )
    gate.add_argument("--manual", action="store_true", help="advance only on `cpctl rollout promote`")
    s.add_argument(
        "--max-error-rate",
        type=_fraction,
        metavar="RATE",
        help="abort above this canary error rate, 0-1 (0.01)",
    )
    s.add_argument(
        "--max-latency-ratio",
        type=_fraction,
        metavar="X",
        help="abort above canary p99 / stable p99, at least 1 (1.5)",
    )
    s.add_argument(
        "--min-requests", type=_count, metavar="N", help="canary requests before a step is judged (50)"
    )
    s.add_argument(
        "--ack-deadline",
        type=parse_duration,
        metavar="DURATION",
        help="pause if a proxy lacks the canary's cluster after this long (30s)",
    )
    s.add_argument(
        "--shadow",
        type=_percent,
        metavar="PERCENT",
        help="also mirror this percent of requests to the canary while the rollout runs; the "
        "mirrored responses are discarded but count in the analysis (default: 0)",
    )
    _output_flag(s)
    s.set_defaults(func=cmd_start, check=start_problem)

    s = leaf(
        rs,
        "status",
        "show MODEL's latest rollout",
        "Show the model's latest rollout: phase, step, weights per version and the canary's "
        "analysis against stable. With -w, follow it until it ends (exit 3 if it is aborted): "
        "on a terminal the view is redrawn; otherwise one line is printed per change (with -o "
        "json or yaml, one document per change).",
        "cpctl rollout status llama -w -o json",
    )
    s.add_argument("model", metavar="MODEL", type=_name)
    s.add_argument("-w", "--watch", action="store_true", help="follow every change until the rollout ends")
    _output_flag(s)
    s.set_defaults(func=cmd_status)

    for name, summary, description in (
        ("pause", "hold MODEL's rollout at its step", "Hold the rollout at its current weights."),
        ("resume", "carry on a paused rollout", "Carry on a paused rollout from its step."),
        (
            "abort",
            "send all of MODEL's traffic back to stable",
            "All traffic back to the stable version at once; the canary's endpoints drain.",
        ),
        (
            "undo",
            "roll a completed rollout back",
            "Start a new rollout, with the same settings, back to the version a completed rollout replaced.",
        ),
    ):
        s = leaf(rs, name, summary, description, f"cpctl rollout {name} llama")
        s.add_argument("model", metavar="MODEL", type=_name)
        if name in ("pause", "abort"):
            s.add_argument(
                "--reason", default="", metavar="TEXT", type=_reason, help="why, for the audit trail"
            )
        _output_flag(s)
        s.set_defaults(func=cmd_command, method=name.capitalize())

    s = leaf(
        rs,
        "promote",
        "move MODEL's rollout one step on",
        "Move the rollout to its next step now, or with --full straight to 100% and completion.",
        "cpctl rollout promote llama --full",
    )
    s.add_argument("model", metavar="MODEL", type=_name)
    s.add_argument("--full", action="store_true", help="to 100%% at once: the canary becomes stable")
    _output_flag(s)
    s.set_defaults(func=cmd_command, method="Promote")

    s = leaf(
        rs,
        "list",
        "the latest rollout of every model",
        "The latest rollout of every model.",
        "cpctl rollout list",
    )
    _output_flag(s)
    s.set_defaults(func=cmd_list)

    s = leaf(
        rs,
        "history",
        "MODEL's audit trail",
        "Who did what to the model's rollouts and drains, when and why (the table's times are "
        "local; -o json and yaml give them in RFC 3339, UTC).",
        "cpctl rollout history llama",
    )
    s.add_argument("model", metavar="MODEL", type=_name)
    _output_flag(s)
    s.set_defaults(func=cmd_history)

    # endpoints ...
    eps = groups.add_parser(
        "endpoints",
        help="list, drain and undrain GPU servers",
        description="Endpoints: their state, EDS weight and load; drain one for maintenance.",
        epilog="example:\n  cpctl endpoints list --model llama",
        formatter_class=fmt,
    )
    es = eps.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = leaf(
        es,
        "list",
        "every endpoint with its state, weight and load",
        "Every endpoint of the fleet with its state (SERVING, HELD_OUT, DRAINING, DRAINED, RETIRED), "
        "EDS weight, load and latency.",
        "cpctl endpoints list --model llama -o json",
    )
    s.add_argument(
        "--model", default="", metavar="MODEL", type=_name_or_all, help="only this model's endpoints"
    )
    _output_flag(s)
    s.set_defaults(func=cmd_endpoints)
    s = leaf(
        es,
        "drain",
        "stop sending ADDRESS new requests",
        "Mark the endpoint DRAINING (no new requests); once idle, or after --drain-timeout, it is "
        "removed from EDS (DRAINED). With -o json or yaml and --wait, the endpoint is printed "
        "once, DRAINED.",
        "cpctl endpoints drain 10.0.0.7:8000 --reason 'driver update' --wait",
        drain=True,
    )
    s.add_argument("address", metavar="ADDRESS", type=_name, help="HOST:PORT as in the fleet file")
    s.add_argument(
        "--drain-timeout",
        dest="drain_timeout",
        type=parse_duration,
        metavar="DURATION",
        help="remove it after this even with requests in flight (default: 120s); here --timeout, "
        "its old name, still works but is deprecated",
    )
    s.add_argument(
        "--timeout",
        dest="drain_timeout",
        type=parse_duration,
        metavar="DURATION",
        help=argparse.SUPPRESS,  # deprecated: the old name of --drain-timeout
    )
    s.add_argument("--reason", default="", metavar="TEXT", type=_reason, help="why, for the audit trail")
    s.add_argument("--wait", action="store_true", help="wait until it is DRAINED, printing progress")
    _output_flag(s)
    s.set_defaults(func=cmd_drain)
    s = leaf(
        es,
        "undrain",
        "bring a draining or drained endpoint back",
        "Bring a draining or drained endpoint back into service.",
        "cpctl endpoints undrain 10.0.0.7:8000",
    )
    s.add_argument("address", metavar="ADDRESS", type=_name)
    _output_flag(s)
    s.set_defaults(func=cmd_undrain)

    # autoscaling ...
    scaling = groups.add_parser(
        "autoscaling",
        help="what the autoscaler wants for each model, and why",
        description="Autoscaling: desired replicas per model and version, and what a scale-down drains.",
        epilog="example:\n  cpctl autoscaling list llama",
        formatter_class=fmt,
    )
    ss = scaling.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = leaf(
        ss,
        "list",
        "desired replicas of every model (or MODEL), and why",
        "The autoscaler's latest decision for every model (version (all)) and each of its versions: "
        "desired and ready replicas, demand, target per replica, forecast and reason; then the "
        "endpoints a scale-down would drain next, and those draining now.",
        "cpctl autoscaling list llama -o json",
    )
    s.add_argument("model", nargs="?", default="", metavar="MODEL", type=_name_or_all, help="only this model")
    _output_flag(s)
    s.set_defaults(func=cmd_autoscaling)

    # quota ...
    quota = groups.add_parser(
        "quota",
        help="per-tenant quotas: what each tenant has used and has left",
        description="Quotas (docs/quotas.md): the rate-limit service's buckets.",
        epilog="example:\n  cpctl quota status acme",
        formatter_class=fmt,
    )
    qs = quota.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = leaf(
        qs,
        "status",
        "each tenant's limit, remaining and reset, per model and kind",
        "Asks the rate-limit service (`controlplane ratelimit`, --quota-service) for every bucket "
        "in use, or TENANT's: requests or tokens per minute, what is left now and how long until "
        "it is whole again. The service must run with --token-file holding the token cpctl sends "
        "(its usual one). Tenants not seen since the service started (or for two minutes, on "
        "Redis) have their whole allowance and are not listed.",
        "cpctl quota status acme --quota-service 127.0.0.1:18081",
    )
    s.add_argument("tenant", nargs="?", default=None, metavar="TENANT", help="only this tenant")
    s.add_argument(
        "--quota-service",
        default=os.environ.get("CPCTL_QUOTA_SERVICE", "127.0.0.1:18081"),
        metavar="HOST:PORT",
        help="the rate-limit service's --listen (default: $CPCTL_QUOTA_SERVICE or %(default)s)",
    )
    _output_flag(s)
    s.set_defaults(func=cmd_quota_status)

    s = leaf(
        groups,
        "proxies",
        "connected proxies and their xDS sync status",
        "One row per connected xDS stream (Envoy or proxyless gRPC) with the status of each "
        "type: SYNCED, STALE (an update not ACKed yet), NACKED, NOT_SENT; then the last NACKs.",
        "cpctl proxies -o yaml",
    )
    _output_flag(s)
    s.set_defaults(func=cmd_proxies)

    s = leaf(
        groups,
        "version",
        "cpctl's build and the control plane's",
        "Print cpctl's version, then the control plane's (asked over the API). If the server "
        "cannot be asked, the client's is still printed, then the error (exit 1, or 4 for the "
        "token), as `kubectl version` does.",
        "cpctl version -o json",
    )
    s.add_argument("--client", action="store_true", help="only cpctl's version; do not ask the server")
    _output_flag(s)
    s.set_defaults(func=None)

    s = groups.add_parser(
        "completion",
        help="print a shell completion script",
        description="Print a completion script for bash or zsh. It completes commands and flags, "
        "and model, version and endpoint names, which it asks the control plane for (with a 1s "
        "deadline, using the --server and --token-file on the line, else the usual defaults).",
        epilog="example:\n  source <(cpctl completion bash)    # or add it to ~/.bashrc",
        formatter_class=fmt,
    )
    s.add_argument("shell", choices=["bash", "zsh"])
    s.set_defaults(func=None)

    # The completion script's question to the server (hidden, as cobra's `__complete`).
    s = groups.add_parser("__complete", parents=[conn], formatter_class=fmt)
    s.add_argument("kind", choices=sorted(set(out.DYNAMIC.values())))
    s.add_argument("model", nargs="?", default="", metavar="MODEL")
    s.set_defaults(func=None)
    return root


def subcommand_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser of the command `args` was parsed for, for its usage line in errors."""
    for name in (getattr(args, "group", None), getattr(args, "command", None)):
        subs = out.subcommands(parser)
        if name not in subs:
            break
        parser = subs[name]
    return parser


def start_problem(args: argparse.Namespace) -> str | None:
    """What the server would refuse as INVALID_ARGUMENT in `rollout start`'s settings, found
    with its own rule (RolloutSpec.check, over the same defaults); None if nothing."""
    from controlplane.rollout.machine import RolloutRejected, RolloutSpec

    d = RolloutSpec(args.model, "", args.to_version)  # the stable version is the server's to know
    spec = replace(
        d,
        steps=tuple(args.steps) if args.steps else d.steps,
        interval_s=None if args.manual else (args.interval or d.interval_s),
        max_error_rate=d.max_error_rate if args.max_error_rate is None else args.max_error_rate,
        max_latency_ratio=d.max_latency_ratio if args.max_latency_ratio is None else args.max_latency_ratio,
        min_requests=d.min_requests if args.min_requests is None else args.min_requests,
        ack_deadline_s=d.ack_deadline_s if args.ack_deadline is None else args.ack_deadline,
        shadow_percent=args.shadow or 0,
    )
    try:
        spec.check()
    except RolloutRejected as e:
        return str(e)
    return None


# ---- the connection -----------------------------------------------------------------------


@dataclass(frozen=True)
class Credential:
    """The bearer token, and where it was read (named in the hint for a refused token)."""

    token: str
    source: str  # the file's path, or $CPCTL_TOKEN


def resolve_token(token_file: Path | None, env: Mapping[str, str]) -> Credential:
    """--token-file, else $CPCTL_TOKEN (the token), else $CPCTL_TOKEN_FILE, else the default
    token file; CliError(exit 4) if none."""
    from controlplane.admin.auth import TokenFileError, read_token

    how = "pass --token-file FILE, or set CPCTL_TOKEN_FILE or CPCTL_TOKEN"
    if token_file is None and env.get("CPCTL_TOKEN", "").strip():
        token = env["CPCTL_TOKEN"].strip()
        if not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
            raise CliError("CPCTL_TOKEN: a token is one word of printable ASCII", EXIT_AUTH)
        return Credential(token, "$CPCTL_TOKEN")
    if token_file is None and env.get("CPCTL_TOKEN_FILE", "").strip():
        token_file = Path(env["CPCTL_TOKEN_FILE"].strip()).expanduser()
    path = token_file or DEFAULT_TOKEN_FILE
    try:
        token = read_token(path)
    except TokenFileError as e:
        raise CliError(f"{e}; {how} (serve writes it to <state-dir>/{TOKEN_FILE_NAME})", EXIT_AUTH) from None
    if not token.isascii() or not token.isprintable():
        raise CliError(f"{path}: a token is one word of printable ASCII", EXIT_AUTH)
    return Credential(token, str(path))


def _user() -> str:
    user = os.environ.get("USER", "")
    if not user:
        with contextlib.suppress(Exception):
            user = getpass.getuser()
    return "".join(c if c.isascii() and c.isprintable() else "?" for c in user) or "unknown"


class Client:
    """A gRPC channel to the operator API, and its calls with token and user metadata."""

    def __init__(self, server: str, credential: Credential, timeout: float) -> None:
        import grpc

        from controlplane.v1 import autoscaling_pb2_grpc, endpoint_pb2_grpc, proxy_pb2_grpc, rollout_pb2_grpc

        self.server = server
        self.timeout = timeout
        self.token_source = credential.source
        self.metadata = (("authorization", f"Bearer {credential.token}"), ("x-cpctl-user", _user()))
        self.channel = grpc.insecure_channel(server)
        self.rollouts = rollout_pb2_grpc.RolloutServiceStub(self.channel)
        self.endpoints = endpoint_pb2_grpc.EndpointServiceStub(self.channel)
        self.proxies = proxy_pb2_grpc.ProxyServiceStub(self.channel)
        self.autoscaling = autoscaling_pb2_grpc.AutoscalingServiceStub(self.channel)

    def call(self, method: Callable[..., Any], request: Any) -> Any:
        return method(request, timeout=self.timeout, metadata=self.metadata)

    def stream(self, method: Callable[..., Any], request: Any) -> Any:
        return method(request, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()


def rpc_error_line(e: Exception, server: str, token_source: str = "") -> tuple[str, int]:
    """A gRPC error as (the one line to print, the exit code). A refused token's line names
    where the token was read (`token_source`), since a stale file is the usual cause."""
    import grpc

    code = e.code() if isinstance(e, grpc.Call) else None
    details = (e.details() if isinstance(e, grpc.Call) else None) or str(e) or "no details"
    details = " ".join(str(details).split())
    name = code.name if code is not None else "UNKNOWN"
    if code == grpc.StatusCode.UNAVAILABLE:
        details += f"; is the control plane running at {server}? (--server or CPCTL_SERVER)"
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
        details += " (raise --request-timeout?)"
    elif code == grpc.StatusCode.UNAUTHENTICATED and token_source:
        details += (
            f"; cpctl sent the token from {token_source}: is it the one {server} uses? "
            f"(`serve --state-dir DIR` keeps it in DIR/{TOKEN_FILE_NAME})"
        )
    elif code == grpc.StatusCode.PERMISSION_DENIED and token_source:
        details += f" (the token from {token_source})"
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        exit_code = EXIT_AUTH
    elif code == grpc.StatusCode.INVALID_ARGUMENT:
        exit_code = EXIT_USAGE  # the server found a bad argument: a usage error, as if found here
    else:
        exit_code = EXIT_ERROR
    return f"cpctl: {name}: {details}", exit_code


# ---- commands -----------------------------------------------------------------------------


def _emit(text: str) -> None:
    print(text, flush=True)


def _emit_rollout(r: Any, fmt: str) -> None:
    """A command's resulting rollout: its summary line, or the whole rollout as a document."""
    _emit(out.summary_line(r) if fmt == "table" else out.dump(out.rollout_to_dict(r), fmt))


def _emit_endpoint(e: Any, fmt: str) -> None:
    if fmt == "table":
        _emit(f"{e.address} ({e.model} {e.version}): {e.state}")
    else:
        _emit(out.dump(out.endpoint_to_dict(e), fmt))


def start_request(args: argparse.Namespace) -> Any:
    """`rollout start`'s arguments as a StartRolloutRequest: only the fields given are set,
    so the server's defaults apply to the rest."""
    from controlplane.v1 import rollout_pb2

    req = rollout_pb2.StartRolloutRequest(model=args.model, to_version=args.to_version, manual=args.manual)
    if args.steps:
        req.steps.extend(args.steps)
    if args.interval is not None:
        req.interval_seconds = args.interval
    if args.shadow is not None:
        req.shadow_percent = args.shadow
    for field, value in (
        ("max_error_rate", args.max_error_rate),
        ("max_latency_ratio", args.max_latency_ratio),
        ("min_requests", args.min_requests),
        ("ack_deadline_seconds", args.ack_deadline),
    ):
        if value is not None:
            setattr(req, field, value)
    return req


def cmd_start(c: Client, args: argparse.Namespace) -> int:
    _emit_rollout(c.call(c.rollouts.Start, start_request(args)), args.output)
    return EXIT_OK


def cmd_command(c: Client, args: argparse.Namespace) -> int:
    from controlplane.v1 import rollout_pb2

    req = rollout_pb2.RolloutCommand(
        model=args.model, full=getattr(args, "full", False), reason=getattr(args, "reason", "")
    )
    _emit_rollout(c.call(getattr(c.rollouts, args.method), req), args.output)
    return EXIT_OK


class RolloutWatch:
    """What `rollout status -w` prints for each rollout the stream brings: on a terminal, the
    table redrawn; otherwise one line per change of state (`out.watch_state`); with -o json
    or yaml, one document per change (a document equal to the last one is not repeated)."""

    def __init__(self, fmt: str, tty: bool) -> None:
        self.fmt = fmt
        self.tty = tty
        self.last: Any = None  # what was last printed: a state or a document

    def text(self, r: Any, now: float) -> str | None:
        """The text to print for `r` (None: nothing changed), without its final newline."""
        if self.fmt != "table":
            doc = out.rollout_to_dict(r)
            if doc == self.last:
                return None
            self.last = doc
            text = out.dump(doc, self.fmt, one_line=True)
            return "---\n" + text if self.fmt == "yaml" else text
        clock = time.strftime("%H:%M:%S", time.localtime(now))
        if self.tty:
            return (
                CLEAR_SCREEN
                + out.rollout_table(r, now=now)
                + f"\n\n(watching; updated {clock}; Ctrl-C stops)"
            )
        state = out.watch_state(r)
        if state == self.last:
            return None
        self.last = state
        return out.watch_line(r, clock)


def cmd_status(c: Client, args: argparse.Namespace) -> int:
    from controlplane.v1 import rollout_pb2

    req = rollout_pb2.GetRolloutRequest(model=args.model)
    if not args.watch:
        r = c.call(c.rollouts.Get, req)
        fmt = args.output
        _emit(
            out.rollout_table(r, now=time.time()) if fmt == "table" else out.dump(out.rollout_to_dict(r), fmt)
        )
        return EXIT_OK
    watch = RolloutWatch(args.output, sys.stdout.isatty())
    last = None
    stream = c.stream(c.rollouts.Watch, req)
    try:
        for r in stream:
            text = watch.text(r, time.time())
            if text is not None:
                _emit(text)
            last = r
    finally:
        stream.cancel()
    return EXIT_ABORTED if last is not None and last.phase == "Aborted" else EXIT_OK


def cmd_list(c: Client, args: argparse.Namespace) -> int:
    from controlplane.v1 import rollout_pb2

    rs = list(c.call(c.rollouts.List, rollout_pb2.ListRolloutsRequest()).rollouts)
    if args.output == "table":
        _emit(out.rollouts_table(rs))
    else:
        _emit(out.dump({"rollouts": [out.rollout_to_dict(r) for r in rs]}, args.output))
    return EXIT_OK


def cmd_history(c: Client, args: argparse.Namespace) -> int:
    from controlplane.v1 import rollout_pb2

    records = list(c.call(c.rollouts.History, rollout_pb2.GetRolloutRequest(model=args.model)).records)
    if args.output == "table":
        _emit(out.history_table(records))
    else:
        doc = {"model": args.model, "records": [out.record_to_dict(a) for a in records]}
        _emit(out.dump(doc, args.output))
    return EXIT_OK


def cmd_endpoints(c: Client, args: argparse.Namespace) -> int:
    from controlplane.v1 import endpoint_pb2

    eps = list(c.call(c.endpoints.List, endpoint_pb2.ListEndpointsRequest(model=args.model)).endpoints)
    if args.output == "table":
        _emit(out.endpoints_table(eps))
    else:
        _emit(out.dump({"endpoints": [out.endpoint_to_dict(e) for e in eps]}, args.output))
    return EXIT_OK


def cmd_quota_status(c: Client, args: argparse.Namespace) -> int:
    import grpc

    from controlplane.quota.service import STATUS_SERVICE

    if ":" not in args.quota_service:
        raise CliError(f"--quota-service: expected HOST:PORT, got {args.quota_service!r}", EXIT_USAGE)
    with grpc.insecure_channel(args.quota_service) as channel:
        call = channel.unary_unary(f"/{STATUS_SERVICE}/Status")
        try:
            raw = call(json.dumps({"tenant": args.tenant}).encode(), timeout=c.timeout, metadata=c.metadata)
        except grpc.RpcError as e:
            line, code = rpc_error_line(e, args.quota_service, c.token_source)
            raise CliError(line.removeprefix("cpctl: "), code) from None
    rows = json.loads(raw)["buckets"]
    if args.output != "table":
        _emit(out.dump({"buckets": rows}, args.output))
    elif not rows:
        _emit("no bucket in use" + (f" for {args.tenant}" if args.tenant else ""))
    else:
        cells = [
            [
                r["tenant"] or "(no key)",
                r["model"],
                r["kind"],
                str(r["limit_per_minute"]),
                str(r["remaining"]),
                f"{r['reset_seconds']:g}s",
            ]
            for r in rows
        ]
        _emit(out.table(["TENANT", "MODEL", "KIND", "LIMIT/MIN", "REMAINING", "RESET"], cells))
    return EXIT_OK


def cmd_drain(c: Client, args: argparse.Namespace) -> int:
    """Drain; with --wait, poll until DRAINED. A table shows the progress; -o json or yaml
    prints the endpoint once: as drained, or as DRAINING without --wait."""
    from controlplane.v1 import endpoint_pb2

    req = endpoint_pb2.DrainRequest(
        address=args.address, timeout_seconds=args.drain_timeout or 0, reason=args.reason
    )
    table = args.output == "table"
    e = c.call(c.endpoints.Drain, req)
    if table or not args.wait:
        _emit_endpoint(e, args.output)
    if not args.wait:
        return EXIT_OK
    give_up = (args.drain_timeout or DEFAULT_DRAIN_TIMEOUT_S) + DRAIN_GRACE_S
    start = time.monotonic()
    shown = (e.state, e.in_flight)
    while e.state != "DRAINED":
        if time.monotonic() - start > give_up:
            raise CliError(f"{args.address} is still {e.state} after {give_up:g}s; stopped waiting")
        time.sleep(DRAIN_POLL_S)
        found = [
            x
            for x in c.call(c.endpoints.List, endpoint_pb2.ListEndpointsRequest()).endpoints
            if x.address == args.address
        ]
        if not found:
            raise CliError(f"{args.address} is no longer in the fleet")
        e = found[0]
        if table and (e.state, e.in_flight) != shown and e.state != "DRAINED":
            shown = (e.state, e.in_flight)
            elapsed = time.monotonic() - start
            _emit(f"  {out.seconds_text(elapsed):>6}  {e.state}, {out.number_text(e.in_flight)} in flight")
    if table:
        _emit(f"{args.address}: DRAINED after {out.seconds_text(time.monotonic() - start)}")
    else:
        _emit_endpoint(e, args.output)
    return EXIT_OK


def cmd_undrain(c: Client, args: argparse.Namespace) -> int:
    from controlplane.v1 import endpoint_pb2

    _emit_endpoint(c.call(c.endpoints.Undrain, endpoint_pb2.DrainRequest(address=args.address)), args.output)
    return EXIT_OK


def cmd_autoscaling(c: Client, args: argparse.Namespace) -> int:
    from controlplane.v1 import autoscaling_pb2

    rows = list(c.call(c.autoscaling.List, autoscaling_pb2.ListAutoscalingRequest(model=args.model)).scaling)
    if args.output == "table":
        _emit(out.scaling_table(rows))
    else:
        _emit(out.dump({"scaling": [out.scaling_to_dict(s) for s in rows]}, args.output))
    return EXIT_OK


def cmd_proxies(c: Client, args: argparse.Namespace) -> int:
    from controlplane.v1 import proxy_pb2

    ps = list(c.call(c.proxies.List, proxy_pb2.ListProxiesRequest()).proxies)
    if args.output == "table":
        _emit(out.proxies_table(ps))
    else:
        _emit(out.dump({"proxies": [out.proxy_to_dict(p) for p in ps]}, args.output))
    return EXIT_OK


def cmd_version(connect: Callable[[], Client] | None, args: argparse.Namespace, server: str) -> int:
    """The client's version, then the server's (`connect` None: --client, not asked). When
    the server cannot be asked, the client's is printed all the same, then the error line."""
    import grpc

    from controlplane.v1 import proxy_pb2

    server_version = None
    error: tuple[str, int] | None = None
    if connect is not None:
        client = None
        try:
            client = connect()
            server_version = client.call(
                client.proxies.ServerVersion, proxy_pb2.ServerVersionRequest()
            ).version
        except CliError as e:
            error = (f"cpctl: {e}", e.code)
        except grpc.RpcError as e:
            error = rpc_error_line(e, server, client.token_source if client else "")
        finally:
            if client is not None:
                client.close()
    if args.output == "table":
        _emit(out.version_text(__version__, server_version, server))
    else:
        _emit(out.dump(out.version_doc(__version__, server_version, server), args.output))
    if error is not None:
        print(error[0], file=sys.stderr)
        return error[1]
    return EXIT_OK


def completion_names(c: Client, kind: str, model: str) -> list[str]:
    """The names `cpctl __complete KIND [MODEL]` prints, from the fleet's endpoints: every
    model, MODEL's versions, or every endpoint address; in the fleet's order, once each."""
    from controlplane.v1 import endpoint_pb2

    eps = c.call(c.endpoints.List, endpoint_pb2.ListEndpointsRequest()).endpoints
    if kind == "models":
        names = [e.model for e in eps]
    elif kind == "versions":
        names = [e.version for e in eps if e.model == model]
    else:
        names = [e.address for e in eps]
    return list(dict.fromkeys(names))


# ---- main ---------------------------------------------------------------------------------


def _server(args: argparse.Namespace) -> str:
    return getattr(args, "server", None) or os.environ.get("CPCTL_SERVER") or DEFAULT_ADMIN_LISTEN


def _connect(args: argparse.Namespace, server: str, timeout: float = DEFAULT_RPC_TIMEOUT_S) -> Client:
    credential = resolve_token(getattr(args, "token_file", None), os.environ)
    return Client(server, credential, getattr(args, "request_timeout", timeout))


def _complete(args: argparse.Namespace, server: str) -> int:
    """`cpctl __complete`: names for the shell, one a line; on any failure nothing at all
    (exit 1), since whatever it prints lands in the user's command line."""
    import grpc

    try:
        client = _connect(args, server, COMPLETION_TIMEOUT_S)
    except CliError:
        return EXIT_ERROR
    try:
        names = completion_names(client, args.kind, args.model)
    except grpc.RpcError:
        return EXIT_ERROR
    finally:
        client.close()
    if names:
        _emit("\n".join(names))
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check = getattr(args, "check", None)
    problem = check(args) if check is not None else None
    if problem:
        subcommand_parser(parser, args).error(problem)  # exit 2, as argparse's own errors
    if args.group == "completion":
        _emit(out.completion_script(parser, args.shell).rstrip("\n"))
        return EXIT_OK
    server = _server(args)
    if ":" not in server:
        parser.error(f"--server: expected HOST:PORT, got {server!r}")
    if args.group == "__complete":
        return _complete(args, server)
    if args.group == "version":
        return cmd_version(None if args.client else lambda: _connect(args, server), args, server)
    try:
        client = _connect(args, server)
    except CliError as e:
        print(f"cpctl: {e}", file=sys.stderr)
        return e.code
    import grpc

    try:
        return int(args.func(client, args))
    except CliError as e:
        print(f"cpctl: {e}", file=sys.stderr)
        return e.code
    except grpc.RpcError as e:
        line, code = rpc_error_line(e, server, client.token_source)
        print(line, file=sys.stderr)
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away: stop quietly, without a second error at exit.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    finally:
        client.close()


if __name__ == "__main__":
    raise SystemExit(main())
