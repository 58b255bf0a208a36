"""Wiring only: builds the rooms and connects them."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog
from envoy.service.load_stats.v3 import lrs_pb2_grpc
from envoy.service.status.v3 import csds_pb2_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from controlplane import limits
from controlplane.actuators.emulator import EmulatorProvider
from controlplane.admin import auth
from controlplane.admin.defaults import DEFAULT_ADMIN_LISTEN, DEFAULT_STATE_DIR
from controlplane.admin.servers import admin_server, scaler_server
from controlplane.admin.service import SERVICE_NAMES
from controlplane.autoscaling.persist import HistoryFile
from controlplane.balancing.controller import WeightController
from controlplane.discovery.manager import Discovery
from controlplane.drain.controller import EndpointDrains
from controlplane.fleet.errors import FleetConfigInvalid
from controlplane.fleet.model import Fleet
from controlplane.fleet.watch import FleetFileWatcher
from controlplane.ha.fleet import EtcdFleetSource
from controlplane.ha.replica import Replica
from controlplane.hold.service import HoldingService
from controlplane.hold.start import start_holding
from controlplane.net.tls import XdsTls, server_credentials
from controlplane.obs.http import StatusHTTPServer
from controlplane.obs.metrics import Metrics
from controlplane.obs.runtime import watch_event_loop
from controlplane.rollout.controller import RolloutController
from controlplane.rollout.store import RolloutStore, StateStore, StoreUnavailable
from controlplane.signals import lrs
from controlplane.xds import csds
from controlplane.xds import memory as xds_memory
from controlplane.xds.cache import SnapshotCache
from controlplane.xds.reconciler import Reconciler
from controlplane.xds.server import ADS_SERVICE, PER_TYPE_SERVICES, XdsServer
from controlplane.xds.snapshot import Lingering

log = structlog.get_logger("controlplane")
XDS_MEMORY_FILE = "xds-memory.bin"  # in the state directory


@dataclass(frozen=True)
class ServeOptions:
    config: Path | None  # the fleet file; None with an etcd store (the fleet is in etcd)
    xds_listen: str = "127.0.0.1:18000"
    xds_tls: XdsTls | None = None  # TLS (and with a client CA, mutual TLS) on the xDS port
    metrics_listen: str = "127.0.0.1:9102"
    debounce_s: float = 0.1
    max_delay_s: float = 1.0
    watch_interval_s: float = 0.25
    state_dir: Path = DEFAULT_STATE_DIR
    admin_listen: str = DEFAULT_ADMIN_LISTEN
    admin_token_file: Path | None = None
    admin_readonly_token_file: Path | None = None
    rollout_tick_s: float = 1.0
    store: str | None = None  # etcd://HOST:PORT[,...][/PREFIX]: several replicas share state
    replica_id: str = ""
    leader_ttl_s: int = 5
    signal_collectors: int | None = None  # collector processes; None: sized to the cores
    scaler_listen: str | None = None  # KEDA's external scaler (gRPC); None: not served
    # The holding service (hold/): requests for a model with no ready server wait there.
    # None: off (such requests get 503). Port 0: a free port, pushed to the proxies.
    hold_listen: str | None = "127.0.0.1:0"
    hold_address: str | None = None  # HOST:PORT proxies dial; None: the bound listen address


class ControlPlane:
    """The running server: fleet watcher -> reconciler -> snapshot cache -> xDS streams."""

    def __init__(self, options: ServeOptions, metrics: Metrics | None = None) -> None:
        self.options = options
        self.metrics = metrics or Metrics()
        self.cache = SnapshotCache()
        self.xds = XdsServer(self.cache, self.metrics)
        self.reconciler = Reconciler(self.cache, self.metrics, options.debounce_s, options.max_delay_s)
        # The memory file names a snapshot's clusters before any proxy can have them.
        self.reconciler.before_publish.append(lambda snap: self.xds.write_ahead(snap, self.memory_path))
        # The first snapshot turns health to SERVING (until then streams get UNAVAILABLE).
        self.reconciler.on_publish.append(self._on_publish)
        self.weights = WeightController(self.reconciler, self.metrics, collectors=options.signal_collectors)
        self.lrs = lrs.LoadReportingServer(
            self.weights.store,
            streams_gauge=self.metrics.balancing.lrs_streams,
            clamped_counter=self.metrics.balancing.lrs_clamped,
            holds_stream=self._holds_xds_stream,
            refused_counter=self.metrics.balancing.lrs_refused,
        )
        self.replica: Replica | None = None  # with --store: one of several replicas on etcd
        self.store: StateStore
        self.source: FleetFileWatcher | EtcdFleetSource
        if options.store is not None:
            self.replica = Replica(
                options.store, options.replica_id, self._on_fleet, self._on_invalid, options.watch_interval_s
            )
            self.store, self.source = self.replica.state, self.replica.fleet
            self.fleet_name = self.replica.fleet.name
        else:
            assert options.config is not None
            self.store = RolloutStore(options.state_dir)
            self.source = FleetFileWatcher(
                options.config, self._on_fleet, self._on_invalid, options.watch_interval_s
            )
            self.fleet_name = str(options.config)
        self.rollouts = RolloutController(
            self.store,
            self.reconciler,
            self.weights.store,
            self.xds.registry,
            self.metrics,
            tick_s=options.rollout_tick_s,
            # who the audit trail names for the rollout controller's own moves
            actor=self.replica.actor if self.replica is not None else "controller",
        )
        self.drains = EndpointDrains(self.rollouts)
        self._file_fleet: Fleet | None = None
        self.discovery = Discovery(self.drains, self.metrics, self._discovered)
        self.history = HistoryFile(options.state_dir)
        restored = self.weights.autoscaler.forecaster.restore(self.history.read())
        if restored:
            log.info("autoscaling history restored", models=restored, path=str(self.history.path))
        self.provider = EmulatorProvider(
            self.drains,
            self.weights.autoscaler,
            self.weights.store,
            self._serve_fleet,
            options.state_dir / "emulated",
        )
        if self.replica is not None:
            self.rollouts.leader = False  # until this replica wins the election
            self.replica.share(
                self.weights.store,
                self.rollouts.analysed_endpoints,
                self.xds.registry.nodes.keys,
                options.leader_ttl_s,
                on_leadership=self._on_leadership,
                on_store=self.metrics.store_reachable.set,
            )
            assert self.replica.reports is not None
            self.rollouts.peer_reports = self.replica.reports.counters
        self.metrics.rollouts.leader.set(1 if self.rollouts.leader else 0)
        self.health = health.aio.HealthServicer()
        self.admin_health = health.aio.HealthServicer()
        self.grpc_server: grpc.aio.Server | None = None
        self.admin_server: grpc.aio.Server | None = None
        self.scaler_server: grpc.aio.Server | None = None
        self.hold: HoldingService | None = None
        self.scaler_port = 0
        self.admin_port = 0
        self.http: StatusHTTPServer | None = None
        self.xds_port = 0
        self._tasks: list[asyncio.Future[None]] = []
        self._serving = False

    def _serve_fleet(self) -> None:
        """Serve the file's fleet with what discovery found and the servers the emulator
        provider started (either changed, or the file did)."""
        if self._file_fleet is not None:
            self.rollouts.set_file_fleet(self.provider.augment(self.discovery.augment(self._file_fleet)))

    def _discovered(self) -> None:
        """Discovery's set changed: serve it, and probe now (a new server is held out until
        the probes have heard from it; no reason to wait for the next round)."""
        self._serve_fleet()
        self.weights.wake()

    async def _run_provider(self) -> None:
        """Right after each signals round: discovery's drains of servers that left their
        source, and the emulator provider's round (its decisions are fresh then), while the
        fleet asks for it (one replica only)."""
        while True:
            await self.weights.next_round()
            await self.discovery.one_round(self.weights.interval_s())
            if self.replica is not None:
                continue
            try:
                await self.provider.step()
            except Exception:
                log.exception("emulator provider round failed; will retry")

    def _holds_xds_stream(self, node_id: str) -> bool:
        """Whether a node may report load: it holds an xDS stream here, or on another replica."""
        return self.xds.registry.holds_stream(node_id) or (
            self.replica is not None and self.replica.holds(node_id)
        )

    def _on_leadership(self, leads: bool) -> None:
        self.metrics.rollouts.leader_changes.inc()
        self.rollouts.set_leader(leads)
        self.metrics.rollouts.leader.set(1 if leads else 0)

    def _on_fleet(self, fleet: Fleet) -> None:
        first = self.reconciler.fleet is None
        # The rollout controller layers API-made state (rollouts, drains) over the file; the
        # emulator provider (if the fleet asks for it) adds the servers it started.
        self._file_fleet = fleet
        self._serve_fleet()
        # A server the edit added is sent held out (routing/clusters.py): probe it now, so
        # that it takes traffic as soon as it is seen ready, not a signals interval later.
        self.weights.wake()
        if self.provider.active() and self.replica is not None:
            log.warning("autoscaling.provider emulator runs on a single replica only; not with --store")
        self.metrics.config_reloads.labels("success").inc()
        self.metrics.config_last_success.set(time.time())
        self.metrics.config_valid.set(1)
        log.info(
            "fleet config loaded" if first else "fleet config reloaded",
            source=self.fleet_name,
            models=len(fleet.models),
            endpoints=sum(len(v.endpoints) for m in fleet.models for v in m.versions),
        )

    def _on_invalid(self, err: FleetConfigInvalid) -> None:
        self.metrics.config_reloads.labels("invalid").inc()
        self.metrics.config_valid.set(0)
        serving = (
            "the last good config keeps being served"
            if self.cache.current
            else ("no config is served yet; proxies get UNAVAILABLE until the file is valid")
        )
        log.error(
            "fleet config refused",
            source=self.fleet_name,
            errors=[str(e) for e in err.errors],
            consequence=serving,
        )

    async def start(self) -> None:
        # Stored rollout and drain state first, so the first snapshot already has it (after a
        # crash, proxies see the same split as before).
        try:
            await self.rollouts.restore()
            if isinstance(self.source, EtcdFleetSource):
                await self.source.check()
            else:
                self.source.check()
        except StoreUnavailable as e:
            # Keep starting: xDS answers UNAVAILABLE until the fleet loads, retried below.
            log.error("state store unreachable at start; retrying", error=str(e))
        self._restore_memory()
        if self.reconciler.fleet is not None:
            # One bounded scrape round first, so the first snapshot already holds out
            # servers that say they are not ready.
            try:
                await self.weights.tick(first=True)
            except Exception:
                log.exception("first signal round failed; starting with capacity weights")
        server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_concurrent_streams", limits.XDS_MAX_STREAMS_PER_CONNECTION),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 5000),
            ]
        )
        server.add_generic_rpc_handlers(tuple(self.xds.handlers()))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        lrs_pb2_grpc.add_LoadReportingServiceServicer_to_server(self.lrs, server)
        csds_pb2_grpc.add_ClientStatusDiscoveryServiceServicer_to_server(
            csds.ClientStatusServer(self.xds.registry), server
        )
        reflection.enable_server_reflection(
            (
                ADS_SERVICE,
                *PER_TYPE_SERVICES,
                lrs.SERVICE_NAME,
                csds.SERVICE_NAME,
                health.SERVICE_NAME,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        try:
            self.http = StatusHTTPServer(
                self.options.metrics_listen,
                self.metrics,
                self.xds.registry,
                discovery=lambda: self.discovery.status,
            )
        except OSError as e:
            raise OSError(f"--metrics-listen {self.options.metrics_listen}: {e.strerror or e}") from e
        try:
            tls = self.options.xds_tls
            mutual = tls is not None and tls.client_ca is not None
            self.xds.check_identity = self.lrs.check_identity = mutual
            self.xds_port = (
                server.add_secure_port(self.options.xds_listen, server_credentials(tls))
                if tls is not None
                else server.add_insecure_port(self.options.xds_listen)
            )
        except RuntimeError as e:
            self.http.server.server_close()
            raise OSError(f"--xds-listen {self.options.xds_listen}: cannot listen ({e})") from e
        try:
            o = self.options
            admin, self.admin_port = admin_server(
                o.admin_listen,
                o.admin_token_file,
                o.admin_readonly_token_file,
                o.state_dir,
                self.rollouts,
                self.drains,
                self.discovery.source_of,
                self.xds.registry,
                self.weights,
                self.metrics,
                self.admin_health,
            )
            scaler = None
            if o.scaler_listen:
                scaler, self.scaler_port = scaler_server(
                    o.scaler_listen, self.weights.autoscaler, lambda: self.reconciler.fleet, self.admin_health
                )
            # The holding service's port last, once every port given on the command line is
            # bound: a free port picked now can never be one of those.
            self._start_holding()
        except (OSError, auth.TokenFileError):
            self.http.server.server_close()
            raise
        self.reconciler.rebuild_now()
        await server.start()
        await admin.start()
        if scaler is not None:
            await scaler.start()
        self.grpc_server = server
        self.admin_server = admin
        self.scaler_server = scaler
        self.http.start()
        await self._set_health()
        self._tasks += [
            asyncio.create_task(self.rollouts.run()),
            *(asyncio.create_task(loop) for loop in (self.replica.loops() if self.replica else [])),
            asyncio.create_task(self.reconciler.run()),
            asyncio.create_task(self._run_provider()),
            asyncio.create_task(self.history.keep(self.weights.autoscaler.forecaster)),
            asyncio.create_task(self.source.run()),
            asyncio.create_task(self.weights.run()),
            asyncio.create_task(self.xds.keep_memory(self.memory_path)),
            asyncio.create_task(watch_event_loop(self.metrics.event_loop_lag)),
        ]
        log.info(
            "control plane serving",
            xds=self.options.xds_listen,
            metrics=self.options.metrics_listen,
            admin=self.options.admin_listen,
            scaler=self.options.scaler_listen,
            state_dir=str(self.options.state_dir),
            fleet=self.fleet_name,
            store=self.store.where,
        )

    @property
    def memory_path(self) -> Path:
        return self.options.state_dir / XDS_MEMORY_FILE

    def _restore_memory(self) -> None:
        """What proxies had ACKed before a restart: the first snapshot keeps the clusters a
        proxy may still route to (a version replaced while this server was down)."""
        path = self.memory_path
        try:
            found = xds_memory.load(self.xds.memory, path.read_bytes())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            log.warning("xds memory unreadable; starting without it", path=str(path), error=str(e))
            return
        now = time.monotonic()
        self.reconciler.lingering_seed = {n: Lingering(a, now) for n, a in found.assignments.items()}
        log.info("xds memory restored", path=str(path), clusters=found.clusters, routes=found.routes)

    def _start_holding(self) -> None:
        """The holding service on its own thread; proxies learn its address from the snapshot."""
        if self.options.hold_listen is None:
            return
        loop = asyncio.get_running_loop()
        self.hold, address, bound = start_holding(
            self.options.hold_listen,
            self.options.hold_address,
            self.options.state_dir,
            lambda: self.reconciler.fleet,  # read from the holding service's thread: replaced whole
            lambda: self.reconciler.ready,
            lambda: self.reconciler.candidates,
            # A model's first held request starts a signals round at once: it wakes the model.
            lambda model: loop.call_soon_threadsafe(self.weights.wake),
            self.metrics.hold,
        )
        self.reconciler.hold_address = address
        self.weights.held = self.hold.held
        log.info("holding service listening", listen=self.options.hold_listen, port=bound, address=address)

    def _on_publish(self, snapshot: object) -> None:
        if self.grpc_server is not None and not self._serving:
            self._serving = True
            self._tasks.append(asyncio.ensure_future(self._set_health()))

    async def _set_health(self) -> None:
        self._serving = self.cache.current is not None
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if self._serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", ADS_SERVICE):
            await self.health.set(name, status)
        for name in ("", *SERVICE_NAMES):
            await self.admin_health.set(name, status)

    async def stop(self, grace_s: float = 1.0) -> None:
        self.provider.close()
        self.discovery.close()
        if self.hold is not None:
            self.hold.stop()
        if self.scaler_server is not None:
            await self.scaler_server.stop(grace_s)
        if self.admin_server is not None:
            await self.admin_server.stop(grace_s)
        if self.grpc_server is not None:
            await self.grpc_server.stop(grace_s)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await self.weights.close()
        if self.http is not None:
            self.http.stop()
        await self.store.close()
