"""`cpctl version`: cpctl's version, then the control plane's."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from controlplane import __version__
from controlplane.cli import cpctl_output as out
from controlplane.cli.cpctl_commands.client import Client, rpc_error_line, server_address
from controlplane.cli.cpctl_commands.client import connect as connect_client
from controlplane.cli.cpctl_commands.command import EXIT_OK, CliError, Leaves, add_output_flag, emit


def add_parser(groups: argparse._SubParsersAction[argparse.ArgumentParser], leaves: Leaves) -> None:
    """Add the `version` command to `groups`."""
    s = leaves.add(
        groups,
        "version",
        "cpctl's build and the control plane's",
        "Print cpctl's version, then the control plane's (asked over the API). If the server "
        "cannot be asked, the client's is still printed, then the error (exit 1, or 4 for the "
        "token), as `kubectl version` does.",
        "cpctl version -o json",
    )
    s.add_argument("--client", action="store_true", help="only cpctl's version; do not ask the server")
    add_output_flag(s)
    s.set_defaults(func=None)


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
        emit(out.version_text(__version__, server_version, server))
    else:
        emit(out.dump(out.version_doc(__version__, server_version, server), args.output))
    if error is not None:
        print(error[0], file=sys.stderr)
        return error[1]
    return EXIT_OK


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`cpctl version`: the server is asked unless --client."""
    server = server_address(parser, args)
    return cmd_version(None if args.client else lambda: connect_client(args, server), args, server)
