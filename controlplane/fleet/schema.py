"""The fleet YAML's top level, parsed into controlplane.fleet.model: which sections there are,
and the fleet-wide ones (listener, tiers, signals and its prometheus source, priority classes,
the autoscaling provider, discovery settings).

The rest of the schema: models in schema_models (their endpoints in schema_endpoints), the
policies tiers and models share in schema_policies, GPU classes and the checks across the whole
fleet in schema_gpus."""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

from controlplane import limits
from controlplane.fleet.errors import ConfigError, _Errors
from controlplane.fleet.model import (
    PROVIDERS,
    SIGNAL_SOURCES,
    DiscoverySettings,
    EmulatedServer,
    Fleet,
    ListenerSpec,
    PickerSpec,
    PriorityClass,
    PrometheusSpec,
    ProviderSpec,
    ScalingPolicy,
    SignalsSpec,
    Slo,
    Tier,
    TrafficPolicy,
)
from controlplane.fleet.schema_gpus import _check_memory_fit, _gpu_classes, _match_gpu_classes
from controlplane.fleet.schema_models import _models
from controlplane.fleet.schema_policies import TRAFFIC_KEYS, _scaling, _slo, _traffic
from controlplane.fleet.schema_quotas import _quotas
from controlplane.fleet.values import (
    _VERSION,
    _addresses,
    _bounded_duration,
    _duration,
    _int,
    _kind,
    _mapping,
    _number,
    _side_tls,
)


def _fleet(data: Any, errs: _Errors) -> Fleet | None:
    top = _mapping(
        data,
        "",
        errs,
        {
            "listener",
            "tiers",
            "models",
            "gpu_classes",
            "signals",
            "priority_classes",
            "default_priority_class",
            "autoscaling",
            "discovery",
            "picker",
            "quotas",
        },
    )
    if top is None:
        return None
    provider = _provider(top.get("autoscaling"), errs)
    discovery = _discovery(top.get("discovery"), errs)
    picker = _picker(top.get("picker"), errs)
    listener = _listener(top.get("listener"), errs)
    tiers = _tiers(top.get("tiers"), errs)
    gpu_classes = _gpu_classes(top.get("gpu_classes"), errs)
    signals = _signals(top.get("signals"), errs)
    classes, default_class = _priority_classes(
        top.get("priority_classes"), top.get("default_priority_class"), errs
    )
    models = _models(top.get("models"), tiers, errs)
    if (
        listener is None
        or tiers is None
        or models is None
        or gpu_classes is None
        or signals is None
        or provider is None
        or discovery is None
        or picker is None
    ):
        return None
    fleet = Fleet(
        listener=listener,
        tiers=tuple(tiers),
        models=tuple(models),
        gpu_classes=tuple(gpu_classes),
        signals=signals,
        priority_classes=tuple(classes),
        default_priority_class=default_class,
        autoscaling=provider,
        discovery=discovery,
        picker=picker,
    )
    if "quotas" in top:
        adapters = {a.name for m in fleet.models for a in m.adapters}
        fleet = replace(fleet, quotas=_quotas(top["quotas"], {m.name for m in fleet.models}, errs, adapters))
    _check_pickers(fleet, errs)
    _check_flow_control(fleet, errs)
    fleet = _match_gpu_classes(fleet, errs)
    _check_memory_fit(fleet, errs)
    return fleet


def _picker(value: Any, errs: _Errors) -> PickerSpec | None:
    """The fleet-level `picker:` (docs/picker.md): where proxies reach the endpoint pickers,
    and how long they wait for a pick before routing by the weights."""
    m = _mapping(value, "picker", errs, {"endpoints", "timeout", "tls"})
    if m is None:
        return None
    before = len(errs.items)
    kw: dict[str, Any] = {}
    endpoints = _addresses(m.get("endpoints", []), "picker.endpoints", "IP:PORT", errs, unique=True)
    if endpoints is not None:
        kw["endpoints"] = endpoints
    if "timeout" in m:
        kw["timeout_s"] = _bounded_duration(
            m["timeout"],
            "picker.timeout",
            limits.PICKER_TIMEOUT_MIN_S,
            limits.PICKER_TIMEOUT_MAX_S,
            "every picked request may wait this long when the picker is slow",
            errs,
        )
    if "tls" in m:
        kw["tls"] = _side_tls(m["tls"], "picker.tls", errs)
    return PickerSpec(**kw) if len(errs.items) == before else None


def _check_pickers(fleet: Fleet, errs: _Errors) -> None:
    """`balancing: picker` needs pickers to ask: name the tier or model that sets it."""
    if fleet.picker.endpoints:
        return
    why = (
        "balancing: picker needs the pickers' addresses: set picker.endpoints to the "
        "IP:PORT of each `controlplane picker` (docs/picker.md)"
    )
    for tier in fleet.tiers:
        if tier.policy.balancing == "picker":
            errs.add(f"tiers.{tier.name}.balancing", why)
    for model in fleet.models:
        tier_policy = fleet.tier(model.tier).policy.balancing
        if model.policy is not None and model.policy.balancing == "picker" and tier_policy != "picker":
            errs.add(f"models.{model.name}.balancing", why)


TIER_S = "its tier's "


def _check_flow_control(fleet: Fleet, errs: _Errors) -> None:
    """`flow_control` queues in the pickers: it needs `balancing: picker`; its `max_wait` may
    name only the fleet's priority classes."""
    classes = [c.name for c in fleet.priority_classes]
    places = [(f"tiers.{t.name}", t.policy, None) for t in fleet.tiers] + [
        (f"models.{m.name}", m.policy, fleet.tier(m.tier).policy)
        for m in fleet.models
        if m.policy is not None
    ]
    for path, policy, tier in places:
        flow = policy.flow_control
        if flow is None or (tier is not None and tier == policy):
            continue  # none, or the tier's own: checked (and named) there
        if policy.balancing != "picker":
            inherited = tier is not None and tier.flow_control == flow
            errs.add(
                f"{path}.balancing" if inherited else f"{path}.flow_control",
                f"{TIER_S if inherited else ''}flow_control needs balancing: picker "
                f"(the queue is kept by the pickers), got {policy.balancing}"
                + ("; or set flow_control: false on the model" if inherited else ""),
            )
        if tier is not None and tier.flow_control == flow:
            continue
        for name, _ in flow.max_wait_by_class:
            if name not in classes:
                known = f"classes: {', '.join(classes)}" if classes else "no priority_classes are defined"
                errs.add(f"{path}.flow_control.max_wait.{name}", f"unknown priority class ({known})")


def _discovery(value: Any, errs: _Errors) -> DiscoverySettings | None:
    """The fleet-level `discovery:` (docs/discovery.md): how names are resolved and where
    Kubernetes is."""
    m = _mapping(value, "discovery", errs, {"dns", "kubernetes"})
    if m is None:
        return None
    before = len(errs.items)
    kw: dict[str, Any] = {}
    dns = _mapping(m.get("dns"), "discovery.dns", errs, {"nameservers", "min_interval", "max_interval"})
    if dns is not None:
        servers = _addresses(dns.get("nameservers", []), "discovery.dns.nameservers", "HOST:PORT", errs)
        if servers is not None:
            kw["nameservers"] = servers
        for key, attr in (("min_interval", "dns_min_interval_s"), ("max_interval", "dns_max_interval_s")):
            if key in dns:
                got = _duration(dns[key], f"discovery.dns.{key}", errs)
                if got is not None and not 0.1 <= got <= 86400:
                    errs.add(f"discovery.dns.{key}", f"must be between 0.1s and 24h, got {got:g}s")
                kw[attr] = got
    k8s = _mapping(m.get("kubernetes"), "discovery.kubernetes", errs, {"kubeconfig", "labels"})
    if k8s is not None:
        if "kubeconfig" in k8s:
            if not isinstance(k8s["kubeconfig"], str) or not k8s["kubeconfig"]:
                errs.add(
                    "discovery.kubernetes.kubeconfig", f"expected a file path, got {k8s['kubeconfig']!r}"
                )
            kw["kubeconfig"] = k8s["kubeconfig"]
        labels = _mapping(
            k8s.get("labels"), "discovery.kubernetes.labels", errs, {"gpu", "gpu_memory_gb", "capacity"}
        )
        for key, attr in (
            ("gpu", "gpu_label"),
            ("gpu_memory_gb", "gpu_memory_label"),
            ("capacity", "capacity_label"),
        ):
            if labels is not None and key in labels:
                v = labels[key]
                if not isinstance(v, str) or not v or len(v) > 253:
                    errs.add(
                        f"discovery.kubernetes.labels.{key}", f"expected a label or annotation key, got {v!r}"
                    )
                kw[attr] = v
    if len(errs.items) != before:
        return None
    out = DiscoverySettings(**kw)
    if out.dns_min_interval_s > out.dns_max_interval_s:
        errs.add(
            "discovery.dns.min_interval",
            f"is above max_interval ({out.dns_min_interval_s:g}s > {out.dns_max_interval_s:g}s)",
        )
        return None
    return out


_PROVIDER_KEYS = {"provider", "emulator"}
_EMULATOR_KEYS = {"cold_start", "slots", "decode_ms_per_token", "speed"}


def _provider(value: Any, errs: _Errors) -> ProviderSpec | None:
    """The fleet-level `autoscaling:` (who starts and stops replicas)."""
    m = _mapping(value, "autoscaling", errs, _PROVIDER_KEYS)
    if m is None:
        return None
    before = len(errs.items)
    provider = m.get("provider", "none")
    if provider not in PROVIDERS:
        errs.add("autoscaling.provider", f"expected one of {', '.join(PROVIDERS)}, got {provider!r}")
    em = _mapping(m.get("emulator"), "autoscaling.emulator", errs, _EMULATOR_KEYS)
    kw: dict[str, Any] = {}
    if em is not None:
        if "cold_start" in em:
            kw["cold_start_s"] = _duration(em["cold_start"], "autoscaling.emulator.cold_start", errs)
        if "slots" in em:
            kw["slots"] = _int(em["slots"], "autoscaling.emulator.slots", errs, 1, 1024)
        for key, top in (("decode_ms_per_token", 10_000.0), ("speed", 100.0)):
            if key in em:
                kw[key] = _number(em[key], f"autoscaling.emulator.{key}", errs, maximum=top)
    if len(errs.items) != before or em is None:
        return None
    return ProviderSpec(provider=str(provider), emulator=EmulatedServer(**kw))


def _priority_classes(value: Any, default: Any, errs: _Errors) -> tuple[list[PriorityClass], str | None]:
    """Classes highest first. A class is shed (429) at or above its `shed_at` saturation, so
    `shed_at` may not grow down the list: a higher class is never shed before a lower one."""
    m = _mapping(value, "priority_classes", errs, set(value) if isinstance(value, dict) else set())
    out: list[PriorityClass] = []
    if not m:
        if default is not None:
            errs.add("default_priority_class", "names a class, but no priority_classes are defined")
        return out, None
    floor_path, floor = None, math.inf
    for name, spec in m.items():
        path = f"priority_classes.{name}"
        if not isinstance(name, str) or not _VERSION.match(name):
            errs.add(path, "class names use letters, digits, '.', '_' and '-'")
            continue
        c = _mapping(spec, path, errs, {"routing_priority", "shed_at"})
        if c is None:
            continue
        prio = c.get("routing_priority", "default")
        if prio not in ("default", "high"):
            errs.add(f"{path}.routing_priority", f"expected default or high, got {prio!r}")
            continue
        shed_at = None
        if "shed_at" in c:
            shed_at = _number(c["shed_at"], f"{path}.shed_at", errs)
            if shed_at is None:
                continue
        level = math.inf if shed_at is None else shed_at
        if level > floor:
            errs.add(
                f"{path}.shed_at",
                f"{shed_at if shed_at is not None else 'never'} is above {floor_path}'s {floor:g}: "
                "a class listed lower would be kept while a higher one is shed; list classes highest "
                "first with shed_at never growing",
            )
        floor_path, floor = path, min(floor, level)
        out.append(PriorityClass(name=name, high=prio == "high", shed_at=shed_at))
    names = [c.name for c in out]
    if default is None:
        errs.add(
            "default_priority_class",
            f"missing: name the class of requests without x-priority ({', '.join(names)})",
        )
        return out, None
    if default not in names:
        errs.add("default_priority_class", f"unknown class {default!r} (classes: {', '.join(names)})")
        return out, None
    return out, str(default)


_SIGNAL_DURATIONS = {
    "interval": "interval_s",
    "timeout": "timeout_s",
    "stale_after": "stale_after_s",
    "stale_full": "stale_full_s",
    "slow_start": "slow_start_s",
}


def _signals(value: Any, errs: _Errors) -> SignalsSpec | None:
    allowed = {"enabled", "metrics_path", "health_path", "source", "prometheus", *_SIGNAL_DURATIONS}
    m = _mapping(value, "signals", errs, allowed)
    if m is None:
        return None
    before = len(errs.items)
    kwargs: dict[str, Any] = {}
    if "enabled" in m:
        if not isinstance(m["enabled"], bool):
            errs.add("signals.enabled", f"expected true or false, got {_kind(m['enabled'])}")
        kwargs["enabled"] = m["enabled"]
    for key in ("metrics_path", "health_path"):
        if key in m:
            if not isinstance(m[key], str) or not m[key].startswith("/"):
                errs.add(f"signals.{key}", f"expected a path starting with '/', got {m[key]!r}")
            kwargs[key] = m[key]
    for key, field_name in _SIGNAL_DURATIONS.items():
        if key in m:
            kwargs[field_name] = _duration(m[key], f"signals.{key}", errs)
    interval, timeout = kwargs.get("interval_s"), kwargs.get("timeout_s")
    if (
        interval is not None
        and not limits.SIGNALS_INTERVAL_MIN_S <= interval <= limits.SIGNALS_INTERVAL_MAX_S
    ):
        errs.add(
            "signals.interval",
            f"must be between {limits.SIGNALS_INTERVAL_MIN_S * 1000:g}ms and "
            f"{limits.SIGNALS_INTERVAL_MAX_S:g}s, got {m['interval']!r} (shorter burns a core; "
            "longer delays every weight and readiness change)",
        )
    if timeout is not None and timeout < limits.SIGNALS_TIMEOUT_MIN_S:
        errs.add(
            "signals.timeout",
            f"must be at least {limits.SIGNALS_TIMEOUT_MIN_S * 1000:g}ms, got {m['timeout']!r} "
            "(no server answers sooner: every scrape would fail)",
        )
    if "source" in m:
        if m["source"] not in SIGNAL_SOURCES:
            errs.add(
                "signals.source",
                f"unknown source {m['source']!r} (known: {', '.join(sorted(SIGNAL_SOURCES))})",
            )
        kwargs["source"] = m["source"]
    if "prometheus" in m:
        kwargs["prometheus"] = _prometheus(m["prometheus"], errs)
    elif kwargs.get("source") == "prometheus":
        reason = "required when signals.source is prometheus (at least its url)"
        errs.items.append(
            ConfigError(errs.file, "signals.prometheus", reason, errs.lines.get("signals.source"))
        )
    if len(errs.items) != before:
        return None
    spec = SignalsSpec(**kwargs)
    if spec.timeout_s > spec.interval_s:
        errs.add("signals.timeout", f"must not exceed signals.interval ({spec.interval_s:g}s)")
    if spec.stale_full_s <= spec.stale_after_s:
        errs.add("signals.stale_full", f"must be greater than signals.stale_after ({spec.stale_after_s:g}s)")
    prom = spec.prometheus if spec.source == "prometheus" else None
    if prom is not None and spec.stale_after_s < prom.interval_s:
        # Every sample is already up to one query interval old when it arrives.
        errs.add(
            "signals.stale_after",
            f"must be at least signals.prometheus.interval ({prom.interval_s:g}s) with the prometheus source",
        )
    return spec if len(errs.items) == before else None


_LABEL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _prometheus(value: Any, errs: _Errors) -> PrometheusSpec | None:
    path = "signals.prometheus"
    m = _mapping(value, path, errs, {"url", "interval", "timeout", "address_label"})
    if m is None:
        return None
    before = len(errs.items)
    kwargs: dict[str, Any] = {}
    if "url" not in m:
        reason = "required: the Prometheus server, e.g. http://prometheus:9090"
        errs.items.append(ConfigError(errs.file, f"{path}.url", reason, errs.lines.get(path)))
    else:
        url = m["url"]
        parts = urlsplit(url.strip()) if isinstance(url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            errs.add(f"{path}.url", f"expected http://HOST:PORT or https://HOST:PORT, got {url!r}")
        elif parts.query or parts.fragment:
            errs.add(f"{path}.url", f"expected no query or fragment, got {url!r}")
        else:
            try:
                _ = parts.port  # raises ValueError on a bad port
            except ValueError as e:
                errs.add(f"{path}.url", f"bad port in {url!r}: {e}")
            kwargs["url"] = url.strip().rstrip("/")
    for key in ("interval", "timeout"):
        if key in m:
            kwargs[f"{key}_s"] = _duration(m[key], f"{path}.{key}", errs)
    if "address_label" in m:
        label = m["address_label"]
        if not isinstance(label, str) or not _LABEL_NAME.match(label):
            errs.add(f"{path}.address_label", f"expected a Prometheus label name, got {label!r}")
        kwargs["address_label"] = label
    if len(errs.items) != before:
        return None
    spec = PrometheusSpec(**kwargs)
    if spec.timeout_s > spec.interval_s:
        errs.add(f"{path}.timeout", f"must not exceed {path}.interval ({spec.interval_s:g}s)")
        return None
    return spec


def _listener(value: Any, errs: _Errors) -> ListenerSpec | None:
    if value is None:
        errs.add("listener", "missing: give at least {port: N}")
        return None
    m = _mapping(value, "listener", errs, {"port", "address"})
    if m is None:
        return None
    port = m.get("port")
    ok = True
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        errs.add("listener.port", f"expected a port number 1-65535, got {port!r}")
        ok = False
    address = m.get("address", "127.0.0.1")
    try:
        ipaddress.ip_address(address)
    except (ValueError, TypeError):
        errs.add("listener.address", f"expected an IP address, got {address!r}")
        ok = False
    if not ok or not isinstance(port, int):
        return None
    return ListenerSpec(port=port, address=str(address))


def _tiers(value: Any, errs: _Errors) -> list[Tier] | None:
    if not value:
        errs.add("tiers", "missing: define at least one tier")
        return None
    tiers_map = _mapping(value, "tiers", errs, set(value) if isinstance(value, dict) else set())
    if tiers_map is None:
        return None
    out: list[Tier] = []
    unbounded: str | None = None
    last_max = 0.0
    for name, spec in tiers_map.items():
        path = f"tiers.{name}"
        if not isinstance(name, str) or not _VERSION.match(name):
            errs.add(path, "tier names use letters, digits, '.', '_' and '-'")
            continue
        m = _mapping(spec, path, errs, {"max_params_b", "autoscaling", "slo", *TRAFFIC_KEYS})
        if m is None:
            continue
        max_b: float | None = None
        if "max_params_b" in m:
            max_b = _number(m["max_params_b"], f"{path}.max_params_b", errs, maximum=limits.PARAMS_B_MAX)
            if max_b is not None and max_b <= last_max:
                errs.add(f"{path}.max_params_b", "tiers must be listed smallest first")
            if max_b is not None:
                last_max = max_b
        if unbounded is not None:
            errs.add(path, f"tier {unbounded!r} has no max_params_b, so it must be the last tier")
        if "max_params_b" not in m:
            unbounded = name
        policy = _traffic(m, path, TrafficPolicy(), errs)
        scaling = _scaling(m.get("autoscaling"), f"{path}.autoscaling", ScalingPolicy(), errs)
        slo = _slo(m.get("slo"), f"{path}.slo", Slo(), errs)
        if policy is not None and scaling is not None and slo is not None:
            out.append(Tier(name=name, max_params_b=max_b, policy=policy, scaling=scaling, slo=slo))
    return out
