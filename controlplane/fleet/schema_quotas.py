"""The fleet YAML's `quotas:` (docs/quotas.md): who a request belongs to, per-minute limits by
tenant and model, and where proxies reach the rate-limit service that counts them."""

from __future__ import annotations

import re
from typing import Any

from controlplane import limits
from controlplane.fleet.errors import _Errors
from controlplane.fleet.model import QuotaLimit, QuotaSpec
from controlplane.fleet.values import _addresses, _bounded_duration, _int, _kind, _mapping, _side_tls

_HEADER_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,99}$")
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # with key.bearer: key-<16 hex digits>
_KINDS = ("requests_per_minute", "tokens_per_minute")
_RESERVED_HEADERS = {"authorization", "host", "content-length", "content-type", "x-model", "x-priority"}


def _limit(value: Any, path: str, errs: _Errors) -> QuotaLimit | None:
    m = _mapping(value, path, errs, set(_KINDS))
    if m is None:
        return None
    kw: dict[str, int] = {}
    for kind in _KINDS:
        if kind in m:
            got = _int(m[kind], f"{path}.{kind}", errs, 0, limits.QUOTA_PER_MINUTE_MAX)
            if got is not None:
                kw[kind] = got
    return QuotaLimit(**kw)


def _tenants(value: Any, path: str, errs: _Errors) -> dict[str, QuotaLimit]:
    m = _mapping(value, path, errs, set(value) if isinstance(value, dict) else set())
    out: dict[str, QuotaLimit] = {}
    for name, spec in (m or {}).items():
        if not isinstance(name, str) or not _TENANT.match(name):
            errs.add(
                f"{path}.{name}",
                "a tenant is the value of the key header: 1-128 letters, digits, '.', '_' or '-'",
            )
            continue
        got = _limit(spec, f"{path}.{name}", errs)
        if got is not None:
            out[name] = got
    return out


def _quotas(
    value: Any, model_names: set[str], errs: _Errors, adapter_names: set[str] | None = None
) -> QuotaSpec | None:
    """`quotas:` or None when absent. Errors name the field and the reason. `quotas.models`
    takes the fleet's models and its models' adapters (an adapter's limits are its own, on top
    of its base model's)."""
    if value is None:
        return None
    m = _mapping(value, "quotas", errs, {"key", "default", "tenants", "models", "service"})
    if m is None:
        return None
    before = len(errs.items)
    kw: dict[str, Any] = {}
    key = _mapping(m.get("key", {}), "quotas.key", errs, {"header", "bearer"})
    if key is not None and "bearer" in key:
        if "header" in key:
            errs.add("quotas.key", "set header or bearer, not both: a request belongs to one tenant")
        elif key["bearer"] is not True and key["bearer"] is not False:
            errs.add("quotas.key.bearer", f"expected true or false, got {key['bearer']!r}")
        else:
            kw["key_bearer"] = key["bearer"]
    elif key is not None and "header" in key:
        header = key["header"]
        if not isinstance(header, str) or not _HEADER_NAME.match(header):
            errs.add("quotas.key.header", f"expected a lower-case header name, got {header!r}")
        elif header in _RESERVED_HEADERS:
            errs.add(
                "quotas.key.header",
                f"{header} is not a tenant key: it is read for routing or carries credentials",
            )
        else:
            kw["key_header"] = header
    if "default" in m:
        default = _limit(m["default"], "quotas.default", errs)
        if default is not None:
            kw["default"] = default
    kw["tenants"] = _tenants(m.get("tenants", {}), "quotas.tenants", errs)
    models = _mapping(m.get("models", {}), "quotas.models", errs, set(m.get("models") or {}))
    per_model: dict[str, tuple[QuotaLimit, dict[str, QuotaLimit]]] = {}
    for name, spec in (models or {}).items():
        path = f"quotas.models.{name}"
        if name not in model_names and name not in (adapter_names or ()):
            known = f"models: {', '.join(sorted(model_names))}"
            if adapter_names:
                known += f"; adapters: {', '.join(sorted(adapter_names))}"
            errs.add(path, f"unknown model or adapter {name!r} ({known})")
            continue
        mm = _mapping(spec, path, errs, {"default", "tenants"})
        if mm is None:
            continue
        model_default = _limit(mm.get("default", {}), f"{path}.default", errs) or QuotaLimit()
        per_model[name] = (model_default, _tenants(mm.get("tenants", {}), f"{path}.tenants", errs))
    kw["models"] = per_model
    service = _mapping(m.get("service"), "quotas.service", errs, {"endpoints", "timeout", "on_error", "tls"})
    if service is not None:
        endpoints = service.get("endpoints")
        if not isinstance(endpoints, list) or not endpoints:
            errs.add(
                "quotas.service.endpoints",
                f"expected a non-empty list of IP:PORT (each `controlplane ratelimit --listen`), "
                f"got {_kind(endpoints)}",
            )
        elif (
            parsed := _addresses(endpoints, "quotas.service.endpoints", "IP:PORT", errs, unique=True)
        ) is not None:
            kw["endpoints"] = parsed
        if "timeout" in service:
            kw["timeout_s"] = _bounded_duration(
                service["timeout"],
                "quotas.service.timeout",
                limits.QUOTA_TIMEOUT_MIN_S,
                limits.QUOTA_TIMEOUT_MAX_S,
                "every request may wait this long for a decision",
                errs,
            )
        on_error = service.get("on_error", "allow")
        if on_error not in ("allow", "deny"):
            errs.add(
                "quotas.service.on_error",
                f"expected allow (serve when the service cannot decide) or deny, got {on_error!r}",
            )
        kw["failure_mode_deny"] = on_error == "deny"
        if "tls" in service:
            kw["service_tls"] = _side_tls(service["tls"], "quotas.service.tls", errs)
    return QuotaSpec(**kw) if len(errs.items) == before else None
