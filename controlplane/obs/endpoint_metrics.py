"""Per-endpoint gauges, rendered when /metrics is read rather than set every round.

At 2,000 endpoints, setting eleven labelled gauges per endpoint every second cost the xDS
process about 50 ms of every weight round. The weight loop now hands over one immutable
tuple of rows per round (`EndpointRows.publish`, O(1)), and this collector turns the
latest rows into metric families only when Prometheus (or a test) reads them, in the
reader's thread. Series of endpoints that left the fleet simply stop appearing. Signal ages
are rendered as of the read, not of the round. A figure never read (None: no page yet, or a
dialect without it) has no sample at all, rather than a 0 that reads as idle or a NaN that
breaks sums: `absent()` and `unless` tell it apart (docs/metrics.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

ENDPOINT_LABELS = ["model", "version", "endpoint"]


@dataclass(frozen=True)
class EndpointRow:
    model: str
    version: str
    endpoint: str
    weight: int
    ready: bool
    capacity: float
    running: float | None  # None: never read (no sample)
    waiting: float | None
    kv_use: float | None
    latency_s: float | None
    error_rate: float | None
    signal_age_s: float
    in_flight: float
    scrape_errors: int  # cumulative, for as long as the endpoint is in the fleet
    was_ready: bool = False  # it has been ready since it joined (else it is still warming)
    adapters_in_use: float | None = None  # LoRA adapters with requests there (None: its page shows none)
    adapter_slots: float | None = None  # its max_lora (None: unknown)

    @property
    def state(self) -> str:
        """ready; held_out (it was ready, and is not now); warming (not ready yet since it joined)."""
        return "ready" if self.ready else "held_out" if self.was_ready else "warming"


VERSION_STATES = ("ready", "held_out", "warming")
_VERSION_ENDPOINTS_HELP = (
    "Endpoints of the version by state: ready, held_out (it was ready since it joined and is not "
    "now: failing health probes, out of sight), warming (not ready yet since it joined or since "
    "the control plane started). Every state is present for every version, 0 included."
)


# (metric name, help, row field); weight and ready are rendered from their own fields.
_GAUGES: tuple[tuple[str, str, str], ...] = (
    (
        "controlplane_endpoint_weight",
        "EDS load_balancing_weight pushed for the endpoint (0: held out, not ready).",
        "weight",
    ),
    (
        "controlplane_endpoint_capacity",
        "Relative capacity used for the endpoint: declared (GPU class or endpoint) or learnt "
        "from its observed throughput against its peers'.",
        "capacity",
    ),
    ("controlplane_endpoint_ready", "1 if the endpoint is ready (/health), else 0.", "ready"),
    (
        "controlplane_endpoint_running",
        "Requests the server reports running (else in flight by the proxies' load reports); no "
        "sample while never read.",
        "running",
    ),
    (
        "controlplane_endpoint_waiting",
        "Requests the server reports queued; no sample while never read (no page yet, or a "
        "server that does not report it).",
        "waiting",
    ),
    (
        "controlplane_endpoint_kv_cache_usage_ratio",
        "KV-cache use the server reports (0-1); no sample while never read (no page yet, or a "
        "server that does not report it).",
        "kv_use",
    ),
    (
        "controlplane_endpoint_latency_seconds",
        "EWMA of the mean end-to-end request latency the server reports, per scrape interval; "
        "no sample until known.",
        "latency_s",
    ),
    (
        "controlplane_endpoint_error_ratio",
        "EWMA error share: the worse of the server's counters and the proxies' load reports; no "
        "sample until either has counted completions.",
        "error_rate",
    ),
    (
        "controlplane_endpoint_in_flight",
        "Requests in progress to the endpoint, summed over all proxies' load reports (LRS).",
        "in_flight",
    ),
    (
        "controlplane_endpoint_adapters_in_use",
        "LoRA adapters with requests running or waiting on the server (vLLM's lora_requests_info, "
        "docs/adapters.md); no sample for a server whose page shows no LoRA.",
        "adapters_in_use",
    ),
    (
        "controlplane_endpoint_adapter_slots",
        "The server's LoRA adapter slots (vLLM's max_lora): adapters it holds loaded at once; no "
        "sample for a server whose page shows no LoRA.",
        "adapter_slots",
    ),
    (
        "controlplane_endpoint_signal_age_seconds",
        "Age of the endpoint's newest readable metrics page (+Inf: never read).",
        "signal_age_s",
    ),
)


class EndpointRows(Collector):
    """The latest rows, and the collector that renders them."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._rows: tuple[tuple[EndpointRow, ...], float] = ((), clock())

    def publish(self, rows: tuple[EndpointRow, ...], at: float | None = None) -> None:
        """The rows of a round that saw the endpoints at monotonic time `at` (default: now)."""
        # One reference swap: readers in other threads see the old pair or the new one.
        self._rows = (rows, self.clock() if at is None else at)

    def rows(self) -> tuple[EndpointRow, ...]:
        return self._rows[0]

    def describe(self) -> Iterator[Metric]:
        for name, doc, _ in _GAUGES:
            yield GaugeMetricFamily(name, doc, labels=ENDPOINT_LABELS)
        yield CounterMetricFamily(
            "controlplane_endpoint_scrape_errors",
            "Scrapes of the endpoint's /metrics that failed or returned an unreadable page.",
            labels=ENDPOINT_LABELS,
        )
        yield GaugeMetricFamily(
            "controlplane_version_endpoints", _VERSION_ENDPOINTS_HELP, labels=["model", "version", "state"]
        )

    def collect(self) -> Iterator[Metric]:
        rows, at = self._rows
        # Signal ages go on growing between rounds, and when rounds stop: a stalled weight
        # loop must not leave every endpoint looking freshly read.
        since = max(0.0, self.clock() - at)
        for name, doc, field in _GAUGES:
            g = GaugeMetricFamily(name, doc, labels=ENDPOINT_LABELS)
            extra = since if field == "signal_age_s" else 0.0
            for r in rows:
                value = getattr(r, field)
                if value is not None:
                    g.add_metric([r.model, r.version, r.endpoint], float(value) + extra)
            yield g
        c = CounterMetricFamily(
            "controlplane_endpoint_scrape_errors",
            "Scrapes of the endpoint's /metrics that failed or returned an unreadable page.",
            labels=ENDPOINT_LABELS,
        )
        for r in rows:
            c.add_metric([r.model, r.version, r.endpoint], float(r.scrape_errors))
        yield c
        # Per version, what the model-level alerts read (one series per state, not per endpoint).
        counts: dict[tuple[str, str], dict[str, int]] = {}
        for r in rows:
            by_state = counts.setdefault((r.model, r.version), dict.fromkeys(VERSION_STATES, 0))
            by_state[r.state] += 1
        v = GaugeMetricFamily(
            "controlplane_version_endpoints", _VERSION_ENDPOINTS_HELP, labels=["model", "version", "state"]
        )
        for (model, version), by_state in counts.items():
            for state, n in by_state.items():
                v.add_metric([model, version, state], float(n))
        yield v
