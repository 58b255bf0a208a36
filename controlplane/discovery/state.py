"""What one discovery source has found, and how far to trust its latest answer (pure).

A source is one version's `discover:` (a DNS name, SRV name, or Kubernetes selector). The
rule that matters: **a failing source never empties a version.**

- a good answer with servers replaces the known set;
- an error (timeout, no nameserver answering, an unreachable API server) keeps the last
  known set, counts a failure, and says why;
- an authoritative empty answer (NXDOMAIN, no records, no ready pods) empties the version
  only once the source has answered empty for a whole `hold_empty_s` (the records' last
  time-to-live, within the DNS interval bounds); until then the last known set stands.
  A source that never had servers is empty at once: there is nothing to keep.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Found:
    """One server a source found."""

    host: str
    port: int
    zone: str | None = None
    gpu: str | None = None  # from a pod's labels or annotations; None: the version's default
    gpu_memory_gb: float | None = None
    capacity: float | None = None
    terminating: bool = False  # Kubernetes: serving but no longer ready (drain it)
    origin: str = ""  # a pod, an EndpointSlice: for status

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


class SourceState:
    """One source's known servers and health."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.known: tuple[Found, ...] | None = None  # None: no answer yet
        self.error: str | None = None  # why the latest answer was not taken (None: it was)
        self.failures = 0  # answers not taken, in all
        self.last_ok: float | None = None  # when an answer was last taken
        self.seen_at: dict[str, float] = {}  # address -> when an answer last named it
        self.empty_since: float | None = None

    def answer(self, found: tuple[Found, ...], now: float, hold_empty_s: float) -> bool:
        """A definite answer (possibly empty). Returns True if the known set changed."""
        before = self.known
        if found or not self.known:
            self.known = tuple(sorted(found, key=lambda f: f.address))
            self.error, self.empty_since, self.last_ok = None, None, now
        else:
            if self.empty_since is None:
                self.empty_since = now
            waited = now - self.empty_since
            if waited >= hold_empty_s:
                self.known, self.error, self.last_ok = (), None, now
            else:
                self.error = (
                    f"answered empty for {waited:.0f}s; the last {len(self.known)} server(s) stay "
                    f"until it has for {hold_empty_s:.0f}s"
                )
        for f in found:
            self.seen_at[f.address] = now
        if self.known is not None:
            live = {f.address for f in self.known}
            for gone in [a for a in self.seen_at if a not in live]:
                del self.seen_at[gone]
        return self.known != before

    def failed(self, error: str) -> None:
        """No answer to trust: keep what is known."""
        self.error = error
        self.failures += 1

    @property
    def healthy(self) -> bool:
        return self.error is None and self.known is not None
