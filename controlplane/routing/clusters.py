"""Pure translation, the upstream side: one Envoy Cluster per model version (its load
balancing policy, circuit breakers, outlier detection and connection handling), the holding
service's cluster, and each version's ClusterLoadAssignment with the endpoints' weights.

Nothing here does I/O; translate.py builds the listeners and routes that name these clusters.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Callable, Mapping

from envoy.config.cluster.v3 import circuit_breaker_pb2, cluster_pb2, outlier_detection_pb2
from envoy.config.core.v3 import address_pb2, base_pb2, extension_pb2, health_check_pb2, protocol_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.extensions.load_balancing_policies.common.v3 import common_pb2
from envoy.extensions.load_balancing_policies.least_request.v3 import least_request_pb2
from envoy.extensions.load_balancing_policies.maglev.v3 import maglev_pb2
from envoy.extensions.load_balancing_policies.override_host.v3 import override_host_pb2
from envoy.extensions.load_balancing_policies.ring_hash.v3 import ring_hash_pb2
from envoy.extensions.load_balancing_policies.round_robin.v3 import round_robin_pb2
from envoy.extensions.load_balancing_policies.subset.v3 import subset_pb2
from envoy.extensions.load_balancing_policies.wrr_locality.v3 import wrr_locality_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2 as common_tls_pb2
from envoy.extensions.transport_sockets.tls.v3 import tls_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from envoy.type.metadata.v3 import metadata_pb2
from envoy.type.v3 import percent_pb2
from google.protobuf import json_format, wrappers_pb2
from google.protobuf.message import Message

from controlplane.fleet.model import (
    Affinity,
    CircuitBreaker,
    Endpoint,
    Fleet,
    KvEventPorts,
    Model,
    SideTls,
    TrafficPolicy,
    Version,
    kv_publisher,
)
from controlplane.resources import names
from controlplane.routing import pb

# A request Envoy sends on a pooled connection just as the server closes it is lost: a 503
# (upstream_cx_destroy_remote_with_active_rq) that is not retried, since the server may have
# seen it. Servers close connections without a `Connection: close` first in two ways:
# - idle ones, after their keep-alive timeout (cpp-httplib in llama.cpp, uvicorn in vLLM and
#   SGLang: 5 s), where Envoy would keep them an hour. Envoy closes them first; 2 s of margin
#   covers the two timers starting a latency apart. Cost: a new connection after 3 s idle.
# - llama.cpp's server, right after every streamed response, although the response said
#   `Keep-Alive`; Envoy hands a connection to a waiting request as soon as its response ends,
#   and 5% of streamed requests failed so under closed-loop load here. So HTTP/1 connections
#   carry one request each: a connect per request (0.2 ms here), nothing next to inference.
#   HTTP/2 connections are kept (a server closes those with GOAWAY, which Envoy heeds).
UPSTREAM_IDLE_TIMEOUT_S = 3.0
UPSTREAM_HTTP1_REQUESTS_PER_CONNECTION = 1
HTTP_PROTOCOL_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"

# Weights per cluster name, then per endpoint address. A weight of 0 holds the endpoint out:
# it is sent with health status UNHEALTHY, so neither Envoy nor proxyless gRPC sends it new
# requests (a not-ready, still-warming server). An address with no weight yet is new (the
# signals have not weighed it): held out the same way while its cluster has a weighed server
# to send to, else (nothing weighed: a control plane that just started, a new version) sent
# with DEFAULT_WEIGHT, since serving something beats serving nothing.
EndpointWeights = Mapping[str, Mapping[str, int]]
DEFAULT_WEIGHT = 1


def flow_config(fleet: Fleet, model: Model) -> str:
    """The model's flow control as its picked clusters tell the pickers (names.FLOW_METADATA_NS
    `config`, JSON; picker/flow.py reads it): the priority classes highest first (none: one,
    ""), the class of a request without a known x-priority, each class's longest wait, the
    bounds and the tenant's header. "" for a model without flow control, or not picked."""
    flow = fleet.flow_control_of(model)
    if flow is None or not fleet.picked(model):
        return ""
    classes = [c.name for c in fleet.priority_classes] or [""]
    return json.dumps(
        {
            "classes": classes,
            "default_class": fleet.default_priority_class or classes[-1 if len(classes) > 1 else 0],
            "max_wait_s": [flow.max_wait(c) for c in classes],
            "max_requests": flow.max_requests,
            "max_bytes": flow.max_bytes,
            "tenant_header": fleet.tenant_header(flow),
            # the tenants the fleet names (its quotas'): the picker's metrics name no others
            "tenants": sorted(fleet.quotas.tenants)[:64] if fleet.quotas is not None else [],
        },
        sort_keys=True,
    )


def adapter_config(fleet: Fleet, model: Model) -> str:
    """The model's LoRA adapters as its picked clusters tell the pickers
    (names.ADAPTERS_METADATA_NS `config`, JSON; picker/adapters.py reads it): its placement,
    and each adapter's source and the versions and endpoints that may serve it (empty: all).
    "" for a model without adapters, or not picked."""
    if not model.adapters or not fleet.picked(model):
        return ""
    return json.dumps(
        {
            "placement": model.placement,
            "adapters": {
                a.name: {"source": a.source, "versions": list(a.versions), "endpoints": list(a.endpoints)}
                for a in model.adapters
            },
        },
        sort_keys=True,
    )


def build_cluster(
    model: Model,
    cname: str,
    traffic: TrafficPolicy | None = None,
    *,
    picked: bool = False,
    flow: str = "",
    adapters: str = "",
) -> cluster_pb2.Cluster:
    """One EDS cluster per model version, HTTP/1.1 (one request per connection) unless
    configured, idle connections closed after UPSTREAM_IDLE_TIMEOUT_S. Weighted least request,
    except for the `round_robin` balancing policy, which gets Envoy's round robin. Circuit
    breakers per routing priority and outlier detection come from the model's traffic policy.
    `picked`: a picker names each request's server (picked_policy), the weights otherwise."""
    t = traffic or TrafficPolicy()
    c = cluster_pb2.Cluster(
        name=cname,
        alt_stat_name=names.stat_name(cname),
        type=cluster_pb2.Cluster.EDS,
        eds_cluster_config=cluster_pb2.Cluster.EdsClusterConfig(eds_config=pb.ads(), service_name=cname),
        connect_timeout=pb.duration(1.0),
        load_balancing_policy=_policy(model, t, picked),
        circuit_breakers=circuit_breaker_pb2.CircuitBreakers(
            thresholds=[
                _thresholds(base_pb2.DEFAULT, t.breaker_default),
                _thresholds(base_pb2.HIGH, t.breaker_high),
            ]
        ),
        outlier_detection=outlier_detection_pb2.OutlierDetection(
            consecutive_5xx=wrappers_pb2.UInt32Value(value=t.outlier_consecutive_5xx),
            enforcing_consecutive_5xx=wrappers_pb2.UInt32Value(value=100),
            # Only 5xx in a row eject; gateway failures and success rate are not used here.
            enforcing_consecutive_gateway_failure=wrappers_pb2.UInt32Value(value=0),
            enforcing_success_rate=wrappers_pb2.UInt32Value(value=0),
            # Failure share per interval: what proxyless gRPC applies (gRFC A50 has no
            # consecutive 5xx); Envoy applies it too. Two servers at least, so that the rule
            # never ejects the only one.
            failure_percentage_threshold=wrappers_pb2.UInt32Value(value=t.outlier_failure_percentage or 100),
            enforcing_failure_percentage=wrappers_pb2.UInt32Value(
                value=100 if t.outlier_failure_percentage else 0
            ),
            failure_percentage_minimum_hosts=wrappers_pb2.UInt32Value(value=2),
            failure_percentage_request_volume=wrappers_pb2.UInt32Value(value=t.outlier_failure_min_requests),
            interval=pb.duration(t.outlier_interval_s),
            base_ejection_time=pb.duration(t.outlier_base_ejection_s),
            max_ejection_percent=wrappers_pb2.UInt32Value(value=t.outlier_max_ejection_percent),
        ),
    )
    c.lrs_server.CopyFrom(pb.self_source())
    # No panic mode: Envoy's default (below 50% healthy, ignore health) would send traffic
    # to servers that said they are not ready. All held out means 503, which is the truth.
    c.common_lb_config.healthy_panic_threshold.value = 0.0
    c.typed_extension_protocol_options[HTTP_PROTOCOL_OPTIONS].CopyFrom(
        pb.pack(upstream_http_options(http2=model.protocol == "http2"))
    )
    if model.cluster_overrides:
        override = json_format.ParseDict(dict(model.cluster_overrides), cluster_pb2.Cluster())
        c.MergeFrom(override)
    if picked and model.tokenizer:
        # The picker's precise prefix index tokenizes the prompt as the servers do.
        c.metadata.filter_metadata[names.KV_METADATA_NS].update({"tokenizer": model.tokenizer})
    if picked and flow:
        c.metadata.filter_metadata[names.FLOW_METADATA_NS].update({"config": flow})
    if picked and adapters:
        c.metadata.filter_metadata[names.ADAPTERS_METADATA_NS].update({"config": adapters})
    return c


def _policy(model: Model, t: TrafficPolicy, picked: bool) -> cluster_pb2.LoadBalancingPolicy:
    """The cluster's load balancing: the picked server first when `picked`, else (or when the
    picker names none) the model's hashing, round robin or weighted least request; within the
    subset of its servers that may serve the request's adapter when some adapters are
    restricted to some servers (adapter_subsets)."""
    if model.affinity is not None:
        inner = hashing_policy(model.affinity)
    elif picked or t.balancing != "round_robin":
        inner = least_request_policy()
    else:
        inner = round_robin_policy()
    if model.restricted_adapters:
        inner = adapter_subsets(inner)
    return picked_policy(inner) if picked else inner


def adapter_subsets(inner: cluster_pb2.LoadBalancingPolicy) -> cluster_pb2.LoadBalancingPolicy:
    """Envoy's subset load balancer over `inner`, keyed on names.ADAPTER_LB_KEY: a request
    whose envoy.lb metadata names an adapter that only some servers may serve (the gateway
    copies its model name there) goes to those servers only (each lists such adapters in its
    endpoint metadata, a list: list_as_any); any other request (the base model's, an adapter
    every server has) matches no subset and takes the whole cluster. Proxyless gRPC, which has
    no subsets, takes `inner`'s own list after it."""
    subset = subset_pb2.Subset(
        fallback_policy=subset_pb2.Subset.ANY_ENDPOINT,
        subset_selectors=[subset_pb2.Subset.LbSubsetSelector(keys=[names.ADAPTER_LB_KEY])],
        list_as_any=True,
        subset_lb_policy=inner,
    )
    return cluster_pb2.LoadBalancingPolicy(
        policies=[_lb_policy("envoy.load_balancing_policies.subset", subset), *inner.policies]
    )


def upstream_http_options(
    *, http2: bool = False, reuse: bool = False
) -> http_protocol_options_pb2.HttpProtocolOptions:
    """HTTP/1.1 (or HTTP/2) to the servers, idle connections closed by Envoy before the servers
    close them (UPSTREAM_IDLE_TIMEOUT_S) and, for HTTP/1.1 unless `reuse`, one request per
    connection (UPSTREAM_HTTP1_REQUESTS_PER_CONNECTION)."""
    common = protocol_pb2.HttpProtocolOptions(idle_timeout=pb.duration(UPSTREAM_IDLE_TIMEOUT_S))
    explicit = http_protocol_options_pb2.HttpProtocolOptions.ExplicitHttpConfig()
    if http2:
        explicit.http2_protocol_options.SetInParent()
    else:
        explicit.http_protocol_options.SetInParent()
        if not reuse:
            common.max_requests_per_connection.value = UPSTREAM_HTTP1_REQUESTS_PER_CONNECTION
    return http_protocol_options_pb2.HttpProtocolOptions(
        common_http_protocol_options=common, explicit_http_config=explicit
    )


def build_hold_cluster(address: str) -> cluster_pb2.Cluster:
    """The control plane's holding service as proxies reach it: HOST:PORT, an IP (STATIC) or a
    name (STRICT_DNS). Its own bound (autoscaling.hold_max per model) refuses what is too
    much, so Envoy's circuit breakers stay out of the way."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
        kind = cluster_pb2.Cluster.STATIC
    except ValueError:
        kind = cluster_pb2.Cluster.STRICT_DNS
    c = cluster_pb2.Cluster(
        name=names.HOLD_CLUSTER,
        type=kind,
        connect_timeout=pb.duration(1.0),
        load_assignment=endpoint_pb2.ClusterLoadAssignment(cluster_name=names.HOLD_CLUSTER),
    )
    # Connections reused: the holding service (aiohttp) keeps them after every response, and
    # idle for 3630 s; the idle timeout as for every generated cluster.
    c.typed_extension_protocol_options[HTTP_PROTOCOL_OPTIONS].CopyFrom(
        pb.pack(upstream_http_options(reuse=True))
    )
    lb = c.load_assignment.endpoints.add().lb_endpoints.add()
    lb.endpoint.address.socket_address.address = host
    lb.endpoint.address.socket_address.port_value = int(port)
    unbounded = CircuitBreaker(max_requests=1 << 20, max_pending=1 << 20)
    c.circuit_breakers.thresholds.extend(
        [_thresholds(base_pb2.DEFAULT, unbounded), _thresholds(base_pb2.HIGH, unbounded)]
    )
    return c


def _thresholds(priority: int, b: CircuitBreaker) -> circuit_breaker_pb2.CircuitBreakers.Thresholds:
    return circuit_breaker_pb2.CircuitBreakers.Thresholds(
        priority=priority,
        max_requests=wrappers_pb2.UInt32Value(value=b.max_requests),
        max_pending_requests=wrappers_pb2.UInt32Value(value=b.max_pending),
        # Envoy's default allows 3 retries in flight per cluster: a dead server under load
        # would exhaust that at once and its requests fail unretried. A budget scales with
        # the load (half the requests in flight may be retries) and still stops storms.
        retry_budget=circuit_breaker_pb2.CircuitBreakers.Thresholds.RetryBudget(
            budget_percent=percent_pb2.Percent(value=50.0),
            min_retry_concurrency=wrappers_pb2.UInt32Value(value=16),
        ),
        track_remaining=True,
    )


def least_request_policy() -> cluster_pb2.LoadBalancingPolicy:
    """Weighted least request for Envoy; proxyless gRPC (which lacks it) takes round robin.

    Each client uses the first policy in the list that it supports.
    """
    wrr = wrr_locality_pb2.WrrLocality(
        endpoint_picking_policy=cluster_pb2.LoadBalancingPolicy(
            policies=[_lb_policy("envoy.load_balancing_policies.round_robin", round_robin_pb2.RoundRobin())]
        )
    )
    return cluster_pb2.LoadBalancingPolicy(
        policies=[
            # Full scan while weights are equal: a model has tens of servers, not thousands,
            # and power of two choices can pick a busy server twice while another has a free
            # slot. Unequal weights use Envoy's EDF path either way. (Envoy reads
            # selection_method since 1.30; its older enable_full_scan field is ignored.)
            _lb_policy(
                "envoy.load_balancing_policies.least_request",
                least_request_pb2.LeastRequest(selection_method=least_request_pb2.LeastRequest.FULL_SCAN),
            ),
            _lb_policy("envoy.load_balancing_policies.wrr_locality", wrr),
        ]
    )


def picked_policy(fallback: cluster_pb2.LoadBalancingPolicy | None = None) -> cluster_pb2.LoadBalancingPolicy:
    """The server a picker named for the request (the PICKED_HEADER, else the same value under
    the envoy.lb metadata; a list is walked on retries), else `fallback`, by default weighted
    least request (a model with affinity passes its hashing policy): a request the picker did
    not answer (down, slow, overloaded) is routed as without a picker. Envoy takes a named
    host only while it is healthy (the default override_host_status: not held out, not
    draining), so a picker that is wrong or behind can never send a request to a server the
    control plane holds out. Proxyless gRPC, which has no override_host, takes the policy
    after it: the fallback's own list."""
    fallback = fallback or least_request_policy()
    override = override_host_pb2.OverrideHost(
        override_host_sources=[
            override_host_pb2.OverrideHost.OverrideHostSource(header=names.PICKED_HEADER),
            override_host_pb2.OverrideHost.OverrideHostSource(
                metadata=metadata_pb2.MetadataKey(
                    key=names.PICKED_METADATA_NS,
                    path=[metadata_pb2.MetadataKey.PathSegment(key=names.PICKED_HEADER)],
                )
            ),
        ],
        fallback_policy=fallback,
    )
    return cluster_pb2.LoadBalancingPolicy(
        policies=[_lb_policy("envoy.load_balancing_policies.override_host", override), *fallback.policies]
    )


def build_picker_cluster(
    endpoints: tuple[tuple[str, int], ...], tls: SideTls | None = None
) -> cluster_pb2.Cluster:
    """The pickers as proxies reach them (build_side_service_cluster)."""
    return build_side_service_cluster(names.PICKER_CLUSTER, endpoints, tls)


def build_side_service_cluster(
    name: str, endpoints: tuple[tuple[str, int], ...], tls: SideTls | None = None
) -> cluster_pb2.Cluster:
    """A service every request may call on the side (the pickers, the rate-limit services) as
    proxies reach it: gRPC (HTTP/2), static IPs, round robin, no circuit breaker of its own.
    One that refuses or resets is ejected for a while, so its share of requests stops paying
    a failed call before they go on without it (each caller fails open). With `tls`, over TLS
    verified against its CA (and with the proxy's certificate: mutual TLS)."""
    c = cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.STATIC,
        connect_timeout=pb.duration(0.25),
        load_assignment=endpoint_pb2.ClusterLoadAssignment(cluster_name=name),
        outlier_detection=outlier_detection_pb2.OutlierDetection(
            consecutive_gateway_failure=wrappers_pb2.UInt32Value(value=2),
            enforcing_consecutive_gateway_failure=wrappers_pb2.UInt32Value(value=100),
            enforcing_consecutive_5xx=wrappers_pb2.UInt32Value(value=0),
            enforcing_success_rate=wrappers_pb2.UInt32Value(value=0),
            interval=pb.duration(1.0),
            base_ejection_time=pb.duration(5.0),
            max_ejection_percent=wrappers_pb2.UInt32Value(value=100),
        ),
    )
    c.typed_extension_protocol_options[HTTP_PROTOCOL_OPTIONS].CopyFrom(
        pb.pack(upstream_http_options(http2=True))
    )
    locality = c.load_assignment.endpoints.add()
    for host, port in endpoints:
        lb = locality.lb_endpoints.add()
        lb.endpoint.address.socket_address.address = host
        lb.endpoint.address.socket_address.port_value = port
    unbounded = CircuitBreaker(max_requests=1 << 20, max_pending=1 << 20)
    c.circuit_breakers.thresholds.extend(
        [_thresholds(base_pb2.DEFAULT, unbounded), _thresholds(base_pb2.HIGH, unbounded)]
    )
    if tls is not None:
        c.transport_socket.name = "envoy.transport_sockets.tls"
        c.transport_socket.typed_config.Pack(upstream_tls(tls))
    return c


def upstream_tls(tls: SideTls) -> tls_pb2.UpstreamTlsContext:
    """TLS to a side service, from files on the proxy's host: its CA verifies the service
    (and the SNI name it must carry, when given); a certificate and key make it mutual. HTTP/2
    is negotiated by ALPN, as gRPC servers require."""
    ctx = tls_pb2.UpstreamTlsContext()
    common = ctx.common_tls_context
    common.alpn_protocols.append("h2")
    common.validation_context.trusted_ca.filename = tls.ca
    if tls.server_name:
        ctx.sni = tls.server_name
        common.validation_context.match_typed_subject_alt_names.add(
            san_type=common_tls_pb2.SubjectAltNameMatcher.DNS
        ).matcher.exact = tls.server_name
    if tls.cert and tls.key:
        cert = common.tls_certificates.add()
        cert.certificate_chain.filename = tls.cert
        cert.private_key.filename = tls.key
    return ctx


def hashing_policy(affinity: Affinity) -> cluster_pb2.LoadBalancingPolicy:
    """Consistent hashing with bounded load: a key keeps its endpoint until that endpoint
    carries more than hash_balance_factor percent of the mean requests in flight."""
    common = common_pb2.ConsistentHashingLbConfig(
        hash_balance_factor=wrappers_pb2.UInt32Value(value=affinity.balance_factor)
    )
    if affinity.algorithm == "ring_hash":
        first = _lb_policy(
            "envoy.load_balancing_policies.ring_hash",
            ring_hash_pb2.RingHash(consistent_hashing_lb_config=common),
        )
    else:
        first = _lb_policy(
            "envoy.load_balancing_policies.maglev", maglev_pb2.Maglev(consistent_hashing_lb_config=common)
        )
    rr = _lb_policy("envoy.load_balancing_policies.round_robin", round_robin_pb2.RoundRobin())
    wrr = wrr_locality_pb2.WrrLocality(endpoint_picking_policy=cluster_pb2.LoadBalancingPolicy(policies=[rr]))
    return cluster_pb2.LoadBalancingPolicy(
        policies=[first, _lb_policy("envoy.load_balancing_policies.wrr_locality", wrr)]
    )


def round_robin_policy() -> cluster_pb2.LoadBalancingPolicy:
    """Plain (weighted) round robin, for Envoy and proxyless gRPC alike."""
    rr = _lb_policy("envoy.load_balancing_policies.round_robin", round_robin_pb2.RoundRobin())
    wrr = wrr_locality_pb2.WrrLocality(endpoint_picking_policy=cluster_pb2.LoadBalancingPolicy(policies=[rr]))
    return cluster_pb2.LoadBalancingPolicy(
        policies=[rr, _lb_policy("envoy.load_balancing_policies.wrr_locality", wrr)]
    )


def _lb_policy(name: str, msg: Message) -> cluster_pb2.LoadBalancingPolicy.Policy:
    return cluster_pb2.LoadBalancingPolicy.Policy(
        typed_extension_config=extension_pb2.TypedExtensionConfig(name=name, typed_config=pb.pack(msg))
    )


def hashed_weights(weights: Mapping[str, int]) -> dict[str, int]:
    """A hashed cluster's EDS weights: each capacity weight squared, over the largest (which
    keeps its value), at least 1; 0 (held out) stays 0.

    Envoy's consistent hashing uses a weight twice: a server's share of the hash table is its
    weight's share of the keys, and its bound (requests in flight before its keys spill) is its
    weight's share of the cluster's. With weights in proportion to capacity, a server 0.35x as
    fast is the home of 0.35x as many prefixes and sessions: every server runs at the same
    utilisation, and a key homed on the slow server waits 1/0.35 = 2.9x as long for each of
    its requests (a cache hit there saves the prefill; the decode stays slow). Chosen in
    expected time (a request costs 1/capacity), a key belongs on a fast server while one is not
    backed up: squared, a slow server homes 0.35^2 = 0.12x the keys of a fast one and is
    bounded at that share of the requests in flight, so it spills sooner."""
    top = max((w for w in weights.values() if w > 0), default=0)
    return {a: (max(1, round(w * w / top)) if w > 0 else w) for a, w in weights.items()}


def ring_hashed(model: Model) -> bool:
    """Whether the model's clusters hash with a ring (gRPC's ring_hash weighs an endpoint by
    its locality's weight times its own, so its locality weighs 1)."""
    return model.affinity is not None and model.affinity.algorithm == "ring_hash"


def build_assignment(
    cname: str,
    version: Version,
    weights: Mapping[str, int],
    priority_of: Callable[[Endpoint], int | None] = lambda ep: 0,
    draining: frozenset[str] = frozenset(),
    *,
    ring_hash: bool = False,
    hashed: bool = False,
    kv_events: KvEventPorts | None = None,
    adapters: Mapping[str, tuple[str, ...]] | None = None,
) -> endpoint_pb2.ClusterLoadAssignment:
    """The version's endpoints with their weights, by EDS priority, one locality each.

    `priority_of` ranks each endpoint (lower first; None: left out because the model does
    not fit its GPU memory); ranks become priorities 0, 1... Weight 0 is sent as UNHEALTHY
    (held out) with weight 1, since EDS weights must be at least 1. Addresses in `draining`
    are sent as DRAINING: no new requests, in-flight ones finish. An address not in `weights`
    (new to the cluster) is held out too while another of the version's servers is weighed
    above 0; with none, it gets DEFAULT_WEIGHT (see EndpointWeights).

    Each endpoint is its own locality (its region and zone, sub_zone its address), weighted
    with the endpoint's weight: Envoy reads the endpoint weight (it ignores locality weights
    unless told otherwise), and gRPC's xds_wrr_locality, which ignores endpoint weights, reads
    the locality's. gRPC's load reports, per locality, so name the endpoint too. A `hashed`
    cluster (a model with affinity) sends its weights squared (hashed_weights). An endpoint
    that publishes KV events (its own `kv_events`, else its version's or `kv_events`'s port on
    its host) says where, for the picker, in its metadata (names.KV_METADATA_NS: `events`,
    `replay`). `adapters`: per address, the restricted adapters it may serve (Model.lb_adapters),
    which its envoy.lb metadata lists for the subset load balancer (adapter_subsets)."""
    if hashed:
        weights = hashed_weights(weights)
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name=cname)
    by_rank: dict[int, list[Endpoint]] = {}
    for ep in version.endpoints:
        rank = priority_of(ep)
        if rank is not None:
            by_rank.setdefault(rank, []).append(ep)
    weighed = any(weights.get(ep.address, 0) > 0 and ep.address not in draining for ep in version.endpoints)
    unweighed = 0 if weighed else DEFAULT_WEIGHT  # the weight of an address new to the cluster
    # EDS priorities must be 0, 1, 2... without gaps: renumber the ranks in use.
    for prio, rank in enumerate(sorted(by_rank)):
        for ep in sorted(by_rank[rank], key=lambda e: (e.region or "", e.zone or "")):
            w = int(weights.get(ep.address, unweighed))
            # gRPC ignores a locality without a weight, so always give one.
            loc = cla.endpoints.add(
                load_balancing_weight=wrappers_pb2.UInt32Value(value=1 if ring_hash else max(1, w)),
                priority=prio,
            )
            loc.locality.sub_zone = ep.address  # unique: gRPC refuses duplicate localities
            if ep.region:
                loc.locality.region = ep.region
            if ep.zone:
                loc.locality.zone = ep.zone
            lb = loc.lb_endpoints.add()
            lb.endpoint.address.socket_address.CopyFrom(
                address_pb2.SocketAddress(address=ep.host, port_value=ep.port)
            )
            if ep.address in draining:
                lb.health_status = health_check_pb2.DRAINING
            elif w <= 0:
                lb.health_status = health_check_pb2.UNHEALTHY
            lb.load_balancing_weight.value = max(1, w)
            publisher = kv_publisher(ep, version.kv_events, kv_events)
            if publisher is not None:
                kv = {"events": publisher[0]} | ({"replay": publisher[1]} if publisher[1] else {})
                lb.metadata.filter_metadata[names.KV_METADATA_NS].update(kv)
            if adapters and adapters.get(ep.address):
                lb.metadata.filter_metadata["envoy.lb"].update(
                    {names.ADAPTER_LB_KEY: list(adapters[ep.address])}
                )
    return cla


def empty_assignment(cname: str) -> endpoint_pb2.ClusterLoadAssignment:
    """What a proxy gets for an EDS name with no data, so its cluster never hangs warming."""
    return endpoint_pb2.ClusterLoadAssignment(cluster_name=cname)
