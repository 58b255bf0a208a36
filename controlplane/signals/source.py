"""Where load signals come from (the interface the weight loop drives).

A source is asked, once per weight round, for what it observed since the last call; it
answers at once with what it has (an endpoint it has nothing new for is simply absent,
and its signals age). Sources: `scrape` (the servers' own /health and /metrics, collected
outside the xDS process: `signals/collector.py`) and `prometheus` (instant queries against
a Prometheus server: `signals/prometheus.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from controlplane.fleet.model import Fleet
from controlplane.obs.metrics import Metrics
from controlplane.signals.store import EndpointKey, ScrapeResult


class SignalSource(Protocol):
    """One kind of signal collection, configured from the fleet's `signals` section."""

    def matches(self, fleet: Fleet) -> bool:
        """Whether this source still serves the fleet's settings (else it is replaced)."""
        ...

    async def collect(
        self, fleet: Fleet, targets: Sequence[EndpointKey], *, first: bool = False
    ) -> Mapping[EndpointKey, ScrapeResult]:
        """What arrived since the last call. `first`: the process is starting; wait up to
        one collection timeout so the first snapshot already reflects the servers."""
        ...

    @property
    def failing(self) -> str | None:
        """Why the source does not deliver now (a collector process down or silent, the latest
        Prometheus round failed), or None while it does. Endpoints that do not answer are the
        endpoints' business, not the source's: they do not make it fail."""
        ...

    async def close(self) -> None: ...


def make_source(fleet: Fleet, metrics: Metrics, collectors: int | None = None) -> SignalSource:
    """The source the fleet's `signals` section asks for. `collectors`: scrape with that
    many collector processes (None: sized to the cores; 0: in this process, for debugging
    and tools only, as it competes with xDS for this process's CPU)."""
    if fleet.signals.source == "prometheus":
        from controlplane.signals.prometheus import PrometheusSource

        return PrometheusSource(fleet, metrics)
    if collectors == 0:
        from controlplane.signals.scrape import InlineScrapeSource

        return InlineScrapeSource(fleet)
    from controlplane.signals.collector import CollectorPool

    return CollectorPool(fleet, metrics, collectors)
