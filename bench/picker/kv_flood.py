"""The picker under a flood of KV events (issue 43): its picks' latency with and without
100,000 blocks stored per second, in the same run, and its index against its bound.

Two emulated servers (no events of their own) behind a control plane; the fleet names, as
their publishers, two ZMQ PUB sockets of a flood process that publishes vLLM 0.32's batches
(1,000 blocks of 16 tokens each, fresh hashes, chained from the last) at `--blocks-per-s`
over both. A probe sends picks straight to the picker's ext_proc port (a request's headers
with the cluster and a chat body as the gateway hands it), one every 10 ms, and times the
answer. Phases of `--seconds` each: without the flood (the baseline); the flood on two
sockets nobody subscribes to (`unsubscribed`: what the generator's own work costs the picks on
a shared machine, where in a fleet the publishers are elsewhere); the flood on the sockets the
picker follows. Printed: pick latency p50/p99 per phase and the rise (over the baseline, and
over `unsubscribed`: the picker's own share), the index's size against
`--kv-index-blocks` (sampled every second), the blocks the picker applied per second, and its
RSS. Everything on loopback; every process is stopped, on failure too.

    .venv/bin/python bench/picker/kv_flood.py                      # 100,000 blocks/s, 60 s
    .venv/bin/python bench/picker/kv_flood.py --seconds 20 --blocks-per-s 50000 --layouts process

Each layout (where the picker reads the events: `process`, its default, a process of its own
at nice 19; `in-process`, --kv-in-process) runs the three phases on a stack of its own.
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
from pathlib import Path

import grpc
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
ports, rate, seconds = [int(p) for p in sys.argv[1].split(",")], float(sys.argv[2]), float(sys.argv[3])
ctx = zmq.Context()
pubs = []
for p in ports:
    s = ctx.socket(zmq.PUB); s.setsockopt(zmq.SNDHWM, 100000); s.bind(f"tcp://127.0.0.1:{p}"); pubs.append(s)
print("bound", flush=True)
decoy, live = sys.argv[4] + ".decoy", sys.argv[4]
while not os.path.exists(decoy):
    time.sleep(0.05)
rng = random.Random(1)
per, n = 1000, 0
tokens = [rng.randrange(32000) for _ in range(16 * per)]
seqs, parents = [0] * len(pubs), [None] * len(pubs)
half = len(pubs) // 2  # the first half: sockets nobody subscribes to (the decoy phase)
start, phase = time.monotonic(), 0
while phase == 0 or time.monotonic() - start < seconds:
    if phase == 0 and os.path.exists(live):
        phase, start, n = 1, time.monotonic(), 0
    i = n % half + (half if phase else 0)
    hashes = [rng.getrandbits(63) for _ in range(per)]
    tokens[rng.randrange(len(tokens))] = rng.randrange(32000)
    event = wire.stored(hashes, parents[i], tokens, 16)
    pubs[i].send_multipart(list(wire.frames(seqs[i], time.time(), [event])))
    seqs[i] += 1; parents[i] = hashes[-1]; n += 1
    ahead = start + n * per / rate - time.monotonic()
    if ahead > 0:
        time.sleep(ahead)
print(n * per, flush=True)
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


def probe(address: str, seconds: float, out: list[float], errors: list[str]) -> None:
    body = json.dumps(
        {
            "model": "chat",
            "messages": [
                {"role": "system", "content": "You are helpful. " * 40},
                {"role": "user", "content": "hi"},
            ],
        }
    )
    channel = grpc.insecure_channel(address)
    stub = ep_grpc.ExternalProcessorStub(channel)
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            req = ep.ProcessingRequest(request_headers=ep.HttpHeaders())
            req.attributes["envoy.filters.http.ext_proc"].fields[CLUSTER_ATTRIBUTE].string_value = "chat@v1"
            req.metadata_context.filter_metadata[METADATA_NS].fields[PROMPT_KEY].string_value = body
            t0 = time.perf_counter()
            call = stub.Process(
                iter([req, ep.ProcessingRequest(response_headers=ep.HttpHeaders())]), timeout=5
            )
            try:
                first = next(call)
                out.append(time.perf_counter() - t0)
                if not first.request_headers.response.header_mutation.set_headers:
                    errors.append("no pick")
                next(call)
            except (grpc.RpcError, StopIteration) as e:
                errors.append(repr(e)[:100])
            time.sleep(0.01)
    finally:
        channel.close()


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


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="per phase (default: %(default)s)")
    p.add_argument("--blocks-per-s", type=float, default=100_000.0, help="the flood (default: %(default)s)")
    p.add_argument(
        "--kv-index-blocks", type=int, default=1 << 20, help="the picker's bound (default: %(default)s)"
    )
    p.add_argument(
        "--layouts",
        default="process,in-process",
        help="where the picker reads the events, each run in turn: `process` (the default: a "
        "process of its own at nice 19), `in-process` (--kv-in-process) (default: %(default)s)",
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
    """The three phases with the picker reading the events as `layout` says; the p99 rise."""
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
        flood_args = [",".join(map(str, decoys + kv)), str(a.blocks_per_s), str(a.seconds), str(go)]
        flood = stack.spawn("flood", [sys.executable, "-c", FLOOD, *flood_args])
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
            ],
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while picker_metric(metrics, "controlplane_picker_clusters") < 1:
            if time.monotonic() > deadline:
                raise RuntimeError("the picker got no assignments")
            time.sleep(0.2)
        time.sleep(3.0)  # the control plane finds both servers ready (a pick needs one)
        phases: dict[str, dict[str, object]] = {}
        for phase in ("baseline", "unsubscribed", "flood"):
            lat: list[float] = []
            errors: list[str] = []
            samples: list[float] = []
            if phase == "unsubscribed":
                Path(f"{go}.decoy").touch()  # the flood on sockets the picker does not follow
            if phase == "flood":
                go.touch()  # the flood on the servers' own sockets
            applied0 = picker_metric(metrics, "controlplane_picker_kv_index_blocks") + picker_metric(
                metrics, "controlplane_picker_kv_index_evicted_blocks"
            )
            child = index_pid(picker.pid)
            cpu0 = (cpu_s(picker.pid), cpu_s(flood.pid), machine_busy(), cpu_s(child) if child else 0.0)
            t = threading.Thread(target=probe, args=(f"127.0.0.1:{picker_port}", a.seconds, lat, errors))
            t.start()
            while t.is_alive():
                samples.append(picker_metric(metrics, "controlplane_picker_kv_index_blocks"))
                t.join(1.0)
            applied = (
                picker_metric(metrics, "controlplane_picker_kv_index_blocks")
                + picker_metric(metrics, "controlplane_picker_kv_index_evicted_blocks")
                - applied0
            )
            lat.sort()
            busy, total = machine_busy()
            phases[phase] = {
                # CPU share of one core over the phase: the picker's, the flood generator's;
                # and the machine's, every core together (1.0: all busy)
                "picker_cpu": round((cpu_s(picker.pid) - cpu0[0]) / a.seconds, 3),
                "index_process_cpu": round((cpu_s(child) - cpu0[3]) / a.seconds, 3) if child else None,
                "flood_cpu": round((cpu_s(flood.pid) - cpu0[1]) / a.seconds, 3),
                "machine_busy": round((busy - cpu0[2][0]) / max(1, total - cpu0[2][1]), 3),
                "picks": len(lat),
                "errors": len(errors),
                "p50_ms": round(1000 * lat[len(lat) // 2], 3) if lat else None,
                "p99_ms": round(1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3) if lat else None,
                "index_blocks_max": max(samples, default=0.0),
                "index_bound": a.kv_index_blocks,
                "blocks_applied_per_s": round(applied / a.seconds),
                "picker_rss_mb": round(rss_mb(picker.pid), 1),
                "index_process_rss_mb": round(rss_mb(child), 1) if child else None,
            }
            print(json.dumps({"phase": phase, **phases[phase]}), flush=True)
        rise = float(phases["flood"]["p99_ms"]) - float(phases["baseline"]["p99_ms"])  # type: ignore[arg-type]
        print(
            json.dumps(
                {
                    "blocks_per_s_offered": a.blocks_per_s,
                    "p99_rise_ms": round(rise, 3),
                    "p99_rise_over_unsubscribed_ms": round(
                        float(phases["flood"]["p99_ms"]) - float(phases["unsubscribed"]["p99_ms"]),
                        3,  # type: ignore[arg-type]
                    ),
                    "p50_rise_ms": round(
                        float(phases["flood"]["p50_ms"]) - float(phases["baseline"]["p50_ms"]), 3
                    ),  # type: ignore[arg-type]
                    "within_bound": float(phases["flood"]["index_blocks_max"]) <= a.kv_index_blocks,  # type: ignore[arg-type]
                    "streams_lost": picker_metric(metrics, "controlplane_picker_kv_streams_lost_total"),
                    "batches_refused_or_gaps": picker_metric(metrics, "controlplane_picker_kv_replays_total"),
                    "median_pick_ms": statistics.median([float(v["p50_ms"]) for v in phases.values()]),  # type: ignore[arg-type]
                }
            )
        )
        return round(rise, 3)
    finally:
        stack.stop()


if __name__ == "__main__":
    raise SystemExit(main())
