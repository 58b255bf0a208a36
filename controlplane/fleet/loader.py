"""Load and validate the fleet YAML. Every error names the file, the key path and the reason."""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from controlplane import limits
from controlplane.fleet.model import (
    DISCOVERY_KINDS,
    DTYPE_BYTES,
    FORECAST_METHODS,
    MEMORY_OVERHEAD,
    METRICS_SCHEMES,
    POLICY_NAMES,
    PROVIDERS,
    SIGNAL_SOURCES,
    Affinity,
    CircuitBreaker,
    Discover,
    DiscoverySettings,
    EmulatedServer,
    Endpoint,
    Fleet,
    GpuClass,
    HealthProbe,
    ListenerSpec,
    MetricsProbe,
    Model,
    PrefixKey,
    PriorityClass,
    PrometheusSpec,
    ProviderSpec,
    ScalingPolicy,
    SignalsSpec,
    Slo,
    Tier,
    TrafficPolicy,
    Version,
)

# A leaf module (no imports of its own): the names a model must not clash with in Envoy.
from controlplane.routing.names import GATEWAY_LISTENER, stat_name

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}$")


_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
PROTOCOLS = ("http1", "http2")
_YAML11_FLOAT_LIKE = re.compile(r"^[-+]?\d+(\.\d*)?[eE][-+]?\d+$")


@dataclass(frozen=True)
class ConfigError:
    """One problem in a config file: where it is and why it is wrong."""

    file: str
    path: str
    reason: str
    line: int | None = None

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        # Control characters from the file (a NUL, a newline in a key) are shown escaped:
        # one error is one line, in a terminal and in a log.
        return _printable(f"{where}: {self.path or '<top>'}: {self.reason}")


def _printable(text: str) -> str:
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class FleetConfigInvalid(Exception):
    """The fleet config has one or more errors; `errors` lists them all."""

    def __init__(self, errors: list[ConfigError]) -> None:
        self.errors = errors
        super().__init__("\n".join(str(e) for e in errors))


class _Errors:
    def __init__(self, file: str, lines: Mapping[str, int]) -> None:
        self.file = file
        self.lines = lines
        self.items: list[ConfigError] = []

    def add(self, path: str, reason: str) -> None:
        self.items.append(ConfigError(self.file, path, reason, self.lines.get(path)))


def load_fleet(path: str | Path) -> Fleet:
    """Read and validate a fleet YAML file; raise FleetConfigInvalid listing every error."""
    return parse_fleet(decode_fleet(read_fleet_bytes(path), str(path)), str(path))


def read_fleet_bytes(path: str | Path) -> bytes:
    """A fleet file's bytes, read no further than one byte past the size limit (so that
    decode_fleet can refuse it); raise FleetConfigInvalid if it cannot be read."""
    try:
        with Path(path).open("rb") as f:
            return f.read(limits.FLEET_FILE_MAX_BYTES + 1)
    except OSError as e:
        raise FleetConfigInvalid([ConfigError(str(path), "", f"cannot read file: {e}")]) from e


def _too_large(file: str) -> FleetConfigInvalid:
    why = f"file is over the {limits.FLEET_FILE_MAX_BYTES} byte limit (docs/limits.md)"
    return FleetConfigInvalid([ConfigError(file, "", why)])


def decode_fleet(data: bytes, file: str) -> str:
    """The file's text: UTF-8 (a UTF-8 BOM is allowed), at most FLEET_FILE_MAX_BYTES."""
    if len(data) > limits.FLEET_FILE_MAX_BYTES:
        raise _too_large(file)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        why = f"not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start} (save the file as UTF-8)"
        raise FleetConfigInvalid([ConfigError(file, "", why, line)]) from None


def parse_fleet(text: str, file: str = "<fleet>") -> Fleet:
    """Validate fleet YAML text; raise FleetConfigInvalid listing every error."""
    if len(text) > limits.FLEET_FILE_MAX_BYTES:
        raise _too_large(file)
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is not None:
            _check_size(node, file)  # before anything expands aliases
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        raise FleetConfigInvalid([ConfigError(file, "", f"not valid YAML: {e}", line)]) from e
    except RecursionError:
        why = f"nested deeper than {limits.FLEET_MAX_DEPTH} levels (docs/limits.md)"
        raise FleetConfigInvalid([ConfigError(file, "", why)]) from None
    lines: dict[str, int] = {}
    dupes: list[tuple[str, int]] = []
    if node is not None:
        _index_lines(node, "", lines, dupes)
    errs = _Errors(file, lines)
    for path, line in dupes:
        errs.items.append(ConfigError(file, path, "duplicate key", line))
    fleet = _fleet(data, errs)
    if errs.items or fleet is None:
        raise FleetConfigInvalid(errs.items)
    return fleet


def _check_size(root: yaml.Node, file: str) -> None:
    """Refuse a document whose nodes, counting every expansion of every alias, exceed
    FLEET_MAX_NODES, or that nests deeper than FLEET_MAX_DEPTH: an alias bomb of a few
    hundred bytes would otherwise expand to billions of nodes in whatever walks it."""
    count = 0
    stack: list[tuple[yaml.Node, int]] = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > limits.FLEET_MAX_NODES:
            why = (
                f"more than {limits.FLEET_MAX_NODES} YAML nodes once aliases are expanded "
                "(an alias bomb, or a file far larger than a fleet needs; docs/limits.md)"
            )
            raise FleetConfigInvalid([ConfigError(file, "", why, node.start_mark.line + 1)])
        if depth > limits.FLEET_MAX_DEPTH:
            why = f"nested deeper than {limits.FLEET_MAX_DEPTH} levels (docs/limits.md)"
            raise FleetConfigInvalid([ConfigError(file, "", why, node.start_mark.line + 1)])
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                stack.append((k, depth + 1))
                stack.append((v, depth + 1))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((v, depth + 1) for v in node.value)


def _index_lines(node: yaml.Node, path: str, out: dict[str, int], dupes: list[tuple[str, int]]) -> None:
    out.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for k, v in node.value:
            key = str(k.value)
            child = f"{path}.{key}" if path else key
            if key in seen:
                dupes.append((child, k.start_mark.line + 1))
            seen.add(key)
            out.setdefault(child, k.start_mark.line + 1)
            _index_lines(v, child, out, dupes)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _index_lines(v, f"{path}[{i}]", out, dupes)


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
        },
    )
    if top is None:
        return None
    provider = _provider(top.get("autoscaling"), errs)
    discovery = _discovery(top.get("discovery"), errs)
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
    )
    fleet = _match_gpu_classes(fleet, errs)
    _check_memory_fit(fleet, errs)
    return fleet


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
        servers = dns.get("nameservers", [])
        if not isinstance(servers, list):
            errs.add("discovery.dns.nameservers", f"expected a list of HOST:PORT, got {_kind(servers)}")
        else:
            parsed = []
            for i, ns in enumerate(servers):
                try:
                    parsed.append(parse_address(ns))
                except ValueError as e:
                    errs.add(f"discovery.dns.nameservers[{i}]", str(e))
            kw["nameservers"] = tuple(parsed)
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


def _check_memory_fit(fleet: Fleet, errs: _Errors) -> None:
    """A model no endpoint can hold is an error that names the shortfall. Endpoints whose
    memory is unknown count as fitting (they get the benefit of the doubt)."""
    for m in fleet.models:
        known = {g.name for g in fleet.gpu_classes} | {
            ep.gpu for v in m.versions for ep in v.endpoints if ep.gpu
        }
        for g in m.preferred_gpus:
            if g not in known:
                folded = {k.casefold(): k for k in sorted(known)}
                close = difflib.get_close_matches(g.casefold(), list(folded), n=1, cutoff=GPU_NEAR_MISS)
                hint = f"; did you mean {folded[close[0]]!r}?" if close else ""
                errs.add(
                    f"models.{m.name}.preferred_gpus",
                    f"{g!r} is neither a gpu_classes entry nor the gpu of any of its endpoints{hint}",
                )
        need = fleet.memory_need_of(m)
        endpoints = [ep for v in m.versions for ep in v.endpoints]
        stable = m.version(m.stable).endpoints
        if (
            need is not None
            and stable
            and not any(fleet.fits(m, ep) for ep in stable)
            and any(fleet.fits(m, ep) for ep in endpoints)
        ):
            errs.add(
                f"models.{m.name}.versions.{m.stable}",
                f"the stable version's endpoints all have less than the {need:g} GB of GPU memory the "
                "model needs, so it would serve nothing",
            )
        if need is None or not endpoints or any(fleet.fits(m, ep) for ep in endpoints):
            continue
        largest = max(fleet.gpu_memory_of(ep) or 0.0 for ep in endpoints)
        why = (
            "memory_gb"
            if m.memory_gb is not None
            else f"{m.params_b:g}B parameters x {DTYPE_BYTES[m.dtype]:g} bytes ({m.dtype}) "
            f"x {MEMORY_OVERHEAD:g}"
        )
        errs.add(
            f"models.{m.name}",
            f"needs {need:g} GB of GPU memory ({why}) but its largest endpoint has {largest:g} GB: "
            f"{need - largest:g} GB short; add endpoints with more memory, a smaller dtype, or set memory_gb",
        )


def _policy(value: Any, path: str, errs: _Errors) -> str | None:
    if value not in POLICY_NAMES:
        errs.add(path, f"unknown balancing policy {value!r} (policies: {', '.join(POLICY_NAMES)})")
        return None
    return str(value)


def _gpu_classes(value: Any, errs: _Errors) -> list[GpuClass] | None:
    m = _mapping(value, "gpu_classes", errs, set(value) if isinstance(value, dict) else set())
    if m is None:
        return None
    out: list[GpuClass] = []
    seen: dict[str, str] = {}  # casefolded name -> the name as first written
    for name, spec in m.items():
        path = f"gpu_classes.{name}"
        first = seen.setdefault(str(name).casefold(), str(name))
        if first != str(name):
            errs.add(path, f"the same class as {first!r}: GPU class names match case-insensitively")
            continue
        g = _mapping(spec, path, errs, {"capacity", "memory_gb"})
        if g is None:
            continue
        capacity = _number(g.get("capacity", 1.0), f"{path}.capacity", errs, maximum=limits.CAPACITY_MAX)
        memory = (
            _number(g["memory_gb"], f"{path}.memory_gb", errs, maximum=limits.MEMORY_GB_MAX)
            if "memory_gb" in g
            else None
        )
        if capacity is not None and (memory is not None or "memory_gb" not in g):
            out.append(GpuClass(name=str(name), capacity=capacity, memory_gb=memory))
    return out


# GPUs as vendors name them. A `gpu` spelled like one of these is taken as meant, never as a
# typo of a declared class it resembles: A10 beside A100, L40 beside L4, H200 beside H100.
KNOWN_GPUS = frozenset(
    name.casefold()
    for name in (
        *("T4", "P4", "P40", "P100", "V100", "A2", "A10", "A10G", "A16", "A30", "A40", "A100", "A800"),
        *("L4", "L20", "L40", "L40S", "H20", "H100", "H800", "H200", "GH200", "B100", "B200", "GB200"),
        *("MI210", "MI250", "MI250X", "MI300X", "MI325X", "Gaudi2", "Gaudi3"),
    )
)
GPU_NEAR_MISS = 0.75  # difflib similarity (casefolded) from which an undeclared gpu is a typo


def match_gpu_class(name: str, classes: Sequence[str]) -> str | None:
    """The entry of `classes` that `name` names, compared case-insensitively (`a100` is class
    `A100`); None if it names none and is no near miss. Raise ValueError with a suggestion for a
    near miss: a name that is no class but is spelled almost like one (`a10O`, `A1000`), unless
    it is a well-known GPU (KNOWN_GPUS)."""
    by_folded = {c.casefold(): c for c in classes}
    folded = name.casefold()
    if folded in by_folded:
        return by_folded[folded]
    if folded in KNOWN_GPUS:
        return None
    close = difflib.get_close_matches(folded, list(by_folded), n=1, cutoff=GPU_NEAR_MISS)
    if not close:
        return None
    raise ValueError(
        f"{name!r} is not a GPU class; did you mean {by_folded[close[0]]!r}? (gpu_classes: "
        f"{', '.join(classes)}; if it is another class, declare it there)"
    )


def _match_gpu_classes(fleet: Fleet, errs: _Errors) -> Fleet:
    """The fleet with every `gpu` (endpoints, discover defaults) and `preferred_gpus` name
    spelled one way: as its gpu_classes entry, else as the first endpoint that uses it. Names
    match case-insensitively, so `gpu: a100` gets class A100's capacity and memory; an
    endpoint's near miss of a class is an error at its key path (a `preferred_gpus` name that
    matches nothing is _check_memory_fit's to report)."""
    classes = [g.name for g in fleet.gpu_classes]
    spelling = {c.casefold(): c for c in classes}

    def check(name: str | None, path: str) -> None:
        if name is None:
            return
        try:
            if match_gpu_class(name, classes) is None:
                spelling.setdefault(name.casefold(), name)
        except ValueError as e:
            errs.add(path, str(e))

    for m in fleet.models:
        for v in m.versions:
            vpath = f"models.{m.name}.versions.{v.name}"
            for i, ep in enumerate(v.endpoints):
                check(ep.gpu, f"{vpath}.endpoints[{i}].gpu")
            if v.discover is not None and v.discover.template is not None:
                check(v.discover.template.gpu, f"{vpath}.discover.gpu")

    def spelt(ep: Endpoint) -> Endpoint:
        gpu = ep.gpu and spelling.get(ep.gpu.casefold(), ep.gpu)
        return ep if gpu == ep.gpu else dataclasses.replace(ep, gpu=gpu)

    def version(v: Version) -> Version:
        discover = v.discover
        if discover is not None and discover.template is not None:
            discover = dataclasses.replace(discover, template=spelt(discover.template))
        return dataclasses.replace(v, endpoints=tuple(map(spelt, v.endpoints)), discover=discover)

    models = tuple(
        dataclasses.replace(
            m,
            versions=tuple(map(version, m.versions)),
            preferred_gpus=tuple(spelling.get(g.casefold(), g) for g in m.preferred_gpus),
        )
        for m in fleet.models
    )
    return dataclasses.replace(fleet, models=models)


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


# Keys of a tier that its models inherit, and may override one by one.
TRAFFIC_KEYS = {
    "timeout",
    "stream_idle_timeout",
    "retries",
    "max_body_bytes",
    "circuit_breakers",
    "outlier_detection",
    "balancing",
}
_BREAKER_KEYS = {"max_requests", "max_pending"}
_OUTLIER_KEYS = {
    "consecutive_5xx",
    "interval",
    "base_ejection_time",
    "max_ejection_percent",
    "failure_percentage",
    "failure_percentage_min_requests",
}


def _int(value: Any, path: str, errs: _Errors, lo: int, hi: int) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        errs.add(path, f"expected a whole number {lo}-{hi}, got {value!r}")
        return None
    return value


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
    if len(errs.items) != before:
        return None
    return dataclasses.replace(base, **kw)


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
    "autoscaling",
    "slo",
    *TRAFFIC_KEYS,
}
AFFINITY_BODY_FIELDS = ("prompt_cache_key", "user")
_HEADER_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,99}$")


def _affinity(value: Any, path: str, errs: _Errors) -> Affinity | None:
    m = _mapping(value, path, errs, {"header", "body", "prefix", "algorithm", "hash_balance_factor"})
    if m is None:
        return None
    before = len(errs.items)
    header, body = m.get("header"), m.get("body")
    prefix = _prefix_key(m["prefix"], f"{path}.prefix", errs) if "prefix" in m else None
    if sum(x is not None for x in (header, body, m.get("prefix"))) != 1:
        errs.add(
            path,
            "give exactly one of header (e.g. x-session-id), body (prompt_cache_key or user) "
            "or prefix (the prompt's leading part)",
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
        header=header, body_field=body, algorithm=str(algorithm), balance_factor=factor, prefix=prefix
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
    affinity = _affinity(m["affinity"], f"{path}.affinity", errs) if "affinity" in m else None
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
    if len(errs.items) != before or tier is None or versions is None:
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
        vm = _mapping(vspec, p, errs, {"endpoints", "health", "metrics", "discover"})
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
        if endpoints is not None:
            out.append(
                Version(
                    name=vname, endpoints=tuple(endpoints), health=health, metrics=metrics, discover=discover
                )
            )
    return out


def _endpoints(
    path: str, value: Any, seen: dict[tuple[str, int], str], errs: _Errors
) -> list[Endpoint] | None:
    epath = f"{path}.endpoints"
    if value is None:
        value = []
    if not isinstance(value, list):
        errs.add(epath, f"expected a list of endpoints, got {_kind(value)}")
        return None
    out: list[Endpoint] = []
    for i, spec in enumerate(value):
        p = f"{epath}[{i}]"
        if isinstance(spec, str):
            spec = {"address": spec}
        m = _mapping(spec, p, errs, {"address", "gpu", "gpu_memory_gb", "capacity", "zone", "region"})
        if m is None:
            continue
        try:
            host, port = parse_address(m.get("address"))
        except ValueError as e:
            errs.add(f"{p}.address", str(e))
            continue
        ip = ipaddress.ip_address(host)
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped  # [::ffff:127.0.0.1]:P is 127.0.0.1:P on the wire
        key = (str(ip), port)
        if key in seen:
            errs.add(f"{p}.address", f"duplicate endpoint {m['address']}, already at {seen[key]}")
            continue
        seen[key] = p
        facts = _endpoint_facts(m, p, errs)
        if facts is not None:
            out.append(Endpoint(host=host, port=port, **facts))
    return out


def _endpoint_facts(m: dict[str, Any], p: str, errs: _Errors) -> dict[str, Any] | None:
    """An endpoint's GPU, memory, capacity and place (listed, or a discovered version's
    defaults); None (and errors) if any is bad."""
    gpu = m.get("gpu")
    if gpu is not None and not isinstance(gpu, str):
        errs.add(f"{p}.gpu", f"expected a GPU class name such as A100, got {_kind(gpu)}")
        return None
    mem = None
    if "gpu_memory_gb" in m:
        mem = _number(m["gpu_memory_gb"], f"{p}.gpu_memory_gb", errs, maximum=limits.MEMORY_GB_MAX)
        if mem is None:
            return None
    capacity = None
    if "capacity" in m:
        capacity = _number(m["capacity"], f"{p}.capacity", errs, maximum=limits.CAPACITY_MAX)
        if capacity is None:
            return None
    where = {k: m.get(k) for k in ("zone", "region")}
    bad = [k for k, v in where.items() if v is not None and (not isinstance(v, str) or not _VERSION.match(v))]
    for k in bad:
        errs.add(f"{p}.{k}", f"expected a name (letters, digits, '.', '_', '-'), got {where[k]!r}")
    if bad:
        return None
    return {
        "gpu": gpu,
        "gpu_memory_gb": mem,
        "capacity": capacity,
        "zone": where["zone"],
        "region": where["region"],
    }


_ENDPOINT_FACTS = {"gpu", "gpu_memory_gb", "capacity", "zone", "region"}
_HOSTNAME = re.compile(
    r"^(?=.{1,253}\.?$)([A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?\.)*[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?\.?$"
)
_K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_PORT_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,13}[a-z0-9])?$")


def _discover(path: str, value: Any, errs: _Errors) -> Discover | None:
    """A version's `discover:` (docs/discovery.md): one of dns, srv, kubernetes."""
    p = f"{path}.discover"
    m = _mapping(value, p, errs, {"dns", "srv", "kubernetes", "port", *_ENDPOINT_FACTS})
    if m is None:
        return None
    kinds = [k for k in DISCOVERY_KINDS if k in m]
    if len(kinds) != 1:
        errs.add(p, f"expected exactly one of {', '.join(DISCOVERY_KINDS)}, got {', '.join(kinds) or 'none'}")
        return None
    kind = kinds[0]
    before = len(errs.items)
    facts = _endpoint_facts(m, p, errs)
    template = Endpoint(host="", port=0, **facts) if facts is not None else None
    if kind in ("dns", "srv"):
        name = m[kind]
        if not isinstance(name, str) or not _HOSTNAME.match(name):
            errs.add(f"{p}.{kind}", f"expected a DNS name, got {name!r}")
        port = None
        if kind == "dns":
            if "port" not in m:
                errs.add(f"{p}.port", "missing: the servers' port (A/AAAA records carry no port)")
            else:
                port = _int(m["port"], f"{p}.port", errs, 1, 65535)
        elif "port" in m:
            errs.add(f"{p}.port", "not allowed with srv: the SRV records give each server's port")
        if len(errs.items) != before:
            return None
        return Discover(kind=kind, name=str(name).rstrip("."), port=port, template=template)
    if "port" in m:
        errs.add(f"{p}.port", "goes inside kubernetes: {namespace, selector, port}")
    k = _mapping(m["kubernetes"], f"{p}.kubernetes", errs, {"namespace", "selector", "port"})
    if k is None:
        return None
    kp = f"{p}.kubernetes"
    ns = k.get("namespace")
    if not isinstance(ns, str) or not _K8S_NAME.match(ns):
        errs.add(f"{kp}.namespace", f"expected a namespace name (lowercase letters, digits, '-'), got {ns!r}")
    selector = k.get("selector")
    if not isinstance(selector, str) or not selector.strip() or len(selector) > 1024:
        errs.add(
            f"{kp}.selector", f'expected a label selector such as "app=vllm,model=llama", got {selector!r}'
        )
    port_value = k.get("port")
    port_num, port_name = None, None
    if isinstance(port_value, bool) or port_value is None:
        errs.add(f"{kp}.port", "missing: the pods' serving port, a number or the EndpointSlice port's name")
    elif isinstance(port_value, int):
        port_num = _int(port_value, f"{kp}.port", errs, 1, 65535)
    elif isinstance(port_value, str) and _PORT_NAME.match(port_value):
        port_name = port_value
    else:
        errs.add(f"{kp}.port", f"expected a port number or name, got {port_value!r}")
    if len(errs.items) != before:
        return None
    return Discover(
        kind="kubernetes",
        namespace=str(ns),
        selector=str(selector).strip(),
        port=port_num,
        port_name=port_name,
        template=template,
    )


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
