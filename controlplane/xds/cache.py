"""The current snapshot, and a way for streams to wait for a newer one."""

from __future__ import annotations

from collections.abc import Callable

from controlplane.xds.snapshot import Snapshot


class SnapshotCache:
    """Holds the latest snapshot; waiters wake once per publish, whatever their number."""

    def __init__(self) -> None:
        self._snapshot: Snapshot | None = None
        self._subscribers: set[Callable[[], None]] = set()

    def subscribe(self, wake: Callable[[], None]) -> None:
        """Call `wake()` at every publish (cheap: each stream sets its own event)."""
        self._subscribers.add(wake)

    def unsubscribe(self, wake: Callable[[], None]) -> None:
        self._subscribers.discard(wake)

    @property
    def current(self) -> Snapshot | None:
        return self._snapshot

    def publish(self, snapshot: Snapshot) -> None:
        """Make `snapshot` current and wake every stream waiting for a change."""
        self._snapshot = snapshot
        for wake in list(self._subscribers):
            wake()
