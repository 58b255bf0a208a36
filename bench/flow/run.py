"""Flow control (issue 44, docs/flow-control.md) against the same fleet without it, in one run.

An emulated fleet of two speeds (`--per-class` fast servers at speed 1.0 and as many at
`--slow-speed`, `--slots` slots each; prompts of `--prompt-words` tokens at
`--prefill-ms` a token, so a request's time to first token is mostly its own prefill),
behind `--proxies` real Envoys and one picker. Two arms, each on a fresh stack: `off`
(`balancing: picker`, no flow control) and `on` (the same with `flow_control`). Phases, each
arm:

- `alone`: the light tenant alone, at 1/11 of 150% of the fleet's capacity;
- `tenants`: the light tenant and a heavy one sending 10x its requests, together 150% of
  the capacity, for `--tenants-seconds` (3 minutes by default);
- `classes`: premium at 30% and standard at 120% of the capacity: premium's TTFT p99
  against the tier's target (`slo.ttft`), and whether any premium request was shed while
  standard ones waited;
- `below`: standard at 70% of the capacity: p50 and p99 against the other arm's.

With flow control on, then: `kill` and `stop`: the servers held by long requests, 200
requests queued in the picker, and the picker SIGKILLed (or SIGSTOPped): how each of the
200 ended and how long the longest took, against its class's longest wait.

Capacity is computed from the servers' speeds, slots and the requests' mean service time.
Everything on loopback; every process is stopped, on failure too.

    .venv/bin/python bench/flow/run.py                       # about 20 minutes on 2 cores
    .venv/bin/python bench/flow/run.py --tenants-seconds 60 --seconds 30 --arms on
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent / "lb_quality"))
sys.path.insert(0, str(REPO))

from loadgen import mean_output_tokens  # noqa: E402
from real import Stack, picker_metric, proxy_stat, start_pickers, start_proxied, start_servers  # noqa: E402

from bench.ports import free_port  # noqa: E402

MODEL = "bench-8b"
MAX_WAIT = {"premium": 5.0, "standard": 10.0, "batch": 20.0}
TTFT_TARGET_S = 4.0  # the tier's slo.ttft


def fleet_yaml(listener: int, picker: int, classes: list[tuple[str, float, int, int]], flow: bool) -> str:
    waits = ", ".join(f"{c}: {s:g}s" for c, s in MAX_WAIT.items())
    lines = [
        f"listener: {{port: {listener}}}",
        "signals: {interval: 500ms, timeout: 400ms}",
        f"picker: {{endpoints: ['127.0.0.1:{picker}'], timeout: 50ms}}",
        "priority_classes: {premium: {routing_priority: high}, standard: {}, batch: {}}",
        "default_priority_class: standard",
        # The tenants named (the picker's metrics label them); no rate-limit service runs here:
        # every Envoy serves without a decision, as docs/quotas.md says (fail open).
        f"quotas: {{key: {{header: x-api-key}}, service: {{endpoints: ['127.0.0.1:{free_port()}']}}, "
        "tenants: {light: {}, heavy: {}}}",
        "tiers:",
        "  small:",
        "    max_params_b: 15",
        "    timeout: 300s",
        "    balancing: picker",
        f"    slo: {{ttft: {TTFT_TARGET_S:g}s}}",
        *([f"    flow_control: {{max_wait: {{{waits}}}, max_requests: 1000}}"] if flow else []),
        "gpu_classes:",
        *(f"  {gpu}: {{capacity: {speed}}}" for gpu, speed, _, _ in classes),
        "models:",
        f"  {MODEL}:",
        "    params_b: 8",
        "    stable: v1",
        "    versions:",
        "      v1:",
        "        endpoints:",
        *(
            f"          - {{address: 127.0.0.1:{port}, gpu: {gpu}}}"
            for gpu, _, base, count in classes
            for port in range(base, base + count)
        ),
    ]
    return "\n".join(lines) + "\n"


def capacity(args: argparse.Namespace) -> float:
    """Requests/s the fleet completes with every slot busy."""
    service = (
        args.prompt_words * args.prefill_ms + mean_output_tokens(24.0, 0.9, 1, 400) * args.decode_ms
    ) / 1000
    slots = args.per_class * args.slots * (1.0 + args.slow_speed)
    return slots / service


def load(
    args: argparse.Namespace, listener: int, seconds: float, streams: list[str], seed: int
) -> dict[str, dict]:  # type: ignore[type-arg]
    cmd = [sys.executable, str(HERE / "load.py"), "--target", f"127.0.0.1:{listener}", "--model", MODEL]
    cmd += ["--duration", str(seconds), "--warmup", str(args.warmup), "--seed", str(seed)]
    cmd += ["--prompt-words", str(args.prompt_words)]
    for s in streams:
        cmd += ["--stream", s]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def settle(stack: Stack, picker_metrics: int, servers: list[str]) -> None:
    """Until nothing waits in the picker and every server is idle (a phase's leftovers gone)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        waiting = picker_metric(picker_metrics, "controlplane_picker_flow_waiting")
        busy = 0.0
        for s in servers:
            try:
                with urllib.request.urlopen(f"http://{s}/metrics", timeout=2) as r:
                    for line in r.read().decode().splitlines():
                        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
                            busy += float(line.rsplit(" ", 1)[1])
            except OSError:
                pass
        if waiting == 0 and busy == 0:
            return
        time.sleep(0.5)
    raise RuntimeError("the fleet did not settle")


def arm(args: argparse.Namespace, flow: bool) -> dict[str, object]:
    work = Path(tempfile.mkdtemp(prefix=f"bench-flow-{'on' if flow else 'off'}-"))
    stack = Stack(work)
    cap = capacity(args)
    out: dict[str, object] = {"capacity_rps": round(cap, 2)}
    try:
        classes = start_servers(stack, args)
        servers = [f"127.0.0.1:{p}" for _, _, base, count in classes for p in range(base, base + count)]
        listener, picker, xds, admin = free_port(), free_port(), free_port(), free_port()
        config = work / "fleet.yaml"
        config.write_text(fleet_yaml(listener, picker, classes, flow))
        serve = ["--admin-listen", f"127.0.0.1:{admin}"]
        start_proxied(stack, work, config, listener, "bench-flow", serve, proxies=args.proxies, xds=xds)
        (metrics,) = start_pickers(stack, work, [picker], xds, admin)
        time.sleep(2.0)  # every server seen ready by the control plane
        light = 1.5 * cap / 11
        phases = {
            "alone": (args.seconds, [f"light:light:standard:{light:.3f}"]),
            "tenants": (
                args.tenants_seconds,
                [f"light:light:standard:{light:.3f}", f"heavy:heavy:standard:{10 * light:.3f}"],
            ),
            "classes": (
                args.seconds,
                [f"premium:light:premium:{0.3 * cap:.3f}", f"standard:heavy:standard:{1.2 * cap:.3f}"],
            ),
            "below": (args.seconds, [f"standard:light:standard:{0.7 * cap:.3f}"]),
        }
        for i, (name, (seconds, streams)) in enumerate(phases.items()):
            if name not in args.phases:
                continue
            settle(stack, metrics, servers)
            shed0 = picker_metric(metrics, "controlplane_picker_flow_shed_total")
            result = load(args, listener, seconds, streams, args.seed + i)
            result["flow_shed"] = picker_metric(metrics, "controlplane_picker_flow_shed_total") - shed0  # type: ignore[assignment]
            out[name] = result
            print(json.dumps({"arm": "on" if flow else "off", "phase": name, **result}), flush=True)
        if flow:
            for act in ("kill", "stop"):
                if act not in args.phases:
                    continue
                settle(stack, metrics, servers)
                learn_slots(stack, args, listener, metrics, servers)
                out[act] = held_then(stack, args, listener, metrics, work, xds, admin, picker, act)
                print(json.dumps({"arm": "on", "phase": act, **out[act]}), flush=True)  # type: ignore[dict-item]
                if act == "kill":  # a picker again on the same port, for the next phase
                    (metrics,) = start_pickers(stack, work, [picker], xds, admin)
                    time.sleep(1.0)
        out["fell_back"] = sum(
            proxy_stat(port, "ext_proc.picker.failure_mode_allowed") for port in stack.envoy_admins
        )
        return out
    finally:
        stack.stop()


def held_then(
    stack: Stack,
    args: argparse.Namespace,
    listener: int,
    metrics: int,
    work: Path,
    xds: int,
    admin: int,
    picker: int,
    act: str,
) -> dict[str, object]:
    """Every slot held by a long request, 200 standard requests queued in the picker, then
    the picker killed (SIGKILL) or hung (SIGSTOP, resumed at the end): how the 200 ended."""
    import http.client

    results: list[tuple[int | str, float, float]] = []  # status, headers at, done at (monotonic)
    lock = threading.Lock()

    def send(tokens: int, record: bool) -> None:
        body = json.dumps({"model": MODEL, "prompt": "hold " * 8, "max_tokens": tokens, "stream": record})
        conn = http.client.HTTPConnection("127.0.0.1", listener, timeout=300)
        headers_at = float("nan")
        try:
            conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
            r = conn.getresponse()  # a stream's headers: the request reached a server
            headers_at = time.monotonic()
            r.read()
            status: int | str = r.status
        except Exception as e:
            status = type(e).__name__
        finally:
            conn.close()
        if record:
            with lock:
                results.append((status, headers_at, time.monotonic()))

    slots = 2 * args.per_class * args.slots
    threads = [threading.Thread(target=send, args=(400, False), daemon=True) for _ in range(slots)]
    for t in threads:  # spread, as the 200 below: each picked (a burst would outrun picker.timeout)
        t.start()
        time.sleep(0.02)
    time.sleep(3.0)  # every slot taken (the picker sees them in flight)
    queued = [threading.Thread(target=send, args=(4, True), daemon=True) for _ in range(200)]
    for t in queued:  # 100 a second: a burst of 200 at once outruns picker.timeout (fail open)
        t.start()
        time.sleep(0.01)
    deadline = time.monotonic() + 60
    while picker_metric(metrics, "controlplane_picker_flow_waiting") < 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    waiting = picker_metric(metrics, "controlplane_picker_flow_waiting")
    proc = next(p for p in stack.procs if "picker" in " ".join(map(str, p.args)) and p.poll() is None)
    at = time.monotonic()
    if act == "kill":
        proc.kill()
        proc.wait()
        stack.procs.remove(proc)  # gone for good: a new one is started on its port
    else:
        os.kill(proc.pid, signal.SIGSTOP)
    try:
        for t in queued:
            t.join(300)
    finally:
        if act == "stop":
            os.kill(proc.pid, signal.SIGCONT)
    statuses: dict[str, int] = {}
    for status, _, _ in results:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    released = [h - at for _, h, _ in results if h == h]
    return {
        "queued_when_signalled": waiting,
        "statuses": statuses,
        # from the signal to the request reaching a server (its stream's headers): the most
        "released_after_max_s": round(max(released, default=float("nan")), 2),
        "served_after_max_s": round(max(d - at for _, _, d in results), 2),
        "max_wait_s": MAX_WAIT["standard"],
    }


def learn_slots(
    stack: Stack, args: argparse.Namespace, listener: int, metrics: int, servers: list[str]
) -> None:
    """Until the picker knows every server's slots (it learns them from a page that shows
    requests waiting): bursts of twice the fleet's slots in short requests."""
    import http.client

    def one() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", listener, timeout=120)
        try:
            body = json.dumps({"model": MODEL, "prompt": "learn " * 8, "max_tokens": 50})
            conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
            conn.getresponse().read()
        finally:
            conn.close()

    deadline = time.monotonic() + 120
    while picker_metric(metrics, "controlplane_picker_server_slots") < len(servers) * args.slots:
        if time.monotonic() > deadline:
            raise RuntimeError("the picker did not learn the servers' slots")
        burst = [threading.Thread(target=one, daemon=True) for _ in range(2 * len(servers) * args.slots)]
        for t in burst:
            t.start()
        for t in burst:
            t.join(120)
        settle(stack, metrics, servers)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default="off,on", help="off, on, or both (default)")
    p.add_argument(
        "--seconds", type=float, default=60.0, help="each phase but tenants (default: %(default)s)"
    )
    p.add_argument("--tenants-seconds", type=float, default=180.0, help="the two tenants' phase")
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--per-class", type=int, default=4, help="servers of each speed")
    p.add_argument("--slow-speed", type=float, default=0.5)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--prompt-words", type=int, default=1000)
    p.add_argument("--prefill-ms", type=float, default=1.0, help="per prompt token at speed 1")
    p.add_argument("--decode-ms", type=float, default=20.0, help="per output token at speed 1")
    p.add_argument("--proxies", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--phases",
        default="alone,tenants,classes,below,kill,stop",
        help="the phases to run (default: every one; kill and stop with flow control on only)",
    )
    args = p.parse_args(argv)
    args.servers = "emulated"
    print(f"capacity {capacity(args):.2f} requests/s; {args.proxies} Envoys, one picker", flush=True)
    results = {name: arm(args, name == "on") for name in args.arms.split(",")}
    print(json.dumps(results), flush=True)
    report(results)
    return 0


def report(results: dict[str, dict]) -> None:  # type: ignore[type-arg]
    def get(a: str, phase: str, stream: str, key: str) -> float:
        try:
            return float(results[a][phase][stream][key])
        except (KeyError, TypeError, ValueError):
            return float("nan")

    print("\n| figure | off | on | target |\n|---|---|---|---|")
    for a_phase, stream, key, target in (
        ("alone", "light", "ttft_p90", ""),
        ("tenants", "light", "ttft_p90", "at most 1.5x alone"),
        ("tenants", "heavy", "ttft_p90", ""),
        ("classes", "premium", "ttft_p99", f"at most {TTFT_TARGET_S:g} s"),
        ("classes", "standard", "ttft_p99", ""),
        ("below", "standard", "ttft_p50", "within the picker's hop"),
        ("below", "standard", "ttft_p99", "within the picker's hop"),
    ):
        row = [f"{get(a, a_phase, stream, key):.3f}" for a in ("off", "on")]
        print(f"| {a_phase} {stream} {key} | {row[0]} | {row[1]} | {target} |")
    for a in ("off", "on"):
        for phase in ("alone", "tenants"):
            alone, together = get(a, "alone", "light", "ttft_p90"), get(a, phase, "light", "ttft_p90")
            if phase == "tenants":
                print(f"{a}: the light tenant's TTFT p90 together / alone = {together / alone:.2f}x")
        premium = results.get(a, {}).get("classes", {}).get("premium", {})
        print(f"{a}: premium statuses {premium.get('statuses')}")


if __name__ == "__main__":
    raise SystemExit(main())
