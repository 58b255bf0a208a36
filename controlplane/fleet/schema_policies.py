"""The policies a tier sets and each of its models may override key by key: traffic (timeouts,
retries, body limit, circuit breakers, outlier detection, balancing), slo, and autoscaling.
Each parser applies the keys it is given over a base: the defaults for a tier, the tier's own
for a model."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from controlplane.fleet.errors import _Errors
from controlplane.fleet.model import (
    FORECAST_METHODS,
    POLICY_NAMES,
    CircuitBreaker,
    FlowControl,
    ScalingPolicy,
    Slo,
    TrafficPolicy,
)
from controlplane.fleet.values import _duration, _int, _join, _mapping, _number

# Keys of a tier that its models inherit, and may override one by one.
TRAFFIC_KEYS = {
    "timeout",
    "stream_idle_timeout",
    "retries",
    "max_body_bytes",
    "circuit_breakers",
    "outlier_detection",
    "balancing",
    "flow_control",
}
_FLOW_KEYS = {"max_wait", "max_requests", "max_bytes", "tenant"}
_BREAKER_KEYS = {"max_requests", "max_pending"}
_OUTLIER_KEYS = {
    "consecutive_5xx",
    "interval",
    "base_ejection_time",
    "max_ejection_percent",
    "failure_percentage",
    "failure_percentage_min_requests",
}


def _policy(value: Any, path: str, errs: _Errors) -> str | None:
    if value not in POLICY_NAMES:
        errs.add(path, f"unknown balancing policy {value!r} (policies: {', '.join(POLICY_NAMES)})")
        return None
    return str(value)


def _traffic(m: dict[str, Any], path: str, base: TrafficPolicy, errs: _Errors) -> TrafficPolicy | None:
    """`base` with the traffic keys present in `m` applied; None (and errors) if any is bad."""
    before = len(errs.items)
    kw: dict[str, Any] = {}
    if "timeout" in m:
        kw["timeout_s"] = _duration(m["timeout"], f"{path}.timeout", errs)
    if "stream_idle_timeout" in m:
        kw["stream_idle_timeout_s"] = _duration(m["stream_idle_timeout"], f"{path}.stream_idle_timeout", errs)
    if "retries" in m:
        kw["retries"] = _int(m["retries"], f"{path}.retries", errs, 0, 10)
    if "max_body_bytes" in m:
        kw["max_body_bytes"] = _int(m["max_body_bytes"], f"{path}.max_body_bytes", errs, 1, 1 << 30)
    if "balancing" in m:
        kw["balancing"] = _policy(m["balancing"], f"{path}.balancing", errs)
    if "circuit_breakers" in m:
        cpath = f"{path}.circuit_breakers"
        cb = _mapping(m["circuit_breakers"], cpath, errs, {"default", "high"})
        for prio, field_name in (("default", "breaker_default"), ("high", "breaker_high")):
            if cb is None or prio not in cb:
                continue
            bm = _mapping(cb[prio], f"{cpath}.{prio}", errs, _BREAKER_KEYS)
            if bm is None:
                continue
            current: CircuitBreaker = getattr(base, field_name)
            max_requests = _int(
                bm.get("max_requests", current.max_requests), f"{cpath}.{prio}.max_requests", errs, 1, 1 << 30
            )
            # At least 1: Envoy queues every request while it connects, so 0 would refuse them all.
            max_pending = _int(
                bm.get("max_pending", current.max_pending), f"{cpath}.{prio}.max_pending", errs, 1, 1 << 30
            )
            if max_requests is not None and max_pending is not None:
                kw[field_name] = CircuitBreaker(max_requests=max_requests, max_pending=max_pending)
    if "outlier_detection" in m:
        opath = f"{path}.outlier_detection"
        od = _mapping(m["outlier_detection"], opath, errs, _OUTLIER_KEYS)
        if od is not None:
            if "consecutive_5xx" in od:
                kw["outlier_consecutive_5xx"] = _int(
                    od["consecutive_5xx"], f"{opath}.consecutive_5xx", errs, 1, 1000
                )
            if "interval" in od:
                kw["outlier_interval_s"] = _duration(od["interval"], f"{opath}.interval", errs)
            if "base_ejection_time" in od:
                kw["outlier_base_ejection_s"] = _duration(
                    od["base_ejection_time"], f"{opath}.base_ejection_time", errs
                )
            if "max_ejection_percent" in od:
                kw["outlier_max_ejection_percent"] = _int(
                    od["max_ejection_percent"], f"{opath}.max_ejection_percent", errs, 0, 100
                )
            if "failure_percentage" in od:
                kw["outlier_failure_percentage"] = _int(
                    od["failure_percentage"], f"{opath}.failure_percentage", errs, 0, 100
                )
            if "failure_percentage_min_requests" in od:
                kw["outlier_failure_min_requests"] = _int(
                    od["failure_percentage_min_requests"],
                    f"{opath}.failure_percentage_min_requests",
                    errs,
                    1,
                    1_000_000,
                )
    if "flow_control" in m:
        kw["flow_control"] = _flow_control(m["flow_control"], f"{path}.flow_control", errs)
    if len(errs.items) != before:
        return None
    return dataclasses.replace(base, **kw)


MAX_WAIT_BOUND_S = 600.0  # a request held longer than this is better answered 429 and retried


def _flow_control(value: Any, path: str, errs: _Errors) -> FlowControl | None:
    """`flow_control:` (docs/flow-control.md): `{}` for the defaults; `false` turns a tier's off
    for one model."""
    if value is False:
        return None
    m = _mapping(value, path, errs, _FLOW_KEYS)
    if m is None:
        return None
    kw: dict[str, Any] = {}
    wait = m.get("max_wait")
    if isinstance(wait, dict):
        by_class = []
        for name, d in wait.items():
            s = _duration(d, f"{path}.max_wait.{name}", errs)
            if s is not None and not 0 < s <= MAX_WAIT_BOUND_S:
                errs.add(f"{path}.max_wait.{name}", f"must be more than 0s and at most {MAX_WAIT_BOUND_S:g}s")
            elif s is not None:
                by_class.append((str(name), s))
        kw["max_wait_by_class"] = tuple(by_class)
    elif wait is not None:
        s = _duration(wait, f"{path}.max_wait", errs)
        if s is not None and not 0 < s <= MAX_WAIT_BOUND_S:
            errs.add(f"{path}.max_wait", f"must be more than 0s and at most {MAX_WAIT_BOUND_S:g}s")
        elif s is not None:
            kw["max_wait_s"] = s
    if "max_requests" in m:
        kw["max_requests"] = _int(m["max_requests"], f"{path}.max_requests", errs, 1, 1_000_000)
    if "max_bytes" in m:
        kw["max_bytes"] = _int(m["max_bytes"], f"{path}.max_bytes", errs, 1, 1 << 34)
    if "tenant" in m:
        t = _mapping(m["tenant"], f"{path}.tenant", errs, {"header"})
        header = (t or {}).get("header")
        if t is not None and (not isinstance(header, str) or not _HEADER.fullmatch(header)):
            errs.add(f"{path}.tenant.header", f"expected a lower-case header name, got {header!r}")
        elif t is not None:
            kw["tenant_header"] = header
    return FlowControl(**kw)


_HEADER = re.compile(r"[a-z0-9!#$%&'*+.^_`|~-]{1,128}")


# slo key -> (Slo attribute, kind)
SLO_KEYS: dict[str, tuple[str, str]] = {
    "availability": ("availability", "objective"),
    "ttft": ("ttft_s", "duration"),
    "ttft_objective": ("ttft_objective", "objective"),
    "tpot": ("tpot_s", "duration"),
    "tpot_objective": ("tpot_objective", "objective"),
}


def _slo(value: Any, path: str, base: Slo, errs: _Errors) -> Slo | None:
    """`base` with the objectives in `value` applied; None (and errors) if any is bad."""
    if value is None:
        return base
    m = _mapping(value, path, errs, set(SLO_KEYS))
    if m is None:
        return None
    before = len(errs.items)
    kw: dict[str, float] = {}
    for key, raw in m.items():
        if key not in SLO_KEYS:
            continue
        attr, kind = SLO_KEYS[key]
        where = _join(path, key)
        if kind == "duration":
            got = _duration(raw, where, errs)
            if got is not None and not 0.001 <= got <= 3600:
                errs.add(where, f"must be between 1ms and 1h, got {got:g}s")
        else:
            got = _number(raw, where, errs)
            if got is not None and not 0.5 <= got < 1:
                errs.add(
                    where,
                    f"must be a share of requests between 0.5 and 1 (exclusive), e.g. 0.999 for "
                    f"99.9%, got {got:g}",
                )
        if got is not None:
            kw[attr] = got
    if len(errs.items) != before:
        return None
    return dataclasses.replace(base, **kw)


# autoscaling key -> (ScalingPolicy attribute, kind, lower bound, upper bound)
SCALING_KEYS: dict[str, tuple[str, str, float, float]] = {
    "min": ("min_replicas", "int", 0, 10_000),
    "max": ("max_replicas", "int", 1, 10_000),
    "target_per_replica": ("target_per_replica", "number", 0.01, 1_000_000),
    "target_utilization": ("target_utilization", "number", 0.01, 1.0),
    "stable_window": ("stable_window_s", "duration", 1.0, 3600.0),
    "panic_window": ("panic_window_s", "duration", 1.0, 3600.0),
    "panic_threshold": ("panic_threshold", "number", 1.0, 1000.0),
    "scale_down_rate": ("scale_down_rate", "number", 1.0, 1000.0),
    "scale_up_rate": ("scale_up_rate", "number", 1.0, 1_000_000.0),
    "idle_grace": ("idle_grace_s", "duration", 1.0, 86400.0),
    "hold_max": ("hold_max", "int", 0, 100_000),
    "predictive": ("predictive", "bool", 0, 1),
    "season": ("season_s", "duration", 60.0, 7 * 86400.0),
    "forecast_bucket": ("forecast_bucket_s", "duration", 1.0, 3600.0),
    "forecast": ("forecast_method", "choice", 0, 0),
    "cold_start": ("cold_start_s", "duration", 0.0, 3600.0),
}
SEASON_BUCKETS_MIN, SEASON_BUCKETS_MAX = 4, 10_080  # a season of 4 to 10,080 buckets


def _scaling(value: Any, path: str, base: ScalingPolicy, errs: _Errors) -> ScalingPolicy | None:
    """`base` with the autoscaling keys in `value` applied; None (and errors) if any is bad."""
    if value is None:
        return base
    m = _mapping(value, path, errs, set(SCALING_KEYS))
    if m is None:
        return None
    before = len(errs.items)
    kw: dict[str, Any] = {}
    for key, raw in m.items():
        if key not in SCALING_KEYS:
            continue
        attr, kind, lo, hi = SCALING_KEYS[key]
        where = _join(path, key)
        if kind == "int":
            kw[attr] = _int(raw, where, errs, int(lo), int(hi))
            continue
        if kind == "bool":
            if not isinstance(raw, bool):
                errs.add(where, f"expected true or false, got {raw!r}")
            kw[attr] = raw
            continue
        if kind == "choice":
            if raw not in FORECAST_METHODS:
                errs.add(where, f"expected one of {', '.join(FORECAST_METHODS)}, got {raw!r}")
            kw[attr] = raw
            continue
        got = _duration(raw, where, errs) if kind == "duration" else _number(raw, where, errs)
        if got is not None and not lo <= got <= hi:
            unit = "s" if kind == "duration" else ""
            errs.add(where, f"must be between {lo:g}{unit} and {hi:g}{unit}, got {got:g}{unit}")
        kw[attr] = got
    if len(errs.items) != before:
        return None
    out = dataclasses.replace(base, **kw)
    if out.min_replicas > out.max_replicas:
        errs.add(path, f"min ({out.min_replicas}) is above max ({out.max_replicas})")
        return None
    buckets = out.season_s / out.forecast_bucket_s
    if not SEASON_BUCKETS_MIN <= buckets <= SEASON_BUCKETS_MAX:
        errs.add(
            _join(path, "forecast_bucket"),
            f"the season ({out.season_s:g}s) must hold {SEASON_BUCKETS_MIN} to {SEASON_BUCKETS_MAX} "
            f"buckets of {out.forecast_bucket_s:g}s, got {buckets:g}",
        )
        return None
    if out.panic_window_s > out.stable_window_s:
        errs.add(
            _join(path, "panic_window"),
            f"must not be longer than the stable window ({out.panic_window_s:g}s > {out.stable_window_s:g}s)",
        )
        return None
    return out
