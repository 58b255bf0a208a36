"""One model of the fleet YAML: its name, tier (named, or derived from params_b), versions and
stable version, dtype and memory, affinity, zones, preferred GPUs, health and metrics probes,
cluster_overrides, and the policies it overrides from its tier. Where a version's servers are
is schema_endpoints'."""

from __future__ import annotations

import re
from typing import Any

from controlplane import limits
from controlplane.fleet.errors import _Errors
from controlplane.fleet.model import (
    ADAPTER_AFFINITY,
    DTYPE_BYTES,
    METRICS_SCHEMES,
    Affinity,
    HealthProbe,
    MetricsProbe,
    Model,
    PrefixKey,
    ScalingPolicy,
    Slo,
    Tier,
    Version,
)
from controlplane.fleet.schema_adapters import adapters as _adapters
from controlplane.fleet.schema_adapters import clashes as _adapter_clashes
from controlplane.fleet.schema_adapters import placement as _placement
from controlplane.fleet.schema_endpoints import _discover, _endpoints, _kv_ports
from controlplane.fleet.schema_policies import TRAFFIC_KEYS, _scaling, _slo, _traffic
from controlplane.fleet.values import _VERSION, _int, _kind, _mapping, _number, _port, _url_path

# A leaf module (no imports of its own): the names a model must not clash with in Envoy.
from controlplane.resources.names import GATEWAY_LISTENER, stat_name

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}$")
PROTOCOLS = ("http1", "http2")


_MODEL_KEYS = {
    "params_b",
    "tier",
    "stable",
    "versions",
    "protocol",
    "cluster_overrides",
    "dtype",
    "memory_gb",
    "preferred_gpus",
    "affinity",
    "zones",
    "health",
    "metrics",
    "kv_events",
    "tokenizer",
    "autoscaling",
    "slo",
    "adapters",
    "placement",
    *TRAFFIC_KEYS,
}
AFFINITY_BODY_FIELDS = ("prompt_cache_key", "user")
_HEADER_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,99}$")


def _models(value: Any, tiers: list[Tier] | None, errs: _Errors) -> list[Model] | None:
    if value is None:
        value = {}
    if not isinstance(value, dict):
        errs.add("models", f"expected a mapping of model name to model, got {_kind(value)}")
        return None
    out: list[Model] = []
    stats: dict[str, str] = {}
    for name, spec in value.items():
        if not isinstance(name, str):
            # `yes:`, `~:` or `1:` are a boolean, null or number in YAML, not a name.
            errs.add("models", f"model names must be strings, got {name!r} (quote it in YAML)")
            continue
        if name == GATEWAY_LISTENER:
            errs.add(f"models.{name}", f"{name!r} is reserved: the gateway listener has that name")
            continue
        other = stats.setdefault(stat_name(name), name)
        if other != name:
            errs.add(
                f"models.{name}",
                f"its Envoy stat name {stat_name(name)!r} is the same as model {other!r}'s; rename one",
            )
            continue
        model = _model(name, spec, tiers, errs)
        if model is not None:
            out.append(model)
    _adapter_clashes(out, errs)
    return out


def _model(name: str, spec: Any, tiers: list[Tier] | None, errs: _Errors) -> Model | None:
    path = f"models.{name}"
    if not _NAME.match(name):
        errs.add(path, "model names use letters, digits and . _ : / - (at most 200)")
        return None
    m = _mapping(spec, path, errs, _MODEL_KEYS)
    if m is None:
        return None
    before = len(errs.items)
    params_b = (
        _number(m["params_b"], f"{path}.params_b", errs, maximum=limits.PARAMS_B_MAX)
        if "params_b" in m
        else None
    )
    tier = _model_tier(path, m, params_b, tiers, errs)
    protocol = m.get("protocol", "http1")
    if protocol not in PROTOCOLS:
        errs.add(f"{path}.protocol", f"expected one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    versions = _versions(path, m.get("versions"), errs)
    stable = m.get("stable")
    if stable is None:
        errs.add(f"{path}.stable", "missing: name the version that takes traffic")
    elif not isinstance(stable, str):
        errs.add(f"{path}.stable", f"expected a version name, got {_kind(stable)}")
        stable = None
    elif versions is not None and stable not in {v.name for v in versions}:
        errs.add(f"{path}.stable", f"names version {stable!r}, which is not under versions")
    base = next((t.policy for t in tiers or [] if t.name == tier), None)
    policy = _traffic(m, path, base, errs) if base is not None else None
    dtype = m.get("dtype", "fp16")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        errs.add(f"{path}.dtype", f"expected one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    memory = (
        _number(m["memory_gb"], f"{path}.memory_gb", errs, maximum=limits.MEMORY_GB_MAX)
        if "memory_gb" in m
        else None
    )
    affinity = (
        _affinity(m["affinity"], f"{path}.affinity", errs) if m.get("affinity", False) is not False else None
    )
    zones = m.get("zones", [])
    if (
        not isinstance(zones, list)
        or not all(isinstance(z, str) for z in zones)
        or len(set(zones)) != len(zones)
    ):
        errs.add(
            f"{path}.zones", f"expected a list of distinct zone names, most preferred first, got {zones!r}"
        )
        zones = []
    preferred = m.get("preferred_gpus", [])
    if not isinstance(preferred, list) or not all(isinstance(g, str) for g in preferred):
        errs.add(f"{path}.preferred_gpus", f"expected a list of GPU class names, got {preferred!r}")
        preferred = []
    overrides = m.get("cluster_overrides")
    if overrides is not None:
        _check_cluster_overrides(overrides, f"{path}.cluster_overrides", errs)
    health, metrics = _probes(m, path, errs)
    tier_scaling = next((t.scaling for t in tiers or [] if t.name == tier), ScalingPolicy())
    scaling = (
        _scaling(m["autoscaling"], f"{path}.autoscaling", tier_scaling, errs) if "autoscaling" in m else None
    )
    tier_slo = next((t.slo for t in tiers or [] if t.name == tier), Slo())
    slo = _slo(m["slo"], f"{path}.slo", tier_slo, errs) if "slo" in m else None
    kv_events = _kv_ports(m["kv_events"], f"{path}.kv_events", errs) if "kv_events" in m else None
    tokenizer = m.get("tokenizer")
    if tokenizer is not None and (not isinstance(tokenizer, str) or not tokenizer or len(tokenizer) > 4096):
        errs.add(
            f"{path}.tokenizer",
            f"expected the path of a directory with tokenizer.json, got {_kind(tokenizer)}",
        )
    adapters = _adapters(m.get("adapters"), f"{path}.adapters", versions, errs)
    placement = _placement(m.get("placement"), f"{path}.placement", adapters, errs)
    if adapters and "affinity" not in m:
        affinity = ADAPTER_AFFINITY  # `affinity: false` keeps Envoy's least request, adapters ignored
    elif affinity is not None and affinity.adapter and not adapters:
        errs.add(f"{path}.affinity.adapter", "the model has no adapters: add them under adapters")
    if len(errs.items) != before or tier is None or versions is None or adapters is None:
        return None
    return Model(
        name=name,
        tier=tier,
        stable=str(stable),
        versions=tuple(versions),
        params_b=params_b,
        protocol=protocol,
        policy=policy,
        dtype=str(dtype),
        memory_gb=memory,
        preferred_gpus=tuple(preferred),
        affinity=affinity,
        zones=tuple(zones),
        cluster_overrides=overrides,
        health=health,
        metrics=metrics,
        scaling=scaling,
        slo=slo,
        kv_events=kv_events,
        tokenizer=tokenizer,
        adapters=adapters,
        placement=placement,
    )


def _model_tier(
    path: str,
    m: dict[str, Any],
    params_b: float | None,
    tiers: list[Tier] | None,
    errs: _Errors,
) -> str | None:
    if not tiers:
        return None  # no valid tier: their errors are reported already
    if "tier" in m:
        tier = m["tier"]
        if not isinstance(tier, str) or tier not in {t.name for t in tiers}:
            names = ", ".join(t.name for t in tiers)
            errs.add(f"{path}.tier", f"unknown tier {tier!r} (tiers: {names})")
            return None
        chosen = next(t for t in tiers if t.name == tier)
        if params_b is not None and chosen.max_params_b is not None and params_b > chosen.max_params_b:
            errs.add(
                f"{path}.tier",
                f"tier {tier!r} holds models up to {chosen.max_params_b:g}B; this one has {params_b:g}B",
            )
            return None
        return str(tier)
    if "params_b" not in m:
        errs.add(path, "give params_b (the tier is derived from it) or tier")
        return None
    if params_b is None:
        return None
    for t in tiers:
        if t.max_params_b is None or params_b <= t.max_params_b:
            return t.name
    largest = max((t.max_params_b or 0.0) for t in tiers)
    errs.add(
        f"{path}.params_b",
        f"no tier can hold a {params_b:g}B model (largest max_params_b is {largest:g}); "
        "add a tier without max_params_b or set tier:",
    )
    return None


def _versions(path: str, value: Any, errs: _Errors) -> list[Version] | None:
    vpath = f"{path}.versions"
    if not value:
        errs.add(vpath, "missing: define at least one version")
        return None
    if not isinstance(value, dict):
        errs.add(vpath, f"expected a mapping of version name to version, got {_kind(value)}")
        return None
    out: list[Version] = []
    seen: dict[tuple[str, int], str] = {}
    for vname, vspec in value.items():
        p = f"{vpath}.{vname}"
        if not isinstance(vname, str) or not _VERSION.match(vname):
            errs.add(p, "version names use letters, digits, '.', '_' and '-' (at most 63)")
            continue
        vm = _mapping(vspec, p, errs, {"endpoints", "health", "metrics", "discover", "kv_events"})
        if vm is None:
            continue
        discover = None
        if "discover" in vm:
            if vm.get("endpoints"):
                errs.add(p, "has both endpoints and discover: a version's endpoints come from one of them")
                continue
            discover = _discover(p, vm["discover"], errs)
            if discover is None:
                continue
        endpoints = _endpoints(p, vm.get("endpoints"), seen, errs)
        health, metrics = _probes(vm, p, errs)
        kv = _kv_ports(vm["kv_events"], f"{p}.kv_events", errs) if "kv_events" in vm else None
        if endpoints is not None and ("kv_events" not in vm or kv is not None):
            out.append(
                Version(
                    name=vname,
                    endpoints=tuple(endpoints),
                    health=health,
                    metrics=metrics,
                    discover=discover,
                    kv_events=kv,
                )
            )
    return out


def _affinity(value: Any, path: str, errs: _Errors) -> Affinity | None:
    m = _mapping(
        value, path, errs, {"header", "body", "prefix", "adapter", "algorithm", "hash_balance_factor"}
    )
    if m is None:
        return None
    before = len(errs.items)
    header, body = m.get("header"), m.get("body")
    prefix = _prefix_key(m["prefix"], f"{path}.prefix", errs) if "prefix" in m else None
    adapter = m.get("adapter")
    if adapter is not None and adapter is not True:
        errs.add(
            f"{path}.adapter", f"expected true (the key is the adapter a request names), got {adapter!r}"
        )
    if sum(x is not None for x in (header, body, m.get("prefix"), adapter)) != 1:
        errs.add(
            path,
            "give exactly one of header (e.g. x-session-id), body (prompt_cache_key or user), "
            "prefix (the prompt's leading part) or adapter (true: the adapter a request names)",
        )
    if header is not None and (not isinstance(header, str) or not _HEADER_NAME.match(header)):
        errs.add(f"{path}.header", f"expected a lower-case header name such as x-session-id, got {header!r}")
    if body is not None and body not in AFFINITY_BODY_FIELDS:
        errs.add(f"{path}.body", f"expected one of {', '.join(AFFINITY_BODY_FIELDS)}, got {body!r}")
    algorithm = m.get("algorithm", "maglev")
    if algorithm not in ("maglev", "ring_hash"):
        errs.add(f"{path}.algorithm", f"expected maglev or ring_hash, got {algorithm!r}")
    factor = _int(m.get("hash_balance_factor", 150), f"{path}.hash_balance_factor", errs, 100, 100_000)
    if len(errs.items) != before or factor is None:
        return None
    return Affinity(
        header=header,
        body_field=body,
        algorithm=str(algorithm),
        balance_factor=factor,
        prefix=prefix,
        adapter=adapter is True,
    )


_PREFIX_KEYS = {"messages", "prompt_bytes", "max_bytes"}


def _prefix_key(value: Any, path: str, errs: _Errors) -> PrefixKey | None:
    """`prefix: true` (the defaults) or `prefix: {messages, prompt_bytes, max_bytes}`."""
    if value is True:
        return PrefixKey()
    m = _mapping(value, path, errs, _PREFIX_KEYS)
    if m is None:
        return None
    kw: dict[str, Any] = {}
    for key, lo, hi in (("messages", 1, 64), ("prompt_bytes", 16, 1_048_576), ("max_bytes", 64, 1_048_576)):
        if key in m:
            kw[key] = _int(m[key], f"{path}.{key}", errs, lo, hi)
    if any(v is None for v in kw.values()):
        return None
    return PrefixKey(**kw)


def _health(value: Any, path: str, errs: _Errors) -> HealthProbe | None:
    """`none`, `{http: {path, port}}` or `{grpc: {service, port}}` (each key optional)."""
    if value == "none":
        return HealthProbe("none")
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in ("http", "grpc"):
        errs.add(
            path,
            "expected none, {http: {path: /health, port: N}} or {grpc: {service: NAME, port: N}}, "
            f"got {value!r}",
        )
        return None
    kind, spec = next(iter(value.items()))
    keys = {"path", "port"} if kind == "http" else {"service", "port"}
    m = _mapping(spec if spec is not None else {}, f"{path}.{kind}", errs, keys)
    if m is None:
        return None
    before = len(errs.items)
    port = _port(m["port"], f"{path}.{kind}.port", errs) if "port" in m else None
    probe_path = _url_path(m["path"], f"{path}.{kind}.path", errs) if "path" in m else None
    service = m.get("service", "")
    if not isinstance(service, str):
        errs.add(f"{path}.{kind}.service", f"expected a gRPC service name (a string), got {service!r}")
    if len(errs.items) != before:
        return None
    return HealthProbe(kind, path=probe_path, service=str(service), port=port)


def _metrics_probe(value: Any, path: str, errs: _Errors) -> MetricsProbe | None:
    """`none` or `{path, port, scheme}` (each optional)."""
    if value == "none":
        return MetricsProbe(enabled=False)
    m = _mapping(value, path, errs, {"path", "port", "scheme"})
    if m is None:
        return None
    before = len(errs.items)
    port = _port(m["port"], f"{path}.port", errs) if "port" in m else None
    probe_path = _url_path(m["path"], f"{path}.path", errs) if "path" in m else None
    scheme = m.get("scheme", "http")
    if scheme not in METRICS_SCHEMES:
        errs.add(f"{path}.scheme", f"expected one of {', '.join(METRICS_SCHEMES)}, got {scheme!r}")
    if len(errs.items) != before:
        return None
    return MetricsProbe(path=probe_path, port=port, scheme=str(scheme))


def _probes(m: dict[str, Any], path: str, errs: _Errors) -> tuple[HealthProbe | None, MetricsProbe | None]:
    health = _health(m["health"], f"{path}.health", errs) if "health" in m else None
    metrics = _metrics_probe(m["metrics"], f"{path}.metrics", errs) if "metrics" in m else None
    return health, metrics


def _check_cluster_overrides(value: Any, path: str, errs: _Errors) -> None:
    # Imported here so that loading a fleet without overrides does not need the xDS types.
    from envoy.config.cluster.v3 import cluster_pb2
    from google.protobuf import json_format

    if not isinstance(value, dict):
        errs.add(path, f"expected a mapping of Envoy Cluster fields, got {_kind(value)}")
        return
    forbidden = {"name", "type", "eds_cluster_config", "load_assignment"} & set(value)
    for key in sorted(forbidden):
        errs.add(f"{path}.{key}", "is managed by the control plane and cannot be overridden")
    # Proxyless gRPC clients get the same clusters and refuse an LRS server other than the
    # xDS server itself ("ConfigSource is not self"): every cluster already names it.
    for key in ("lrs_server", "lrsServer"):
        if key in value:
            errs.add(
                f"{path}.{key}",
                "is managed by the control plane (load reports go to the xDS server itself, "
                "`self`, the only LRS server proxyless gRPC clients accept) and cannot be overridden",
            )
    try:
        json_format.ParseDict(value, cluster_pb2.Cluster())
    except json_format.ParseError as e:
        errs.add(path, f"not a valid Envoy Cluster fragment: {e}")
