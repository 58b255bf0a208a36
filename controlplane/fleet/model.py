"""The fleet as configured: tiers, models, versions and the endpoints serving them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Endpoint:
    """One inference server (a GPU server) serving one model version."""

    host: str
    port: int
    gpu: str | None = None
    gpu_memory_gb: float | None = None

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclass(frozen=True)
class Version:
    """A model version and the endpoints that serve it."""

    name: str
    endpoints: tuple[Endpoint, ...]


@dataclass(frozen=True)
class Tier:
    """A model-size tier. Models up to `max_params_b` billion parameters belong to it."""

    name: str
    max_params_b: float | None
    timeout_s: float


@dataclass(frozen=True)
class Model:
    """A model: its tier, its versions, and the version that takes traffic (`stable`)."""

    name: str
    tier: str
    stable: str
    versions: tuple[Version, ...]
    params_b: float | None = None
    protocol: str = "http1"
    # Merged verbatim into every generated Cluster of this model; Envoy has the last word.
    cluster_overrides: Mapping[str, Any] | None = field(default=None, compare=True)

    def version(self, name: str) -> Version:
        for v in self.versions:
            if v.name == name:
                return v
        raise KeyError(name)


@dataclass(frozen=True)
class ListenerSpec:
    """Where every Envoy listens for inference traffic."""

    port: int
    address: str = "127.0.0.1"


@dataclass(frozen=True)
class Fleet:
    """The whole configured world, as one immutable value."""

    listener: ListenerSpec
    tiers: tuple[Tier, ...]
    models: tuple[Model, ...]

    def tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)

    def model(self, name: str) -> Model:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)
