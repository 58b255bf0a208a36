"""Per-type bookkeeping of one xDS stream: what was sent and is in flight, what the proxy
holds (names, versions, the resources when known), what it carried per response, and what it
rejected. `XdsStream` (protocol.py) decides; a `TypeState` only remembers and answers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

from controlplane.xds.snapshot import SnapshotResource, pair_hash


@dataclass
class InFlight:
    """A response sent on a stream, not yet ACKed or NACKed."""

    nonce: str
    version: str
    resources: dict[str, SnapshotResource]
    removed: frozenset[str]
    generation: int
    created_at: float
    complete: bool = True  # it carried everything desired at `generation` (nothing held back)


@dataclass
class TypeState:
    """What one stream knows about one resource type."""

    requested: bool = False
    wildcard: bool = False
    names: frozenset[str] = frozenset()
    latest_nonce: str = ""
    in_flight: InFlight | None = None
    responded: bool = False
    acked_here: bool = False  # an ACK of this type arrived on this stream
    # What the proxy has, as far as we know: name -> version, and the resource when we know it.
    acked: dict[str, str] = field(default_factory=dict)
    acked_res: dict[str, SnapshotResource] = field(default_factory=dict)
    acked_version: str = ""  # also the content key of what the proxy holds
    # SotW, types a response may carry part of (RDS, EDS): name -> the version_info of the
    # ACKed response that last carried it, which is what the client's own CSDS reports. (A
    # full-state type's every response carries all: acked_version. Delta: the resource's.)
    carried: dict[str, str] = field(default_factory=dict)
    last_subscription: tuple[bool, frozenset[str]] = (False, frozenset())
    # NACK memory: name -> the version the proxy rejected (never sent to it again).
    rejected: dict[str, str] = field(default_factory=dict)
    # A NACK that names no resource blames every change it carried: they become suspects,
    # re-sent `probe` at a time (a bisection) until the rejected ones are found.
    suspects: dict[str, str] = field(default_factory=dict)
    probing: frozenset[str] = frozenset()  # the suspects the next response may carry
    rejected_key: str = ""  # SotW full state: the content key of the last NACKed response
    last_error: str = ""
    last_nacked: bool = False  # something the proxy rejected (or a suspect) is still wanted
    answered: set[str] = field(default_factory=set)
    # Held from an earlier stream, content unknown: not confirmed until ACKed here.
    unconfirmed: set[str] = field(default_factory=set)
    # XOR of per-(name, version) hashes of `acked`: the proxy's state version in O(1).
    state_xor: int = 0
    last_names: tuple[int, int] = (0, 0)  # length and hash of the last SotW names list
    # Whether to keep the resource objects the proxy holds (routes and clusters need them
    # for make-before-break; endpoint assignments do not, and are the bulk).
    keep_resources: bool = True
    # The snapshot generation this type was last found fully in sync with (-1: not known).
    settled: int = -1
    # When the oldest response not yet answered (ACK or NACK) was sent; None: none awaits.
    unacked_since: float | None = None

    def withholds(self, name: str, version: str) -> bool:
        """Whether `name` at `version` must not go to the proxy now: it rejected it, or it
        is a suspect outside the current probe."""
        if self.rejected.get(name) == version:
            return True
        return self.suspects.get(name) == version and name not in self.probing

    def probe(self, n: int) -> None:
        """Let the next response carry the first `n` suspects (at least one, if any)."""
        self.probing = frozenset(list(self.suspects)[: max(1, n)] if self.suspects else ())

    def unsettle(self) -> None:
        """The subscription changed: recompute on the next pump, even after an ACK."""
        self.settled = -1
        if self.in_flight is not None:
            self.in_flight.complete = False

    def hold(self, name: str, version: str, res: SnapshotResource | None = None) -> None:
        """Record that the proxy holds `name` at `version`."""
        old = self.acked.get(name)
        if old is not None:
            self.state_xor ^= pair_hash(name, old)
        self.acked[name] = version
        self.state_xor ^= pair_hash(name, version)
        if res is not None and self.keep_resources:
            self.acked_res[name] = res
        else:
            self.acked_res.pop(name, None)

    def drop(self, name: str) -> None:
        """Record that the proxy no longer holds `name`."""
        old = self.acked.pop(name, None)
        if old is not None:
            self.state_xor ^= pair_hash(name, old)
        self.acked_res.pop(name, None)
        self.carried.pop(name, None)

    def version_info(self, name: str, delta: bool) -> str:
        """The version the proxy's own CSDS gives `name`: the resource's version on delta,
        else the version_info of the response it came in (what a reconnected proxy held
        before, unknown here, reads as the last response it ACKed here)."""
        if delta:
            return self.acked.get(name, "")
        return self.carried.get(name) or self.acked_version

    def state_after(self, updates: dict[str, SnapshotResource], removed: Iterable[str]) -> str:
        """The state version once `updates` and `removed` are applied, without a full scan."""
        x = self.state_xor
        for name in removed:
            if name in self.acked:
                x ^= pair_hash(name, self.acked[name])
        for name, res in updates.items():
            if name in self.acked:
                x ^= pair_hash(name, self.acked[name])
            x ^= pair_hash(name, res.version)
        return f"{x:016x}"


def content_key(resources: Iterable[tuple[str, str]]) -> str:
    """The content key of a set of (name, version): a state-of-the-world response of a
    full-state type is versioned by it, and a NACK of it remembered by it."""
    h = hashlib.blake2b(digest_size=6)
    for name, version in sorted(resources):
        h.update(name.encode())
        h.update(b"\0")
        h.update(version.encode())
        h.update(b"\n")
    return h.hexdigest()
