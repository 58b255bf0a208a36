"""A model's LoRA adapters in the fleet YAML (`adapters:` and `placement:`, docs/adapters.md).

    models:
      llama-3-8b:
        placement: dynamic          # static (default) | dynamic
        adapters:
          sql-lora: {source: /models/sql-lora}
          chat-lora: {source: /models/chat-lora, versions: [v2]}
          legal: {endpoints: ["127.0.0.1:8001"]}

An adapter's name is what a request names as its `model` (body or x-model): it must not be
any model's name or another adapter's, the fleet over (`clashes` names both).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from controlplane import limits
from controlplane.fleet.errors import _Errors
from controlplane.fleet.model import PLACEMENTS, Adapter, Model, Version
from controlplane.fleet.values import _kind, _mapping

# As a model's name: what a request's `model` may be (vLLM takes any string; the routes match
# it exactly, so only its length and characters are bounded).
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}$")
_ADAPTER_KEYS = {"source", "versions", "endpoints"}
SOURCE_MAX_CHARS = 4096


def adapters(
    value: Any, path: str, versions: Iterable[Version] | None, errs: _Errors
) -> tuple[Adapter, ...] | None:
    """A model's `adapters:` (a mapping of name to spec, the spec optional), None on an error."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        errs.add(path, f"expected a mapping of adapter name to adapter, got {_kind(value)}")
        return None
    if len(value) > limits.FLEET_ADAPTERS_MAX:
        errs.add(path, f"{len(value)} adapters, more than {limits.FLEET_ADAPTERS_MAX} per model")
        return None
    known = {v.name for v in versions or ()}
    out: list[Adapter] = []
    before = len(errs.items)
    for name, spec in value.items():
        where = f"{path}.{name}"
        if not isinstance(name, str) or not _NAME.match(name):
            errs.add(
                f"{path}.{name!r}" if not isinstance(name, str) else where,
                "adapter names use letters, digits and . _ : / - (at most 200; quote it in YAML)",
            )
            continue
        m = _mapping(spec, where, errs, _ADAPTER_KEYS)
        if m is None:
            continue
        source = m.get("source")
        if source is not None and (not isinstance(source, str) or not 0 < len(source) <= SOURCE_MAX_CHARS):
            errs.add(
                f"{where}.source",
                f"expected the adapter's path or URI (1 to {SOURCE_MAX_CHARS} characters), "
                f"got {_kind(source)}",
            )
        on = _names(m.get("versions", []), f"{where}.versions", "version names", errs)
        for v in on or ():
            if versions is not None and v not in known:
                errs.add(f"{where}.versions", f"names version {v!r}, which is not under the model's versions")
        at = _names(m.get("endpoints", []), f"{where}.endpoints", "endpoint addresses (HOST:PORT)", errs)
        if on is None or at is None:
            continue
        out.append(Adapter(name, source if isinstance(source, str) else None, on, at))
    return tuple(out) if len(errs.items) == before else None


def _names(value: Any, path: str, what: str, errs: _Errors) -> tuple[str, ...] | None:
    if (
        not isinstance(value, list)
        or not all(isinstance(x, str) and x for x in value)
        or len(set(value)) != len(value)
    ):
        errs.add(path, f"expected a list of distinct {what}, got {value!r}"[:300])
        return None
    return tuple(value)


def placement(value: Any, path: str, found: tuple[Adapter, ...] | None, errs: _Errors) -> str:
    """A model's `placement:`; dynamic needs every adapter's source (what a server loads)."""
    if value is None:
        return "static"
    if value not in PLACEMENTS:
        errs.add(path, f"expected one of {', '.join(PLACEMENTS)}, got {value!r}")
        return "static"
    if value == "dynamic":
        for a in found or ():
            if a.source is None:
                errs.add(
                    path,
                    f"dynamic placement loads adapters from their source: adapter {a.name!r} has none",
                )
    return str(value)


def clashes(models: Iterable[Model], errs: _Errors) -> None:
    """Every adapter name is unique, the fleet over, and no model's name: a request's `model`
    must name one thing. Each clash names both."""
    owners: dict[str, str] = {m.name: f"model {m.name!r}" for m in models}
    for m in models:
        for a in m.adapters:
            other = owners.get(a.name)
            if other is not None:
                errs.add(
                    f"models.{m.name}.adapters.{a.name}",
                    f"its name is also {other}'s: a request's model must name one thing; rename one",
                )
                continue
            owners[a.name] = f"model {m.name!r}'s adapter {a.name!r}"
