"""What an xDS stream's protocol returns: the events `XdsStream` (protocol.py) emits for
each request or snapshot, for the servicer (server.py) to act on. Values only, no behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from envoy.config.core.v3 import base_pb2


@dataclass(frozen=True)
class Send:
    """Write `payload` (a serialised response) to the stream."""

    type_url: str
    nonce: str
    version: str
    payload: bytes
    names: tuple[str, ...]
    removed: tuple[str, ...]
    generation: int


@dataclass(frozen=True)
class Ack:
    """The proxy applied a response. `latency_s` runs from the snapshot's creation."""

    type_url: str
    nonce: str
    version: str
    generation: int
    latency_s: float


@dataclass(frozen=True)
class Nack:
    """The proxy rejected a response (or part of it); it keeps its previous config of what
    it rejected. `rejected` names the resources blamed (all the changed ones if Envoy's
    message names none of them)."""

    type_url: str
    nonce: str
    version: str
    message: str
    rejected: tuple[str, ...] = ()


@dataclass(frozen=True)
class NackCleared:
    """Nothing the proxy rejected is wanted any more (the config moved on, or went back)."""

    type_url: str


@dataclass(frozen=True)
class StaleNonce:
    type_url: str
    nonce: str


@dataclass(frozen=True)
class UnknownType:
    type_url: str


@dataclass(frozen=True)
class NodeIdentified:
    node_id: str
    cluster: str
    user_agent: str
    node: base_pb2.Node | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Refused:
    """The client asked for more than a stream may hold; the caller ends the stream."""

    code: str  # a grpc.StatusCode name
    message: str


Event = Send | Ack | Nack | NackCleared | StaleNonce | UnknownType | NodeIdentified | Refused
