"""`cpctl`: the operator CLI of the control plane's API (rollouts, endpoint drains, autoscaling,
proxies).

A thin gRPC client of `controlplane.v1` on the control plane's --admin-listen address. Every
call carries `authorization: Bearer <token>` and `x-cpctl-user` (recorded in the audit trail).
Exit codes: 0 ok, 1 server error, 2 bad arguments (found here, or refused by the server as
INVALID_ARGUMENT), 3 a watched rollout ended Aborted, 4 no usable credential (missing token,
UNAUTHENTICATED, PERMISSION_DENIED).

The commands live in cpctl_commands/, one module per group (`cpctl rollout ...` is rollout.py);
this module assembles their parsers and runs the one asked for.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable

from controlplane.admin.defaults import DEFAULT_ADMIN_LISTEN
from controlplane.cli import cpctl_output as out
from controlplane.cli.cpctl_commands import (
    autoscaling,
    completion,
    endpoints,
    proxies,
    quota,
    rollout,
    version,
)
from controlplane.cli.cpctl_commands.client import (
    DEFAULT_TOKEN_FILE,
    connect,
    connection_flags,
    rpc_error_line,
    server_address,
)
from controlplane.cli.cpctl_commands.command import EXIT_OK, CliError, Formatter, Leaves

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


def build_parser() -> argparse.ArgumentParser:
    """cpctl's parser: the connection flags, then each command group's own (in the order
    `cpctl --help` lists them)."""
    conn = connection_flags(legacy_timeout=True)
    root = argparse.ArgumentParser(
        prog="cpctl",
        description="Operate the inference control plane: roll model versions out in canary steps, "
        "drain endpoints, see what autoscaling wants and which proxies are in sync.",
        epilog=EPILOG,
        formatter_class=Formatter,
        parents=[conn],
    )
    groups = root.add_subparsers(dest="group", required=True, metavar="COMMAND")
    leaves = Leaves(conn, connection_flags(legacy_timeout=False))
    for group in (rollout, endpoints, autoscaling, quota, proxies, version, completion):
        group.add_parser(groups, leaves)
    return root


def subcommand_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser of the command `args` was parsed for, for its usage line in errors."""
    for name in (getattr(args, "group", None), getattr(args, "command", None)):
        subs = out.subcommands(parser)
        if name not in subs:
            break
        parser = subs[name]
    return parser


def run_with_client(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """A command that calls the operator API: its `func` with a connected Client; an expected
    failure or a gRPC error is one line on stderr and its exit code."""
    server = server_address(parser, args)
    try:
        client = connect(args, server)
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


# Each command group's run function, by the group's name.
RUNS: dict[str, Callable[[argparse.ArgumentParser, argparse.Namespace], int]] = {
    "rollout": run_with_client,
    "endpoints": run_with_client,
    "autoscaling": run_with_client,
    "quota": run_with_client,
    "proxies": run_with_client,
    "version": version.run,
    "completion": completion.run_script,
    "__complete": completion.run_complete,
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check = getattr(args, "check", None)
    problem = check(args) if check is not None else None
    if problem:
        subcommand_parser(parser, args).error(problem)  # exit 2, as argparse's own errors
    return RUNS[args.group](parser, args)


if __name__ == "__main__":
    raise SystemExit(main())
