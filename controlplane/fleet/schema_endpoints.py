"""Where a version's servers are: a list of endpoints (IP:PORT, each with its GPU, memory,
capacity, zone and region), or a `discover:` rule (dns, srv or kubernetes) whose same facts are
the defaults for the servers it finds. An address appears once across a model's versions."""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from controlplane import limits
from controlplane.fleet.errors import _Errors
from controlplane.fleet.model import DISCOVERY_KINDS, Discover, Endpoint, KvEventPorts
from controlplane.fleet.values import (
    _VERSION,
    _int,
    _kind,
    _mapping,
    _number,
    _port,
    _zmq_endpoint,
    parse_address,
)


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
        m = _mapping(
            spec,
            p,
            errs,
            {"address", "gpu", "gpu_memory_gb", "capacity", "zone", "region", "kv_events", "kv_replay"},
        )
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
        kv = {k: _zmq_endpoint(m[k], f"{p}.{k}", errs) for k in ("kv_events", "kv_replay") if k in m}
        if "kv_replay" in m and "kv_events" not in m:
            errs.add(f"{p}.kv_replay", "a replay socket without kv_events: name the publisher too")
            continue
        if facts is not None and None not in kv.values():
            out.append(
                Endpoint(
                    host=host,
                    port=port,
                    kv_events=kv.get("kv_events"),
                    kv_replay=kv.get("kv_replay"),
                    **facts,
                )
            )
    return out


def _kv_ports(value: Any, path: str, errs: _Errors) -> KvEventPorts | None:
    """A version's or model's `kv_events: {port: N, replay_port: M}` (docs/kv-events.md)."""
    m = _mapping(value, path, errs, {"port", "replay_port"})
    if m is None:
        return None
    if "port" not in m:
        errs.add(f"{path}.port", "missing: the port each server publishes its KV events on")
        return None
    port = _port(m["port"], f"{path}.port", errs)
    replay = _port(m["replay_port"], f"{path}.replay_port", errs) if "replay_port" in m else None
    if port is None or ("replay_port" in m and replay is None):
        return None
    return KvEventPorts(port, replay)


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
