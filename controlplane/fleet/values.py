"""Checks of one value in the fleet YAML, shared by every section: a mapping and its allowed keys,
numbers, whole numbers, ports, URL paths, durations, IP:PORT addresses, and the rule for names of
versions, tiers, classes and places.

The underscored helpers record a precise error at the key path and return None; they are for
the schema modules of controlplane.fleet only. parse_duration and parse_address raise
ValueError instead."""

from __future__ import annotations

import ipaddress
import math
import re
from typing import Any

from controlplane import limits
from controlplane.fleet.errors import _Errors
from controlplane.fleet.model import SideTls

_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_YAML11_FLOAT_LIKE = re.compile(r"^[-+]?\d+(\.\d*)?[eE][-+]?\d+$")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _mapping(value: Any, path: str, errs: _Errors, allowed: set[str]) -> dict[str, Any] | None:
    if value is None:
        value = {}
    if not isinstance(value, dict):
        errs.add(path, f"expected a mapping, got {_kind(value)}")
        return None
    for key in value:
        if not isinstance(key, str):
            errs.add(path, f"keys must be strings, got {key!r}")
        elif key not in allowed:
            errs.add(_join(path, key), f"unknown key (allowed: {', '.join(sorted(allowed))})")
    return value


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "a number"}.get(
        type(value), f"a {type(value).__name__}"
    )


def _number(
    value: Any, path: str, errs: _Errors, *, positive: bool = True, maximum: float | None = None
) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        if isinstance(value, str) and _YAML11_FLOAT_LIKE.match(value.strip()):
            errs.add(
                path,
                f"expected a number, got the text {value!r}: YAML reads an exponent without a dot "
                "as text; write it as 1.0e+3",
            )
        else:
            errs.add(path, f"expected a number, got {_kind(value)}")
        return None
    if not math.isfinite(value):
        errs.add(path, f"expected a finite number, got {value}")
        return None
    if positive and value <= 0:
        errs.add(path, f"must be greater than 0, got {value}")
        return None
    if maximum is not None and value > maximum:
        errs.add(path, f"must be at most {maximum:g}, got {value:g}")
        return None
    return float(value)


def _int(value: Any, path: str, errs: _Errors, lo: int, hi: int) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        errs.add(path, f"expected a whole number {lo}-{hi}, got {value!r}")
        return None
    return value


def _port(value: Any, path: str, errs: _Errors) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        errs.add(path, f"expected a port number 1-65535, got {value!r}")
        return None
    return value


def _url_path(value: Any, path: str, errs: _Errors) -> str | None:
    if not isinstance(value, str) or not value.startswith("/"):
        errs.add(path, f"expected a path starting with '/', got {value!r}")
        return None
    return value


def parse_duration(value: Any) -> float:
    """Parse '60s', '500ms', '3m', '1h' or a plain number of seconds; raise ValueError."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 60s, 500ms, 3m")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.match(value.strip())):
        seconds = float(m.group(1)) * _UNIT_S[m.group(2)]
    else:
        raise ValueError(f"expected a duration such as 60s, 500ms, 3m; got {value!r}")
    if not math.isfinite(seconds):
        raise ValueError(f"expected a finite duration, got {value!r}")
    if seconds <= 0:
        raise ValueError(f"must be greater than 0, got {value!r}")
    if seconds < limits.DURATION_MIN_S:
        raise ValueError(
            f"must be at least 1ms, got {value!r} (shorter rounds to 0, which Envoy reads as none)"
        )
    if seconds > limits.DURATION_MAX_S:
        raise ValueError(f"must be at most 30 days (720h), got {value!r}")
    return seconds


def _duration(value: Any, path: str, errs: _Errors) -> float | None:
    try:
        return parse_duration(value)
    except ValueError as e:
        errs.add(path, str(e))
        return None


def parse_address(value: Any) -> tuple[str, int]:
    """Parse 'IP:PORT' or '[IPv6]:PORT'; raise ValueError naming what is wrong."""
    if not isinstance(value, str):
        raise ValueError(f"expected 'IP:PORT', got {_kind(value)}")
    text = value.strip()
    if text.startswith("["):
        host, sep, port_text = text[1:].partition("]:")
    else:
        host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"bad address {value!r}: expected IP:PORT (IPv6 as [IP]:PORT)")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(
            f"bad address {value!r}: {host!r} is not an IP address "
            "(EDS endpoints must be IP literals; Envoy does not resolve names in EDS)"
        ) from None
    if not (port_text.isascii() and port_text.isdigit()) or not 0 < int(port_text) < 65536:
        raise ValueError(f"bad address {value!r}: port must be 1-65535")
    return host, int(port_text)


def _addresses(
    value: Any, path: str, what: str, errs: _Errors, *, unique: bool = False
) -> tuple[tuple[str, int], ...] | None:
    """A list of IP:PORT: the addresses that parse (each bad one an error at `path[i]`; with
    `unique`, one listed twice an error at `path`), or None (and an error) when `value` is not
    a list."""
    if not isinstance(value, list):
        errs.add(path, f"expected a list of {what}, got {_kind(value)}")
        return None
    parsed = []
    for i, item in enumerate(value):
        try:
            parsed.append(parse_address(item))
        except ValueError as e:
            errs.add(f"{path}[{i}]", str(e))
    if unique and len(set(parsed)) != len(parsed):
        errs.add(path, "lists an address twice")
    return tuple(parsed)


def _bounded_duration(
    value: Any, path: str, lo_s: float, hi_s: float, why: str, errs: _Errors
) -> float | None:
    """A duration between lo_s and hi_s (ms precision in the error), else None and an error at
    `path` that says `why` the bounds matter."""
    got = _duration(value, path, errs)
    if got is not None and not lo_s <= got <= hi_s:
        errs.add(
            path, f"must be between {lo_s * 1000:g}ms and {hi_s * 1000:g}ms ({why}), got {got * 1000:g}ms"
        )
        return None
    return got


def _side_tls(value: Any, path: str, errs: _Errors) -> SideTls | None:
    """`tls: {ca, cert, key, server_name}` of a side service: each a non-empty string (files
    on the proxy's host); cert and key together. None (and errors) when it does not parse."""
    m = _mapping(value, path, errs, {"ca", "cert", "key", "server_name"})
    if m is None:
        return None
    before = len(errs.items)
    got: dict[str, str] = {}
    for key in ("ca", "cert", "key", "server_name"):
        if key not in m:
            continue
        v = m[key]
        if not isinstance(v, str) or not v.strip():
            errs.add(f"{path}.{key}", f"expected a non-empty string, got {_kind(v)}")
        else:
            got[key] = v.strip()
    if "ca" not in m:
        errs.add(
            f"{path}.ca", "missing: the CA file (on the proxy's host) that signed the services' certificates"
        )
    if ("cert" in m) != ("key" in m):
        errs.add(path, "cert and key go together (the proxy's client certificate for mutual TLS)")
    if len(errs.items) != before:
        return None
    return SideTls(got["ca"], got.get("cert"), got.get("key"), got.get("server_name"))


_ZMQ_TCP = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})$")


def _zmq_endpoint(value: Any, path: str, errs: _Errors) -> str | None:
    """A ZMQ endpoint a server publishes on: tcp://HOST:PORT or ipc://PATH."""
    if isinstance(value, str) and value.startswith("ipc://") and 6 < len(value) <= 1024:
        return str(value)
    m = _ZMQ_TCP.match(value) if isinstance(value, str) else None
    if m is None or not 1 <= int(m.group(2)) <= 65535:
        errs.add(
            path, f"expected a ZMQ endpoint such as tcp://10.0.0.7:5557 or ipc:///run/vllm-kv, got {value!r}"
        )
        return None
    return str(value)
