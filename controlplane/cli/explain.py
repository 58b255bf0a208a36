"""`controlplane explain MODEL`: every effective setting of one model, where it comes from,
and what it becomes in Envoy.

`explain()` is pure: fleet (plus, optionally, the raw YAML mapping, to tell a key set in the
file from an inherited one, and the live rollout state) -> a plain dict. The Envoy half of it
is read back from the resources `translate()` generates, so it shows what proxies actually
get, cluster_overrides included. `render_text()`, `render_json()` and `render_yaml()` format
it; `fetch_rollout()` asks the control plane's operator API (found as cpctl finds it) what a
rollout is doing, since the file alone cannot say; `run()` is the command.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controlplane.fleet.loader import SCALING_KEYS
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
from controlplane.routing import names
from controlplane.signals.store import UNREACHABLE_AFTER

SCHEMA_VERSION = 1
OUTPUT_FORMATS = ("table", "json", "yaml")
# How long explain waits for the operator API: enough on loopback, short when nothing listens.
LIVE_DEADLINE_S = 0.5
RUNNING_PHASES = ("Progressing", "Paused")

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


# ---------------------------------------------------------------------------------------------
# formatting helpers


def fmt_duration(seconds: float) -> str:
    """60.0 -> '60s', 0.5 -> '500ms', 90.0 -> '90s'."""
    if seconds < 1:
        return f"{seconds * 1000:g}ms"
    return f"{seconds:g}s"


def fmt_bytes(n: int) -> str:
    """8388608 -> '8388608 (8 MiB)'."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n} ({n / size:g} {unit})"
    return str(n)


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

    from controlplane.routing import translate

    res = translate.translate(fleet)
    stable_cluster = names.cluster_name(model.name, model.stable)
    cluster = res.by_type[translate.CLUSTER][stable_cluster]
    gateway = res.by_type[translate.ROUTE][names.GATEWAY_ROUTES]
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
    listener = res.by_type[translate.LISTENER][names.GATEWAY_LISTENER]
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
    out["load_balancer"] = first
    out["connect_timeout_s"] = _seconds(cluster.connect_timeout)
    if model.cluster_overrides and "load_balancing_policy" in model.cluster_overrides:
        warnings.append(
            "cluster_overrides.load_balancing_policy is appended after the generated policies; Envoy "
            f"uses the first it supports ({first}), so it has no effect"
        )

    # Proxyless gRPC clients get a route of their own, without retries or idle timeout.
    api = res.by_type[translate.ROUTE].get(names.api_route_name(model.name))
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
        cla = res.by_type[translate.ENDPOINT][cname]
        placed: dict[tuple[str, int], int] = {}
        for loc in cla.endpoints:
            for lb in loc.lb_endpoints:
                sa = lb.endpoint.address.socket_address
                placed[(sa.address, sa.port_value)] = loc.priority
        placement[version.name] = placed
    return out, placement


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
# the live rollout: the file cannot say how a rollout splits the traffic, the control plane can


@dataclass(frozen=True)
class LiveRollout:
    """What the operator API at `server` said about a model's rollout: `state` (cpctl's
    `rollout_to_dict`, with `summary` its one-line form), None if the model never had one; or
    `error`, why it could not be asked (then the rollout is unknown)."""

    server: str
    state: Mapping[str, Any] | None = None
    summary: str = ""
    error: str | None = None


def fetch_rollout(
    model: str,
    server: str | None = None,
    token_file: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = LIVE_DEADLINE_S,
) -> LiveRollout:
    """Ask the control plane for `model`'s latest rollout, finding it and its token as cpctl
    does (--server, else $CPCTL_SERVER, else the default address; cpctl.resolve_token). Never
    raises: a control plane that is not there, or refuses, is a LiveRollout with an error."""
    import grpc

    from controlplane.admin.defaults import DEFAULT_ADMIN_LISTEN
    from controlplane.cli import cpctl
    from controlplane.cli import cpctl_output as out
    from controlplane.v1 import rollout_pb2

    env = os.environ if env is None else env
    # cpctl's order (cpctl._server, private and reading os.environ): flag, $CPCTL_SERVER, default.
    server = server or env.get("CPCTL_SERVER") or DEFAULT_ADMIN_LISTEN
    try:
        credential = cpctl.resolve_token(token_file, env)
    except cpctl.CliError as e:
        # cpctl's advice on where tokens come from follows the first clause; one line is enough.
        return LiveRollout(
            server, error=f"no token to ask the control plane at {server} ({str(e).split('; ')[0]})"
        )
    client = cpctl.Client(server, credential, timeout_s)
    try:
        r = client.call(client.rollouts.Get, rollout_pb2.GetRolloutRequest(model=model))
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.NOT_FOUND and "has no rollout" in (e.details() or ""):
            return LiveRollout(server)
        if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return LiveRollout(server, error=f"no control plane answered at {server}")
        line, _ = cpctl.rpc_error_line(e, server, client.token_source)
        return LiveRollout(server, error=line.removeprefix("cpctl: "))
    finally:
        client.close()
    return LiveRollout(server, out.rollout_to_dict(r), out.summary_line(r))


def live_split(model: Model, live: LiveRollout | None) -> tuple[Mapping[str, Any] | None, bool]:
    """(the rollout that decides how the model's traffic is split now, None if the file's
    stable takes it all; whether the split is unknown). Unknown when the control plane could
    not be asked, or when a finished rollout started from another stable than the file's (a
    completed rollout's canary stays stable until the file names it; an edit of the file's
    stable drops that: from the rollout alone, which of them serves cannot be told)."""
    if live is not None and live.error is not None:
        return None, True
    if live is None or live.state is None:
        return None, False
    r = live.state
    versions = {v.name for v in model.versions}
    named = {r["stable_version"], r["canary_version"], r.get("previous_version")} - {None}
    if not named <= versions:
        return None, False  # about versions the file no longer has
    if r["phase"] in RUNNING_PHASES:
        return r, False
    if started_from(r) == model.stable:
        return r, False  # Aborted: back on the file's stable; Completed: the file not updated yet
    if r["phase"] == "Completed" and r["stable_version"] == model.stable:
        return None, False  # the file names the new stable
    return None, True


def started_from(r: Mapping[str, Any]) -> str:
    """The stable version a rollout (cpctl's JSON form) started from: once Completed that is
    the version the new stable replaced."""
    return str(r["previous_version"] if r["phase"] == "Completed" else r["stable_version"])


def _traffic(model: Model, live: LiveRollout | None) -> dict[str, int] | None:
    """Each version's percent of the model's traffic (x-model-version aside); None when unknown."""
    r, unknown = live_split(model, live)
    if unknown:
        return None
    shares = {v.name: 100 if v.name == model.stable else 0 for v in model.versions}
    if r is not None and r["phase"] in RUNNING_PHASES:
        shares = {v: int(r["weights"].get(v, 0)) for v in shares}
    elif r is not None and r["phase"] == "Completed":
        shares = {v: 100 if v == r["stable_version"] else 0 for v in shares}
    return shares


def _role(version: str, model: Model, live: LiveRollout | None) -> str:
    """stable (serves as the stable version), canary (a running rollout's), replaced (the old
    stable of a completed rollout, which the file still names), aborted (an aborted rollout's
    canary), unrouted (reached only with x-model-version), or unknown (a rollout may route to
    it, but how could not be told)."""
    r, unknown = live_split(model, live)
    if unknown:
        return "stable" if version == model.stable else "unknown"
    if r is None:
        return "stable" if version == model.stable else "unrouted"
    # The parts as cpctl shows them: once Completed, stable_version is the new stable.
    stable, canary, previous = r["stable_version"], r["canary_version"], r.get("previous_version")
    roles = {
        "Completed": {previous: "replaced", stable: "stable"},
        "Aborted": {canary: "aborted", stable: "stable"},
    }.get(r["phase"], {canary: "canary", stable: "stable"})
    return roles.get(version, "unrouted")


def _rollout_doc(model: Model, live: LiveRollout | None) -> dict[str, Any]:
    """The `rollout` section: whether the control plane was asked, what it said (cpctl's JSON
    form), and `applies`: whether the versions' traffic and roles follow it."""
    if live is None:
        return {
            "asked": False,
            "server": None,
            "error": None,
            "state": None,
            "summary": None,
            "applies": False,
        }
    r, _ = live_split(model, live)
    return {
        "asked": True,
        "server": live.server,
        "error": live.error,
        "state": None if live.state is None else dict(live.state),
        "summary": live.summary or None,
        "applies": r is not None,
    }


# ---------------------------------------------------------------------------------------------
# the explanation


def explain(
    fleet: Fleet, name: str, raw: Mapping[str, Any] | None = None, live: LiveRollout | None = None
) -> dict[str, Any]:
    """Everything that decides how `name` is served, as a JSON-ready dict.

    `raw` is the fleet file's YAML mapping; with it, a setting's source is the key actually set
    in the file. Without it, sources are inferred from values (a key set to the value it would
    inherit anyway shows as inherited). `live` is what the control plane said about the model's
    rollout; without it, the file's stable version takes all the traffic. Raises UnknownModel."""
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

    shares = _traffic(model, live)
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
                "role": _role(version.name, model, live),
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
        "rollout": _rollout_doc(model, live),
        "versions": versions,
        "warnings": warnings,
    }


# ---------------------------------------------------------------------------------------------
# rendering


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [(indent + "  ".join(c.ljust(widths[i]) for i, c in enumerate(r))).rstrip() for r in rows]


def _tier_text(e: Mapping[str, Any]) -> str:
    tier, bound = e["tier"], e["tier"]["max_params_b"]
    if tier["chosen_by"] == "model":
        how = "named by the model" + (f"; holds up to {bound:g}B" if bound is not None else "")
    else:
        how = f"from params_b {e['params_b']:g}" + (f" <= {bound:g}" if bound is not None else ", unbounded")
    return f"{tier['name']}  ({how})"


def _policy_rows(settings: Mapping[str, Any]) -> list[list[str]]:
    rows = [["KEY", "VALUE", "SOURCE", ""]]
    for key, entry in settings.items():
        note = "unset: follows the timeout" if entry["follows"] == "timeout" else ""
        rows.append([key, entry["text"], entry["source"], note])
    return rows


def _retry_lines(retry: Mapping[str, Any] | None) -> list[str]:
    if retry is None:
        return ["none (retries 0)"]
    on = [*retry["retry_on"], *(str(c) for c in retry["retriable_status_codes"])]
    lines = [f"up to {retry['num_retries']} on {', '.join(on)}"]
    if retry["other_host"]:
        lines.append("each retry to another host (previous_hosts)")
    n = retry["next_priority_after_attempts"]
    if n is not None:
        lines.append(
            f"after {n} failed attempts the next goes to the next EDS priority (previous_priorities)"
        )
    lines.append("never once response headers have gone to the client")
    return lines


def _envoy_rows(e: Mapping[str, Any]) -> list[list[str]]:
    env, rows = e["envoy"], []
    route = env["route"]
    if route:
        rows.append(
            ["route timeout", f"{fmt_duration(route['timeout_s'])}: the whole request, streaming included"]
        )
        idle = route["idle_timeout_s"]
        rows.append(
            [
                "idle timeout",
                ("none" if idle is None else fmt_duration(idle))
                + ": longest silence, the wait for response headers included",
            ]
        )
        rows.append(["routing priority", route["routing_priority"]])
    retry = _retry_lines(env["retry"])
    rows += [["retries" if i == 0 else "", line] for i, line in enumerate(retry)]
    budget = (env["circuit_breakers"].get("default") or {}).get("retry_budget")
    if budget:
        share, least = budget["percent"], budget["min_concurrency"]
        rows.append(["retry budget", f"{share:g}% of requests in flight may be retries, at least {least}"])
    limits = env["body_limit"]
    if limits["header_routed_bytes"] is not None:
        rows.append(["max body", f"{fmt_bytes(limits['header_routed_bytes'])} with the x-model header"])
    if limits["body_routed_bytes"] is not None:
        rows.append(
            ["", f"{fmt_bytes(limits['body_routed_bytes'])} if named in the JSON body (listener-wide)"]
        )
    for prio in ("default", "high"):
        b = env["circuit_breakers"].get(prio)
        text = "Envoy defaults" if b is None else f"{b['max_requests']} in flight, {b['max_pending']} pending"
        rows.append([f"breaker {prio}", text])
    od = env["outlier_detection"]
    counted = "507 and connection failures included" if od["local_origin_errors_count"] else "507 included"
    rows.append(["outlier detection", f"eject after {od['consecutive_5xx']} consecutive 5xx ({counted})"])
    rows.append(
        [
            "",
            f"for {fmt_duration(od['base_ejection_time_s'])} x ejections in a row, at most "
            f"{od['max_ejection_percent']}% of hosts at once; swept every {fmt_duration(od['interval_s'])}",
        ]
    )
    if od["enforcing_consecutive_5xx"] != 100:
        rows.append(["", f"enforced for {od['enforcing_consecutive_5xx']}% of detections"])
    panic = env["healthy_panic_threshold_percent"]
    if panic == 0:
        rows.append(["panic mode", "off (threshold 0%): no healthy endpoint -> 503"])
    else:
        rows.append(["panic mode", "Envoy default (50%)" if panic is None else f"threshold {panic:g}%"])
    lb = env["load_balancer"] or "Envoy default"
    weighted = " with the control plane's weights" if lb == "least_request" else ""
    rows.append(["balancing", f"{e['settings']['balancing']['text']}: Envoy {lb}{weighted}"])
    aff = e["affinity"]
    if aff is not None:
        key = f"header {aff['header']}" if aff["header"] else f"JSON body field {aff['body_field']}"
        rows.append(
            ["affinity", f"{aff['algorithm']} on the {key}, bounded at {aff['balance_factor']}% of mean load"]
        )
    rows.append(["connect timeout", fmt_duration(env["connect_timeout_s"])])
    g = env["proxyless_grpc"]
    if g is not None:
        idle = (
            "no idle timeout" if g["idle_timeout_s"] is None else f"idle {fmt_duration(g['idle_timeout_s'])}"
        )
        retries = "no retries, no body limit" if not g["retries"] else f"{g['retries']} retries"
        rows.append(["proxyless gRPC", f"timeout {fmt_duration(g['timeout_s'])}; {idle}; {retries}"])
    return rows


def _memory_rows(e: Mapping[str, Any]) -> list[list[str]]:
    mem, f = e["memory"], e["failover"]
    need = mem["formula"] if mem["need_gb"] is None else f"{mem['need_gb']:g} GB, {mem['formula']}"
    rows = [["need", need]]
    rows.append(["preferred GPUs", ", ".join(mem["preferred_gpus"]) or "none: every endpoint at priority 0"])
    if f["held_out_after_s"] is not None:
        rows.append(
            [
                "dead endpoint",
                f"held out (EDS UNHEALTHY) after {f['held_out_after_scrapes']} failed scrapes in a row "
                f"(about {fmt_duration(f['held_out_after_s'])})",
            ]
        )
    return rows


_WHERE = {"gpu_class": "class", "endpoint": "endpoint"}


def _endpoint_row(ep: Mapping[str, Any]) -> list[str]:
    memory = "unknown"
    if ep["gpu_memory_gb"] is not None:
        memory = f"{ep['gpu_memory_gb']:g} GB ({_WHERE[ep['gpu_memory_source']]})"
    capacity = "learnt at run time"
    if ep["capacity"] is not None:
        capacity = f"{ep['capacity']:g} ({_WHERE[ep['capacity_source']]})"
    if ep["eds_priority"] is None:
        eds = f"left out: {ep['reason']}"
    else:
        eds = f"priority {ep['eds_priority']} ({ep['placement']})"
    return [ep["address"], ep["gpu"] or "-", memory, capacity, eds]


def _stable_text(e: Mapping[str, Any]) -> str:
    v = next(v for v in e["versions"] if v["stable"])
    share, cluster = v["traffic_percent"], f"cluster {e['cluster']}"
    live_stable = next((x["name"] for x in e["versions"] if x["role"] == "stable"), e["stable"])
    if v["role"] == "replaced":
        return f"{e['stable']}  (in the file; {live_stable} replaced it: its rollout completed)"
    if v["role"] == "canary":
        return f"{e['stable']}  (in the file; the running rollout's canary, from {live_stable})"
    if share is None:
        return f"{e['stable']}  ({cluster} takes all traffic, unless a rollout moved some: see rollout)"
    if share < 100:
        return f"{e['stable']}  ({cluster} takes {share}% of the traffic while the rollout runs)"
    return f"{e['stable']}  ({cluster} takes all traffic)"


def _rollout_text(e: Mapping[str, Any]) -> str | None:
    """The `rollout` line: the live state, or why it is unknown; None for a single version."""
    r, model = e["rollout"], e["model"]
    see = f"`cpctl rollout status {model}`"
    if not r["asked"]:
        return f"not asked (--offline); {see} shows it" if len(e["versions"]) > 1 else None
    if r["error"] is not None:
        return f"unknown: {r['error']}; {see} shows it"
    if r["state"] is None:
        return f"none  (asked the control plane at {r['server']})"
    summary = str(r["summary"] or r["state"]["phase"]).removeprefix(f"{model}: ")
    if any(v["traffic_percent"] is None for v in e["versions"]):
        return (
            f"{summary}  (live from {r['server']}); it started from {started_from(r['state'])}, not "
            f"the file's stable {e['stable']}: `cpctl endpoints list --model {model}` shows what serves"
        )
    return f"{summary}  (live from {r['server']}; {see})"


def _version_status(v: Mapping[str, Any], e: Mapping[str, Any]) -> str:
    share, role, name = v["traffic_percent"], v["role"], v["name"]
    if role == "stable" and not v["stable"]:
        if share == 100:
            return (
                f"stable since its rollout completed: takes the traffic (the file says stable: {e['stable']})"
            )
        return f"stable of the running rollout: {share}% of the traffic (the file says stable: {e['stable']})"
    if role == "stable" and share is None:
        return "stable in the file: takes the traffic unless a rollout moved some"
    if role == "stable":
        return "stable: takes the traffic" if share == 100 else f"stable: {share}% of the traffic"
    if role == "canary":
        return f"canary of the running rollout: {share}% of the traffic"
    if role == "replaced":
        return "replaced by the completed rollout: no traffic; its endpoints drain, then its cluster goes"
    if role == "aborted":
        return "canary of an aborted rollout: no traffic; its endpoints drain"
    if role == "unknown":
        return "not stable in the file; a rollout may send it traffic: see rollout above"
    return f"not stable: only requests with x-model-version: {name} reach it"


def render_text(e: Mapping[str, Any], config: str | None = None) -> str:
    """The explanation for people: aligned columns, one fact per line."""
    lines = [f"model {e['model']}" + (f"  ({config})" if config else "")]
    rollout = _rollout_text(e)
    lines += _table(
        [
            ["tier", _tier_text(e)],
            ["protocol", e["protocol"]],
            ["stable", _stable_text(e)],
            *([["rollout", rollout]] if rollout is not None else []),
        ]
    )
    lines += ["", "traffic policy  (source: model = models.<name>, tier = tiers.<tier>, default = built in)"]
    lines += _table(_policy_rows(e["settings"]))
    if e["priority_classes"]:
        rows = [["CLASS (x-priority)", "ROUTING PRIORITY", "SHED AT"]]
        for c in e["priority_classes"]:
            name = c["name"] + (" (default)" if c["default"] else "")
            shed = "never" if c["shed_at"] is None else f"{c['shed_at']:g}"
            rows.append([name, c["routing_priority"], shed])
        lines += ["", "priority classes", *_table(rows)]
    lines += ["", "in Envoy", *_table(_envoy_rows(e))]
    rows = [["KEY", "VALUE", "SOURCE"]]
    rows += [[key, entry["text"], entry["source"]] for key, entry in e["autoscaling"].items()]
    lines += ["", "autoscaling  (desired replicas; see docs/autoscaling.md)", *_table(rows)]
    lines += ["", "memory and placement", *_table(_memory_rows(e))]
    for v in e["versions"]:
        lines += ["", f"version {v['name']}  cluster {v['cluster']}  ({_version_status(v, e)})"]
        if v["source"] != "file":
            lines.append(
                f"  endpoints discovered from {v['source']} at run time: `cpctl endpoints list` shows them"
            )
            continue
        if not v["endpoints"]:
            lines.append("  no endpoints")
            continue
        lines += _table(
            [["ADDRESS", "GPU", "GPU MEMORY", "CAPACITY", "EDS"], *map(_endpoint_row, v["endpoints"])]
        )
    if e["warnings"]:
        lines += ["", "notes", *(f"  - {w}" for w in e["warnings"])]
    return "\n".join(lines) + "\n"


def render_json(e: Mapping[str, Any]) -> str:
    """The explanation for scripts: stable keys, durations in seconds, sizes in bytes and GB."""
    return json.dumps(e, indent=2) + "\n"


def render_yaml(e: Mapping[str, Any]) -> str:
    """The same document as render_json, as YAML (keys in the same order)."""
    import yaml

    return str(yaml.safe_dump(dict(e), sort_keys=False, default_flow_style=False, allow_unicode=True))


def render(e: Mapping[str, Any], fmt: str, config: str | None = None) -> str:
    """The explanation in an output format: table (text for people), json or yaml."""
    if fmt == "json":
        return render_json(e)
    if fmt == "yaml":
        return render_yaml(e)
    return render_text(e, config)


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
) -> int:
    """`controlplane explain`: 0 explained, 1 invalid config (errors on stderr), 2 unknown model.
    `config` `-` reads standard input. With `live`, a model with several versions has its
    rollout asked of the control plane through `fetch` (fetch_rollout; tests pass their own)."""
    import yaml

    from controlplane.cli.fleet_input import read_fleet_input
    from controlplane.fleet.loader import FleetConfigInvalid, decode_fleet, parse_fleet

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
    try:
        explanation = explain(fleet, model, raw if isinstance(raw, Mapping) else None, state)
    except UnknownModel as e:
        print(f"controlplane explain: {e} (in {name})", file=sys.stderr)
        return 2
    sys.stdout.write(render(explanation, fmt, name))
    return 0
