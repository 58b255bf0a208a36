"""Incremental translation: rebuild only the resources whose inputs changed.

`IncrementalTranslator.translate` returns exactly what `translate` returns (a property
test checks it), but memoises each piece by its inputs, so one cluster's weight change
builds one ClusterLoadAssignment and reuses every other message object. Reused objects
let the snapshot skip re-serialising them too. Pure: no I/O, only memory.

Isolation: a model whose resources fail to build (bad data, a bug) keeps its last good
ones and every other model's go out as usual (`failed` says which and why); a model that
never built is left out until it does.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message

from controlplane.fleet.model import (
    Adapter,
    Affinity,
    Endpoint,
    Fleet,
    GpuClass,
    ListenerSpec,
    Model,
    PickerSpec,
    PriorityClass,
    QuotaSpec,
    SideTls,
    TrafficPolicy,
    Version,
)
from controlplane.resources import names
from controlplane.resources.types import CLUSTER, ENDPOINT, LISTENER, ROUTE
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
from controlplane.routing.quotas import build_ratelimit_cluster
from controlplane.routing.translate import (
    NO_OVERLAY,
    DesiredResources,
    RoutingOverlay,
    ShedClasses,
    build_api_listener,
    build_api_routes,
    build_gateway_listener,
    build_gateway_routes,
    holds,
    picks,
)

_ClusterKey = tuple[str, str, TrafficPolicy, Affinity | None, bool, str | None, str, str, bool]
_PlacementKey = tuple[
    tuple[str, ...],
    tuple[str, ...],
    float | None,
    tuple[GpuClass, ...],
    bool,
    bool,
    tuple[object, object],
    tuple[Adapter, ...],
]
_ModelRouteKey = tuple[
    str,
    str,
    TrafficPolicy,
    Affinity | None,
    tuple[tuple[str, bool], ...],
    tuple[tuple[str, int], ...],
    tuple[str, int] | None,
    bool,
    str | None,
    tuple[Adapter, ...],
]
_RouteKey = tuple[
    ListenerSpec,
    PickerSpec,
    QuotaSpec | None,
    tuple[_ModelRouteKey, ...],
    tuple[PriorityClass, ...],
    str | None,
    tuple[tuple[str, tuple[str, ...]], ...],
]


GATEWAY = "(gateway)"  # IncrementalTranslator.failed's key for the shared gateway resources


@dataclass(frozen=True)
class _ModelResources:
    clusters: dict[str, Message]
    assignments: dict[str, Message]
    listener: Message
    route: Message


def _cluster_key(fleet: Fleet, model: Model) -> _ClusterKey:
    overrides = json.dumps(model.cluster_overrides, sort_keys=True) if model.cluster_overrides else ""
    return (
        model.protocol,
        overrides,
        fleet.traffic_of(model),
        model.affinity,
        fleet.picked(model),
        model.tokenizer,
        flow_config(fleet, model),
        adapter_config(fleet, model),
        bool(model.restricted_adapters),  # subsets for them
    )


class IncrementalTranslator:
    """Memoised translation. Keep one per process; it holds the last message per name."""

    def __init__(self) -> None:
        self._clusters: dict[str, tuple[_ClusterKey, Message]] = {}
        self._assignments: dict[
            str, tuple[tuple[Endpoint, ...], _PlacementKey, dict[str, int], frozenset[str], Message]
        ] = {}
        self._api: dict[
            str,
            tuple[
                tuple[str, str, TrafficPolicy, Affinity | None, tuple[tuple[str, int], ...]], Message, Message
            ],
        ] = {}
        self._gateway: tuple[_RouteKey, Message, Message] | None = None
        self._hold: tuple[str, Message] | None = None  # the holding service's cluster, by address
        self._picker: tuple[PickerSpec, Message] | None = None  # the pickers' cluster
        # the rate-limit cluster, by its endpoints and TLS
        self._quota: tuple[tuple[tuple[tuple[str, int], ...], SideTls | None], Message] | None = None
        self.built = 0  # messages built by the last translate() call, for tests and benchmarks
        # Isolation: a model whose resources fail to build keeps its last good ones (or, new,
        # is left out) while every other model's go out as usual. model -> why, last call.
        self.failed: dict[str, str] = {}
        self._good: dict[str, _ModelResources] = {}  # model -> its last good resources

    def translate(
        self,
        fleet: Fleet,
        weights: EndpointWeights | None = None,
        shed: ShedClasses | None = None,
        overlay: RoutingOverlay = NO_OVERLAY,
    ) -> DesiredResources:
        """Same result as routing.translate.translate, rebuilding only what changed."""
        weights = weights or {}
        shed = shed or {}
        self.built = 0
        self.failed = {}
        clusters: dict[str, Message] = {}
        assignments: dict[str, Message] = {}
        listeners: dict[str, Message] = {}
        routes: dict[str, Message] = {}
        left_out: set[str] = set()
        for model in fleet.models:
            try:
                mine = self._model(fleet, model, weights, overlay)
                self._good[model.name] = mine
            except Exception as e:  # one model's bad data never stops the others' updates
                self.failed[model.name] = f"{type(e).__name__}: {e}"
                found = self._good.get(model.name)
                if found is None:
                    left_out.add(model.name)  # never built: it is not served yet
                    continue
                mine = found
            clusters.update(mine.clusters)
            assignments.update(mine.assignments)
            listeners[names.api_listener_name(model.name)] = mine.listener
            routes[names.api_route_name(model.name)] = mine.route
        if overlay.hold_address is not None:
            if self._hold is None or self._hold[0] != overlay.hold_address:
                self.built += 1
                self._hold = (overlay.hold_address, build_hold_cluster(overlay.hold_address))
            clusters[names.HOLD_CLUSTER] = self._hold[1]
        if picks(fleet):
            if self._picker is None or self._picker[0] != fleet.picker:
                self.built += 1
                self._picker = (fleet.picker, build_picker_cluster(fleet.picker.endpoints, fleet.picker.tls))
            clusters[names.PICKER_CLUSTER] = self._picker[1]
        if fleet.quotas is not None:
            key = (fleet.quotas.endpoints, fleet.quotas.service_tls)
            if self._quota is None or self._quota[0] != key:
                self.built += 1
                self._quota = (key, build_ratelimit_cluster(fleet.quotas))
            clusters[names.RATELIMIT_CLUSTER] = self._quota[1]
        if left_out:
            fleet = dataclasses.replace(
                fleet, models=tuple(m for m in fleet.models if m.name not in left_out)
            )
        rkey: _RouteKey = (
            fleet.listener,
            fleet.picker,
            fleet.quotas,
            tuple(
                (
                    m.name,
                    m.stable,
                    fleet.traffic_of(m),
                    m.affinity,
                    tuple(
                        (v.name, names.cluster_name(m.name, v.name) in overlay.unrouted) for v in m.versions
                    ),
                    overlay.splits.get(m.name, ()),
                    overlay.shadow.get(m.name),
                    holds(m, overlay),
                    m.tokenizer,  # a picked model with one sends the picker its prompt
                    m.adapters,  # their names route as the model's; /v1/models lists them
                )
                for m in fleet.models
            ),
            fleet.priority_classes,
            fleet.default_priority_class,
            tuple(sorted((m, tuple(sorted(c))) for m, c in shed.items() if c)),
        )
        if self._gateway is None or self._gateway[0] != rkey:
            try:
                built = (rkey, build_gateway_listener(fleet), build_gateway_routes(fleet, shed, overlay))
            except Exception as e:
                if self._gateway is None:
                    raise  # nothing good to keep: the snapshot build fails as a whole
                self.failed[GATEWAY] = f"{type(e).__name__}: {e}"  # the last good one stays
            else:
                self.built += 2
                self._gateway = built
        listeners[names.GATEWAY_LISTENER] = self._gateway[1]
        routes[names.GATEWAY_ROUTES] = self._gateway[2]
        self._prune(clusters, {m.name for m in fleet.models} | left_out)
        return DesiredResources(
            by_type={CLUSTER: clusters, ENDPOINT: assignments, LISTENER: listeners, ROUTE: routes},
            wildcard={LISTENER: frozenset({names.GATEWAY_LISTENER})},
        )

    def _model(
        self, fleet: Fleet, model: Model, weights: EndpointWeights, overlay: RoutingOverlay
    ) -> _ModelResources:
        """One model's clusters, assignments, API listener and routes."""
        ckey = _cluster_key(fleet, model)
        clusters: dict[str, Message] = {}
        assignments: dict[str, Message] = {}
        for version in model.versions:
            cname = names.cluster_name(model.name, version.name)
            clusters[cname] = self._cluster(model, cname, ckey)
            assignments[cname] = self._assignment(
                fleet, model, cname, version, weights.get(cname, {}), overlay.draining
            )
        akey = (
            model.stable,
            model.tier,
            fleet.traffic_of(model),
            model.affinity,
            overlay.splits.get(model.name, ()),
        )
        cached = self._api.get(model.name)
        if cached is None or cached[0] != akey:
            self.built += 2
            cached = (akey, build_api_listener(model), build_api_routes(fleet, model, overlay))
            self._api[model.name] = cached
        return _ModelResources(clusters, assignments, cached[1], cached[2])

    def _cluster(self, model: Model, cname: str, key: _ClusterKey) -> Message:
        cached = self._clusters.get(cname)
        if cached is not None and cached[0] == key:
            return cached[1]
        self.built += 1
        msg = build_cluster(model, cname, key[2], picked=key[4], flow=key[6], adapters=key[7])
        self._clusters[cname] = (key, msg)
        return msg

    def _assignment(
        self,
        fleet: Fleet,
        model: Model,
        cname: str,
        version: Version,
        weights: Mapping[str, int],
        draining: frozenset[str],
    ) -> Message:
        # Placement (memory fit, preferred GPU classes) depends on these and the endpoints.
        pkey: _PlacementKey = (
            model.preferred_gpus,
            model.zones,
            fleet.memory_need_of(model),
            fleet.gpu_classes,
            ring_hashed(model),
            model.affinity is not None,  # hashed: weights squared
            (model.kv_events, version.kv_events),  # where the servers publish KV events
            model.adapters,  # the restricted adapters' subsets
        )
        mine = (
            frozenset(ep.address for ep in version.endpoints if ep.address in draining)
            if draining
            else draining
        )
        cached = self._assignments.get(cname)
        if (
            cached is not None
            and (cached[0] is version.endpoints or cached[0] == version.endpoints)
            and cached[1] == pkey
            and cached[2] == weights
            and cached[3] == mine
        ):
            return cached[4]
        self.built += 1
        msg = build_assignment(
            cname,
            version,
            weights,
            functools.partial(fleet.endpoint_priority, model),
            mine,
            ring_hash=pkey[4],
            hashed=pkey[5],
            kv_events=model.kv_events,
            adapters=model.lb_adapters(version),
        )
        self._assignments[cname] = (version.endpoints, pkey, dict(weights), mine, msg)
        return msg

    def _prune(self, clusters: Mapping[str, Any], models: set[str]) -> None:
        for cache in (self._clusters, self._assignments):
            for name in [n for n in cache if n not in clusters]:
                del cache[name]
        for name in [n for n in self._api if n not in models]:
            del self._api[name]
        for name in [n for n in self._good if n not in models]:
            del self._good[name]
