"""A churn rig: one real Envoy, the control plane, echo backends and steady load, while the fleet
file, the control-plane process and the xDS connection are changed under it.

Pieces, usable alone:

- `SteadyLoad`: paced requests (about 30 per second in all) to a set of models through Envoy's
  listener; every outcome recorded; a failure is a non-200, a connection error, or an answer
  from a backend of another model.
- `Relay`: a TCP forwarder between Envoy and the control plane's xDS port; `cut()` drops every
  connection, so Envoy reconnects to the same control-plane process.
- `FleetSpec` / `ModelSpec`: the fleet file as plain data, rendered to YAML.
- `ChurnRig`: the processes, edit primitives (replace a version, add/remove a model, cluster-level
  edits, a NACKed override, kill -9 and restart, cut the xDS connection), the convergence check.
- `run_churn`: seeded random edits on a started rig; returns a `ChurnResult` with a report.

Every address is on 127.0.0.1 and every port is free; `ChurnRig.close()` stops everything.
"""

from __future__ import annotations

import contextlib
import json
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import yaml

from controlplane.sim.backend import EchoBackend
from tests.integration.harness import Client, ControlPlane, Envoy, free_port, http_get, wait_until

BAD_OVERRIDE: dict[str, Any] = {"connect_timeout": "-1s"}  # schema-valid, rejected by Envoy


# ---------------------------------------------------------------------------------------------
# Load


@dataclass(frozen=True)
class Outcome:
    """One request: when it was sent (monotonic), to which model, and what came back."""

    t: float
    model: str
    status: int  # 0: no HTTP answer (connection error)
    backend: str
    detail: str
    failed: bool


class SteadyLoad:
    """`threads` keep-alive clients sending `rate` requests per second in all to `models`
    (round robin over the models, alternately by x-model header and by JSON body).

    `owner` maps a backend name to its model: an answer from another model's backend is a
    failure too (a misroute)."""

    def __init__(
        self,
        port: int,
        models: Sequence[str],
        owner: Callable[[str], str | None],
        rate: float = 30.0,
        threads: int = 3,
    ) -> None:
        self.port = port
        self.models = list(models)
        self.owner = owner
        self.interval = threads / rate
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True, name=f"load-{i}")
            for i in range(threads)
        ]

    def _run(self, index: int) -> None:
        client = Client(self.port)
        i = index
        due = time.monotonic() + index * self.interval / len(self._threads)
        while not self._stop.is_set():
            now = time.monotonic()
            if due > now:
                time.sleep(due - now)
            due = max(due + self.interval, time.monotonic() - self.interval)  # no bursts to catch up
            with self._lock:
                models = list(self.models)
            if not models:
                continue
            model = models[i % len(models)]
            i += 1
            sent = time.monotonic()
            try:
                reply = client.post(header=model) if i % 2 else client.post(model)
            except Exception as e:
                outcome = Outcome(sent, model, 0, "", f"connection error: {e!r}", True)
            else:
                owner = self.owner(reply.backend)
                if reply.status != 200:
                    detail = f"{reply.status} {reply.body[:200]}"
                elif owner != model:
                    detail = f"misrouted to backend {reply.backend!r} (of model {owner!r})"
                else:
                    detail = ""
                outcome = Outcome(sent, model, reply.status, reply.backend, detail, bool(detail))
            with self._lock:
                self.outcomes.append(outcome)
        client.close()

    def set_models(self, models: Iterable[str]) -> None:
        with self._lock:
            self.models = list(models)

    def snapshot(self) -> list[Outcome]:
        with self._lock:
            return list(self.outcomes)

    def failures(self, since: float = 0.0) -> list[Outcome]:
        return [o for o in self.snapshot() if o.failed and o.t >= since]

    def total(self) -> int:
        with self._lock:
            return len(self.outcomes)

    def backends_since(self, since: float, model: str | None = None) -> Counter[str]:
        return Counter(
            o.backend
            for o in self.snapshot()
            if o.t >= since and not o.failed and (model is None or o.model == model)
        )

    def first_from(self, backends: Iterable[str], since: float, model: str | None = None) -> float | None:
        """When a request sent at or after `since` was first answered by one of `backends`."""
        wanted = set(backends)
        return next(
            (
                o.t
                for o in self.snapshot()
                if o.t >= since and o.backend in wanted and (model is None or o.model == model)
            ),
            None,
        )

    def last(self, n: int, model: str | None = None) -> list[Outcome]:
        return [o for o in self.snapshot() if model is None or o.model == model][-n:]

    def start(self) -> SteadyLoad:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            if t.is_alive():
                t.join(15)


# ---------------------------------------------------------------------------------------------
# xDS relay


class Relay:
    """A TCP forwarder on a free loopback port to `upstream` (host:port), one thread per
    direction. While the upstream is down, an accepted connection is closed at once."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self._listen = socket.socket()
        self._listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listen.bind(("127.0.0.1", 0))
        self._listen.listen(64)
        self._listen.settimeout(0.2)
        self.port = int(self._listen.getsockname()[1])
        self.accepted = 0
        self.cuts = 0
        self._pairs: set[tuple[socket.socket, socket.socket]] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True, name="xds-relay")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Relay:
        self._thread.start()
        return self

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                down, _ = self._listen.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            down.settimeout(None)
            try:
                up = socket.create_connection(self.upstream, timeout=1.0)
            except OSError:
                down.close()
                continue
            up.settimeout(None)
            for s in (down, up):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = (down, up)
            with self._lock:
                self._pairs.add(pair)
                self.accepted += 1
            threading.Thread(target=self._pump, args=(down, up, pair), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, pair), daemon=True).start()

    def _pump(
        self, src: socket.socket, dst: socket.socket, pair: tuple[socket.socket, socket.socket]
    ) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        self._close(pair)

    def _close(self, pair: tuple[socket.socket, socket.socket]) -> None:
        with self._lock:
            self._pairs.discard(pair)
        for s in pair:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()

    def live(self) -> int:
        with self._lock:
            return len(self._pairs)

    def cut(self) -> int:
        """Drop every relayed connection (both sides); return how many there were."""
        with self._lock:
            pairs = list(self._pairs)
            self.cuts += 1
        for pair in pairs:
            self._close(pair)
        return len(pairs)

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listen.close()
        self.cut()
        if self._thread.is_alive():
            self._thread.join(2)


# ---------------------------------------------------------------------------------------------
# The fleet file as data


@dataclass
class ModelSpec:
    """One model of the fleet file: its versions (version -> backend names) and any other keys
    (traffic policy, affinity, cluster_overrides) as they go into the YAML."""

    name: str
    params_b: float
    stable: str
    versions: dict[str, list[str]]
    keys: dict[str, Any] = field(default_factory=dict)

    def clusters(self) -> set[str]:
        return {f"{self.name}@{v}" for v in self.versions}


@dataclass
class FleetSpec:
    listener_port: int
    models: dict[str, ModelSpec] = field(default_factory=dict)
    tiers: dict[str, dict[str, Any]] = field(
        default_factory=lambda: {
            "small": {"max_params_b": 15, "timeout": "30s"},
            "large": {"timeout": "120s"},
        }
    )
    signals: dict[str, Any] | None = None

    def render(self, address: Callable[[str], str]) -> str:
        """The YAML text; `address` maps a backend name to its host:port."""
        doc: dict[str, Any] = {"listener": {"port": self.listener_port}, "tiers": self.tiers}
        if self.signals is not None:
            doc["signals"] = self.signals
        doc["models"] = {
            m.name: {
                "params_b": m.params_b,
                "stable": m.stable,
                **m.keys,
                "versions": {
                    v: {"endpoints": [address(b) for b in backends]} for v, backends in m.versions.items()
                },
            }
            for m in self.models.values()
        }
        return yaml.safe_dump(json.loads(json.dumps(doc)), sort_keys=False)

    def clusters(self) -> set[str]:
        return {c for m in self.models.values() for c in m.clusters()}


# ---------------------------------------------------------------------------------------------
# The rig


@dataclass
class Edit:
    """One change made to the running system, for the report."""

    index: int
    t: float  # monotonic, when it took effect on our side (file written, process killed, ...)
    kind: str
    detail: str
    model: str = ""  # replace: the model, and the old and new backends
    old_backends: frozenset[str] = frozenset()
    new_backends: frozenset[str] = frozenset()


class ChurnRig:
    """Echo backends, the control plane, an optional xDS relay and one real Envoy on loopback.

    The fleet is `self.fleet` (a FleetSpec); mutate it with the primitives below, then `write()`.
    Backends of removed versions keep running until close(), so a failure is always the
    proxy's config, never a dead server."""

    def __init__(self, tmp: Path, *, delta: bool, relay: bool = True, node_id: str = "envoy-1") -> None:
        self.tmp = tmp
        self.delta = delta
        self.use_relay = relay
        self.node_id = node_id
        self.fleet = FleetSpec(listener_port=free_port())
        self.backends: dict[str, EchoBackend] = {}
        self.backend_model: dict[str, str] = {}
        self.cp: ControlPlane | None = None
        self.envoy: Envoy | None = None
        self.relay: Relay | None = None
        self.load: SteadyLoad | None = None
        self.edits: list[Edit] = []
        self.started_at = time.monotonic()
        self._seq = 0

    # -- setup and teardown

    @property
    def config(self) -> Path:
        return self.tmp / "fleet.yaml"

    def backend(self, name: str, model: str) -> str:
        """Start backend `name` (of `model`) if it is not running; return its name."""
        if name not in self.backends:
            b = EchoBackend(name, model).start()
            self.backends[name] = b
            self.backend_model[name] = model
        return name

    def new_backends(self, model: str, version: str, n: int) -> list[str]:
        return [self.backend(f"{model}-{version}-{i}", model) for i in range(n)]

    def add_model(
        self, name: str, params_b: float = 8, backends: int = 2, version: str = "v1", **keys: Any
    ) -> ModelSpec:
        spec = ModelSpec(name, params_b, version, {version: self.new_backends(name, version, backends)}, keys)
        self.fleet.models[name] = spec
        return spec

    def write(self) -> float:
        """Write the fleet file atomically (as a ConfigMap update is); return the monotonic time."""
        text = self.fleet.render(lambda b: self.backends[b].address)
        tmp = self.config.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(self.config)
        return time.monotonic()

    def start(self, load_models: Sequence[str] = (), rate: float = 30.0) -> ChurnRig:
        """Write the fleet, start the control plane, the relay, Envoy and (if models are given)
        the steady load; wait until every model in `load_models` answers."""
        self.write()
        # Assigned before start(), so that close() stops a process whose start timed out.
        self.cp = ControlPlane(self.config, self.tmp)
        self.cp.start()
        xds = self.cp.xds
        if self.use_relay:
            self.relay = Relay(self.cp.xds).start()
            xds = self.relay.address
        self.envoy = Envoy(self.node_id, xds, self.tmp, self.fleet.listener_port, delta=self.delta)
        self.envoy.start()
        for m in load_models:
            wait_until(lambda m=m: self.probe(m)[0] == 200, 10, f"model {m} to answer")  # type: ignore[misc]
        if load_models:
            self.load = SteadyLoad(
                self.fleet.listener_port, load_models, self.backend_model.get, rate=rate
            ).start()
            wait_until(lambda: self.load is not None and self.load.total() >= 20, 10, "load to flow")
        self.started_at = time.monotonic()
        return self

    def close(self) -> None:
        if self.load is not None:
            self.load.stop()
        for p in (self.envoy, self.cp):
            if p is not None:
                with contextlib.suppress(Exception):
                    p.stop()
        if self.relay is not None:
            self.relay.close()
        for b in self.backends.values():
            with contextlib.suppress(Exception):
                b.stop()

    def __enter__(self) -> ChurnRig:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- observation

    def probe(self, model: str) -> tuple[int, str]:
        """One request by header on a fresh connection: (status, backend name)."""
        c = Client(self.fleet.listener_port)
        try:
            r = c.post(header=model)
            return r.status, r.backend
        finally:
            c.close()

    def envoy_clusters(self) -> dict[str, set[str]]:
        """Envoy's dynamic clusters (names with '@') and their endpoints, from admin /clusters."""
        assert self.envoy is not None
        _, text = http_get(f"http://127.0.0.1:{self.envoy.admin_port}/clusters")
        out: dict[str, set[str]] = {}
        for line in text.splitlines():
            parts = line.split("::")
            if "@" not in parts[0]:
                continue
            hosts = out.setdefault(parts[0], set())
            if len(parts) == 4 and parts[2] == "weight":
                hosts.add(parts[1])
        return out

    def envoy_failure_counters(self) -> list[str]:
        """Envoy's non-zero counters that say why a request failed locally: no route, no
        cluster (a route naming a cluster it does not have), no healthy host, overflow."""
        assert self.envoy is not None
        try:
            _, text = http_get(
                f"http://127.0.0.1:{self.envoy.admin_port}/stats?filter={quote(FAILURE_STATS)}"
            )
        except OSError as e:
            return [f"admin /stats unreachable: {e}"]
        out = []
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if value.strip() not in ("", "0"):
                out.append(f"{name}={value.strip()}")
        return out or ["none"]

    def proxy_types(self) -> dict[str, dict[str, Any]]:
        """The control plane's /debug/proxies entry per type for our node ({} if not there)."""
        assert self.cp is not None
        for p in self.cp.proxies():
            if p["node_id"] == self.node_id:
                return dict(p["types"])
        return {}

    def proxy_status(self) -> dict[str, str]:
        """The control plane's /debug/proxies statuses per type for our node ({} if not there)."""
        return {t: str(v["status"]) for t, v in self.proxy_types().items()}

    def divergence(self) -> list[str]:
        """What differs between the fleet file and what Envoy has and does (empty: converged)."""
        problems: list[str] = []
        want = {
            f"{m.name}@{v}": {self.backends[b].address for b in backends}
            for m in self.fleet.models.values()
            for v, backends in m.versions.items()
        }
        try:
            have = self.envoy_clusters()
        except Exception as e:
            return [f"envoy admin: {e!r}"]
        if set(have) != set(want):
            problems.append(
                f"clusters: missing {sorted(set(want) - set(have))}, extra {sorted(set(have) - set(want))}"
            )
        for name in sorted(set(want) & set(have)):
            if have[name] != want[name]:
                problems.append(
                    f"{name} endpoints: want {sorted(want[name])}, envoy has {sorted(have[name])}"
                )
        for m in self.fleet.models.values():
            try:
                status, backend = self.probe(m.name)
            except Exception as e:
                problems.append(f"{m.name}: probe failed {e!r}")
                continue
            if status != 200 or backend not in m.versions[m.stable]:
                problems.append(
                    f"{m.name}: answered {status} from {backend!r}, want one of stable {m.stable}"
                )
        try:
            types = self.proxy_types()
        except Exception as e:
            problems.append(f"/debug/proxies: {e!r}")
        else:
            if not types or any(v["status"] != "SYNCED" for v in types.values()):
                problems.append(f"proxy status { {t: v['status'] for t, v in types.items()} or 'missing' }")
                for t, v in types.items():
                    if v["status"] != "SYNCED":
                        problems.append(f"  {t}: {json.dumps(v)[:400]}")
        return problems

    def wait_converged(self, timeout: float = 20.0) -> float:
        """Wait until divergence() is empty; return the seconds it took, or fail with what differs."""
        start = time.monotonic()
        last: list[str] = []
        while time.monotonic() - start < timeout:
            last = self.divergence()
            if not last:
                return time.monotonic() - start
            time.sleep(0.2)
        raise AssertionError(f"not converged after {timeout}s:\n  " + "\n  ".join(last))

    # -- edits (each returns a description; write() makes it take effect)

    def record(self, kind: str, detail: str, t: float | None = None, **kw: Any) -> Edit:
        self._seq += 1
        edit = Edit(self._seq, t if t is not None else time.monotonic(), kind, detail, **kw)
        self.edits.append(edit)
        return edit

    def replace_version(self, model: str, backends: int = 2) -> tuple[str, Edit]:
        """Give `model` a new version with new backends as its only and stable version (the old
        version removed in the same edit); not written yet. Returns the description and an
        unrecorded Edit carrying the model and its old and new backends, for the report."""
        spec = self.fleet.models[model]
        old = spec.stable
        new = f"v{int(old.lstrip('v')) + 1}" if old.lstrip("v").isdigit() else f"{old}x"
        old_backends = frozenset(spec.versions[old])
        spec.versions = {new: self.new_backends(model, new, backends)}
        spec.stable = new
        detail = f"{model} {old}->{new} (old removed)"
        pending = Edit(0, 0.0, "replace", detail, model, old_backends, frozenset(spec.versions[new]))
        return detail, pending

    def switch_to(self, model: str, version: str, backends: list[str]) -> str:
        """Make `version` (with these backends) the model's only and stable version."""
        spec = self.fleet.models[model]
        old = spec.stable
        spec.versions = {version: [self.backend(b, model) for b in backends]}
        spec.stable = version
        return f"{model} {old}->{version} (old removed)"

    def kill_control_plane(self) -> float:
        assert self.cp is not None and self.cp.proc is not None
        self.cp.proc.kill()
        self.cp.stop()
        return time.monotonic()

    def start_control_plane(self) -> float:
        """Start the control plane again on the same ports and state dir; return when it listens."""
        assert self.cp is not None
        old = self.cp
        self.cp = ControlPlane(
            old.config,
            old.log_dir,
            xds_port=old.xds_port,
            metrics_port=old.metrics_port,
            admin_port=old.admin_port,
        )
        self.cp.start()
        return time.monotonic()

    def cut_xds(self) -> int:
        assert self.relay is not None, "the rig was built without the relay"
        return self.relay.cut()

    # -- reporting

    def since_edit(self, t: float) -> str:
        """'+1.23s after #5 replace p1 v2->v3' for a monotonic time."""
        before = [e for e in self.edits if e.t <= t]
        if not before:
            return f"{t - self.started_at:+.2f}s from start (before any edit)"
        e = before[-1]
        return f"+{t - e.t:.2f}s after #{e.index} {e.kind} {e.detail}"


# ---------------------------------------------------------------------------------------------
# Scrapes


class ScrapeStorm:
    """`n` concurrent scrapes of the control plane's status port (mostly /metrics, one in ten
    /debug/proxies), all released at once from their own threads; every failure recorded."""

    def __init__(self, metrics_port: int, n: int = 1000) -> None:
        self.port = metrics_port
        self.n = n
        self.failures: list[str] = []
        self.latencies: list[float] = []
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self.run, daemon=True, name="scrape-storm")

    def _one(self, i: int, go: threading.Barrier) -> None:
        path = "/debug/proxies" if i % 10 == 0 else "/metrics"
        go.wait()
        started = time.monotonic()
        try:
            status, body = http_get(f"http://127.0.0.1:{self.port}{path}", timeout=60)
            ok = status == 200 and (path != "/metrics" or "controlplane_xds_proxies_stale" in body)
            why = "" if ok else f"{path}: {status} {body[:80]}"
        except Exception as e:
            why = f"{path}: {e!r}"
        with self._lock:
            self.latencies.append(time.monotonic() - started)
            if why:
                self.failures.append(why)

    def run(self) -> None:
        go = threading.Barrier(self.n)
        threads = [threading.Thread(target=self._one, args=(i, go), daemon=True) for i in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)

    def summary(self) -> str:
        lat = sorted(self.latencies)
        if not lat:
            return "scrape storm: not run"
        return (
            f"scrape storm: {self.n} concurrent scrapes ({self.n // 10} of /debug/proxies), "
            f"{len(self.failures)} failed; latency p50 {lat[len(lat) // 2]:.2f}s, max {lat[-1]:.2f}s"
        )


# ---------------------------------------------------------------------------------------------
# The churn


# Envoy's counters of local failures (admin /stats regex).
FAILURE_STATS = (
    r"(no_route|no_cluster|rq_direct_response|upstream_cx_none_healthy|upstream_rq_pending_overflow"
    r"|upstream_rq_503|upstream_cx_connect_fail|update_empty|upstream_rq_maintenance_mode)$"
)
KINDS = ("replace", "add", "remove", "cluster", "nack", "unnack", "restart", "reconnect")
# Share of each kind among the drawn edits (unnack is scheduled after each nack, not drawn).
MIX = {"replace": 0.25, "add": 0.15, "remove": 0.10, "cluster": 0.20, "nack": 0.10, "restart": 0.10}
POLICIES = ("round_robin", "least_request", "adaptive", "weighted_response_time")


@dataclass
class ChurnResult:
    seed: int
    mode: str
    edits: list[Edit]
    outcomes: list[Outcome]
    converged_after: float | None
    convergence_error: str
    duration: float
    report: str
    scrape_failures: list[str] = field(default_factory=list)

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.failed]


def deck(n: int, rng: random.Random, relay: bool) -> list[str]:
    """`n` edit kinds in the MIX proportions (each at least once), shuffled."""
    mix = dict(MIX)
    if relay:
        mix["reconnect"] = 0.10
    kinds: list[str] = []
    for kind, share in mix.items():
        kinds += [kind] * max(1, round(n * share))
    while len(kinds) < n:
        kinds.append("replace")
    while len(kinds) > n:
        kinds.remove("replace")
    rng.shuffle(kinds)
    return kinds


class Churn:
    """Seeded random edits on a started ChurnRig whose permanent models carry the load."""

    def __init__(self, rig: ChurnRig, rng: random.Random, permanent: Sequence[str]) -> None:
        self.rig = rig
        self.rng = rng
        self.permanent = list(permanent)
        self.transient_seq = 0
        self.nacked: str | None = None  # the model carrying BAD_OVERRIDE
        self.unnack_in = 0  # edits until the override is taken out again
        self.pending_replaces: list[Edit] = []
        self.storm: ScrapeStorm | None = None

    def transient(self) -> list[str]:
        return [m for m in self.rig.fleet.models if m not in self.permanent]

    # Fleet mutations: change rig.fleet, return a description; the caller writes.

    def m_replace(self) -> str:
        model = self.rng.choice(self.permanent)
        detail, pending = self.rig.replace_version(model, backends=self.rng.choice((1, 2)))
        self.pending_replaces.append(pending)
        return detail

    def m_add(self, **keys: Any) -> str:
        self.transient_seq += 1
        name = f"t{self.transient_seq}"
        params = self.rng.choice((7, 70))
        self.rig.add_model(name, params_b=params, backends=self.rng.choice((1, 2)), **keys)
        return f"add {name} ({params}B){' with ' + json.dumps(keys) if keys else ''}"

    def m_remove(self, avoid: str | None = None) -> str:
        choices = [m for m in self.transient() if m != avoid]
        if not choices:
            return self.m_add()
        name = self.rng.choice(choices)
        del self.rig.fleet.models[name]
        if name == self.nacked:
            self.nacked = None
        return f"remove {name}"

    def m_cluster(self) -> str:
        fleet = self.rig.fleet
        option = self.rng.choice(("outlier", "breakers", "balancing", "affinity", "connect_timeout"))
        if option == "outlier":
            tier = self.rng.choice(list(fleet.tiers))
            value = {"consecutive_5xx": self.rng.randint(3, 10), "interval": f"{self.rng.randint(2, 8)}s"}
            fleet.tiers[tier]["outlier_detection"] = value
            return f"tier {tier} outlier_detection={value}"
        if option == "breakers":
            tier = self.rng.choice(list(fleet.tiers))
            value = {"default": {"max_requests": self.rng.randint(500, 2000)}}
            fleet.tiers[tier]["circuit_breakers"] = value
            return f"tier {tier} circuit_breakers={value}"
        spec = fleet.models[self.rng.choice(self.permanent)]
        if option == "balancing":
            policy = self.rng.choice([p for p in POLICIES if p != spec.keys.get("balancing")])
            spec.keys["balancing"] = policy
            return f"{spec.name} balancing={policy}"
        if option == "affinity":
            if "affinity" in spec.keys:
                del spec.keys["affinity"]
                return f"{spec.name} affinity removed"
            spec.keys["affinity"] = {"header": "x-session-id"}
            return f"{spec.name} affinity={{header: x-session-id}}"
        timeout = self.rng.choice(("1s", "2s", "3s"))
        if spec.keys.get("cluster_overrides", {}).get("connect_timeout") == timeout:
            del spec.keys["cluster_overrides"]
            return f"{spec.name} cluster_overrides removed"
        spec.keys["cluster_overrides"] = {"connect_timeout": timeout}
        return f"{spec.name} cluster_overrides={{connect_timeout: {timeout}}}"

    def m_nack(self) -> str:
        """BAD_OVERRIDE on a transient model (an existing one, or a new one), beside another
        kind of change in the same edit."""
        companion = self.rng.choice(("replace", "add", "cluster", "remove"))
        existing = self.transient()
        if existing and self.rng.random() < 0.5:
            target = self.rng.choice(existing)
            self.rig.fleet.models[target].keys["cluster_overrides"] = dict(BAD_OVERRIDE)
            bad = f"{target} cluster_overrides={{connect_timeout: -1s}}"
        else:
            bad = self.m_add(cluster_overrides=dict(BAD_OVERRIDE))
            target = f"t{self.transient_seq}"
        self.nacked = target
        self.unnack_in = self.rng.randint(1, 3)
        other = self.m_remove(avoid=target) if companion == "remove" else self.mutate(companion)
        return f"{bad} + {companion}: {other}"

    def m_unnack(self) -> str:
        target = self.nacked
        self.nacked = None
        if target is None or target not in self.rig.fleet.models:
            return "nothing to fix"
        spec = self.rig.fleet.models[target]
        spec.keys.pop("cluster_overrides", None)
        detail = f"{target} bad override removed"
        if self.rng.random() < 0.5:
            detail += f" + cluster: {self.m_cluster()}"
        return detail

    MUTATIONS = ("replace", "add", "remove", "cluster", "nack", "unnack")

    def mutate(self, kind: str) -> str:
        return {
            "replace": self.m_replace,
            "add": self.m_add,
            "remove": self.m_remove,
            "cluster": self.m_cluster,
            "nack": self.m_nack,
            "unnack": self.m_unnack,
        }[kind]()

    def commit(self, kind: str, detail: str) -> Edit:
        t = self.rig.write()
        edit = self.rig.record(kind, detail, t)
        for p in self.pending_replaces:
            edit.model, edit.old_backends, edit.new_backends = p.model, p.old_backends, p.new_backends
        self.pending_replaces.clear()
        return edit

    def step(self, kind: str) -> None:
        """One edit of `kind` (adjusted when it cannot apply as drawn)."""
        if kind == "add" and len(self.transient()) >= 6:
            kind = "remove"
        if kind == "remove" and not [m for m in self.transient() if m != self.nacked]:
            kind = "add"
        if kind == "nack" and self.nacked is not None:
            self.commit("unnack", self.mutate("unnack"))
            time.sleep(self.rng.uniform(0.3, 1.5))
        if kind in self.MUTATIONS:
            self.commit(kind, self.mutate(kind))
        elif kind == "restart":
            self.restart()
        elif kind == "reconnect":
            n = self.rig.cut_xds()
            self.rig.record("reconnect", f"relay cut {n} connection(s)")
        else:
            raise ValueError(kind)

    def restart(self) -> None:
        if self.storm is not None:
            self.storm.thread.join(120)  # scrapes of a process being killed would fail for that
        down = self.rng.uniform(0.5, 2.0)
        t = self.rig.kill_control_plane()
        detail = f"kill -9, down {down:.2f}s"
        edit_while_down = self.rng.random() < 0.5
        if edit_while_down:
            time.sleep(down / 2)
            kind = self.rng.choice(("replace", "add", "cluster"))
            inner = self.mutate(kind)
            self.rig.write()
            detail += f", edited while down: {kind}: {inner}"
            time.sleep(down / 2)
        else:
            time.sleep(down)
        edit = self.rig.record("restart", detail, t)
        for p in self.pending_replaces:
            edit.model, edit.old_backends, edit.new_backends = p.model, p.old_backends, p.new_backends
        self.pending_replaces.clear()
        up = self.rig.start_control_plane()
        edit.detail += f", back after {up - t:.2f}s"

    def run(self, kinds: Sequence[str], scrapes: int = 0) -> None:
        """The edits in order; with `scrapes`, a storm of that many concurrent scrapes of the
        control plane's status port starts halfway and runs beside the edits that follow."""
        for i, kind in enumerate(kinds):
            if scrapes and i == len(kinds) // 2:
                assert self.rig.cp is not None
                self.storm = ScrapeStorm(self.rig.cp.metrics_port, scrapes)
                self.storm.thread.start()
            self.step(kind)
            if self.nacked is not None:
                self.unnack_in -= 1
                if self.unnack_in < 0:
                    time.sleep(self.rng.uniform(0.3, 1.5))
                    self.commit("unnack", self.mutate("unnack"))
            time.sleep(self.rng.uniform(0.3, 1.5))
        if self.nacked is not None:
            self.commit("unnack", self.mutate("unnack"))


def replace_timings(rig: ChurnRig, outcomes: Sequence[Outcome]) -> list[str]:
    """Per replace: when traffic first reached the new backends, and when it last hit the old."""
    lines = []
    for e in rig.edits:
        if not e.model:
            continue
        mine = [o for o in outcomes if o.model == e.model and o.t >= e.t and not o.failed]
        first_new = next((o.t for o in mine if o.backend in e.new_backends), None)
        last_old = max((o.t for o in mine if o.backend in e.old_backends), default=None)
        lines.append(
            f"  #{e.index} {e.detail}: new version first served "
            + (f"+{first_new - e.t:.2f}s" if first_new is not None else "never (in the run)")
            + ", old version last served "
            + (f"+{last_old - e.t:.2f}s" if last_old is not None else "-")
        )
    return lines


def run_churn(
    tmp: Path,
    *,
    delta: bool,
    seed: int,
    edits: int = 20,
    permanent: int = 3,
    transient: int = 2,
    rate: float = 30.0,
    relay: bool = True,
    converge_timeout: float = 20.0,
    scrapes: int = 1000,
) -> ChurnResult:
    """Build a rig, churn it with `edits` seeded random edits under steady load, wait for
    convergence, stop everything; return the outcome and a printable report."""
    tmp.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    mode = "delta" if delta else "sotw"
    begun = time.monotonic()
    rig = ChurnRig(tmp, delta=delta, relay=relay)
    converged_after: float | None = None
    converged_at = 0.0
    convergence_error = ""
    try:
        names = [f"p{i}" for i in range(permanent)]
        for i, name in enumerate(names):
            rig.add_model(name, params_b=70 if i % 3 == 2 else 8, backends=2)
        for i in range(transient):
            rig.add_model(f"t0{i}", params_b=8, backends=1)
        rig.start(load_models=names, rate=rate)
        churn = Churn(rig, rng, names)
        kinds = deck(edits, rng, relay)
        churn.run(kinds, scrapes=scrapes)
        if churn.storm is not None:
            churn.storm.thread.join(120)
        try:
            converged_after = rig.wait_converged(converge_timeout)
            converged_at = time.monotonic()
        except AssertionError as e:
            convergence_error = str(e)
        time.sleep(1.0)  # a last stretch of traffic on the converged config
        assert rig.load is not None
        rig.load.stop()
        outcomes = rig.load.snapshot()
        report = churn_report(
            rig, seed, mode, outcomes, converged_after, converged_at, convergence_error, begun
        )
        storm = churn.storm
        if storm is not None:
            report += "\n" + storm.summary()
            report += "".join(f"\n  {f}" for f in storm.failures[:5])
        return ChurnResult(
            seed,
            mode,
            list(rig.edits),
            outcomes,
            converged_after,
            convergence_error,
            time.monotonic() - begun,
            report,
            scrape_failures=list(storm.failures) if storm is not None else [],
        )
    finally:
        rig.close()


def churn_report(
    rig: ChurnRig,
    seed: int,
    mode: str,
    outcomes: Sequence[Outcome],
    converged_after: float | None,
    converged_at: float,
    convergence_error: str,
    begun: float,
) -> str:
    failures = [o for o in outcomes if o.failed]
    mix = Counter(e.kind for e in rig.edits)
    lines = [
        f"churn {mode} seed={seed}: {len(rig.edits)} edits in {time.monotonic() - begun:.1f}s",
        "edit mix: " + ", ".join(f"{k}={mix[k]}" for k in KINDS if mix[k]),
        "sequence:",
        *(f"  #{e.index} {e.t - rig.started_at:7.2f}s {e.kind}: {e.detail}" for e in rig.edits),
        "replacements:",
        *replace_timings(rig, outcomes),
        f"requests: {len(outcomes)}, failures: {len(failures)}"
        + (f" ({Counter(o.model for o in failures)})" if failures else ""),
    ]
    by_status = Counter(o.status for o in failures)
    if failures:
        lines.append(f"failures by status: {dict(by_status)}")
        lines.append("first failures:")
        for o in failures[:15]:
            lines.append(f"  {o.model} {rig.since_edit(o.t)}: {o.detail[:160]}")
        # Failure bursts: first and last failure after each edit.
        bursts: dict[int, list[Outcome]] = {}
        for o in failures:
            before = [e for e in rig.edits if e.t <= o.t]
            bursts.setdefault(before[-1].index if before else 0, []).append(o)
        lines.append("failures per preceding edit:")
        for index, items in bursts.items():
            e = next((x for x in rig.edits if x.index == index), None)
            base = e.t if e else rig.started_at
            lines.append(
                f"  #{index} {e.kind + ' ' + e.detail if e else '(start)'}: {len(items)} failures, "
                f"+{items[0].t - base:.2f}s .. +{items[-1].t - base:.2f}s"
            )
    if converged_after is not None:
        lines.append(
            f"converged {converged_after:.2f}s after the churn ended "
            f"({converged_at - rig.edits[-1].t:.2f}s after the last edit began)"
        )
    else:
        lines.append(convergence_error)
    if rig.relay is not None:
        lines.append(f"xds relay: {rig.relay.accepted} connections accepted, {rig.relay.cuts} cuts")
    lines.append(f"logs: {rig.tmp} (controlplane.log, {rig.node_id}.log, fleet.yaml)")
    return "\n".join(lines)


def describe_failures(rig: ChurnRig, failures: Sequence[Outcome], limit: int = 10) -> str:
    """The first failures with their time relative to the edit before each."""
    if not failures:
        return "no failures"
    lines = [f"{len(failures)} failures, by status {dict(Counter(o.status for o in failures))}:"]
    lines += [f"  {o.model} {rig.since_edit(o.t)}: {o.detail[:160]}" for o in failures[:limit]]
    if rig.envoy is not None:
        lines.append("envoy's own count of why: " + ", ".join(rig.envoy_failure_counters()))
    return "\n".join(lines)
