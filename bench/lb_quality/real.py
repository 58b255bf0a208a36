"""Load-balancing quality through the real stack: Envoy, the control plane, emulated GPU servers
(or, with `--servers llama.cpp`, real llama.cpp servers of two speeds).

For each policy (default: round_robin, least_request, adaptive; `picker` adds `--pickers`
real `controlplane picker` processes, `ideal` is the load generator's own oracle) this starts, on loopback:
emulated servers of two GPU classes (`controlplane emulate`, one process per class), the
control plane on a fleet file naming the policy, one real Envoy, and an open-loop Poisson
load generator in its own process (`loadgen.py`). After a warm-up it measures latency
percentiles and errors, then stops everything. All policies run in the same invocation
against the same fleet and the same seeded arrivals, so the ratio is what matters.

    .venv/bin/python bench/lb_quality/real.py                  # ~3.5 min
    .venv/bin/python bench/lb_quality/real.py --load 0.7 --duration 60
    .venv/bin/python bench/lb_quality/real.py --servers llama.cpp   # the real extra; ~3 min

With `--servers llama.cpp` the servers are real `llama-server` processes (the `real` extra):
a fast class serving a tiny random GGUF of 2 layers and a slow one of 6 (hidden 256, one
thread each, as the demo's A100 and L4), `--per-class` of each. Their speeds are not
declared in the fleet (both classes at capacity 1.0: the operator does not know them), and
the load is sized from their throughput measured at the start of the run, all servers busy
at once, as they share the machine's cores. Each request asks for every token
(`ignore_eos`), so a random model does not end early.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))  # the repository: bench.ports

from loadgen import mean_output_tokens  # noqa: E402
from simulate import REAL_BENCH_WORK  # noqa: E402

from bench.ports import free_port, free_ports  # noqa: E402

PROMPT_TOKENS = 32  # the load generator's prompt: "bench " x 32


def wait_http(url: str, timeout: float, what: str, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{what}: a process exited early ({p.args!r})")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what}")


class Stack:
    """Every process of one run; stop() always stops them all."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.envoy_admins: list[int] = []  # admin port of each Envoy started
        self.llamas: list[Any] = []  # controlplane.sim.llamacpp.LlamaServer, each stopped by stop()

    def spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = (self.workdir / f"{name}.log").open("ab")
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for server in self.llamas:
            server.stop()
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def start_proxied(
    stack: Stack,
    workdir: Path,
    config: Path,
    listener: int,
    node_id: str,
    serve_args: Sequence[str] = (),
    proxies: int = 1,
    xds: int | None = None,
) -> int:
    """Start `controlplane serve` on `config` (free ports, its state in workdir) and
    `proxies` real Envoys bootstrapped from it; return once they serve `listener`. Several
    Envoys share the listener's port (SO_REUSEPORT, Envoy's default on Linux): the kernel
    spreads connections over them, as an L4 balancer spreads clients over gateway replicas.
    Returns the control plane's status (metrics) port; its xDS port is `xds` (default: a
    free one)."""
    xds, metrics = xds or free_port(), free_port()
    serve = [str(BIN / "controlplane"), "serve", "--config", str(config), "--xds-listen", f"127.0.0.1:{xds}"]
    serve += ["--metrics-listen", f"127.0.0.1:{metrics}", "--state-dir", str(workdir / "state"), *serve_args]
    stack.spawn("controlplane", serve)
    wait_http(f"http://127.0.0.1:{metrics}/healthz", 30, "the control plane", stack.procs)
    envoy = shutil.which("envoy", path=str(BIN)) or "envoy"
    for i in range(proxies):
        name = node_id if proxies == 1 else f"{node_id}-{i}"
        boot = [str(BIN / "controlplane"), "bootstrap", "--node-id", name, "--xds", f"127.0.0.1:{xds}"]
        bootstrap = workdir / f"{name}.yaml"
        stack.envoy_admins.append(free_port())
        bootstrap.write_text(
            subprocess.run(
                [*boot, "--admin-port", str(stack.envoy_admins[-1])],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        )
        stack.spawn(
            name,
            [envoy, "-c", str(bootstrap), "--disable-hot-restart", "-l", "warning", "--concurrency", "1"],
        )
    wait_http(f"http://127.0.0.1:{listener}/v1/models", 30, "envoy", stack.procs)
    if proxies > 1:
        wait_proxies_served(metrics, proxies, stack.procs)
    return metrics


def wait_proxies_served(metrics: int, proxies: int, procs: list[subprocess.Popen[bytes]]) -> None:
    """Until the control plane has `proxies` proxies connected with nothing left to send."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"a process exited early ({p.args!r})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/debug/proxies", timeout=1) as r:
                listed = json.loads(r.read())
            if len(listed) >= proxies:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {proxies} proxies to connect")


def fleet_yaml(
    policy: str,
    listener: int,
    classes: list[tuple[str, float, int, int]],
    pickers: Sequence[str] = (),
    affinity: str = "",
    kv: tuple[str, dict[str, tuple[str, str]]] | None = None,
) -> str:
    """The fleet file: one model on every server, `policy` its tier's balancing; `affinity`
    (YAML flow, e.g. `{prefix: {}}`) the model's affinity, if any; `kv`: the model's tokenizer
    directory and each server's KV-event publisher and replay socket (docs/kv-events.md)."""
    lines = [
        f"listener: {{port: {listener}}}",
        # With a tokenizer the picker tokenizes each prompt: a budget for that, not the 5 ms default.
        *(
            [f"picker: {{endpoints: {json.dumps(list(pickers))}{', timeout: 50ms' if kv else ''}}}"]
            if pickers
            else []
        ),
        "tiers:",
        f"  small: {{max_params_b: 15, timeout: 300s, balancing: {policy}}}",
        "gpu_classes:",
    ]
    for gpu, speed, _, _ in classes:
        lines.append(f"  {gpu}: {{capacity: {speed}}}")
    lines += ["models:", "  bench-8b:", "    params_b: 8", "    stable: v1"]
    lines += [f"    affinity: {affinity}"] if affinity else []
    lines += [f"    tokenizer: '{kv[0]}'"] if kv else []
    lines += ["    versions:", "      v1:"]
    lines.append("        endpoints:")
    for gpu, _, base, count in classes:
        for port in range(base, base + count):
            where = kv[1].get(f"127.0.0.1:{port}") if kv else None
            events = f", kv_events: '{where[0]}', kv_replay: '{where[1]}'" if where else ""
            lines.append(f"          - {{address: 127.0.0.1:{port}, gpu: {gpu}{events}}}")
    return "\n".join(lines) + "\n"


# The real servers' GGUFs (as the demo's A100 and L4 classes): the same architecture, the slow
# one with 3x the layers.
LLAMA_MODELS = {"fast": {"n_embd": 256, "n_layer": 2}, "slow": {"n_embd": 256, "n_layer": 6}}
LLAMA_CTX = 512  # per slot: the prompt and up to 400 tokens


def start_llama_servers(stack: Stack, args: argparse.Namespace) -> list[tuple[str, float, int, int]]:
    """Real llama-servers, `--per-class` of each class: (gpu, declared capacity 1.0, base
    port, count) per class, once every server is healthy."""
    from controlplane.sim.llamacpp import LlamaServer, llama_server_binary, missing, write_tiny_llama

    why = missing()
    binary = llama_server_binary()
    if why is not None or binary is None:
        raise SystemExit(f"--servers llama.cpp: {why}")
    classes: list[tuple[str, float, int, int]] = []
    for gpu, shape in LLAMA_MODELS.items():
        model = stack.workdir / f"{gpu}.gguf"
        write_tiny_llama(model, **shape)
        base = free_ports(args.per_class)
        classes.append((gpu, 1.0, base, args.per_class))
        for i in range(args.per_class):
            server = LlamaServer(
                binary,
                model,
                stack.workdir,
                alias=f"{gpu}-{i}",
                port=base + i,
                slots=args.slots,
                ctx_per_slot=LLAMA_CTX,
            )
            stack.llamas.append(server)  # before start(): one that fails to start is stopped too
            server.start()
    return classes


def measured_capacity(args: argparse.Namespace) -> tuple[float, dict[str, float]]:
    """Requests/s the real servers complete together, each kept at its slots with requests of
    the load's mean size for a few seconds: (the sum, each server's)."""
    import concurrent.futures

    workdir = Path(tempfile.mkdtemp(prefix="lbq-capacity-"))
    stack = Stack(workdir)
    tokens = round(mean_output_tokens(24.0, 0.9, 1, 400))
    body = json.dumps({"prompt": "bench " * 32, "max_tokens": tokens, "ignore_eos": True}).encode()
    try:
        classes = start_llama_servers(stack, args)
        urls = [
            f"http://127.0.0.1:{port}/v1/completions"
            for _, _, base, count in classes
            for port in range(base, base + count)
        ]
        done = dict.fromkeys(urls, 0)
        stop_at = time.monotonic() + 6.0

        def client(url: str) -> None:
            while time.monotonic() < stop_at:
                req = urllib.request.Request(url, body, {"content-type": "application/json"})
                with urllib.request.urlopen(req, timeout=60) as r:
                    r.read()
                done[url] += 1

        workers = [url for url in urls for _ in range(args.slots)]
        with concurrent.futures.ThreadPoolExecutor(len(workers)) as pool:
            list(pool.map(client, workers))
        per = {server.alias: done[f"{server.base}/v1/completions"] / 6.0 for server in stack.llamas}
        return sum(per.values()), per
    finally:
        stack.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def start_servers(stack: Stack, args: argparse.Namespace) -> list[tuple[str, float, int, int]]:
    """The emulated fleet, one `controlplane emulate` per GPU class: (gpu, speed, base port,
    count) per class, once every server answers."""
    if args.servers == "llama.cpp":
        return start_llama_servers(stack, args)
    classes: list[tuple[str, float, int, int]] = []
    for gpu, speed in (("fast", 1.0), ("slow", args.slow_speed)):
        base = free_ports(args.per_class)
        classes.append((gpu, speed, base, args.per_class))
        emulate = [
            str(BIN / "controlplane"),
            "emulate",
            "--listen",
            f"127.0.0.1:{base}",
            "--model",
            "bench-8b",
        ]
        emulate += [
            "--gpu",
            gpu,
            "--speed",
            str(speed),
            "--slots",
            str(args.slots),
            "--count",
            str(args.per_class),
        ]
        emulate += [
            "--decode-ms-per-token",
            str(args.decode_ms),
            "--prefill-ms-per-token",
            str(args.prefill_ms),
        ]
        if getattr(args, "kv_tokens", None):  # the prefix cache's size (bench/peers)
            emulate += ["--kv-capacity-tokens", str(args.kv_tokens)]
        publishers = getattr(args, "kv_publishers", None)
        if publishers is None:
            stack.spawn(f"emulate-{gpu}", emulate)
            continue
        # KV events (bench/peers' kv work): a process per server, each publishing its own.
        for i in range(args.per_class):
            address = f"127.0.0.1:{base + i}"
            events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
            publishers[address] = (events, replay)
            one = [*emulate]
            one[one.index("--listen") + 1] = address
            one[one.index("--count") + 1] = "1"
            one += ["--kv-events", events, "--kv-replay", replay, "--tokenizer", str(args.kv_tokenizer)]
            stack.spawn(f"emulate-{gpu}-{i}", one)
    for _, _, base, count in classes:
        for port in range(base, base + count):
            wait_http(f"http://127.0.0.1:{port}/health", 20, "emulated servers", stack.procs)
    return classes


def start_pickers(
    stack: Stack, workdir: Path, ports: Sequence[int], xds: int, admin: int, extra: Sequence[str] = ()
) -> list[int]:
    """`controlplane picker` processes on `ports` (with `extra` flags), reading the servers'
    loads from the operator API: their metrics ports, once each has the control plane's
    assignments."""
    metrics = []
    peer_token = workdir / "picker-peer-token"  # the pickers' shared --peer-token-file
    peer_token.write_text("bench-picker-peers\n")
    for i, port in enumerate(ports):
        metrics.append(free_port())
        stack.spawn(
            f"picker-{i}",
            [
                str(BIN / "controlplane"), "picker", "--control-plane", f"127.0.0.1:{xds}",
                "--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{metrics[-1]}",
                "--admin", f"127.0.0.1:{admin}", "--token-file", str(workdir / "state" / "admin-token"),
                "--node-id", f"picker-{i}",
                "--peers", ",".join(f"127.0.0.1:{p}" for p in ports if p != port),
                "--peer-token-file", str(peer_token),
                *extra,
            ],
        )  # fmt: skip
    for port in metrics:
        deadline = time.monotonic() + 30
        while picker_metric(port, "controlplane_picker_clusters") < 1:
            if time.monotonic() > deadline or any(p.poll() is not None for p in stack.procs):
                raise RuntimeError("a picker did not get the control plane's assignments")
            time.sleep(0.2)
    return metrics


def picker_metric(port: int, name: str) -> float:
    """The sum of a picker's samples named `name` (any labels); 0 before it answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            page = r.read().decode()
    except OSError:
        return 0.0
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in page.splitlines()
        if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{")
    )


def picker_replicas(policy: str, args: argparse.Namespace) -> int:
    """Pickers a policy runs: `picker` --pickers, `picker-xN` N, any other none."""
    if policy == "picker":
        return int(args.pickers)
    if policy.startswith("picker-x"):
        return int(policy.removeprefix("picker-x"))
    return 0


def run_policy(policy: str, args: argparse.Namespace, rate: float) -> dict[str, object]:
    """One policy on a fresh stack. `ideal` is the per-request full-scan picker run by the
    load generator itself, straight to the servers (no Envoy, no control plane): it knows
    every server's requests in flight, its slots and its speed, the best a balancer can know.
    `picker` is the real one: `--pickers` `controlplane picker` processes that every Envoy
    asks per request (balancing: picker); `picker-x2`, two of them, and so on."""
    workdir = Path(tempfile.mkdtemp(prefix=f"lbq-{policy}-"))
    stack = Stack(workdir)
    try:
        classes = start_servers(stack, args)
        load = [sys.executable, str(HERE / "loadgen.py"), "--model", "bench-8b", "--rate", f"{rate:.3f}"]
        load += ["--duration", str(args.duration), "--warmup", str(args.warmup), "--seed", str(args.seed)]
        if args.servers == "llama.cpp":
            load.append("--ignore-eos")
        picker_metrics: list[int] = []
        if policy == "ideal":
            servers = [
                f"127.0.0.1:{port}@{speed}@{args.slots}"
                for _, speed, base, count in classes
                for port in range(base, base + count)
            ]
            load += ["--picker", ",".join(servers), "--service-s", f"{service_seconds(args):.4f}"]
        else:
            listener = free_port()
            config = workdir / "fleet.yaml"
            pickers = [free_port() for _ in range(picker_replicas(policy, args))]
            balancing = "picker" if pickers else policy
            config.write_text(fleet_yaml(balancing, listener, classes, [f"127.0.0.1:{p}" for p in pickers]))
            xds, admin = free_port(), free_port()
            serve = ["--admin-listen", f"127.0.0.1:{admin}"] if pickers else []
            start_proxied(
                stack, workdir, config, listener, f"bench-{policy}", serve, proxies=args.proxies, xds=xds
            )
            if pickers:
                picker_metrics = start_pickers(stack, workdir, pickers, xds, admin)
            load += ["--target", f"127.0.0.1:{listener}"]
        out = subprocess.run(load, check=True, capture_output=True, text=True)
        result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
        result["workdir"] = str(workdir)
        result["by_proxy"] = [proxy_requests(port) for port in stack.envoy_admins]
        if picker_metrics:
            asked = sum(proxy_stat(port, "ext_proc.picker.streams_started") for port in stack.envoy_admins)
            fell = sum(
                proxy_stat(port, "ext_proc.picker.failure_mode_allowed") for port in stack.envoy_admins
            )
            result["picker"] = {
                "asked": asked,
                "fell_back": fell,
                "picks": sum(picker_metric(p, "controlplane_picker_picks_total") for p in picker_metrics),
            }
        return result
    finally:
        stack.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def proxy_stat(admin: int, suffix: str) -> int:
    """The sum of an Envoy's counters whose name ends with `suffix`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/stats?filter={suffix}$") as r:
        text = r.read().decode()
    return sum(int(line.rsplit(": ", 1)[-1]) for line in text.splitlines() if line.strip())


def proxy_requests(admin: int) -> int:
    """Requests an Envoy took on the model listener (its downstream_rq_total)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/stats?filter=^http\\..*downstream_rq_total$") as r:
        text = r.read().decode()
    return sum(int(line.rsplit(": ", 1)[-1]) for line in text.splitlines() if "admin" not in line)


def service_seconds(args: argparse.Namespace) -> float:
    """Mean time a request holds a slot on a speed-1.0 server."""
    mean_tokens = mean_output_tokens(24.0, 0.9, 1, 400)
    return (PROMPT_TOKENS * args.prefill_ms + mean_tokens * args.decode_ms) / 1000.0


def simulated_picker_p90(args: argparse.Namespace, load: float) -> float:
    """The simulation's per-request picker (controlplane/sim) on this fleet and workload."""
    from controlplane.sim.fleetsim import capacity_rps, make_requests, simulate
    from controlplane.sim.service import ServerSpec

    def spec(speed: float) -> ServerSpec:
        return ServerSpec(
            slots=args.slots,
            speed=speed,
            prefill_s_per_token=args.prefill_ms / 1000,
            decode_s_per_token=args.decode_ms / 1000,
        )

    fleet = [spec(1.0)] * args.per_class + [spec(args.slow_speed)] * args.per_class
    work = REAL_BENCH_WORK  # this script's requests: loadgen.py's sizes, PROMPT_TOKENS
    requests = make_requests(load * capacity_rps(fleet, work), 1200.0, work, args.proxies, args.seed)
    run = simulate(
        fleet, requests, "picker", sidecars=args.proxies, seed=args.seed, workload=work, warmup_s=60.0
    )
    return run.percentile(90)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--policies",
        default="round_robin,least_request,adaptive",
        help="comma-separated, first is the baseline: fleet balancing policies (adaptive, capacity, "
        "least_request, picker: the real per-request picker, --pickers of them; picker-x2: two, "
        "...) and `ideal`, "
        "the load generator's own per-request full scan straight to the servers (default: %(default)s)",
    )
    p.add_argument(
        "--load",
        type=float,
        action="append",
        help="offered load as a share of fleet capacity, repeatable (0.85)",
    )
    p.add_argument("--duration", type=float, default=45.0, help="measured seconds per policy")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds of load before measuring")
    p.add_argument("--per-class", type=int, default=3, help="servers per GPU class (two classes)")
    p.add_argument("--slow-speed", type=float, default=0.35, help="speed of the slow class (fast: 1.0)")
    p.add_argument("--slots", type=int, default=4, help="concurrent sequences per server")
    p.add_argument("--decode-ms", type=float, default=10.0, help="decode ms per output token at speed 1")
    p.add_argument("--prefill-ms", type=float, default=0.5, help="prefill ms per prompt token at speed 1")
    p.add_argument(
        "--proxies", type=int, default=1, help="Envoys sharing the listener port (each its own view)"
    )
    p.add_argument(
        "--pickers", type=int, default=1, help="`controlplane picker` processes for the picker policy"
    )
    p.add_argument("--sim", action="store_true", help="also print the simulated picker's p90 per load")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keep", action="store_true", help="keep each run's logs and fleet file")
    p.add_argument(
        "--servers",
        choices=["emulator", "llama.cpp"],
        default="emulator",
        help="emulated servers (default), or real llama.cpp servers of two speeds (the real extra)",
    )
    args = p.parse_args(argv)

    policies = args.policies.split(",")
    base = policies[0]
    if args.servers == "llama.cpp":
        if "ideal" in policies:
            p.error("--servers llama.cpp: the ideal picker needs the servers' speeds, which are not declared")
        capacity, per_server = measured_capacity(args)
        print(
            f"fleet: {args.per_class} real llama-server(s) of 2 layers + {args.per_class} of 6 "
            f"(hidden 256, 1 thread, {args.slots} slots each), behind {args.proxies} Envoy(s); "
            f"measured together: {', '.join(f'{k} {v:.1f}' for k, v in per_server.items())} req/s, "
            f"capacity {capacity:.1f} req/s",
            flush=True,
        )
    else:
        service_s = service_seconds(args)
        capacity = args.per_class * args.slots * (1.0 + args.slow_speed) / service_s
        print(
            f"fleet: {args.per_class} x speed 1.0 + {args.per_class} x speed {args.slow_speed}, "
            f"{args.slots} slots each, behind {args.proxies} Envoy(s); mean service "
            f"{service_s * 1000:.0f} ms at speed 1; capacity {capacity:.1f} req/s",
            flush=True,
        )
    summary: list[str] = []
    # The policy whose p90 is set against the others': the real picker, else adaptive.
    focus = next((k for k in ("picker", "adaptive") if k in policies), "")
    others: list[str] = []
    for load in args.load or [0.85]:
        rate = load * capacity
        results: dict[str, dict[str, object]] = {}
        for policy in policies:
            print(
                f"load {load:.0%} ({rate:.1f} req/s): {policy} "
                f"({args.warmup:g} s warm-up + {args.duration:g} s) ...",
                flush=True,
            )
            results[policy] = run_policy(policy, args, rate)
        p90 = {k: float(r["p90"]) for k, r in results.items()}  # type: ignore[arg-type]
        print()
        print(f"### load {load:.0%}\n")
        print("| policy | requests | errors | p50 s | p90 s | p99 s | p90 vs " + base + " |")
        print("|---|---|---|---|---|---|---|")
        for policy, r in results.items():
            print(
                f"| {policy} | {r['requests']} | {r['errors']} | {float(r['p50']):.2f} | "  # type: ignore[arg-type]
                f"{p90[policy]:.2f} | {float(r['p99']):.2f} | {p90[policy] / p90[base]:.2f}x |"  # type: ignore[arg-type]
            )
        for policy, r in results.items():
            print(f"{policy}: requests by server {dict(sorted(r['by_backend'].items()))}")  # type: ignore[attr-defined]
            if r["by_proxy"]:
                print(f"{policy}: requests by proxy {r['by_proxy']}")
            if "picker" in r:
                print(f"{policy}: picker {r['picker']}")
            if r["errors"]:
                print(f"{policy}: statuses {r['statuses']} samples {r['error_samples']}")
        row = f"| {load:.0%} | " + " | ".join(f"{p90[k]:.2f}" for k in policies)
        others = [k for k in policies if k != focus]
        if args.sim:
            sim = simulated_picker_p90(args, load)
            row += f" | {sim:.2f}"
        if focus:
            row += " | " + " | ".join(f"{p90[focus] / p90[k]:.2f}x" for k in others)
            if args.sim:
                row += f" | {p90[focus] / sim:.2f}x"
        summary.append(row + " |")
    print("\n### p90 s by load" + (f", and {focus}'s p90 against each" if focus else "") + "\n")
    head = [
        "load",
        *policies,
        *(["simulated picker"] if args.sim else []),
        *[f"{focus} vs {k}" for k in others if focus],
        *([f"{focus} vs simulated picker"] if focus and args.sim else []),
    ]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
