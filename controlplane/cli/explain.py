"""`controlplane explain MODEL`: every effective setting of one model, where it comes from,
and what it becomes in Envoy.

`explain()` is pure: fleet (plus, optionally, the raw YAML mapping, to tell a key set in the
file from an inherited one, the live rollout state and the endpoints' live loads) -> a plain
dict. The Envoy half of it is read back from the resources `translate()` generates, so it
shows what proxies actually get, cluster_overrides included. `run()` is the command. Beside
it: explain_live.py asks the control plane what a rollout is doing (`fetch_rollout()`) and
what the endpoints' loads are (`fetch_loads()`), since the file alone cannot say;
explain_output.py prints the dict (`render_text()`, `render_json()`, `render_yaml()`). Their
public names are importable from here too.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from controlplane.cli.explain_live import (
    LIVE_DEADLINE_S,
    RUNNING_PHASES,
    LiveLoads,
    LiveRollout,
    fetch_loads,
    fetch_rollout,
    live_split,
    loads_doc,
    rollout_doc,
    started_from,
    traffic_shares,
    version_loads,
    version_role,
)
from controlplane.cli.explain_output import (
    fmt_bytes,
    fmt_duration,
    render,
    render_json,
    render_text,
    render_yaml,
)
from controlplane.fleet.model import (
    DEFAULT_TARGET_PER_REPLICA,
    DTYPE_BYTES,
    MEMORY_OVERHEAD,
    Endpoint,
    Fleet,
    Model,
    ScalingPolicy,
    Tier,
    TrafficPolicy,
)
from controlplane.fleet.schema_policies import SCALING_KEYS
from controlplane.resources import names
from controlplane.signals.store import UNREACHABLE_AFTER

__all__ = [
    "LIVE_DEADLINE_S",
    "OUTPUT_FORMATS",
    "RUNNING_PHASES",
    "SCHEMA_VERSION",
    "LiveLoads",
    "LiveRollout",
    "UnknownModel",
    "explain",
    "fetch_loads",
    "fetch_rollout",
    "fmt_bytes",
    "fmt_duration",
    "live_split",
    "loads_doc",
    "render",
    "render_json",
    "render_text",
    "render_yaml",
    "rollout_doc",
    "run",
    "started_from",
    "traffic_shares",
    "version_loads",
    "version_role",
]

SCHEMA_VERSION = 1
OUTPUT_FORMATS = ("table", "json", "yaml")

# Where a setting's value comes from.
SOURCE_MODEL = "model"  # set on the model (models.<name>.<key>)
SOURCE_TIER = "tier"  # set on its tier (tiers.<tier>.<key>)
SOURCE_DEFAULT = "default"  # built in

# Config key path -> TrafficPolicy attribute (and, for breakers, the CircuitBreaker attribute).
_SETTINGS: tuple[tuple[tuple[str, ...], str, str | None, str], ...] = (
    (("timeout",), "timeout_s", None, "duration"),
    (("stream_idle_timeout",), "stream_idle_timeout_s", None, "duration"),
    (("retries",), "retries", None, "int"),
    (("max_body_bytes",), "max_body_bytes", None, "bytes"),
    (("circuit_breakers", "default", "max_requests"), "breaker_default", "max_requests", "int"),
    (("circuit_breakers", "default", "max_pending"), "breaker_default", "max_pending", "int"),
    (("circuit_breakers", "high", "max_requests"), "breaker_high", "max_requests", "int"),
    (("circuit_breakers", "high", "max_pending"), "breaker_high", "max_pending", "int"),
    (("outlier_detection", "consecutive_5xx"), "outlier_consecutive_5xx", None, "int"),
    (("outlier_detection", "interval"), "outlier_interval_s", None, "duration"),
    (("outlier_detection", "base_ejection_time"), "outlier_base_ejection_s", None, "duration"),
    (("outlier_detection", "max_ejection_percent"), "outlier_max_ejection_percent", None, "percent"),
    (("balancing",), "balancing", None, "str"),
)


class UnknownModel(KeyError):
    """The fleet has no model of that name; `known` lists the ones it has."""

    def __init__(self, name: str, known: list[str]) -> None:
        self.name = name
        self.known = known
        super().__init__(name)

    def __str__(self) -> str:
        names = ", ".join(self.known) if self.known else "(none)"
        return f"unknown model {self.name!r}; known models: {names}"


# The text beside each setting's value (explain_output.py formats the rest).
def _fmt(kind: str, value: Any) -> str:
    if kind == "duration":
        return fmt_duration(float(value))
    if kind == "bytes":
        return fmt_bytes(int(value))
    if kind == "percent":
        return f"{value}%"
    return str(value)


# ---------------------------------------------------------------------------------------------
# sources


def _raw_model(raw: Mapping[str, Any] | None, name: str) -> Mapping[str, Any] | None:
    models = raw.get("models") if isinstance(raw, Mapping) else None
    if not isinstance(models, Mapping):
        return None
    for key, spec in models.items():
        if str(key) == name:
            return spec if isinstance(spec, Mapping) else {}
    return None


def _raw_tier(raw: Mapping[str, Any] | None, name: str) -> Mapping[str, Any] | None:
    tiers = raw.get("tiers") if isinstance(raw, Mapping) else None
    if not isinstance(tiers, Mapping):
        return None
    spec = tiers.get(name)
    return spec if isinstance(spec, Mapping) else {}


def _has(mapping: Mapping[str, Any] | None, path: tuple[str, ...]) -> bool:
    node: Any = mapping
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return False
        node = node[key]
    return True


def _value(policy: TrafficPolicy, attr: str, sub: str | None) -> Any:
    v = getattr(policy, attr)
    return getattr(v, sub) if sub is not None else v


def _source(
    path: tuple[str, ...],
    attr: str,
    sub: str | None,
    model_policy: TrafficPolicy,
    tier_policy: TrafficPolicy,
    raw_model: Mapping[str, Any] | None,
    raw_tier: Mapping[str, Any] | None,
    have_raw: bool,
) -> str:
    if have_raw:
        if _has(raw_model, path):
            return SOURCE_MODEL
        if _has(raw_tier, path):
            return SOURCE_TIER
        return SOURCE_DEFAULT
    # Without the YAML, compare values: a key set to the value it inherits anyway shows as inherited.
    if _value(model_policy, attr, sub) != _value(tier_policy, attr, sub):
        return SOURCE_MODEL
    if _value(tier_policy, attr, sub) != _value(TrafficPolicy(), attr, sub):
        return SOURCE_TIER
    return SOURCE_DEFAULT


def _tier_choice(fleet: Fleet, model: Model, raw_model: Mapping[str, Any] | None, have_raw: bool) -> str:
    """'model' if the model names its tier, 'params_b' if the tier follows from its size."""
    if have_raw:
        return "model" if _has(raw_model, ("tier",)) else "params_b"
    if model.params_b is None:
        return "model"
    derived = next(
        (t.name for t in fleet.tiers if t.max_params_b is None or model.params_b <= t.max_params_b), None
    )
    return "params_b" if derived == model.tier else "model"


# ---------------------------------------------------------------------------------------------
# the Envoy side, read back from the generated resources


def _seconds(d: Any) -> float:
    return float(d.ToNanoseconds()) / 1e9


def _find_route(routes: Any, name: str, cluster: str) -> Any | None:
    for vh in routes.virtual_hosts:
        for r in vh.routes:
            if r.name == name and r.HasField("route") and r.route.cluster == cluster:
                return r
    return None


def _envoy(
    fleet: Fleet, model: Model, warnings: list[str]
) -> tuple[dict[str, Any], dict[str, dict[tuple[str, int], int]]]:
    """What the generated resources say, and each version's EDS placement (address -> priority)."""
    # Imported here: the Envoy protobufs are heavy and only this half needs them.
    from envoy.extensions.filters.http.buffer.v3 import buffer_pb2
    from envoy.extensions.filters.network.http_connection_manager.v3 import (
        http_connection_manager_pb2 as hcm_pb2,
    )
    from envoy.extensions.retry.priority.previous_priorities.v3 import previous_priorities_config_pb2

    from controlplane.resources import types
    from controlplane.routing import translate

    res = translate.translate(fleet)
    stable_cluster = names.cluster_name(model.name, model.stable)
    cluster = res.by_type[types.CLUSTER][stable_cluster]
    gateway = res.by_type[types.ROUTE][names.GATEWAY_ROUTES]
    header_route = _find_route(gateway, f"header/{model.name}", stable_cluster)
    out: dict[str, Any] = {"cluster": stable_cluster}

    # Route: timeouts, retries, routing priority.
    route: dict[str, Any] = {}
    retry: dict[str, Any] | None = None
    if header_route is not None:
        action = header_route.route
        route = {
            "timeout_s": _seconds(action.timeout),
            "idle_timeout_s": _seconds(action.idle_timeout) if action.HasField("idle_timeout") else None,
            "routing_priority": "high" if action.priority == 1 else "default",
        }
        if action.HasField("retry_policy"):
            rp = action.retry_policy
            update_frequency = None
            if rp.HasField("retry_priority"):
                cfg = previous_priorities_config_pb2.PreviousPrioritiesConfig()
                if rp.retry_priority.typed_config.Unpack(cfg):
                    update_frequency = cfg.update_frequency
            retry = {
                "num_retries": rp.num_retries.value,
                "retry_on": [s for s in rp.retry_on.split(",") if s and s != "retriable-status-codes"],
                "retriable_status_codes": list(rp.retriable_status_codes),
                "other_host": any(
                    p.name == "envoy.retry_host_predicates.previous_hosts" for p in rp.retry_host_predicate
                ),
                "host_selection_max_attempts": rp.host_selection_retry_max_attempts,
                # Attempts in one EDS priority before the next attempt goes to the next priority.
                "next_priority_after_attempts": update_frequency,
            }
    out["route"] = route
    out["retry"] = retry

    # Body limits: the route's for x-model requests; a body-routed request is read (by the
    # listener's buffer filter) before its model, hence its route, is known: the listener's.
    header_limit = None
    if header_route is not None and translate.BUFFER_FILTER in header_route.typed_per_filter_config:
        per_route = buffer_pb2.BufferPerRoute()
        if header_route.typed_per_filter_config[translate.BUFFER_FILTER].Unpack(per_route):
            header_limit = per_route.buffer.max_request_bytes.value
    listener_limit = None
    listener = res.by_type[types.LISTENER][names.GATEWAY_LISTENER]
    hcm = hcm_pb2.HttpConnectionManager()
    if listener.filter_chains and listener.filter_chains[0].filters[0].typed_config.Unpack(hcm):
        for f in hcm.http_filters:
            buf = buffer_pb2.Buffer()
            if f.name == translate.BUFFER_FILTER and f.typed_config.Unpack(buf):
                listener_limit = buf.max_request_bytes.value
    out["body_limit"] = {"header_routed_bytes": header_limit, "body_routed_bytes": listener_limit}

    # Cluster: circuit breakers (Envoy uses the first threshold of each priority), retry budget.
    breakers: dict[str, Any] = {}
    for t in cluster.circuit_breakers.thresholds:
        prio = "high" if t.priority == 1 else "default"
        if prio in breakers:
            warnings.append(
                f"cluster_overrides adds a second {prio}-priority circuit-breaker threshold; Envoy uses "
                "only the first of each priority (the generated one), so it has no effect"
            )
            continue
        entry: dict[str, Any] = {
            "max_requests": t.max_requests.value if t.HasField("max_requests") else 1024,
            "max_pending": t.max_pending_requests.value if t.HasField("max_pending_requests") else 1024,
            "retry_budget": None,
        }
        if t.HasField("retry_budget"):
            entry["retry_budget"] = {
                "percent": t.retry_budget.budget_percent.value,
                "min_concurrency": t.retry_budget.min_retry_concurrency.value,
            }
        breakers[prio] = entry
    out["circuit_breakers"] = breakers

    od = cluster.outlier_detection
    out["outlier_detection"] = {
        "consecutive_5xx": od.consecutive_5xx.value if od.HasField("consecutive_5xx") else 5,
        "enforcing_consecutive_5xx": (
            od.enforcing_consecutive_5xx.value if od.HasField("enforcing_consecutive_5xx") else 100
        ),
        "interval_s": _seconds(od.interval) if od.HasField("interval") else 10.0,
        "base_ejection_time_s": _seconds(od.base_ejection_time)
        if od.HasField("base_ejection_time")
        else 30.0,
        "max_ejection_percent": od.max_ejection_percent.value if od.HasField("max_ejection_percent") else 10,
        "local_origin_errors_count": not od.split_external_local_origin_errors,
    }
    panic = None
    if cluster.common_lb_config.HasField("healthy_panic_threshold"):
        panic = cluster.common_lb_config.healthy_panic_threshold.value
    out["healthy_panic_threshold_percent"] = panic
    policies = [p.typed_extension_config.name for p in cluster.load_balancing_policy.policies]
    first = policies[0].rsplit(".", 1)[-1] if policies else None
    if first == "subset" and len(policies) > 1:  # adapters on some servers only: the policy within
        first = policies[1].rsplit(".", 1)[-1]
    out["load_balancer"] = first
    out["picker"] = _picker(fleet, cluster, hcm) if first == "override_host" else None
    if out["picker"] is not None:
        out["picker"]["prefix_index"] = _prefix_index(model)
    out["adapters"] = _adapters(model, out["picker"] is not None)
    out["connect_timeout_s"] = _seconds(cluster.connect_timeout)
    if model.cluster_overrides and "load_balancing_policy" in model.cluster_overrides:
        warnings.append(
            "cluster_overrides.load_balancing_policy is appended after the generated policies; Envoy "
            f"uses the first it supports ({first}), so it has no effect"
        )

    # Proxyless gRPC clients get a route of their own, without retries or idle timeout.
    api = res.by_type[types.ROUTE].get(names.api_route_name(model.name))
    grpc: dict[str, Any] | None = None
    if api is not None and api.virtual_hosts and api.virtual_hosts[0].routes:
        a = api.virtual_hosts[0].routes[0].route
        grpc = {
            "timeout_s": _seconds(a.timeout),
            "idle_timeout_s": _seconds(a.idle_timeout) if a.HasField("idle_timeout") else None,
            "retries": a.retry_policy.num_retries.value if a.HasField("retry_policy") else 0,
        }
    out["proxyless_grpc"] = grpc

    # EDS: where each endpoint of each version is placed.
    placement: dict[str, dict[tuple[str, int], int]] = {}
    for version in model.versions:
        cname = names.cluster_name(model.name, version.name)
        cla = res.by_type[types.ENDPOINT][cname]
        placed: dict[tuple[str, int], int] = {}
        for loc in cla.endpoints:
            for lb in loc.lb_endpoints:
                sa = lb.endpoint.address.socket_address
                placed[(sa.address, sa.port_value)] = loc.priority
        placement[version.name] = placed
    return out, placement


def _picker(fleet: Fleet, cluster: Any, hcm: Any) -> dict[str, Any]:
    """A picked model's cluster and listener read back: who Envoy asks, within what budget,
    what routes a request the picker does not answer, and where those fallbacks are counted."""
    from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2
    from envoy.extensions.load_balancing_policies.override_host.v3 import override_host_pb2

    from controlplane.routing import translate

    override = override_host_pb2.OverrideHost()
    cluster.load_balancing_policy.policies[0].typed_extension_config.typed_config.Unpack(override)
    fallback = [p.typed_extension_config.name.rsplit(".", 1)[-1] for p in override.fallback_policy.policies]
    budget = None
    for f in hcm.http_filters:
        cfg = ext_proc_pb2.ExternalProcessor()
        if f.name == translate.EXT_PROC_FILTER and f.typed_config.Unpack(cfg):
            budget = _seconds(cfg.message_timeout)
    return {
        "endpoints": [f"{host}:{port}" for host, port in fleet.picker.endpoints],
        "budget_s": budget,
        "fallback": fallback[0] if fallback else None,
        "fallbacks_counted_in": [
            "envoy_http_ext_proc_picker_failure_mode_allowed",
            'controlplane_picker_picks_total{reason!~"least_loaded|approximate|kv_hit"}',
        ],
    }


def _adapters(model: Model, picked: bool) -> dict[str, Any] | None:
    """The model's LoRA adapters (docs/adapters.md) and how their requests are placed; None
    without any."""
    if not model.adapters:
        return None
    names = [a.name for a in model.adapters]
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    restricted = [a.name for a in model.restricted_adapters]
    hashed = model.affinity is not None and model.affinity.adapter
    envoy = (
        "Envoy hashes each adapter's requests on its name (bounded load)"
        if hashed
        else "Envoy routes them as the base model's"
    ) + (
        f"; {', '.join(restricted[:5])}{' and more' if len(restricted) > 5 else ''} only to "
        f"{'its' if len(restricted) == 1 else 'their'} endpoints (Envoy subsets)"
        if restricted
        else ""
        if hashed
        else ", wherever the adapter is"
    )
    how = (
        "the picker sends each adapter's requests where it is loaded"
        + ("; one no server has is loaded onto one first" if model.placement == "dynamic" else "")
        + f"; without a pick, {envoy}"
        if picked
        else f"no picker: {envoy}"
    )
    return {
        "names": names,
        "placement": model.placement,
        "picked": picked,
        "text": f"{len(names)} ({shown}), placement {model.placement}: {how}",
    }


def _prefix_index(model: Model) -> dict[str, Any]:
    """Which prefix index the picker scores this model's requests by (docs/kv-events.md):
    precise (the servers' KV events, the prompt tokenized with the model's tokenizer) for the
    servers that publish, approximate for the others and for a model without a tokenizer."""
    from controlplane.fleet.model import kv_publisher

    servers = [(ep, v) for v in model.versions for ep in v.endpoints]
    publishing = sum(1 for ep, v in servers if kv_publisher(ep, v.kv_events, model.kv_events) is not None)
    if model.tokenizer and (publishing or model.kv_events or any(v.kv_events for v in model.versions)):
        return {
            "kind": "precise",
            "tokenizer": model.tokenizer,
            "publishing": publishing,
            "servers": len(servers),
            "text": f"precise: the servers' KV events ({publishing} of {len(servers)} listed servers "
            f"publish; the others approximate), prompts tokenized with {model.tokenizer}",
        }
    why = "no tokenizer" if not model.tokenizer else "no server names kv_events"
    return {"kind": "approximate", "text": f"approximate ({why}): where a prompt's first bytes went last"}


# ---------------------------------------------------------------------------------------------
# memory and endpoints


def _autoscaling(
    fleet: Fleet,
    model: Model,
    raw_model: Mapping[str, Any] | None,
    raw_tier: Mapping[str, Any] | None,
    have_raw: bool,
) -> dict[str, dict[str, Any]]:
    """Each autoscaling key's effective value and where it comes from."""
    policy = fleet.scaling_of(model)
    tier_policy = fleet.tier(model.tier).scaling
    out: dict[str, dict[str, Any]] = {}
    for key, (attr, kind, _, _) in SCALING_KEYS.items():
        value = getattr(policy, attr)
        path = ("autoscaling", key)
        if have_raw:
            source = (
                SOURCE_MODEL
                if _has(raw_model, path)
                else SOURCE_TIER
                if _has(raw_tier, path)
                else SOURCE_DEFAULT
            )
        elif value != getattr(tier_policy, attr):
            source = SOURCE_MODEL
        else:
            source = SOURCE_TIER if value != getattr(ScalingPolicy(), attr) else SOURCE_DEFAULT
        if value is None:
            text = f"learnt (servers' slots x target_utilization, else {DEFAULT_TARGET_PER_REPLICA:g})"
        else:
            text = (
                fmt_duration(value)
                if kind == "duration"
                else str(value).lower()
                if kind in ("bool", "choice")
                else f"{value:g}"
            )
        out[key] = {"value": value, "text": text, "source": source}
    return out


def _memory(fleet: Fleet, model: Model) -> dict[str, Any]:
    need = fleet.memory_need_of(model)
    if model.memory_gb is not None:
        source, formula = "memory_gb", "declared (memory_gb)"
    elif need is not None and model.params_b is not None:
        source = "derived"
        formula = (
            f"{model.params_b:g}B parameters x {DTYPE_BYTES[model.dtype]:g} bytes ({model.dtype}) "
            f"x {MEMORY_OVERHEAD:g}"
        )
    else:
        source, formula = "unknown", "unknown (no memory_gb, no params_b): every endpoint counts as fitting"
    return {
        "need_gb": None if need is None else round(need, 6),
        "source": source,
        "formula": formula,
        "dtype": model.dtype,
        "preferred_gpus": list(model.preferred_gpus),
    }


def _gpu_memory(fleet: Fleet, ep: Endpoint) -> tuple[float | None, str]:
    if ep.gpu_memory_gb is not None:
        return ep.gpu_memory_gb, "endpoint"
    have = fleet.gpu_memory_of(ep)
    return (have, "gpu_class") if have is not None else (None, "unknown")


def _capacity(fleet: Fleet, ep: Endpoint) -> tuple[float | None, str]:
    if ep.capacity is not None:
        return ep.capacity, "endpoint"
    declared = fleet.declared_capacity(ep)
    return (declared, "gpu_class") if declared is not None else (None, "learnt")


def _endpoint(
    fleet: Fleet, model: Model, ep: Endpoint, placed: Mapping[tuple[str, int], int]
) -> dict[str, Any]:
    memory, memory_source = _gpu_memory(fleet, ep)
    capacity, capacity_source = _capacity(fleet, ep)
    priority = placed.get((ep.host, ep.port))
    need = fleet.memory_need_of(model)
    if priority is None:
        placement = "left out"
        if need is not None and memory is not None and need > memory:
            reason = f"needs {need:g} GB, has {memory:g} GB"
        else:
            reason = "not in EDS"
    elif priority == 0:
        placement = "preferred" if model.preferred_gpus else "primary"
        reason = (
            f"GPU class {ep.gpu} is preferred"
            if model.preferred_gpus
            else "the model prefers no GPU class: every endpoint that fits is at priority 0"
        )
    else:
        placement = "fallback"
        reason = (
            f"GPU class {ep.gpu or '(none)'} is not among preferred_gpus "
            f"({', '.join(model.preferred_gpus)}): used when priority 0 is short of healthy endpoints"
        )
    return {
        "address": ep.address,
        "gpu": ep.gpu,
        "gpu_memory_gb": memory,
        "gpu_memory_source": memory_source,
        "capacity": capacity,
        "capacity_source": capacity_source,
        "eds_priority": priority,
        "placement": placement,
        "reason": reason,
    }


# ---------------------------------------------------------------------------------------------
# the explanation


def explain(
    fleet: Fleet,
    name: str,
    raw: Mapping[str, Any] | None = None,
    live: LiveRollout | None = None,
    loads: LiveLoads | None = None,
) -> dict[str, Any]:
    """Everything that decides how `name` is served, as a JSON-ready dict.

    `raw` is the fleet file's YAML mapping; with it, a setting's source is the key actually set
    in the file. Without it, sources are inferred from values (a key set to the value it would
    inherit anyway shows as inherited). `live` is what the control plane said about the model's
    rollout; without it, the file's stable version takes all the traffic. `loads` is what it
    said about the endpoints' loads (each version's `live`); without it they are not shown.
    Raises UnknownModel."""
    try:
        model = fleet.model(name)
    except KeyError:
        raise UnknownModel(name, [m.name for m in fleet.models]) from None
    tier: Tier = fleet.tier(model.tier)
    have_raw = raw is not None
    raw_model = _raw_model(raw, model.name)
    raw_tier = _raw_tier(raw, tier.name)
    policy = fleet.traffic_of(model)
    warnings: list[str] = []

    settings: dict[str, dict[str, Any]] = {}
    for path, attr, sub, kind in _SETTINGS:
        key = ".".join(path)
        value = _value(policy, attr, sub)
        source = _source(path, attr, sub, policy, tier.policy, raw_model, raw_tier, have_raw)
        entry: dict[str, Any] = {"value": value, "text": "", "source": source, "follows": None}
        if key == "stream_idle_timeout" and value is None:
            # Unset: the route's idle timeout is the timeout (Envoy's own default would be 5 min).
            entry.update(value=policy.timeout_s, follows="timeout")
        entry["text"] = _fmt(kind, entry["value"])
        settings[key] = entry

    envoy, placement = _envoy(fleet, model, warnings)

    shares = traffic_shares(model, live)
    versions: list[dict[str, Any]] = []
    for version in model.versions:
        eps = [_endpoint(fleet, model, ep, placement[version.name]) for ep in version.endpoints]
        versions.append(
            {
                "name": version.name,
                "stable": version.name == model.stable,
                "cluster": names.cluster_name(model.name, version.name),
                "endpoints": eps,
                "source": version.discover.source() if version.discover is not None else "file",
                "traffic_percent": None if shares is None else shares[version.name],
                "role": version_role(version.name, model, live),
                "live": version_loads(version.name, loads),
            }
        )
        placed = [e for e in eps if e["eds_priority"] is not None]
        if not placed and version.discover is None:
            why = "it has no endpoints" if not eps else "no endpoint fits the model's memory need"
            if version.name == model.stable:
                warnings.append(
                    f"stable version {version.name}: {why}, so its cluster is empty and every request "
                    "gets 503 (no healthy upstream)"
                )
            else:
                warnings.append(f"version {version.name}: {why}, so its cluster is empty")
        elif model.preferred_gpus and all(e["eds_priority"] == 1 for e in placed):
            warnings.append(
                f"version {version.name}: no endpoint of a preferred GPU class "
                f"({', '.join(model.preferred_gpus)}); all of them are at priority 1, which Envoy "
                "uses since priority 0 is empty"
            )

    stable_eps = next(v["endpoints"] for v in versions if v["stable"])
    has_fallback = any(e["eds_priority"] == 1 for e in stable_eps)
    retry = envoy["retry"]
    reaches_fallback = (
        retry is not None
        and retry["next_priority_after_attempts"] is not None
        and retry["num_retries"] >= retry["next_priority_after_attempts"]
    )
    if retry is None:
        warnings.append(
            "retries 0: no retry policy; a connection failure or a 507 goes straight to the client"
        )
    elif has_fallback and not reaches_fallback:
        warnings.append(
            f"retries {retry['num_retries']}: no retry reaches the fallback priority (that takes "
            f"{retry['next_priority_after_attempts']} failed attempts first); when preferred endpoints "
            "die, requests can fail until the signals hold them out"
        )
    idle = settings["stream_idle_timeout"]["value"]
    if idle < policy.timeout_s:
        warnings.append(
            f"stream_idle_timeout {fmt_duration(idle)} is below the timeout "
            f"{fmt_duration(policy.timeout_s)}: it also bounds the wait for response headers, so a "
            f"non-streamed completion that takes longer than {fmt_duration(idle)} is cut (504 stream timeout)"
        )
    limits = envoy["body_limit"]
    if limits["body_routed_bytes"] is not None and limits["body_routed_bytes"] > policy.max_body_bytes:
        warnings.append(
            f"max_body_bytes {policy.max_body_bytes} holds for requests naming the model in the x-model "
            f"header; requests naming it only in the JSON body get the listener-wide "
            f"{limits['body_routed_bytes']} (the largest of any model)"
        )
    if not fleet.signals.enabled:
        warnings.append(
            "signals are off: the control plane never holds a dead endpoint out; only retries and "
            "outlier detection keep traffic off it"
        )
    if model.cluster_overrides:
        warnings.append(
            f"cluster_overrides sets {', '.join(sorted(model.cluster_overrides))}: merged into every "
            "cluster of the model; the Envoy values shown are after the merge"
        )

    return {
        "schema": SCHEMA_VERSION,
        "model": model.name,
        "tier": {
            "name": tier.name,
            "chosen_by": _tier_choice(fleet, model, raw_model, have_raw),
            "max_params_b": tier.max_params_b,
        },
        "params_b": model.params_b,
        "protocol": model.protocol,
        "stable": model.stable,
        "cluster": envoy["cluster"],
        "settings": settings,
        "priority_classes": [
            {
                "name": c.name,
                "default": c.name == fleet.default_priority_class,
                "routing_priority": "high" if c.high else "default",
                "shed_at": c.shed_at,
            }
            for c in fleet.priority_classes
        ],
        "affinity": None
        if model.affinity is None
        else {
            "header": model.affinity.header,
            "body_field": model.affinity.body_field,
            "adapter": model.affinity.adapter,
            "algorithm": model.affinity.algorithm,
            "balance_factor": model.affinity.balance_factor,
        },
        "envoy": envoy,
        "autoscaling": _autoscaling(fleet, model, raw_model, raw_tier, have_raw),
        "memory": _memory(fleet, model),
        "failover": {
            "has_fallback": has_fallback,
            "retries_reach_fallback": reaches_fallback,
            "held_out_after_scrapes": UNREACHABLE_AFTER if fleet.signals.enabled else None,
            "held_out_after_s": UNREACHABLE_AFTER * fleet.signals.interval_s
            if fleet.signals.enabled
            else None,
        },
        "rollout": rollout_doc(model, live),
        "loads": loads_doc(loads),
        "versions": versions,
        "warnings": warnings,
    }


# ---------------------------------------------------------------------------------------------
# the command


def run(
    model: str,
    config: Path,
    fmt: str = "table",
    *,
    live: bool = True,
    server: str | None = None,
    token_file: Path | None = None,
    fetch: Callable[[str, str | None, Path | None], LiveRollout] | None = None,
    fetch_live_loads: Callable[[str, str | None, Path | None], LiveLoads] | None = None,
) -> int:
    """`controlplane explain`: 0 explained, 1 invalid config (errors on stderr), 2 unknown model.
    `config` `-` reads standard input. With `live`, a model with several versions has its
    rollout asked of the control plane through `fetch` (fetch_rollout; tests pass their own),
    and every model its endpoints' loads through `fetch_live_loads` (fetch_loads)."""
    import yaml

    from controlplane.cli.fleet_input import read_fleet_input
    from controlplane.fleet.errors import FleetConfigInvalid
    from controlplane.fleet.loader import decode_fleet, parse_fleet

    name = str(config)
    try:
        name, data = read_fleet_input(config)
        text = decode_fleet(data, name)
        fleet = parse_fleet(text, name)
    except FleetConfigInvalid as e:
        for err in e.errors:
            print(err, file=sys.stderr)
        print(f"{name}: {len(e.errors)} error(s)", file=sys.stderr)
        return 1
    raw = yaml.safe_load(text)
    found = next((m for m in fleet.models if m.name == model), None)
    ask = fetch or fetch_rollout
    state = ask(model, server, token_file) if live and found is not None and len(found.versions) > 1 else None
    ask_loads = fetch_live_loads or fetch_loads
    loads = ask_loads(model, server, token_file) if live and found is not None else None
    try:
        explanation = explain(fleet, model, raw if isinstance(raw, Mapping) else None, state, loads)
    except UnknownModel as e:
        print(f"controlplane explain: {e} (in {name})", file=sys.stderr)
        return 2
    sys.stdout.write(render(explanation, fmt, name))
    return 0
