"""Load-balancing quality through the real stack: Envoy, the control plane, emulated GPU servers.

For each policy (default: round_robin, least_request, adaptive) this starts, on loopback:
emulated servers of two GPU classes (`controlplane emulate`, one process per class), the
control plane on a fleet file naming the policy, one real Envoy, and an open-loop Poisson
load generator in its own process (`loadgen.py`). After a warm-up it measures latency
percentiles and errors, then stops everything. All policies run in the same invocation
against the same fleet and the same seeded arrivals, so the ratio is what matters.

    .venv/bin/python bench/lb_quality/real.py                  # ~3.5 min
    .venv/bin/python bench/lb_quality/real.py --load 0.7 --duration 60
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(HERE))

from loadgen import mean_output_tokens  # noqa: E402

PROMPT_TOKENS = 32  # the load generator's prompt: "bench " x 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> int:
    """A base port with n consecutive free ports after it (for `emulate --count`)."""
    for _ in range(200):
        base = free_port()
        if base + n >= 65535:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


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

    def spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = (self.workdir / f"{name}.log").open("ab")
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def stop(self) -> None:
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
    stack: Stack, workdir: Path, config: Path, listener: int, node_id: str, serve_args: Sequence[str] = ()
) -> int:
    """Start `controlplane serve` on `config` (free ports, its state in workdir) and one real
    Envoy bootstrapped from it; return once Envoy serves `listener`. Returns the control
    plane's status (metrics) port."""
    xds, metrics, envoy_admin = free_port(), free_port(), free_port()
    serve = [str(BIN / "controlplane"), "serve", "--config", str(config), "--xds-listen", f"127.0.0.1:{xds}"]
    serve += ["--metrics-listen", f"127.0.0.1:{metrics}", "--state-dir", str(workdir / "state"), *serve_args]
    stack.spawn("controlplane", serve)
    wait_http(f"http://127.0.0.1:{metrics}/healthz", 30, "the control plane", stack.procs)
    boot = [str(BIN / "controlplane"), "bootstrap", "--node-id", node_id, "--xds", f"127.0.0.1:{xds}"]
    bootstrap = workdir / "envoy.yaml"
    bootstrap.write_text(
        subprocess.run(
            [*boot, "--admin-port", str(envoy_admin)], check=True, capture_output=True, text=True
        ).stdout
    )
    envoy = shutil.which("envoy", path=str(BIN)) or "envoy"
    stack.spawn(
        "envoy", [envoy, "-c", str(bootstrap), "--disable-hot-restart", "-l", "warning", "--concurrency", "1"]
    )
    wait_http(f"http://127.0.0.1:{listener}/v1/models", 30, "envoy", stack.procs)
    return metrics


def fleet_yaml(policy: str, listener: int, classes: list[tuple[str, float, int, int]]) -> str:
    lines = [
        f"listener: {{port: {listener}}}",
        "tiers:",
        f"  small: {{max_params_b: 15, timeout: 300s, balancing: {policy}}}",
        "gpu_classes:",
    ]
    for gpu, speed, _, _ in classes:
        lines.append(f"  {gpu}: {{capacity: {speed}}}")
    lines += ["models:", "  bench-8b:", "    params_b: 8", "    stable: v1", "    versions:", "      v1:"]
    lines.append("        endpoints:")
    for gpu, _, base, count in classes:
        for port in range(base, base + count):
            lines.append(f"          - {{address: 127.0.0.1:{port}, gpu: {gpu}}}")
    return "\n".join(lines) + "\n"


def run_policy(policy: str, args: argparse.Namespace, rate: float) -> dict[str, object]:
    workdir = Path(tempfile.mkdtemp(prefix=f"lbq-{policy}-"))
    stack = Stack(workdir)
    try:
        classes: list[tuple[str, float, int, int]] = []
        for gpu, speed in (("fast", 1.0), ("slow", args.slow_speed)):
            base = free_ports(args.per_class)
            classes.append((gpu, speed, base, args.per_class))
            stack.spawn(
                f"emulate-{gpu}",
                [
                    str(BIN / "controlplane"),
                    "emulate",
                    "--listen",
                    f"127.0.0.1:{base}",
                    "--model",
                    "bench-8b",
                    "--gpu",
                    gpu,
                    "--speed",
                    str(speed),
                    "--slots",
                    str(args.slots),
                    "--count",
                    str(args.per_class),
                    "--decode-ms-per-token",
                    str(args.decode_ms),
                    "--prefill-ms-per-token",
                    str(args.prefill_ms),
                ],
            )
        for _, _, base, count in classes:
            for port in range(base, base + count):
                wait_http(f"http://127.0.0.1:{port}/health", 20, "emulated servers", stack.procs)
        listener, xds, metrics, admin = free_port(), free_port(), free_port(), free_port()
        config = workdir / "fleet.yaml"
        config.write_text(fleet_yaml(policy, listener, classes))
        stack.spawn(
            "controlplane",
            [
                str(BIN / "controlplane"),
                "serve",
                "--config",
                str(config),
                "--xds-listen",
                f"127.0.0.1:{xds}",
                "--metrics-listen",
                f"127.0.0.1:{metrics}",
            ],
        )
        wait_http(f"http://127.0.0.1:{metrics}/healthz", 20, "the control plane", stack.procs)
        bootstrap = workdir / "envoy.yaml"
        bootstrap.write_text(
            subprocess.run(
                [
                    str(BIN / "controlplane"),
                    "bootstrap",
                    "--node-id",
                    f"bench-{policy}",
                    "--xds",
                    f"127.0.0.1:{xds}",
                    "--admin-port",
                    str(admin),
                ],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        )
        envoy = shutil.which("envoy", path=str(BIN)) or "envoy"
        stack.spawn(
            "envoy",
            [envoy, "-c", str(bootstrap), "--disable-hot-restart", "-l", "warning", "--concurrency", "1"],
        )
        wait_http(f"http://127.0.0.1:{listener}/v1/models", 20, "envoy", stack.procs)
        out = subprocess.run(
            [
                sys.executable,
                str(HERE / "loadgen.py"),
                "--target",
                f"127.0.0.1:{listener}",
                "--model",
                "bench-8b",
                "--rate",
                f"{rate:.3f}",
                "--duration",
                str(args.duration),
                "--warmup",
                str(args.warmup),
                "--seed",
                str(args.seed),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
        result["workdir"] = str(workdir)
        return result
    finally:
        stack.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--policies",
        default="round_robin,least_request,adaptive",
        help="comma-separated, first is the baseline (default: %(default)s)",
    )
    p.add_argument("--load", type=float, default=0.85, help="offered load as a share of fleet capacity")
    p.add_argument("--duration", type=float, default=45.0, help="measured seconds per policy")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds of load before measuring")
    p.add_argument("--per-class", type=int, default=3, help="servers per GPU class (two classes)")
    p.add_argument("--slow-speed", type=float, default=0.35, help="speed of the slow class (fast: 1.0)")
    p.add_argument("--slots", type=int, default=4, help="concurrent sequences per server")
    p.add_argument("--decode-ms", type=float, default=10.0, help="decode ms per output token at speed 1")
    p.add_argument("--prefill-ms", type=float, default=0.5, help="prefill ms per prompt token at speed 1")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keep", action="store_true", help="keep each run's logs and fleet file")
    args = p.parse_args(argv)

    mean_tokens = mean_output_tokens(24.0, 0.9, 1, 400)
    service_s = (PROMPT_TOKENS * args.prefill_ms + mean_tokens * args.decode_ms) / 1000.0
    capacity = args.per_class * args.slots * (1.0 + args.slow_speed) / service_s
    rate = args.load * capacity
    print(
        f"fleet: {args.per_class} x speed 1.0 + {args.per_class} x speed {args.slow_speed}, "
        f"{args.slots} slots each; mean service {service_s * 1000:.0f} ms at speed 1; "
        f"capacity {capacity:.1f} req/s; offered {rate:.1f} req/s ({args.load:.0%})",
        flush=True,
    )
    results: dict[str, dict[str, object]] = {}
    for policy in args.policies.split(","):
        print(f"running {policy} ({args.warmup:g} s warm-up + {args.duration:g} s) ...", flush=True)
        results[policy] = run_policy(policy, args, rate)
    base = args.policies.split(",")[0]
    print()
    print("| policy | requests | errors | p50 s | p90 s | p99 s | p90 vs " + base + " |")
    print("|---|---|---|---|---|---|---|")
    for policy, r in results.items():
        ratio = float(r["p90"]) / float(results[base]["p90"])  # type: ignore[arg-type]
        print(
            f"| {policy} | {r['requests']} | {r['errors']} | {float(r['p50']):.2f} | "  # type: ignore[arg-type]
            f"{float(r['p90']):.2f} | {float(r['p99']):.2f} | {ratio:.2f}x |"  # type: ignore[arg-type]
        )
    for policy, r in results.items():
        print(f"{policy}: requests by server {dict(sorted(r['by_backend'].items()))}")  # type: ignore[attr-defined]
        if r["errors"]:
            print(f"{policy}: statuses {r['statuses']} samples {r['error_samples']}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
