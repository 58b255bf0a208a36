"""`controlplane picker`: a per-request endpoint picker (Envoy ext_proc) for models with
`balancing: picker` (docs/picker.md)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from controlplane import limits
from controlplane.cli import argtypes
from controlplane.cli.commands.side_listen import SideService, add_listen_flags, check_listen

if TYPE_CHECKING:
    from controlplane.net.tls import ServerTls


PICKER = SideService(
    default_listen="127.0.0.1:18090",
    callers="Envoy reaches this picker over gRPC, and its peers read it",
    tls_field="picker.tls",
    mutual_callers="each proxy, each peer",
    mutual_extra=", and this picker presents --tls-cert to its --peers, verifying theirs with it",
    harm="steer picks",
    harm_help="ask for picks and so steer requests",
    trusted="proxies and pickers",
    docs="docs/picker.md#trust",
)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `picker` and its flags to `sub`."""
    pk = sub.add_parser(
        "picker",
        help="run a per-request endpoint picker for models with balancing: picker",
        description="Run an endpoint picker: Envoy asks it (ext_proc) which server takes each "
        "request of a model with `balancing: picker`, and routes by the control plane's weights "
        "whenever it does not answer in time. It learns the servers, their weights and which are "
        "held out or draining from the control plane over ADS. Several may run; list them all "
        "in the fleet file's picker.endpoints. Runs until SIGINT or SIGTERM. See docs/picker.md.",
    )
    pk.add_argument(
        "--control-plane",
        required=True,
        metavar="HOST:PORT",
        help="the control plane's xDS address (its serve --xds-listen)",
    )
    add_listen_flags(pk, PICKER)
    pk.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve Prometheus metrics on this address (default: none)",
    )
    pk.add_argument(
        "--admin",
        metavar="HOST:PORT",
        help="the control plane's operator API (its serve --admin-listen): read every server's "
        "running and waiting requests and capacity there, so that picks follow the servers' own "
        "pages (default: none; then picks follow the EDS weights)",
    )
    pk.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help="a token of the operator API for --admin (the read-only one is enough)",
    )
    pk.add_argument(
        "--loads-interval",
        type=argtypes.number(0.05, 60),
        default=0.25,
        metavar="SECONDS",
        help="how often the loads are read from --admin (default: %(default)s)",
    )
    pk.add_argument(
        "--prefix-entries",
        type=argtypes.number(0, 10_000_000),
        default=65536,
        metavar="N",
        help="prefix keys remembered, least recently used dropped first; each is kept as a 16-byte "
        "digest, about 200 bytes with its index entry, whatever the key's length (default: "
        "%(default)s; 0 turns the prefix index off). Keys come from the gateway's prefix "
        "affinity, for models with affinity: {prefix: ...}",
    )
    pk.add_argument(
        "--kv-in-process",
        action="store_true",
        help="read the servers' KV events in the picker's own process, within 30%% of its loop, "
        "instead of a process of its own that takes only CPU time nothing else wants (the "
        "default, SCHED_IDLE: a flood of events then slows the picks far less: "
        "docs/kv-events.md); for comparisons",
    )
    pk.add_argument(
        "--kv-index-blocks",
        type=argtypes.number(0, 100_000_000),
        default=1 << 20,
        metavar="N",
        help="blocks the precise prefix index keeps over every server, from the servers' KV "
        "events (models with a tokenizer: and kv_events: in the fleet file, docs/kv-events.md); "
        "about 140 bytes each; past it, the server holding the most loses its oldest "
        "(default: %(default)s)",
    )
    pk.add_argument(
        "--kv-index-cpu",
        type=argtypes.number(0.01, 64),
        default=limits.KV_INDEX_CPU,
        metavar="CORES",
        help="the most CPU time the precise index's process takes (every thread of it), in cores: "
        "past it, it stops reading events until it has paid the excess back; a publisher faster "
        "than that falls behind, and a batch read more than 5 s after its stamp is skipped, that "
        "server's entries dropped until it is caught up (docs/kv-events.md#a-flood-of-events) "
        "(default: %(default)s)",
    )
    pk.add_argument(
        "--prefix-load-bound",
        type=argtypes.number(1.0, 100),
        default=1.5,
        metavar="X",
        help="a request goes back to the server its prefix went to while that server's expected "
        "time is at most X times the mean of the eligible servers' (default: %(default)s)",
    )
    pk.add_argument(
        "--peers",
        default="",
        metavar="HOST:PORT,...",
        help="the other pickers' --listen addresses: each reads the others' requests in flight "
        "every --peers-interval and ranks by all of them, so several pickers choose as one "
        "would (default: none)",
    )
    pk.add_argument(
        "--peer-token-file",
        type=Path,
        metavar="FILE",
        help="a token every picker of the group shares: its peers must send it to read this "
        "picker's requests in flight, and it sends it to them. --peers needs it, or "
        "--tls-client-ca (then the peers' certificates are the credential)",
    )
    pk.add_argument(
        "--peer-server-name",
        metavar="NAME",
        help="with --tls-client-ca: the name the peers' certificates carry, checked in place of "
        "the address in --peers (default: the address itself, as an IP subjectAltName)",
    )
    pk.add_argument(
        "--peers-interval",
        type=argtypes.number(0.01, 10),
        default=0.05,
        metavar="SECONDS",
        help="how often the --peers are read (default: %(default)s)",
    )
    pk.add_argument(
        "--no-adapter-affinity",
        action="store_true",
        help="pick a request naming a LoRA adapter as its base model's, blind to where the adapter "
        "is loaded (still only among the servers that may serve it): for comparing, as "
        "bench/adapters does (default: the servers holding it first, docs/adapters.md)",
    )
    pk.add_argument(
        "--adapter-idle-unload",
        type=argtypes.number(1, 86400),
        default=600.0,
        metavar="SECONDS",
        help="with placement: dynamic, an adapter this picker loaded onto a server and has not sent "
        "a request of there this long (none in flight) is unloaded from it (default: %(default)s)",
    )
    pk.add_argument("--node-id", help="its node id on the control plane (default: picker-PID)")
    pk.add_argument("--log-format", choices=("console", "json"), default="console")
    pk.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def _read_token(flag: str, path: Path) -> str:
    """A token file's one word; ValueError with the line to print."""
    try:
        token = path.read_text().strip()
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot read ({e.strerror or e})") from None
    if not token:
        raise ValueError(f"{flag} {path}: empty")
    return token


def check(args: argparse.Namespace) -> tuple[ServerTls | None, str | None, str | None]:
    """Every flag checked before anything starts: the TLS files, where it may listen without
    client certificates, what --peers needs, the tokens. Returns (tls, token for --admin, peer
    token); ValueError with the one line to print."""
    tls = check_listen(args, PICKER)
    mutual = tls is not None and tls.client_ca is not None
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    if peers and not mutual and args.peer_token_file is None:
        raise ValueError(
            "--peers: a peer's counts steer picks, so peers must prove who they are: give "
            "--peer-token-file (a token every picker of the group shares) or --tls-client-ca "
            "(docs/picker.md#trust)"
        )
    if tls is not None and not mutual and peers:
        raise ValueError(
            "--peers over TLS needs --tls-client-ca (the CA that signed every picker's certificate)"
        )
    if args.peer_server_name and not mutual:
        raise ValueError("--peer-server-name needs --tls-client-ca (it names the peers' certificates)")
    token = None
    if args.admin is not None:
        if args.token_file is None:
            raise ValueError(
                "--admin needs --token-file (the read-only token is enough: "
                "serve --admin-readonly-token-file)"
            )
        token = _read_token("--token-file", args.token_file)
    peer_token = _read_token("--peer-token-file", args.peer_token_file) if args.peer_token_file else None
    return tls, token, peer_token


def run(args: argparse.Namespace) -> int:
    """`controlplane picker`: check every flag (exit 2), then serve until a signal; an address
    it cannot listen on is one line and exit 2, as for serve."""
    from controlplane.obs.logging import configure_logging
    from controlplane.picker.service import serve

    configure_logging(args.log_format, args.log_level)
    try:
        tls, token, peer_token = check(args)
    except ValueError as e:
        print(f"controlplane picker: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(
            serve(
                args.control_plane,
                args.listen,
                args.metrics_listen,
                args.node_id,
                admin=args.admin,
                token=token,
                loads_interval_s=args.loads_interval,
                prefix_entries=int(args.prefix_entries),
                kv_index_blocks=int(args.kv_index_blocks),
                prefix_bound=args.prefix_load_bound,
                peers=[p.strip() for p in args.peers.split(",") if p.strip()],
                peers_interval_s=args.peers_interval,
                tls=tls,
                peer_token=peer_token,
                peer_server_name=args.peer_server_name,
                adapter_affinity=not args.no_adapter_affinity,
                adapter_idle_unload_s=args.adapter_idle_unload,
                kv_in_process=args.kv_in_process,
                kv_index_cpu=args.kv_index_cpu,
            )
        )
    except OSError as e:
        print(f"controlplane picker: {e}", file=sys.stderr)
        return 2
    return 0
