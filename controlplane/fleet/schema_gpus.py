"""GPU classes, and the checks that need the whole fleet: `gpu_classes:`; one spelling for every
gpu name (matched case-insensitively, a near miss of a class refused as a typo unless it is a
well-known GPU); and whether each model fits in the GPU memory of some endpoint."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from typing import Any

from controlplane import limits
from controlplane.fleet.errors import _Errors
from controlplane.fleet.model import DTYPE_BYTES, MEMORY_OVERHEAD, Endpoint, Fleet, GpuClass, Version
from controlplane.fleet.values import _mapping, _number


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
