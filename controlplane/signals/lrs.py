"""Envoy load reporting (LRS, envoy.service.load_stats.v3) server (thin I/O shell).

Each proxy opens one stream. We answer its first request by asking for every cluster
(`send_all_clusters`), at endpoint granularity, every `interval_s`. Each report's
per-endpoint counts (in progress, issued, succeeded, failed) go into the SignalStore,
keyed by the proxy's node id; when the stream ends, that proxy's contribution is dropped.
Reports count only from a node that holds an xDS stream on this replica.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import structlog
from envoy.config.endpoint.v3 import load_report_pb2
from envoy.service.load_stats.v3 import lrs_pb2, lrs_pb2_grpc
from google.protobuf import duration_pb2
from prometheus_client import Counter, Gauge

from controlplane import limits
from controlplane.fleet.model import format_address
from controlplane.net.tls import identity_mismatch
from controlplane.resources.names import model_of_cluster
from controlplane.signals.store import SignalStore

log = structlog.get_logger("controlplane.lrs")

SERVICE_NAME = "envoy.service.load_stats.v3.LoadReportingService"


class LoadReportingServer(lrs_pb2_grpc.LoadReportingServiceServicer):  # type: ignore[misc]
    """Collects Envoy load reports into the store."""

    def __init__(
        self,
        store: SignalStore,
        interval_s: float = 1.0,
        streams_gauge: Gauge | None = None,
        clamped_counter: Counter | None = None,
        holds_stream: Callable[[str], bool] | None = None,
        refused_counter: Counter | None = None,
    ) -> None:
        self.store = store
        self.interval_s = interval_s
        self.streams_gauge = streams_gauge
        self.streams = 0
        self.reports = 0
        self.clamped_counter = clamped_counter
        self.clamped = 0  # endpoint reports with a count over limits.LRS_MAX_COUNT, cut to it
        self.check_identity = False  # mutual TLS: the node id must be the certificate's identity
        # Reports count only from a node holding an xDS stream here: anyone can open an LRS
        # stream, but only a proxy we serve routes the traffic it reports. An Envoy's ADS and
        # LRS streams share one connection (one cluster), so they reach the same replica.
        self.holds_stream = holds_stream
        self.refused_counter = refused_counter
        self.refused = 0  # reports not used: their node holds no xDS stream here

    async def StreamLoadStats(
        self,
        request_iterator: AsyncIterator[lrs_pb2.LoadStatsRequest],
        context: grpc.aio.ServicerContext[lrs_pb2.LoadStatsRequest, lrs_pb2.LoadStatsResponse],
    ) -> AsyncIterator[lrs_pb2.LoadStatsResponse]:
        node = ""
        self.streams += 1
        if self.streams_gauge is not None:
            self.streams_gauge.inc()
        try:
            async for req in request_iterator:
                if not node and self.check_identity and (why := identity_mismatch(context, req.node.id)):
                    log.warning("load reporting stream refused", reason=why)
                    await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
                    return
                if not node:
                    node = req.node.id or context.peer()
                    log.info("load reporting stream opened", node=node)
                    interval = duration_pb2.Duration()
                    interval.FromNanoseconds(int(self.interval_s * 1e9))
                    yield lrs_pb2.LoadStatsResponse(
                        send_all_clusters=True,
                        load_reporting_interval=interval,
                        report_endpoint_granularity=True,
                    )
                if self.holds_stream is None or self.holds_stream(node):
                    self._record(node, req)
                elif req.cluster_stats:
                    self.refused += 1
                    if self.refused_counter is not None:
                        self.refused_counter.labels("no_xds_stream").inc()
                    if self.refused in (1, 10, 100) or self.refused % 1000 == 0:
                        log.warning(
                            "load report from a node without an xDS stream not used",
                            node=node,
                            refused=self.refused,
                        )
        finally:
            self.streams -= 1
            if self.streams_gauge is not None:
                self.streams_gauge.dec()
            if node:
                self.store.forget_node(node)
                log.info("load reporting stream closed", node=node)

    def _record(self, node: str, req: lrs_pb2.LoadStatsRequest) -> None:
        now = time.monotonic()
        for cs in req.cluster_stats:
            model = model_of_cluster(cs.cluster_name)
            if model is None:
                continue  # not one of ours (a static cluster)
            self.reports += 1
            for loc in cs.upstream_locality_stats:
                for address, counts in _endpoint_stats(loc):
                    if max(counts) > limits.LRS_MAX_COUNT:
                        # No endpoint serves a million requests a second: a bug or a lie,
                        # which would otherwise set error rates and in-flight gauges at will.
                        self.clamped += 1
                        if self.clamped_counter is not None:
                            self.clamped_counter.inc()
                    in_progress, issued, succeeded, failed = (
                        float(min(c, limits.LRS_MAX_COUNT)) for c in counts
                    )
                    self.store.record_lrs(
                        (model, address),
                        node,
                        in_progress=in_progress,
                        issued=issued,
                        succeeded=succeeded,
                        failed=failed,
                        now=now,
                    )


def _endpoint_stats(
    loc: load_report_pb2.UpstreamLocalityStats,
) -> list[tuple[str, tuple[int, int, int, int]]]:
    """(address, (in progress, issued, succeeded, failed)) per endpoint of one locality's
    report. Envoy reports endpoints (report_endpoint_granularity); gRPC reports localities
    only, and each of ours is one endpoint named by its sub_zone (routing/clusters.py), so
    the locality's counts are that endpoint's."""

    def counts(s: Any) -> tuple[int, int, int, int]:
        return (
            s.total_requests_in_progress,
            s.total_issued_requests,
            s.total_successful_requests,
            s.total_error_requests,
        )

    if loc.upstream_endpoint_stats:
        return [
            (
                format_address(es.address.socket_address.address, es.address.socket_address.port_value),
                counts(es),
            )
            for es in loc.upstream_endpoint_stats
        ]
    host, sep, port = loc.locality.sub_zone.rpartition(":")
    if not sep or not port.isdigit():
        return []
    return [(format_address(host.strip("[]"), int(port)), counts(loc))]
