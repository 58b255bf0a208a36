"""`cpctl completion bash|zsh` prints the shell completion script; the hidden `cpctl __complete
KIND [MODEL]` is the script's question to the server for model, version and endpoint names."""

from __future__ import annotations

import argparse

from controlplane.cli import cpctl_output as out
from controlplane.cli.cpctl_commands.client import Client, connect, server_address
from controlplane.cli.cpctl_commands.command import EXIT_ERROR, EXIT_OK, CliError, Formatter, Leaves, emit

COMPLETION_TIMEOUT_S = 1.0  # `__complete` answers the shell quickly, or with nothing


def add_parser(groups: argparse._SubParsersAction[argparse.ArgumentParser], leaves: Leaves) -> None:
    """Add the `completion` command and the hidden `__complete` to `groups`."""
    s = groups.add_parser(
        "completion",
        help="print a shell completion script",
        description="Print a completion script for bash or zsh. It completes commands and flags, "
        "and model, version and endpoint names, which it asks the control plane for (with a 1s "
        "deadline, using the --server and --token-file on the line, else the usual defaults).",
        epilog="example:\n  source <(cpctl completion bash)    # or add it to ~/.bashrc",
        formatter_class=Formatter,
    )
    s.add_argument("shell", choices=["bash", "zsh"])
    s.set_defaults(func=None)

    # The completion script's question to the server (hidden, as cobra's `__complete`).
    s = groups.add_parser("__complete", parents=[leaves.conn], formatter_class=Formatter)
    s.add_argument("kind", choices=sorted(set(out.DYNAMIC.values())))
    s.add_argument("model", nargs="?", default="", metavar="MODEL")
    s.set_defaults(func=None)


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


def run_script(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`cpctl completion SHELL`: the script for every command of `parser`, cpctl's own."""
    emit(out.completion_script(parser, args.shell).rstrip("\n"))
    return EXIT_OK


def run_complete(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`cpctl __complete`: names for the shell, one a line; on any failure nothing at all
    (exit 1), since whatever it prints lands in the user's command line."""
    import grpc

    server = server_address(parser, args)
    try:
        client = connect(args, server, COMPLETION_TIMEOUT_S)
    except CliError:
        return EXIT_ERROR
    try:
        names = completion_names(client, args.kind, args.model)
    except grpc.RpcError:
        return EXIT_ERROR
    finally:
        client.close()
    if names:
        emit("\n".join(names))
    return EXIT_OK
