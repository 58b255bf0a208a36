"""The picker under a flood of KV events (issue 43): its picks' latency with and without
100,000 blocks stored per second, in the same run, and its index against its bound.

Two emulated servers (no events of their own) behind a control plane; the fleet names, as
their publishers, two ZMQ PUB sockets of a flood process that publishes vLLM 0.32's batches
(1,000 blocks of 16 tokens each, fresh hashes, each batch a chain of its own: before
2026-12-08 chained from the last, so that once a server's blocks were dropped, every later
block's parent was unknown and it was skipped, not keyed) at `--blocks-per-s` over
both. A probe sends picks straight to the picker's ext_proc port (a request's headers with the
cluster and a chat body as the gateway hands it), one every 10 ms, and times the answer, all
through the run: from a process of its own, one connection and a stream per pick as Envoy
sends them (`--probe thread`: from a thread of this bench, as before 2026-12-07). Phases:
`quiet` (`--quiet-seconds`, no flood); the fill (the flood on the servers' sockets until the
index is at its bound, not measured); then `--window` seconds of `decoy` (the flood on two
sockets nobody subscribes to: the generator's own work, which in a fleet runs on the servers,
not beside the picker) and of `flood` (the sockets the picker follows) in turn, until
`--seconds` of flood. The windows take turns so that the machine's drift (p99 moves by a
millisecond from minute to minute on a shared 2-core machine) falls on both alike; the first
`--settle` seconds of each are not counted (the last window's events are still being applied).
Printed: per condition, pick latency p50/p99, CPU and blocks applied per second; the p99 rise
of `flood` over `decoy` (and per half of the windows, and per pair of a flood window and the
decoy window before it, with the pairs' median, to show how steady it is; a 90% interval for
it, by resampling the pairs; and over `quiet`), the index's size against `--kv-index-blocks`
(sampled every second), and the picker's and its index process's RSS. Everything on loopback;
every process is stopped, on failure too.

    .venv/bin/python bench/picker/kv_flood.py                      # 100,000 blocks/s, 60 s
    .venv/bin/python bench/picker/kv_flood.py --layouts process --seconds 240   # a narrower interval
    .venv/bin/python bench/picker/kv_flood.py --seconds 20 --window 4 --settle 1 --layouts process
    .venv/bin/python bench/picker/kv_flood.py --layouts process --blocks-per-s 1000 \
        --kv-index-blocks 10000 --control mem   # what a busy process alone costs (--control)

Each layout (where the picker reads the events: `process`, its default, a process of its own
at nice 19; `in-process`, --kv-in-process) runs the phases on a stack of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(HERE.parent / "lb_quality"))
sys.path.insert(0, str(REPO))

from real import Stack, picker_metric, start_proxied, wait_http  # noqa: E402

from bench.ports import free_port  # noqa: E402
from controlplane.picker.request import CLUSTER_ATTRIBUTE, PROMPT_KEY  # noqa: E402
from controlplane.resources.names import METADATA_NS  # noqa: E402
from controlplane.sim.tokenizer import make_tokenizer  # noqa: E402

FLOOD = """
import random, sys, time, zmq
from controlplane.kvcache import wire
import os
ports, flood_rate, seconds = [int(p) for p in sys.argv[1].split(",")], float(sys.argv[2]), float(sys.argv[3])
fill_rate = float(sys.argv[5])
ctx = zmq.Context()
pubs = []
for p in ports:
    s = ctx.socket(zmq.PUB); s.setsockopt(zmq.SNDHWM, 100000); s.bind(f"tcp://127.0.0.1:{p}"); pubs.append(s)
print("bound", flush=True)
decoy, live, stop = sys.argv[4] + ".decoy", sys.argv[4], sys.argv[4] + ".stop"
filled = sys.argv[4] + ".filled"  # until then, the fill's rate
while not os.path.exists(decoy):
    time.sleep(0.05)
rng = random.Random(1)
per, n = 1000, 0
tokens = [rng.randrange(32000) for _ in range(16 * per)]
seqs = [0] * len(pubs)
half = len(pubs) // 2  # the first half: sockets nobody subscribes to; the second: the servers'
start, on, rate = time.monotonic(), False, fill_rate
due = start
while not (n % 10 == 0 and os.path.exists(stop)) and time.monotonic() - start < seconds:
    if n % 10 == 0:  # which sockets and rate: looked at every 10 batches (0.1 s at 100,000 blocks/s)
        on = os.path.exists(live)
        rate = flood_rate if os.path.exists(filled) else fill_rate
    i = n % half + (half if on else 0)
    hashes = [rng.getrandbits(63) for _ in range(per)]
    tokens[rng.randrange(len(tokens))] = rng.randrange(32000)
    # A chain of its own (a 16,000-token prompt): one dropped batch, or a server's blocks dropped
    # (a gap, a batch read late), leaves the next batches' parents known, so they are all keyed.
    event = wire.stored(hashes, None, tokens, 16)
    pubs[i].send_multipart(list(wire.frames(seqs[i], time.time(), [event])))
    seqs[i] += 1; n += 1
    due += per / rate
    ahead = due - time.monotonic()
    if ahead > 0:
        time.sleep(ahead)
print(n * per, flush=True)
"""

# `--control`: in the `flood` windows, instead of (or besides) the flood, a process under
# SCHED_IDLE as the index's process runs, busy 40% of the time (1 ms in 2.5): `cpu` sums
# integers (no memory), `mem` churns a dict of 2,000,000 random keys (a random insert and a
# delete at a time, as the index does), to tell what of the rise is the cores and what memory.
CONTROL = """
import os, random, sys, time
go, kind = sys.argv[1], sys.argv[2]
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
rng = random.Random(2)
d = {rng.getrandbits(63): i for i in range(2_000_000)} if kind == "mem" else {}
ks = list(d)
print("ready", flush=True)
while not os.path.exists(go + ".stop"):
    if not os.path.exists(go):
        time.sleep(0.05)
        continue
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.001:
        if kind == "cpu":
            x = sum(i * i for i in range(200))
        else:
            for _ in range(50):
                i = rng.randrange(len(ks))
                d.pop(ks[i], None)
                ks[i] = rng.getrandbits(63)
                d[ks[i]] = i
    time.sleep(0.0015)
"""


def fleet(listener: int, servers: list[str], picker: str, kv: list[int], tokenizer: Path) -> str:
    eps = "\n".join(
        f"          - {{address: '{a}', kv_events: 'tcp://127.0.0.1:{p}'}}"
        for a, p in zip(servers, kv, strict=True)
    )
    return (
        f"listener: {{port: {listener}}}\n"
        "signals: {interval: 500ms}\n"
        f"picker: {{endpoints: ['{picker}'], timeout: 50ms}}\n"
        "tiers: {small: {timeout: 10s, balancing: picker}}\n"
        "models:\n"
        "  chat:\n"
        "    params_b: 1\n"
        f"    tokenizer: '{tokenizer}'\n"
        "    stable: v1\n"
        "    versions:\n"
        "      v1:\n"
        "        endpoints:\n"
        f"{eps}\n"
    )


def pick_request() -> ep.ProcessingRequest:
    """A pick's first message, as the gateway sends it: its headers, the cluster, a chat body."""
    body = json.dumps(
        {
            "model": "chat",
            "messages": [
                {"role": "system", "content": "You are helpful. " * 40},
                {"role": "user", "content": "hi"},
            ],
        }
    )
    req = ep.ProcessingRequest(request_headers=ep.HttpHeaders())
    req.attributes["envoy.filters.http.ext_proc"].fields[CLUSTER_ATTRIBUTE].string_value = "chat@v1"
    req.metadata_context.filter_metadata[METADATA_NS].fields[PROMPT_KEY].string_value = body
    return req


def probe(address: str, stop: threading.Event, out: list[tuple[float, float]], errors: list[str]) -> None:
    """`--probe thread`: picks from a thread of this process until `stop`, one every 10 ms
    (synchronous gRPC: a thread per pick for its request stream): (when it was sent,
    monotonic; its latency) each."""
    req = pick_request()
    channel = grpc.insecure_channel(address)
    stub = ep_grpc.ExternalProcessorStub(channel)
    try:
        while not stop.is_set():
            sent, t0 = time.monotonic(), time.perf_counter()
            call = stub.Process(
                iter([req, ep.ProcessingRequest(response_headers=ep.HttpHeaders())]), timeout=5
            )
            try:
                first = next(call)
                out.append((sent, time.perf_counter() - t0))
                if not first.request_headers.response.header_mutation.set_headers:
                    errors.append("no pick")
                next(call)
            except (grpc.RpcError, StopIteration) as e:
                errors.append(repr(e)[:100])
            time.sleep(0.01)
    finally:
        channel.close()


# `--probe process` (the default): the picks from a process of its own, as Envoy sends them:
# one HTTP/2 connection, a stream per pick, no thread per pick (grpc.aio), so that neither
# this bench's own work (its scrapes, under its GIL) nor a thread started for each pick's
# request stream (the synchronous client's way, `--probe thread`) is in the latencies.
PROBE = """
import asyncio, json, os, sys, time
import grpc
address, stop, out = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, os.path.dirname(sys.argv[4]))
from kv_flood import ep, ep_grpc, pick_request
async def main():
    samples, errors = [], []
    req = pick_request()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)
        print("ready", flush=True)
        n = 0
        while not (n % 10 == 0 and os.path.exists(stop)):
            n += 1
            sent, t0 = time.monotonic(), time.perf_counter()
            try:
                call = stub.Process(timeout=5)
                await call.write(req)
                first = await call.read()
                samples.append((sent, time.perf_counter() - t0))
                if not first.request_headers.response.header_mutation.set_headers:
                    errors.append("no pick")
                await call.write(ep.ProcessingRequest(response_headers=ep.HttpHeaders()))
                await call.read()
                await call.done_writing()
            except grpc.RpcError as e:
                errors.append(repr(e)[:100])
            await asyncio.sleep(0.01)
    with open(out, "w") as f:
        json.dump({"samples": samples, "errors": errors}, f)
asyncio.run(main())
"""


def cpu_s(pid: int) -> float:
    """The CPU seconds (user + system) process `pid` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of every core since boot (/proc/stat)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def index_pid(pid: int) -> int | None:
    """The picker's index process (its child), if it has one."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split()
        if children:
            return int(children[0])
    return None


def by_label(metrics: int, name: str, label: str) -> dict[str, float]:
    """A picker's samples of `name`, summed by the value of `label` (every server)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=2) as r:
        page = r.read().decode()
    out: dict[str, float] = {}
    for line in page.splitlines():
        if line.startswith(name + "{") and f'{label}="' in line:
            value = line.split(f'{label}="', 1)[1].split('"', 1)[0]
            out[value] = out.get(value, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@dataclass
class Usage:
    """What one condition's windows used, summed."""

    seconds: float = 0.0
    picker: float = 0.0
    index: float = 0.0
    flood: float = 0.0
    busy: float = 0.0
    total: float = 0.0
    applied: float = 0.0


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def bootstrap_rise(windows: list[tuple[list[float], list[float]]], rounds: int = 1000) -> tuple[float, float]:
    """A 90% interval for the pooled p99 rise (ms), by resampling pairs of windows (each pair's
    decoy and flood latencies) with replacement: picks within a window are not independent (a
    slow second slows many), so the pairs are what is drawn. NaN: under 2 pairs."""
    pairs = [(np.array(d), np.array(f)) for d, f in windows]
    if len(pairs) < 2:
        return float("nan"), float("nan")
    rng = np.random.default_rng(7)

    def p99(x: np.ndarray) -> float:
        return float(np.sort(x)[min(len(x) - 1, int(0.99 * len(x)))])  # percentile()'s rule

    rises = []
    for _ in range(rounds):
        drawn = rng.integers(0, len(pairs), len(pairs))
        d = np.concatenate([pairs[i][0] for i in drawn])
        f = np.concatenate([pairs[i][1] for i in drawn])
        rises.append(1000 * (p99(f) - p99(d)))
    low, high = np.percentile(rises, [5, 95])
    return round(float(low), 3), round(float(high), 3)


def measure(
    a: argparse.Namespace, stack: Stack, picker: int, flood: int, metrics: int, port: int, go: Path
) -> float:
    """The quiet phase, the fill, then decoy and flood windows in turn; prints each condition and
    the rise; returns the p99 rise of the flood over the decoy windows."""
    samples: list[tuple[float, float]] = []
    errors: list[str] = []
    sizes: list[float] = []
    lags: list[float] = []  # the largest server's event lag, sampled every second
    stop = threading.Event()
    child = index_pid(picker)
    windows: list[tuple[str, float, float]] = []  # condition, counted from, end
    usage: dict[str, Usage] = {}
    busy_decoys: list[float] = []  # decoy windows whose index process was still busy after 4 x --window
    waited: dict[str, float] = {}  # seconds past --settle until the index's process was idle

    def applied() -> float:
        return picker_metric(metrics, "controlplane_picker_kv_index_blocks") + picker_metric(
            metrics, "controlplane_picker_kv_index_evicted_blocks"
        )

    def counters() -> tuple[float, float, float, tuple[float, float], float]:
        return (
            cpu_s(picker),
            cpu_s(child) if child else 0.0,
            cpu_s(flood),
            machine_busy(),
            applied(),
        )

    def wait(until: float) -> None:
        while (left := until - time.monotonic()) > 0:
            sizes.append(picker_metric(metrics, "controlplane_picker_kv_index_blocks"))
            lags.append(
                max(
                    by_label(metrics, "controlplane_picker_kv_event_lag_seconds", "server").values(),
                    default=0,
                )
            )
            time.sleep(min(1.0, left))

    def idle(most_s: float) -> bool:
        """Wait until the index's process is idle (at most one clock tick of CPU, 2% of a core,
        in half a second): it reads at most --kv-index-cpu of a core, so the flood's messages
        queued in a flood window may still be read after it. False: not within `most_s`."""
        deadline = time.monotonic() + most_s
        before = cpu_s(child) if child else 0.0
        while child and time.monotonic() < deadline:
            time.sleep(0.5)
            now = cpu_s(child)
            if now - before <= 1.0 / os.sysconf("SC_CLK_TCK"):
                return True
            before = now
        return not child

    def window(condition: str, seconds: float) -> None:
        """`seconds` of `condition`, counted after `--settle` (a decoy window: once the index's
        process is idle, too), its picks and CPU over the counted part only."""
        start = time.monotonic()
        if condition == "decoy" and not idle(4 * seconds):
            busy_decoys.append(start)
        wait(max(start + a.settle, time.monotonic()))
        counted, c0 = time.monotonic(), counters()
        wait(counted + seconds - a.settle)
        end, c1 = time.monotonic(), counters()
        windows.append((condition, counted, end))
        waited[condition] = waited.get(condition, 0.0) + counted - start - a.settle
        u = usage.setdefault(condition, Usage())
        u.seconds += end - start
        u.picker += c1[0] - c0[0]
        u.index += c1[1] - c0[1]
        u.flood += c1[2] - c0[2]
        u.busy += c1[3][0] - c0[3][0]
        u.total += c1[3][1] - c0[3][1]
        u.applied += c1[4] - c0[4]

    address = f"127.0.0.1:{port}"
    if a.probe == "thread":
        t = threading.Thread(target=probe, args=(address, stop, samples, errors))
        t.start()
    else:
        picks = go.parent / "picks.json"
        prober = stack.spawn(
            "probe", [sys.executable, "-c", PROBE, address, f"{go}.stop", str(picks), __file__]
        )
    try:
        window("quiet", a.quiet_seconds)  # no flood at all
        Path(f"{go}.decoy").touch()  # the generator starts, on sockets the picker does not follow
        go.touch()  # the fill: the flood on the servers' own sockets until the index is at its bound
        deadline = time.monotonic() + 2 * a.kv_index_blocks / a.fill_blocks_per_s + 30
        while picker_metric(metrics, "controlplane_picker_kv_index_blocks") < 0.99 * a.kv_index_blocks:
            if time.monotonic() > deadline:
                raise RuntimeError("the index did not reach its bound under the fill")
            time.sleep(0.5)
        Path(f"{go}.filled").touch()  # from now on, --blocks-per-s
        flooded = 0.0
        while flooded < a.seconds:
            go.unlink()
            window("decoy", a.window)
            go.touch()
            window("flood", a.window)
            flooded += a.window
    finally:
        Path(f"{go}.stop").touch()
        stop.set()
        if a.probe == "thread":
            t.join()
        else:
            prober.wait(30)
            got = json.loads(picks.read_text())
            samples.extend((sent, lat) for sent, lat in got["samples"])
            errors.extend(got["errors"])

    def latencies(condition: str, part: slice = slice(None)) -> list[float]:
        spans = [(s, e) for c, s, e in windows if c == condition][part]
        return [lat for sent, lat in samples if any(s <= sent < e for s, e in spans)]

    out: dict[str, dict[str, float]] = {}
    for condition, u in usage.items():
        lat = latencies(condition)
        out[condition] = {
            "picks": len(lat),
            "p50_ms": round(1000 * percentile(lat, 0.5), 3),
            "p99_ms": round(1000 * percentile(lat, 0.99), 3),
            # CPU share of one core: the picker's, its index process's, the generator's; and the
            # machine's, every core together (1.0: all busy)
            "picker_cpu": round(u.picker / u.seconds, 3),
            "index_process_cpu": round(u.index / u.seconds, 3) if child else float("nan"),
            "flood_cpu": round(u.flood / u.seconds, 3),
            "machine_busy": round(u.busy / max(1.0, u.total), 3),
            "blocks_applied_per_s": round(u.applied / u.seconds),
            "waited_idle_s_per_window": round(
                waited.get(condition, 0.0) / max(1, sum(1 for w in windows if w[0] == condition)), 2
            ),
        }
        print(json.dumps({"condition": condition, **out[condition]}), flush=True)
    halves = len([w for w in windows if w[0] == "flood"]) // 2
    by_half = [
        round(
            1000 * (percentile(latencies("flood", part), 0.99) - percentile(latencies("decoy", part), 0.99)),
            3,
        )
        for part in (slice(None, halves), slice(halves, None))
    ]
    rise = out["flood"]["p99_ms"] - out["decoy"]["p99_ms"]
    # Each flood window against the decoy window before it: how steady the rise is from pair
    # to pair (a few slow windows can carry the pooled p99), printed beside it, not for it.
    decoys = [(s, e) for c, s, e in windows if c == "decoy"]
    floods = [(s, e) for c, s, e in windows if c == "flood"]
    paired = []
    for (ds, de), (fs, fe) in zip(decoys, floods, strict=False):
        d = [lat for sent, lat in samples if ds <= sent < de]
        f = [lat for sent, lat in samples if fs <= sent < fe]
        if d and f:
            paired.append((d, f))
    pairs = [round(1000 * (percentile(f, 0.99) - percentile(d, 0.99)), 3) for d, f in paired]
    low, high = bootstrap_rise(paired)
    print(
        json.dumps(
            {
                "blocks_per_s_offered": a.blocks_per_s,
                "p99_rise_ms": round(rise, 3),
                "p99_rise_ms_by_half": by_half,
                "p99_rise_over_quiet_ms": round(out["flood"]["p99_ms"] - out["quiet"]["p99_ms"], 3),
                "p50_rise_ms": round(out["flood"]["p50_ms"] - out["decoy"]["p50_ms"], 3),
                "p99_rise_ms_by_pair": pairs,
                "p99_rise_ms_pair_median": round(statistics.median(pairs), 3) if pairs else None,
                "pairs_flood_slower": f"{sum(1 for x in pairs if x > 0)}/{len(pairs)}",
                "p99_rise_ms_90pct_interval": [low, high],
                "errors": len(errors),
                "decoy_windows_index_busy": len(busy_decoys),
                "batches": by_label(metrics, "controlplane_picker_kv_batches_total", "result"),
                "streams_lost_by_reason": by_label(
                    metrics, "controlplane_picker_kv_streams_lost_total", "reason"
                ),
                "lag_s_max": max(lags, default=0.0),
                "throttled_s": picker_metric(metrics, "controlplane_picker_kv_throttled_seconds_total"),
                "index_blocks_max": max(sizes, default=0.0),
                "within_bound": max(sizes, default=0.0) <= a.kv_index_blocks,
                "streams_lost": picker_metric(metrics, "controlplane_picker_kv_streams_lost_total"),
                "table_rebuilds": picker_metric(metrics, "controlplane_picker_kv_table_rebuilds"),
                "table_torn_reads": picker_metric(metrics, "controlplane_picker_kv_table_torn_reads_total"),
                "batches_refused_or_gaps": picker_metric(metrics, "controlplane_picker_kv_replays_total"),
                "picker_rss_mb": round(rss_mb(picker), 1),
                "index_process_rss_mb": round(rss_mb(child), 1) if child else None,
            }
        ),
        flush=True,
    )
    return round(rise, 3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--seconds",
        type=float,
        default=60.0,
        help="of flood, in windows, after the fill (default: %(default)s)",
    )
    p.add_argument(
        "--window", type=float, default=6.0, help="each flood and decoy window (default: %(default)s)"
    )
    p.add_argument(
        "--settle",
        type=float,
        default=2.0,
        help="the start of each window not measured: the last one's events still applied "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--quiet-seconds", type=float, default=20.0, help="the first phase, no flood (default: %(default)s)"
    )
    p.add_argument("--blocks-per-s", type=float, default=100_000.0, help="the flood (default: %(default)s)")
    p.add_argument(
        "--fill-blocks-per-s",
        type=float,
        default=15_000.0,
        help="the fill's rate, before the windows: within what the index's process reads at the "
        "picker's default --kv-index-cpu (30,000 fell behind here), so that its size reaches the "
        "bound (a faster publisher falls behind and its blocks are dropped, "
        "docs/kv-events.md#a-flood-of-events) (default: %(default)s)",
    )
    p.add_argument(
        "--kv-index-cpu",
        default=None,
        help="the picker's --kv-index-cpu (default: the picker's own)",
    )
    p.add_argument(
        "--kv-index-blocks", type=int, default=1 << 20, help="the picker's bound (default: %(default)s)"
    )
    p.add_argument(
        "--layouts",
        default="process,in-process",
        help="where the picker reads the events, each run in turn: `process` (the default: a "
        "process of its own at nice 19), `in-process` (--kv-in-process) (default: %(default)s)",
    )
    p.add_argument(
        "--probe",
        choices=("process", "thread"),
        default="process",
        help="where the picks come from: `process`, one of its own with one connection and a "
        "stream per pick as Envoy sends them (grpc.aio); `thread`, a thread of this bench "
        "(synchronous gRPC, a thread per pick: the figures before 2026-12-07) (default: %(default)s)",
    )
    p.add_argument(
        "--control",
        choices=("cpu", "mem"),
        help="also run, in the flood windows only, a process under SCHED_IDLE busy 40%% of the time: "
        "`cpu` on integers, `mem` churning a dict of 2,000,000 keys; with a small flood "
        "(--blocks-per-s 1000 --kv-index-blocks 10000) it shows what such a process alone costs "
        "the picks (docs/benchmarks.md)",
    )
    a = p.parse_args(argv)
    layouts = a.layouts.split(",")
    for layout in layouts:
        if layout not in ("process", "in-process"):
            p.error(f"--layouts: unknown {layout!r} (process, in-process)")
    rises = {layout: run_layout(a, layout) for layout in layouts}
    print(json.dumps({"p99_rise_ms_by_layout": rises}), flush=True)
    return 0


def run_layout(a: argparse.Namespace, layout: str) -> float:
    """The phases with the picker reading the events as `layout` says; the p99 rise."""
    print(f"# layout: {layout}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench-kv-flood-"))
    stack = Stack(work)
    try:
        servers = [free_port(), free_port()]
        for i, port in enumerate(servers):
            stack.spawn(
                f"server-{i}",
                [str(BIN / "controlplane"), "emulate", "--listen", f"127.0.0.1:{port}", "--model", "chat"],
            )
        for port in servers:
            wait_http(f"http://127.0.0.1:{port}/health", 20, "a server", stack.procs)
        kv = [free_port(), free_port()]
        decoys = [free_port(), free_port()]
        go = work / "go"
        fill_s = 2 * a.kv_index_blocks / a.fill_blocks_per_s
        most = a.quiet_seconds + 6 * a.seconds + fill_s + 120  # a bound only
        flood_args = [
            ",".join(map(str, decoys + kv)), str(a.blocks_per_s), str(most), str(go), str(a.fill_blocks_per_s)
        ]  # fmt: skip
        flood = stack.spawn("flood", [sys.executable, "-c", FLOOD, *flood_args])
        if a.control:
            stack.spawn("control", [sys.executable, "-c", CONTROL, str(go), a.control])
        listener, picker_port, xds = free_port(), free_port(), free_port()
        tokenizer = make_tokenizer(work / "tokenizer")
        config = work / "fleet.yaml"
        addresses = [f"127.0.0.1:{p}" for p in servers]
        config.write_text(fleet(listener, addresses, f"127.0.0.1:{picker_port}", kv, tokenizer))
        start_proxied(stack, work, config, listener, "bench-envoy", xds=xds)
        metrics = free_port()  # after the control plane took its own
        picker = stack.spawn(
            "picker",
            [
                str(BIN / "controlplane"), "picker", "--control-plane", f"127.0.0.1:{xds}",
                "--listen", f"127.0.0.1:{picker_port}", "--metrics-listen", f"127.0.0.1:{metrics}",
                "--kv-index-blocks", str(a.kv_index_blocks),
                *(["--kv-in-process"] if layout == "in-process" else []),
                *(["--kv-index-cpu", a.kv_index_cpu] if a.kv_index_cpu else []),
            ],
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while picker_metric(metrics, "controlplane_picker_clusters") < 1:
            if time.monotonic() > deadline:
                raise RuntimeError("the picker got no assignments")
            time.sleep(0.2)
        time.sleep(3.0)  # the control plane finds both servers ready (a pick needs one)
        return measure(a, stack, picker.pid, flood.pid, metrics, picker_port, go)
    finally:
        stack.stop()


if __name__ == "__main__":
    raise SystemExit(main())
