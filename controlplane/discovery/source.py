"""What a discovery source's loop and the Discovery that runs it share: the key that names a
source, and the calls the loop reports its answers through.

The Kubernetes loop (kubernetes.py) is started by Discovery (manager.py) and reports back to
it; both import this module and neither imports the other's types, so the I/O shell of a
source never depends on the manager that owns it.
"""

from __future__ import annotations

from typing import Protocol

from controlplane.discovery.state import Found
from controlplane.fleet.model import Fleet

SourceKey = tuple[str, str]  # (model, version)


class SourceReports(Protocol):
    """Where a source's loop reads the fleet it serves and reports each answer."""

    @property
    def fleet(self) -> Fleet | None:
        """The file's fleet (its discovery settings apply); None once discovery stops."""
        ...

    def answered(self, key: SourceKey, found: tuple[Found, ...], hold_empty_s: float) -> None:
        """A definite answer (possibly empty) from the source `key`."""
        ...

    def failed(self, key: SourceKey, why: str) -> None:
        """No answer to trust from the source `key`: the last known set stands."""
        ...
