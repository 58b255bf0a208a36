"""Pure translation: the fleet (and endpoint weights) -> Envoy Listener/Route/Cluster/CLA.

`translate` builds every resource; the listeners (the gateway's filter chain, proxyless
gRPC's API listeners) and the routes are built here, the clusters and endpoint assignments
in clusters.py. Nothing here does I/O. The output is plain protobuf messages keyed by type
URL and name; the xds room serialises them once into a snapshot.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.core.v3 import address_pb2, base_pb2, grpc_service_pb2, substitution_format_string_pb2
from envoy.config.listener.v3 import api_listener_pb2, listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.filters.common.set_filter_state.v3 import value_pb2 as value_pb2_fs
from envoy.extensions.filters.http.buffer.v3 import buffer_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2, processing_mode_pb2
from envoy.extensions.filters.http.header_to_metadata.v3 import header_to_metadata_pb2
from envoy.extensions.filters.http.json_to_metadata.v3 import json_to_metadata_pb2
from envoy.extensions.filters.http.lua.v3 import lua_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.http.set_filter_state.v3 import set_filter_state_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2
from envoy.extensions.retry.priority.previous_priorities.v3 import previous_priorities_config_pb2
from envoy.type.matcher.v3 import metadata_pb2, regex_pb2, string_pb2, value_pb2
from google.protobuf import any_pb2, wrappers_pb2
from google.protobuf.message import Message

from controlplane import limits
from controlplane.fleet.model import Fleet, Model, PriorityClass, TrafficPolicy
from controlplane.resources import names
from controlplane.resources.types import CLUSTER, ENDPOINT, LISTENER, ROUTE
from controlplane.routing import pb
from controlplane.routing.clusters import (
    EndpointWeights,
    adapter_config,
    build_assignment,
    build_cluster,
    build_hold_cluster,
    build_picker_cluster,
    flow_config,
    ring_hashed,
)
from controlplane.routing.quotas import (
    COPIES_FIELDS,
    OUTPUT_LIMIT_FIELDS,
    USAGE_METADATA,
    add_rate_limits,
    build_ratelimit_cluster,
    build_ratelimit_filter,
    build_stream_usage_filter,
    counts_tokens,
    output_metadata_key,
    own_limited_adapters,
)

MODEL_HEADER = names.MODEL_HEADER
METADATA_NS = names.METADATA_NS
JSON_CONTENT_TYPES = r"^application/json(\s*;.*)?$"

# Direct responses follow the OpenAI error shape, so SDKs surface the message.
ERR_UNKNOWN_MODEL = {
    "error": {
        "message": "The model does not exist on this gateway.",
        "type": "invalid_request_error",
        "code": "model_not_found",
    }
}
ERR_NO_MODEL = {
    "error": {
        "message": (
            "No model given: set the 'model' field of a JSON body sent with "
            "'content-type: application/json' (the body is read only then), or the x-model header."
        ),
        "type": "invalid_request_error",
        "code": "model_required",
    }
}

HEALTH_BODY = {"status": "ok"}  # llama.cpp's answer; vLLM's is an empty 200


PRIORITY_HEADER = "x-priority"
RETRY_AFTER_S = 1
ERR_SHED = {
    "error": {
        "message": "The service is saturated for this priority class; retry after the Retry-After delay.",
        "type": "rate_limit_exceeded",
        "code": "rate_limit_exceeded",
    }
}


@dataclass(frozen=True)
class DesiredResources:
    """What every proxy should have. `wildcard` lists, per type, what a wildcard request gets."""

    by_type: Mapping[str, Mapping[str, Message]]
    wildcard: Mapping[str, frozenset[str]] = field(default_factory=dict)


# Priority classes shed per model right now (from the signals): model -> class names.
ShedClasses = Mapping[str, frozenset[str]]

MODEL_VERSION_HEADER = "x-model-version"  # reaches that version of the model at any step


@dataclass(frozen=True)
class RoutingOverlay:
    """What rollouts and drains change on top of the fleet (rollout/overlay.py builds it).

    `splits`: per model, the versions that get traffic and their percent (each above 0); one
    entry routes to that version alone, none to the stable version. `draining`: endpoint
    addresses sent with EDS health status DRAINING, so proxies send them no new requests.
    `shadow`: per model, (version, percent) of requests mirrored to it, responses discarded.
    `unrouted`: clusters (versions leaving or draining) that no route may name, not even the
    x-model-version route to that version. `holding` and `hold_address`: see below."""

    splits: Mapping[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)
    draining: frozenset[str] = frozenset()
    shadow: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    unrouted: frozenset[str] = frozenset()
    # Holding (hold/): `hold_address` is where proxies reach the control plane's holding
    # service (None: off); the models in `holding` have no ready server, and their routes
    # go there instead, so their requests wait for a server rather than get 503.
    holding: frozenset[str] = frozenset()
    hold_address: str | None = None


NO_OVERLAY = RoutingOverlay()


def translate(
    fleet: Fleet,
    weights: EndpointWeights | None = None,
    shed: ShedClasses | None = None,
    overlay: RoutingOverlay = NO_OVERLAY,
) -> DesiredResources:
    """Build every Envoy resource for the fleet. Deterministic: same input, same bytes."""
    weights = weights or {}
    clusters: dict[str, Message] = {}
    assignments: dict[str, Message] = {}
    for model in fleet.models:
        for version in model.versions:
            cname = names.cluster_name(model.name, version.name)
            clusters[cname] = build_cluster(
                model,
                cname,
                fleet.traffic_of(model),
                picked=fleet.picked(model),
                flow=flow_config(fleet, model),
                adapters=adapter_config(fleet, model),
            )
            assignments[cname] = build_assignment(
                cname,
                version,
                weights.get(cname, {}),
                functools.partial(fleet.endpoint_priority, model),
                overlay.draining,
                ring_hash=ring_hashed(model),
                hashed=model.affinity is not None,
                kv_events=model.kv_events,
                adapters=model.lb_adapters(version),
            )
    if overlay.hold_address is not None:
        clusters[names.HOLD_CLUSTER] = build_hold_cluster(overlay.hold_address)
    if picks(fleet):
        clusters[names.PICKER_CLUSTER] = build_picker_cluster(fleet.picker.endpoints, fleet.picker.tls)
    if fleet.quotas is not None:
        clusters[names.RATELIMIT_CLUSTER] = build_ratelimit_cluster(fleet.quotas)
    gateway_routes = build_gateway_routes(fleet, shed or {}, overlay)
    listeners: dict[str, Message] = {names.GATEWAY_LISTENER: build_gateway_listener(fleet)}
    routes: dict[str, Message] = {names.GATEWAY_ROUTES: gateway_routes}
    for model in fleet.models:
        listeners[names.api_listener_name(model.name)] = build_api_listener(model)
        routes[names.api_route_name(model.name)] = build_api_routes(fleet, model, overlay)
    return DesiredResources(
        by_type={CLUSTER: clusters, ENDPOINT: assignments, LISTENER: listeners, ROUTE: routes},
        # API listeners are only for proxyless gRPC clients, which ask for them by name.
        wildcard={LISTENER: frozenset({names.GATEWAY_LISTENER})},
    )


def holds(model: Model, overlay: RoutingOverlay) -> bool:
    """Whether the model's requests go to the holding service now (HTTP/1 models only)."""
    return overlay.hold_address is not None and model.name in overlay.holding and model.protocol == "http1"


def _hcm_filter(hcm: hcm_pb2.HttpConnectionManager) -> listener_components_pb2.Filter:
    return listener_components_pb2.Filter(
        name="envoy.filters.network.http_connection_manager", typed_config=pb.pack(hcm)
    )


def _router() -> hcm_pb2.HttpFilter:
    return hcm_pb2.HttpFilter(name="envoy.filters.http.router", typed_config=pb.pack(router_pb2.Router()))


BUFFER_FILTER = "envoy.filters.http.buffer"


def _buffer(fleet: Fleet) -> hcm_pb2.HttpFilter:
    """Request bodies over the limit get 413. Routes by x-model header apply their model's
    limit; a body-routed request's model is only known once its body is read, so the
    listener-wide limit (the largest of any model) applies to it."""
    limit = max(
        (fleet.traffic_of(m).max_body_bytes for m in fleet.models), default=TrafficPolicy().max_body_bytes
    )
    cfg = buffer_pb2.Buffer(max_request_bytes=wrappers_pb2.UInt32Value(value=limit))
    return hcm_pb2.HttpFilter(name=BUFFER_FILTER, typed_config=pb.pack(cfg))


def _json_rule(field: str, key: str) -> json_to_metadata_pb2.JsonToMetadata.Rule:
    return json_to_metadata_pb2.JsonToMetadata.Rule(
        selectors=[json_to_metadata_pb2.JsonToMetadata.Selector(key=field)],
        on_present=json_to_metadata_pb2.JsonToMetadata.KeyValuePair(
            metadata_namespace=METADATA_NS,
            key=key,
            type=json_to_metadata_pb2.JsonToMetadata.STRING,
        ),
    )


def affinity_state_key(body_field: str) -> str:
    """The filter-state key a body affinity field is hashed from."""
    return f"{METADATA_NS}.affinity.{body_field}"


def _affinity_body_fields(fleet: Fleet) -> list[str]:
    """The body fields requests hash on: the affinity ones, and `model` where a model hashes
    its adapters' requests on their name (Affinity.adapter)."""
    fields = {m.affinity.body_field for m in fleet.models if m.affinity and m.affinity.body_field}
    fields |= {ADAPTER_FIELD for m in fleet.models if m.affinity and m.affinity.adapter}
    return sorted(fields)


PREFIX_FIELD = "prefix"  # affinity_prefix in metadata; never a body field name (AFFINITY_BODY_FIELDS)
ADAPTER_FIELD = "model"  # the body's model, hashed for Affinity.adapter (affinity_model in metadata)
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"


def picks(fleet: Fleet) -> bool:
    """Whether any model asks a picker for its requests' servers."""
    return any(fleet.picked(m) for m in fleet.models)


def _processing_mode(response_headers: int) -> processing_mode_pb2.ProcessingMode:
    return processing_mode_pb2.ProcessingMode(
        request_header_mode=processing_mode_pb2.ProcessingMode.SEND,
        response_header_mode=response_headers,
        request_body_mode=processing_mode_pb2.ProcessingMode.NONE,
        response_body_mode=processing_mode_pb2.ProcessingMode.NONE,
        request_trailer_mode=processing_mode_pb2.ProcessingMode.SKIP,
        response_trailer_mode=processing_mode_pb2.ProcessingMode.SKIP,
    )


# What a pick asks of Envoy for the rest of its stream (`mode_override`, the only override
# the filter allows): the response's headers, so the picker sees the request end.
PICKED_MODE = _processing_mode(processing_mode_pb2.ProcessingMode.SEND)
# ...and, for a model with flow control, its trailers too: the response's end (Envoy adds
# empty trailers where the response has none), when its server's slot is free again. Its
# headers alone do not say that: a streamed response's come before its first token, and
# Envoy closes the picker's stream once it has nothing more to send it.
FLOW_PICKED_MODE = processing_mode_pb2.ProcessingMode(
    request_header_mode=processing_mode_pb2.ProcessingMode.SEND,
    response_header_mode=processing_mode_pb2.ProcessingMode.SEND,
    request_body_mode=processing_mode_pb2.ProcessingMode.NONE,
    response_body_mode=processing_mode_pb2.ProcessingMode.NONE,
    request_trailer_mode=processing_mode_pb2.ProcessingMode.SKIP,
    response_trailer_mode=processing_mode_pb2.ProcessingMode.SEND,
)


def _picker_filter(fleet: Fleet) -> hcm_pb2.HttpFilter:
    """Envoy asks a picker (picker/) which server takes the request, on the routes of models
    with `balancing: picker` only: off for the gateway's virtual host, on for their routes
    (`_picker_off`, `_picker_on`). Not `disabled` here with `FilterConfig` per route: Envoy
    decides that when it builds the filter chain, from the route the headers alone match, and
    a body-routed request only finds its route once json_to_metadata has read the body (seen:
    the picker was never asked). The filter reads its per-route config when it runs. It sends the request
    headers and the model json_to_metadata read (and the route's cluster, so the picker picks
    in the version the route chose), never the body: with no body sent, a picker that is
    down, errs, or does not answer within picker.timeout costs the request nothing but the
    wait (failure_mode_allow), and the cluster's policy routes it by the weights
    (clusters.picked_policy). The answer sets the picked-endpoint header (and the envoy.lb
    metadata) and nothing else; the route is not looked up again, and the picker may not
    answer in Envoy's place (disable_immediate_response).

    The response's headers go to the picker only for a request it picked: the filter's
    mode skips them, and a pick overrides that for its stream (PICKED_MODE, the one
    override allowed). They tell it, with `upstream.address`, that the request has ended
    (or, streamed, started answering) and where it went, so it counts each server's
    requests in flight. Sending them always would send a local reply's too: a request
    refused before the filter (a quota's 429 from the rate-limit filter before it, a body
    over the limit) never ran the filter's request side, yet its response passes through
    the filter on the way out, and Envoy opened a picker stream for it (seen: 29 quota
    429s and one 200 started 30 streams, 1 pick). A picker that hangs after a pick costs
    that response's headers at most the budget once more (then failure_mode_allow again).

    With `flow_control` on any picked model (docs/flow-control.md), a picker holds the
    requests of a model whose every server is full: it tells Envoy to wait for its answer up
    to the request's class's maximum wait (`override_message_timeout`, at most
    `max_message_timeout`: the longest wait of any model plus FLOW_TIMEOUT_MARGIN_S), then
    answers with the server, or with a 429 in Envoy's place (immediate responses are allowed
    then) a moment before that wait ends. A picker that dies releases what it held at once
    (the stream breaks: failure_mode_allow), one that hangs when the class's wait ends."""
    queues = [f.longest_wait() for m in fleet.models if fleet.picked(m) and (f := fleet.flow_control_of(m))]
    # A picker that loads an adapter for a request (placement: dynamic) asks Envoy to wait
    # for it as a queue does (docs/adapters.md).
    loads = any(fleet.picked(m) and m.adapters and m.placement == "dynamic" for m in fleet.models)
    longest = max([*queues, ADAPTER_LOAD_WAIT_S if loads else 0.0])
    cfg = ext_proc_pb2.ExternalProcessor(
        grpc_service=grpc_service_pb2.GrpcService(
            envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=names.PICKER_CLUSTER),
            timeout=pb.duration(fleet.picker.timeout_s),
        ),
        failure_mode_allow=True,
        processing_mode=_processing_mode(processing_mode_pb2.ProcessingMode.SKIP),
        allow_mode_override=True,
        allowed_override_modes=[PICKED_MODE, FLOW_PICKED_MODE] if queues else [PICKED_MODE],
        disable_immediate_response=not (queues or loads),
        request_attributes=["xds.cluster_name"],
        response_attributes=["upstream.address"],
        message_timeout=pb.duration(fleet.picker.timeout_s),
        max_message_timeout=pb.duration(longest + FLOW_TIMEOUT_MARGIN_S) if queues or loads else None,
        stat_prefix="picker",
        metadata_options=ext_proc_pb2.MetadataOptions(
            forwarding_namespaces=ext_proc_pb2.MetadataOptions.MetadataNamespaces(
                untyped=[METADATA_NS, names.SUBSET_METADATA_NS]
            ),
            receiving_namespaces=ext_proc_pb2.MetadataOptions.MetadataNamespaces(
                untyped=[names.PICKED_METADATA_NS]
            ),
        ),
        disable_clear_route_cache=True,
    )
    return hcm_pb2.HttpFilter(name=EXT_PROC_FILTER, typed_config=pb.pack(cfg))


# How long a request may wait while a picker loads its adapter onto a server (placement:
# dynamic): vLLM loads one from local disk in well under a second; a download takes longer.
ADAPTER_LOAD_WAIT_S = 30.0
FLOW_TIMEOUT_MARGIN_S = 1.0  # max_message_timeout past the longest wait of any model: a cap, never reached


def _picker_off() -> any_pb2.Any:
    """The picker filter's config for the gateway's virtual host: off."""
    return pb.pack(ext_proc_pb2.ExtProcPerRoute(disabled=True))


def _picker_on() -> any_pb2.Any:
    """The picker filter's config for a picked model's route: on (the most specific wins)."""
    return pb.pack(
        ext_proc_pb2.ExtProcPerRoute(
            overrides=ext_proc_pb2.ExtProcOverrides(failure_mode_allow=wrappers_pb2.BoolValue(value=True))
        )
    )


LUA_FILTER = "envoy.filters.http.lua"
PREFIX_KEY_LUA = (Path(__file__).with_name("prefix_key.lua")).read_text()


def _prefix_affinity(fleet: Fleet) -> bool:
    return any(m.affinity is not None and m.affinity.prefix is not None for m in fleet.models)


def _sends_prompt(fleet: Fleet, model: Model) -> bool:
    """The picker gets this model's request body (controlplane.prompt metadata): it is picked,
    and has a tokenizer for the precise prefix index."""
    return bool(model.tokenizer) and fleet.picked(model)


def _lua_needed(fleet: Fleet) -> bool:
    return _prefix_affinity(fleet) or any(_sends_prompt(fleet, m) for m in fleet.models)


def _prefix_key_filter() -> hcm_pb2.HttpFilter:
    """Envoy's Lua filter with prefix_key.lua: the key of a prefix-affinity model's request
    (its route's metadata says how to take it), into dynamic metadata. It runs once the
    buffer filter holds the whole body."""
    cfg = lua_pb2.Lua(default_source_code=base_pb2.DataSource(inline_string=PREFIX_KEY_LUA))
    return hcm_pb2.HttpFilter(name=LUA_FILTER, typed_config=pb.pack(cfg))


def _affinity_filter_state(fields: list[str]) -> hcm_pb2.HttpFilter:
    """Body fields copied to metadata become hashable filter state (`envoy.hashable_string`;
    the plain string factory does not hash, and requests would spread at random). It runs
    after json_to_metadata has read the body, which holds the filter chain until then."""
    cfg = set_filter_state_pb2.Config(
        on_request_headers=[
            value_pb2_fs.FilterStateValue(
                object_key=affinity_state_key(f),
                factory_key="envoy.hashable_string",
                format_string=substitution_format_string_pb2.SubstitutionFormatString(
                    text_format_source=base_pb2.DataSource(
                        inline_string=f"%DYNAMIC_METADATA({METADATA_NS}:affinity_{f})%"
                    ),
                    # A request without the key formats as "" (not "-"), so it is skipped and
                    # the route's fallback hash applies: keyless requests must not all hash
                    # alike onto one server.
                    omit_empty_values=True,
                ),
                skip_if_empty=True,
            )
            for f in fields
        ]
    )
    return hcm_pb2.HttpFilter(name="envoy.filters.http.set_filter_state", typed_config=pb.pack(cfg))


def _adapter_subsets(fleet: Fleet) -> bool:
    """Whether an adapter of some model may be served by some of its servers only: then the
    request's model goes to envoy.lb too (clusters.adapter_subsets)."""
    return any(m.restricted_adapters for m in fleet.models)


def _model_to_lb() -> hcm_pb2.HttpFilter:
    """The x-model header's name into envoy.lb (names.ADAPTER_LB_KEY), after the body's, so
    that the name the request is routed by is the one its subset is chosen by."""
    cfg = header_to_metadata_pb2.Config(
        request_rules=[
            header_to_metadata_pb2.Config.Rule(
                header=MODEL_HEADER,
                on_header_present=header_to_metadata_pb2.Config.KeyValuePair(
                    metadata_namespace="envoy.lb",
                    key=names.ADAPTER_LB_KEY,
                    type=header_to_metadata_pb2.Config.STRING,
                ),
            )
        ]
    )
    return hcm_pb2.HttpFilter(name="envoy.filters.http.header_to_metadata", typed_config=pb.pack(cfg))


def _json_to_metadata(
    affinity_fields: list[str] | None = None, tokens: bool = False, subsets: bool = False
) -> hcm_pb2.HttpFilter:
    """The model (and affinity fields) from the request's JSON body; with token quotas
    (routing/quotas.py), every limit on its output and count of completions it may carry
    (OUTPUT_LIMIT_FIELDS, COPIES_FIELDS) too, and the response's usage.total_tokens (a JSON
    response's; a stream's is text/event-stream and passes by: the stream usage filter reads
    its usage event, if it has one)."""
    rules = [_json_rule("model", "model")]
    if subsets:  # the body's model picks a restricted adapter's subset (clusters.adapter_subsets)
        lb = _json_rule("model", names.ADAPTER_LB_KEY)
        lb.on_present.metadata_namespace = "envoy.lb"
        rules.append(lb)
    rules += [_json_rule(f, f"affinity_{f}") for f in affinity_fields or []]
    if tokens:
        for key, path in {**OUTPUT_LIMIT_FIELDS, **COPIES_FIELDS}.items():
            rule = _json_rule(path[0], output_metadata_key(key))
            for step in path[1:]:
                rule.selectors.add(key=step)
            rules.append(rule)
    cfg = json_to_metadata_pb2.JsonToMetadata(
        request_rules=json_to_metadata_pb2.JsonToMetadata.MatchRules(
            rules=rules,
            allow_content_types_regex=regex_pb2.RegexMatcher(regex=JSON_CONTENT_TYPES),
        )
    )
    if tokens:
        usage = _json_rule("usage", USAGE_METADATA)
        usage.selectors.add(key="total_tokens")
        cfg.response_rules.CopyFrom(
            json_to_metadata_pb2.JsonToMetadata.MatchRules(
                rules=[usage], allow_content_types_regex=regex_pb2.RegexMatcher(regex=JSON_CONTENT_TYPES)
            )
        )
    return hcm_pb2.HttpFilter(name="envoy.filters.http.json_to_metadata", typed_config=pb.pack(cfg))


def _retry_after() -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key="retry-after", value=str(RETRY_AFTER_S)),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _overflow_is_429() -> hcm_pb2.LocalReplyConfig:
    """A request refused by a circuit breaker (Envoy's 503 with flag UO) is load shedding:
    answer 429 with Retry-After in OpenAI's shape, which clients back off and retry on."""
    return hcm_pb2.LocalReplyConfig(
        mappers=[
            hcm_pb2.ResponseMapper(
                filter=accesslog_pb2.AccessLogFilter(
                    response_flag_filter=accesslog_pb2.ResponseFlagFilter(flags=["UO"])
                ),
                status_code=wrappers_pb2.UInt32Value(value=429),
                body=base_pb2.DataSource(inline_string=json.dumps(ERR_SHED, separators=(",", ":"))),
                headers_to_add=[_retry_after(), _json_header()],
            )
        ]
    )


def _counts_tokens(fleet: Fleet) -> bool:
    return fleet.quotas is not None and counts_tokens(fleet.quotas)


def build_gateway_listener(fleet: Fleet) -> listener_pb2.Listener:
    """The listener every Envoy serves inference traffic on: HCM with RDS over ADS."""
    hcm = hcm_pb2.HttpConnectionManager(
        stat_prefix="inference",
        codec_type=hcm_pb2.HttpConnectionManager.AUTO,
        rds=hcm_pb2.Rds(config_source=pb.ads(), route_config_name=names.GATEWAY_ROUTES),
        http_filters=[
            _buffer(fleet),
            _json_to_metadata(
                body_fields := _affinity_body_fields(fleet),
                tokens=_counts_tokens(fleet),
                subsets=_adapter_subsets(fleet),
            ),
            *([_model_to_lb()] if _adapter_subsets(fleet) else []),
            *([_prefix_key_filter()] if _lua_needed(fleet) else []),
            *(
                [_affinity_filter_state(state_fields)]
                if (state_fields := body_fields + ([PREFIX_FIELD] if _prefix_affinity(fleet) else []))
                else []
            ),
            *([build_stream_usage_filter()] if _counts_tokens(fleet) else []),
            *([build_ratelimit_filter(fleet.quotas)] if fleet.quotas is not None else []),
            *([_picker_filter(fleet)] if picks(fleet) else []),
            _router(),
        ],
        local_reply_config=_overflow_is_429(),
    )
    return listener_pb2.Listener(
        name=names.GATEWAY_LISTENER,
        address=address_pb2.Address(
            socket_address=address_pb2.SocketAddress(
                address=fleet.listener.address, port_value=fleet.listener.port
            )
        ),
        filter_chains=[listener_components_pb2.FilterChain(filters=[_hcm_filter(hcm)])],
    )


def build_api_listener(model: Model) -> listener_pb2.Listener:
    """An API listener for proxyless gRPC clients dialing xds:///<model>."""
    hcm = hcm_pb2.HttpConnectionManager(
        stat_prefix=names.stat_name(model.name),
        rds=hcm_pb2.Rds(config_source=pb.ads(), route_config_name=names.api_route_name(model.name)),
        http_filters=[_router()],
    )
    return listener_pb2.Listener(
        name=names.api_listener_name(model.name),
        api_listener=api_listener_pb2.ApiListener(api_listener=pb.pack(hcm)),
    )


def _json_header() -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key="content-type", value="application/json"),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _direct(
    name: str, status: int, body: object, match: route_components_pb2.RouteMatch
) -> route_components_pb2.Route:
    return route_components_pb2.Route(
        name=name,
        match=match,
        direct_response=route_components_pb2.DirectResponseAction(
            status=status,
            body=base_pb2.DataSource(inline_string=json.dumps(body, separators=(",", ":"))),
        ),
        response_headers_to_add=[_json_header()],
    )


# Retried: a request whose server never answered (the connection failed, the stream was
# refused, or the connection was reset before the response began: a server that died with
# the request, whose work is lost anyway), and 507 (the server is out of memory, another may
# not be). Never once a response has started: Envoy retries only before it has sent response
# headers downstream, and 5xx other than 507 and timeouts are not retried.
RETRY_ON = "connect-failure,refused-stream,reset,retriable-status-codes"
RETRIABLE_STATUS_CODES = (507,)


def _model_action(
    fleet: Fleet,
    model: Model,
    *,
    proxyless: bool = False,
    high: bool = False,
    overlay: RoutingOverlay = NO_OVERLAY,
    version: str | None = None,
    adapter_key: str | None = None,
) -> route_components_pb2.RouteAction:
    """Where a model's requests go: `version` alone when given, else the overlay's split (a
    rollout in progress), else the stable version. `adapter_key`: the route takes requests
    naming one of the model's adapters, by the x-model header ("header") or the body ("body"),
    and hashes them on that name when the model's affinity is by adapter."""
    t = fleet.traffic_of(model)
    action = route_components_pb2.RouteAction(
        timeout=pb.duration(t.timeout_s),
        priority=base_pb2.HIGH if high else base_pb2.DEFAULT,
    )
    if version is None and not proxyless and holds(model, overlay):
        # No server of the model is ready: wait in the holding service, not 503. The same
        # timeouts apply; the service sends the request on as soon as a server is ready.
        action.cluster = names.HOLD_CLUSTER
        action.idle_timeout.CopyFrom(pb.duration(t.stream_idle_timeout_s or t.timeout_s))
        return action
    split = () if version is not None else overlay.splits.get(model.name, ())
    if len(split) > 1:
        for v, percent in split:
            action.weighted_clusters.clusters.add(
                name=names.cluster_name(model.name, v), weight=wrappers_pb2.UInt32Value(value=percent)
            )
    else:
        target = version or (split[0][0] if split else model.stable)
        action.cluster = names.cluster_name(model.name, target)
    shadow = overlay.shadow.get(model.name)
    if shadow is not None and version is None and not proxyless:
        mirror = action.request_mirror_policies.add(cluster=names.cluster_name(model.name, shadow[0]))
        mirror.runtime_fraction.default_value.numerator = shadow[1]
    a = model.affinity
    keyed = None
    if a is not None and a.header is not None:
        keyed = action.hash_policy.add()
        keyed.header.header_name = a.header
    elif a is not None and a.body_field is not None and not proxyless:
        keyed = action.hash_policy.add()
        keyed.filter_state.key = affinity_state_key(a.body_field)
    elif a is not None and a.prefix is not None and not proxyless:
        keyed = action.hash_policy.add()
        keyed.filter_state.key = affinity_state_key(PREFIX_FIELD)
    elif a is not None and a.adapter and adapter_key is not None and not proxyless:
        keyed = action.hash_policy.add()
        if adapter_key == "header":
            keyed.header.header_name = MODEL_HEADER
        else:
            keyed.filter_state.key = affinity_state_key(ADAPTER_FIELD)
    if keyed is not None and not proxyless:
        # A request without a key hashes on its request id: spread as at random, within the
        # bounded load, instead of every keyless request on one server.
        keyed.terminal = True
        action.hash_policy.add().header.header_name = "x-request-id"
    if proxyless:
        return _proxyless_action(action, t)
    # Always set: Envoy's own default (5 min, from the listener) would cut a long generation.
    action.idle_timeout.CopyFrom(pb.duration(t.stream_idle_timeout_s or t.timeout_s))
    if t.retries:
        action.retry_policy.CopyFrom(
            route_components_pb2.RetryPolicy(
                retry_on=RETRY_ON,
                retriable_status_codes=RETRIABLE_STATUS_CODES,
                num_retries=wrappers_pb2.UInt32Value(value=t.retries),
                retry_host_predicate=[
                    route_components_pb2.RetryPolicy.RetryHostPredicate(
                        name="envoy.retry_host_predicates.previous_hosts",
                        typed_config=pb.pack(previous_hosts_pb2.PreviousHostsPredicate()),
                    )
                ],
                host_selection_retry_max_attempts=5,
                # After two failed attempts in one priority (both preferred hosts down, say),
                # the next retry goes to the next priority: the fallback GPU class.
                retry_priority=route_components_pb2.RetryPolicy.RetryPriority(
                    name="envoy.retry_priorities.previous_priorities",
                    typed_config=pb.pack(
                        previous_priorities_config_pb2.PreviousPrioritiesConfig(update_frequency=2)
                    ),
                ),
            )
        )
    return action


# Retried for proxyless gRPC: UNAVAILABLE, what a call gets when no server took it (a refused
# or lost connection, a server going away). gRPC retries only before the response headers
# arrive, so a started generation is never sent again.
PROXYLESS_RETRY_ON = "unavailable"


def _proxyless_action(
    action: route_components_pb2.RouteAction, t: TrafficPolicy
) -> route_components_pb2.RouteAction:
    """The same route action in gRPC's terms: gRPC ignores `timeout` and reads
    max_stream_duration as the call's deadline (gRFC A31), takes gRPC status codes as retry
    conditions (gRFC A44), and has no idle timeout or retry predicates."""
    action.max_stream_duration.max_stream_duration.CopyFrom(pb.duration(t.timeout_s))
    if t.retries:
        action.retry_policy.CopyFrom(
            route_components_pb2.RetryPolicy(
                retry_on=PROXYLESS_RETRY_ON,
                num_retries=wrappers_pb2.UInt32Value(value=t.retries),
                retry_back_off=route_components_pb2.RetryPolicy.RetryBackOff(
                    base_interval=pb.duration(0.025), max_interval=pb.duration(0.25)
                ),
            )
        )
    return action


def _model_route(
    fleet: Fleet,
    model: Model,
    name: str,
    match: route_components_pb2.RouteMatch,
    *,
    high: bool = False,
    overlay: RoutingOverlay = NO_OVERLAY,
    version: str | None = None,
    adapter_key: str | None = None,
) -> route_components_pb2.Route:
    route = route_components_pb2.Route(
        name=name,
        match=match,
        route=_model_action(
            fleet, model, high=high, overlay=overlay, version=version, adapter_key=adapter_key
        ),
    )
    add_rate_limits(fleet, model, route.route, adapter_key=adapter_key)
    if route.route.cluster == names.HOLD_CLUSTER:
        held = route.request_headers_to_add.add(
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
        )
        held.header.key = names.HOLD_MODEL_HEADER
        held.header.value = model.name
        stands_for = [names.cluster_name(model.name, v) for v, _ in overlay.splits.get(model.name, ())] or [
            names.cluster_name(model.name, model.stable)
        ]
        route.metadata.filter_metadata[HOLD_METADATA].update({"clusters": stands_for})
    body_limit = buffer_pb2.BufferPerRoute(
        buffer=buffer_pb2.Buffer(
            max_request_bytes=wrappers_pb2.UInt32Value(value=fleet.traffic_of(model).max_body_bytes)
        )
    )
    route.typed_per_filter_config[BUFFER_FILTER].CopyFrom(pb.pack(body_limit))
    if fleet.picked(model) and route.route.cluster != names.HOLD_CLUSTER:
        route.typed_per_filter_config[EXT_PROC_FILTER].CopyFrom(_picker_on())
    if _sends_prompt(fleet, model) and route.route.cluster != names.HOLD_CLUSTER:
        prompt = {"prompt_max_bytes": limits.PICKER_PROMPT_MAX_BYTES}
        route.metadata.filter_metadata[LUA_FILTER].update(prompt)
    prefix = model.affinity.prefix if model.affinity is not None else None
    if prefix is not None:
        route.metadata.filter_metadata[LUA_FILTER].update(
            {
                "prefix_messages": prefix.messages,
                "prefix_prompt_bytes": prefix.prompt_bytes,
                "prefix_max_bytes": prefix.max_bytes,
            }
        )
    return route


def model_names(model: Model) -> string_pb2.StringMatcher:
    """What a request's model must be to take `model`'s routes: its name, or one of its
    adapters' (a request naming an adapter is its base model's: tier, rollout, classes and
    servers; the picker finds the servers holding the adapter). Names are letters, digits
    and . _ : / - (fleet/schema_adapters.py): only the dot needs escaping in RE2, which
    Envoy matches against the whole value."""
    if not model.adapters:
        return string_pb2.StringMatcher(exact=model.name)
    return _names_regex([model.name, *(a.name for a in model.adapters)])


def _names_regex(names: list[str]) -> string_pb2.StringMatcher:
    alternatives = "|".join(n.replace(".", "\\.") for n in names)
    return string_pb2.StringMatcher(safe_regex=regex_pb2.RegexMatcher(regex=f"(?:{alternatives})"))


def _namings(fleet: Fleet, model: Model) -> list[tuple[str, string_pb2.StringMatcher, bool]]:
    """The ways a request names `model`, each with its own routes: (route name suffix, what the
    name must be, whether it names an adapter). One, model_names, unless the model hashes its
    requests by adapter (Affinity.adapter) or quotas name one of its adapters: then the base
    model's name alone and its adapters' names. With Affinity.adapter the base model's requests
    spread within the bound (no key) and its adapters' are hashed on the name (each adapter
    keeps to the servers that hold it); with quotas, the adapters' route asks for the adapter's
    limits too (routing/quotas.py)."""
    by_adapter = model.affinity is not None and model.affinity.adapter
    if not (by_adapter or own_limited_adapters(fleet, model)):
        return [("", model_names(model), False)]
    return [
        ("", string_pb2.StringMatcher(exact=model.name), False),
        ("/adapters", _names_regex([a.name for a in model.adapters]), True),
    ]


def _metadata_model(value: value_pb2.ValueMatcher) -> metadata_pb2.MetadataMatcher:
    return metadata_pb2.MetadataMatcher(
        filter=METADATA_NS,
        path=[metadata_pb2.MetadataMatcher.PathSegment(key="model")],
        value=value,
    )


def _class_routes(
    fleet: Fleet,
    model: Model,
    name: str,
    headers: list[route_components_pb2.HeaderMatcher],
    metadata: list[metadata_pb2.MetadataMatcher],
    shed: frozenset[str],
    overlay: RoutingOverlay = NO_OVERLAY,
    adapter_key: str | None = None,
) -> list[route_components_pb2.Route]:
    """A model's routes for one way of naming it: with several versions, a route per version
    for requests that name one in x-model-version; a route per priority class that is treated
    unlike the default class (shed with 429, or sent at routing priority HIGH), then the
    default class's route, which also takes requests without x-priority."""

    def behaviour(c: PriorityClass) -> str:
        return "shed" if c.name in shed else ("high" if c.high else "normal")

    default = next((c for c in fleet.priority_classes if c.name == fleet.default_priority_class), None)
    default_behaviour = behaviour(default) if default is not None else "normal"
    out: list[route_components_pb2.Route] = []

    def match_also(header: str, value: str) -> route_components_pb2.RouteMatch:
        exact = route_components_pb2.HeaderMatcher(
            name=header, string_match=string_pb2.StringMatcher(exact=value)
        )
        return route_components_pb2.RouteMatch(
            prefix="/", headers=[*headers, exact], dynamic_metadata=metadata
        )

    routable = [v for v in model.versions if names.cluster_name(model.name, v.name) not in overlay.unrouted]
    if len(routable) > 1:
        for v in routable:
            match = match_also(MODEL_VERSION_HEADER, v.name)
            out.append(
                _model_route(fleet, model, f"{name}@{v.name}", match, version=v.name, adapter_key=adapter_key)
            )
    for c in fleet.priority_classes:
        b = behaviour(c)
        if c is default or b == default_behaviour:
            continue
        match = match_also(PRIORITY_HEADER, c.name)
        out.append(
            _shed_route(f"{name}/{c.name}", match)
            if b == "shed"
            else _model_route(
                fleet,
                model,
                f"{name}/{c.name}",
                match,
                high=b == "high",
                overlay=overlay,
                adapter_key=adapter_key,
            )
        )
    match = route_components_pb2.RouteMatch(prefix="/", headers=headers, dynamic_metadata=metadata)
    if default_behaviour == "shed":
        out.append(_shed_route(name, match))
    else:
        out.append(
            _model_route(
                fleet,
                model,
                name,
                match,
                high=default_behaviour == "high",
                overlay=overlay,
                adapter_key=adapter_key,
            )
        )
    return out


def _shed_route(name: str, match: route_components_pb2.RouteMatch) -> route_components_pb2.Route:
    route = _direct(name, 429, ERR_SHED, match)
    route.response_headers_to_add.append(_retry_after())
    return route


def build_gateway_routes(
    fleet: Fleet, shed: ShedClasses | None = None, overlay: RoutingOverlay = NO_OVERLAY
) -> route_pb2.RouteConfiguration:
    """x-model header first, then the JSON body's `model`; unknown -> 404, none -> 400.
    Per model, priority classes that are shed get 429 and high ones routing priority HIGH;
    a rollout's split (the overlay) applies to every class."""
    shed = shed or {}
    header_absent = route_components_pb2.HeaderMatcher(
        name=MODEL_HEADER, present_match=True, invert_match=True
    )
    routes: list[route_components_pb2.Route] = [
        # The gateway's own health, as a model server answers it (vLLM, llama.cpp, TGI serve
        # GET /health): benchmark tools check it before they start (guidellm refused the
        # gateway on the 400 below), load balancers probe it. With x-model set, the request
        # goes on to that model's servers, whose own /health answers.
        *(
            _direct(
                f"health-{method.lower()}",
                200,
                HEALTH_BODY,
                route_components_pb2.RouteMatch(
                    path="/health",
                    headers=[
                        route_components_pb2.HeaderMatcher(
                            name=":method", string_match=string_pb2.StringMatcher(exact=method)
                        ),
                        header_absent,
                    ],
                ),
            )
            for method in ("GET", "HEAD")
        ),
        _direct(
            "list-models",
            200,
            {
                "object": "list",
                "data": [
                    entry
                    for m in fleet.models
                    for entry in (
                        {"id": m.name, "object": "model", "owned_by": "controlplane"},
                        *(
                            # As vLLM lists its adapters: the base model as `parent`.
                            {
                                "id": a.name,
                                "object": "model",
                                "owned_by": "controlplane",
                                "parent": m.name,
                                "root": a.source or a.name,
                            }
                            for a in m.adapters
                        ),
                    )
                ],
            },
            route_components_pb2.RouteMatch(
                path="/v1/models",
                headers=[
                    route_components_pb2.HeaderMatcher(
                        name=":method",
                        string_match=string_pb2.StringMatcher(exact="GET"),
                    )
                ],
            ),
        ),
    ]
    for model in fleet.models:
        for suffix, matcher, adapters in _namings(fleet, model):
            routes += _class_routes(
                fleet,
                model,
                f"header/{model.name}{suffix}",
                [route_components_pb2.HeaderMatcher(name=MODEL_HEADER, string_match=matcher)],
                [],
                shed.get(model.name, frozenset()),
                overlay,
                adapter_key="header" if adapters else None,
            )
    for model in fleet.models:
        for suffix, matcher, adapters in _namings(fleet, model):
            routes += _class_routes(
                fleet,
                model,
                f"body/{model.name}{suffix}",
                [header_absent],
                [_metadata_model(value_pb2.ValueMatcher(string_match=matcher))],
                shed.get(model.name, frozenset()),
                overlay,
                adapter_key="body" if adapters else None,
            )
    routes.append(
        _direct(
            "unknown-model-header",
            404,
            ERR_UNKNOWN_MODEL,
            route_components_pb2.RouteMatch(
                prefix="/",
                headers=[route_components_pb2.HeaderMatcher(name=MODEL_HEADER, present_match=True)],
            ),
        )
    )
    routes.append(
        _direct(
            "unknown-model-body",
            404,
            ERR_UNKNOWN_MODEL,
            route_components_pb2.RouteMatch(
                prefix="/",
                dynamic_metadata=[_metadata_model(value_pb2.ValueMatcher(present_match=True))],
            ),
        )
    )
    routes.append(_direct("no-model", 400, ERR_NO_MODEL, route_components_pb2.RouteMatch(prefix="/")))
    vhost = route_components_pb2.VirtualHost(name="inference", domains=["*"], routes=routes)
    if picks(fleet):
        vhost.typed_per_filter_config[EXT_PROC_FILTER].CopyFrom(_picker_off())
    return route_pb2.RouteConfiguration(name=names.GATEWAY_ROUTES, virtual_hosts=[vhost])


def build_api_routes(
    fleet: Fleet, model: Model, overlay: RoutingOverlay = NO_OVERLAY
) -> route_pb2.RouteConfiguration:
    """Routes for a proxyless gRPC client of one model: to the stable cluster, or a rollout's
    split as weighted clusters (gRPC subscribes to each cluster a route names and switches
    routes once it has them all)."""
    return route_pb2.RouteConfiguration(
        name=names.api_route_name(model.name),
        virtual_hosts=[
            route_components_pb2.VirtualHost(
                name=model.name,
                domains=["*"],
                routes=[
                    route_components_pb2.Route(
                        match=route_components_pb2.RouteMatch(prefix=""),
                        route=_model_action(fleet, model, proxyless=True, overlay=overlay),
                    )
                ],
            )
        ],
    )


HOLD_METADATA = "controlplane.hold"  # a holding route's metadata: the clusters it stands for


def entry_refs(route: route_components_pb2.Route) -> frozenset[str]:
    """The clusters one route entry sends traffic to. A holding entry (to the holding
    service) stands for the model's own clusters too: make-before-break holds it back, like
    them, from a proxy that does not have them (a new model whose cluster it refused keeps
    answering 404, never reaching its servers around the proxy)."""
    if not route.HasField("route"):
        return frozenset()
    out = {w.name for w in route.route.weighted_clusters.clusters}
    if route.route.cluster:
        out.add(route.route.cluster)
    held = route.metadata.filter_metadata.get(HOLD_METADATA)
    if held is not None and "clusters" in held.fields:
        out |= {v.string_value for v in held.fields["clusters"].list_value.values}
    return frozenset(out)


def cluster_refs(msg: Message) -> frozenset[str]:
    """The cluster names a RouteConfiguration (or a Listener) sends traffic to."""
    out: set[str] = set()
    if isinstance(msg, route_pb2.RouteConfiguration):
        for vh in msg.virtual_hosts:
            for r in vh.routes:
                out |= entry_refs(r)
    return frozenset(out)


def rds_names(msg: Message) -> frozenset[str]:
    """The route configurations a Listener asks for over RDS (its HTTP connection managers,
    in filter chains or as an API listener). Empty: its routes, if any, are inline."""
    if not isinstance(msg, listener_pb2.Listener):
        return frozenset()
    configs = [f.typed_config for chain in msg.filter_chains for f in chain.filters]
    if msg.HasField("api_listener"):
        configs.append(msg.api_listener.api_listener)
    out: set[str] = set()
    for cfg in configs:
        if cfg.Is(hcm_pb2.HttpConnectionManager.DESCRIPTOR):
            hcm = hcm_pb2.HttpConnectionManager()
            cfg.Unpack(hcm)
            if hcm.HasField("rds"):
                out.add(hcm.rds.route_config_name)
    return frozenset(out)
