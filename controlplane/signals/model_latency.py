"""Per-model-version time to first token and time per output token, merged from the servers'
own histograms and rendered when /metrics is read.

Burn-rate rules need latency series per model version. The servers export histograms per
pod; only the control plane knows which pod serves which version. The collector processes
parse each server's TTFT and TPOT histograms (`ServerHistogram`, signals/parse.py), and here
they are merged into one cumulative histogram per (model, version):

- A server's first histogram seen is its baseline: what it counted before the control plane
  saw it (before this process started, or before it joined the version) is not added, as
  rate() ignores a series' first sample. Afterwards, its increase since its previous
  histogram is added.
- A counter reset (a restarted server: the new histogram does not `continue` the previous
  one, as a count, a bucket or the sum went down, the increase is not one requests could
  make, or the bounds changed) takes the new histogram whole as the increase, as
  Prometheus' rate() does.
- A server that leaves keeps its past counts in the total: the merged series only grow.
- Bounds: those every server that has reported for the version has (plus +Inf). A server with
  other bounds narrows them for good, so every bucket exported counts every contribution;
  `_sum` likewise only while every server gave one.
- Series of versions no longer in the fleet disappear.

Cost: the weight loop only queues each histogram that arrived (`observe`: a server's
consecutive ones collapse into the newest within a lifetime, which the collector tells with
`ServerHistogram.life`, so O(1); without it the buckets are compared); the arithmetic
(`fold`) runs when /metrics is read, in the reader's thread, or after FOLD_AFTER_S unread.
Folding the collapsed queue adds exactly what folding every histogram in turn would.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from controlplane.signals.parse import ServerHistogram, continues, same_life

if TYPE_CHECKING:
    from controlplane.fleet.model import Fleet
    from controlplane.signals.parse import ServerSample

# `le` as prometheus_client (and so vLLM) writes it, as the SLO thresholds' `le` label is too.
_le: Callable[[float], str] = floatToGoString  # (untyped upstream)

FOLD_AFTER_S = 30.0  # with no /metrics read for this long, the weight loop folds (bounds memory)

# (ServerSample field, metric family, help)
FAMILIES: tuple[tuple[str, str, str], ...] = (
    (
        "ttft",
        "controlplane_model_time_to_first_token_seconds",
        "Time to first token of the model version's requests: the sum of its servers' own "
        "histograms (vLLM/SGLang time_to_first_token_seconds) since the control plane saw them, "
        "surviving server restarts and departures; buckets common to all its servers.",
    ),
    (
        "tpot",
        "controlplane_model_time_per_output_token_seconds",
        "Time per output token of the model version (one observation per output token after "
        "the first; TGI: one per request, its mean): the sum of its servers' own histograms since "
        "the control plane saw them, surviving server restarts and departures.",
    ),
)
LABELS = ["model", "version"]

EndpointKey = tuple[str, str]  # (model, address)
# One histogram queued: (the endpoint's version then, the histogram, whether it must stay: a
# baseline, or the first after a reset or a change of version), or None: the endpoint left
# the fleet (forget its baseline).
_Entry = tuple[str, ServerHistogram, bool] | None


@dataclass
class MergedHistogram:
    """One (model, version)'s merged cumulative histogram."""

    bounds: tuple[float, ...]  # finite bounds, ascending
    counts: list[float]  # cumulative, per bound
    count: float = 0.0  # the +Inf bucket
    sum: float | None = 0.0  # None once a server gave no sum

    def narrow(self, bounds: tuple[float, ...]) -> None:
        """Keep only the bounds also in `bounds`."""
        if bounds is self.bounds or bounds == self.bounds:
            return
        keep = set(bounds)
        if all(b in keep for b in self.bounds):
            return
        pairs = [(b, c) for b, c in zip(self.bounds, self.counts, strict=True) if b in keep]
        self.bounds = tuple(b for b, _ in pairs)
        self.counts = [c for _, c in pairs]

    def add(
        self, bounds: tuple[float, ...], counts: Iterable[float], count: float, sum_: float | None
    ) -> None:
        """Add an increase given on `bounds` (which must include this histogram's bounds)."""
        if bounds is self.bounds or bounds == self.bounds:
            self.counts = [m + c for m, c in zip(self.counts, counts, strict=True)]
        else:
            by_bound = dict(zip(bounds, counts, strict=True))
            self.counts = [m + by_bound[b] for b, m in zip(self.bounds, self.counts, strict=True)]
        self.count += count
        self.sum = None if self.sum is None or sum_ is None else self.sum + sum_


class ModelLatency(Collector):
    """The merged histograms, and the collector that renders them (thread-safe: the weight
    loop observes, /metrics readers fold and render)."""

    def __init__(
        self, registry: CollectorRegistry | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.clock = clock
        # Guards what the loop hands over (_pending, _live); held briefly by both.
        self._lock = threading.Lock()
        self._pending: dict[tuple[EndpointKey, str], list[_Entry]] = {}
        self._live: frozenset[tuple[str, str]] = frozenset()  # (model, version) in the fleet
        # The loop's only: the fleet's endpoint -> version, and each endpoint's histogram queued
        # last (what the fold will have accounted for it).
        self._versions: tuple[object, dict[EndpointKey, str]] = (None, {})
        self._queued: dict[tuple[EndpointKey, str], tuple[str, ServerHistogram]] = {}
        # Held by one fold at a time (and its rendering); guards what follows.
        self._fold_lock = threading.Lock()
        self._accounted: dict[tuple[EndpointKey, str], tuple[str, ServerHistogram]] = {}
        self._merged: dict[tuple[str, str, str], MergedHistogram] = {}  # (field, model, version)
        self._folded_at = clock()
        if registry is not None:
            registry.register(self)

    # -- the weight loop

    def retain(self, fleet: Fleet) -> dict[EndpointKey, str]:
        """Follow the fleet: endpoints that left it lose their baseline (their past counts stay
        merged), versions that left it lose their series. Returns endpoint -> version (an
        address listed under several versions of a model counts for the first)."""
        cached, versions = self._versions
        if cached is fleet:
            return versions
        versions = {}
        for m in fleet.models:
            for v in m.versions:
                for ep in v.endpoints:
                    versions.setdefault((m.name, ep.address), v.name)
        live = frozenset((m.name, v.name) for m in fleet.models for v in m.versions)
        with self._lock:
            for gone in [k for k in self._queued if k[0] not in versions]:
                del self._queued[gone]
                self._pending.setdefault(gone, []).append(None)
            self._live = live
        self._versions = (fleet, versions)
        return versions

    def observe(self, fleet: Fleet, samples: Iterable[tuple[EndpointKey, ServerSample | None]]) -> None:
        """Queue the histograms of this round's samples (None: unchanged, nothing to queue)."""
        versions = self.retain(fleet)
        with self._lock:
            pending, queued = self._pending, self._queued
            for key, sample in samples:
                if sample is None or (sample.ttft is None and sample.tpot is None):
                    continue
                version = versions.get(key)
                if version is None:
                    continue
                for field, h in (("ttft", sample.ttft), ("tpot", sample.tpot)):
                    if h is None:
                        continue
                    before = queued.get((key, field))
                    queued[key, field] = (version, h)
                    if before is None or before[0] != version:
                        same = False
                    elif h.life and before[1].life:  # told by the collector: O(1)
                        same = h.life == before[1].life
                    else:
                        same = same_life(before[1], h)
                    queue = pending.get((key, field))
                    if queue is None:
                        pending[key, field] = [(version, h, not same)]
                        continue
                    last = queue[-1]
                    # Within a lifetime the newest is all the fold needs; a baseline and the
                    # first of a new lifetime (a reset, another version) stay.
                    if same and last is not None and not last[2]:
                        queue[-1] = (version, h, False)
                    else:
                        queue.append((version, h, not same))
        # Nobody reads /metrics: fold here now and then, so the queue stays small. Never wait
        # for a reader's fold (it empties the queue too).
        if self.clock() - self._folded_at > FOLD_AFTER_S and self._fold_lock.acquire(blocking=False):
            try:
                self._fold()
            finally:
                self._fold_lock.release()

    # -- readers

    def fold(self) -> None:
        """Add what was queued to the merged histograms."""
        with self._fold_lock:
            self._fold()

    def _fold(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
            live = self._live
            self._folded_at = self.clock()
        for (key, field), entries in pending.items():
            for entry in entries:
                if entry is None:
                    self._accounted.pop((key, field), None)
                else:
                    self._fold_one(key, field, *entry, live)
        for gone in [k for k in self._merged if (k[1], k[2]) not in live]:
            del self._merged[gone]

    def _fold_one(
        self,
        key: EndpointKey,
        field: str,
        version: str,
        h: ServerHistogram,
        anchor: bool,
        live: frozenset[tuple[str, str]],
    ) -> None:
        """Add `h`'s increase over the endpoint's previous histogram. Only an anchor can be a
        reset: any other entry was queued as the same lifetime as the one before it."""
        before = self._accounted.get((key, field))
        self._accounted[key, field] = (version, h)
        model = key[0]
        merged = self._merged.get((field, model, version))
        if merged is None:
            if (model, version) not in live:
                return
            merged = self._merged[field, model, version] = MergedHistogram(
                h.bounds, [0.0] * len(h.bounds), 0.0, 0.0 if h.sum is not None else None
            )
        else:
            merged.narrow(h.bounds)
        if before is None:
            if h.sum is None:
                merged.sum = None
            return  # the baseline
        prev = before[1]
        if anchor and not continues(prev, h):  # a reset: all of it is new
            merged.add(h.bounds, h.counts, h.count, h.sum)
        elif h.bounds is merged.bounds or h.bounds == merged.bounds:  # the usual case, in one pass
            merged.counts = [m + b - a for m, a, b in zip(merged.counts, prev.counts, h.counts, strict=True)]
            merged.count += h.count - prev.count
            merged.sum = (
                None
                if merged.sum is None or h.sum is None or prev.sum is None
                else merged.sum + h.sum - prev.sum
            )
        else:
            merged.add(
                h.bounds,
                [b - a for a, b in zip(prev.counts, h.counts, strict=True)],
                h.count - prev.count,
                None if h.sum is None or prev.sum is None else h.sum - prev.sum,
            )

    def merged(self) -> dict[tuple[str, str, str], MergedHistogram]:
        """(field, model, version) -> its merged histogram, folded now (a copy, for tests)."""
        with self._fold_lock:
            self._fold()
            return {
                k: MergedHistogram(m.bounds, list(m.counts), m.count, m.sum) for k, m in self._merged.items()
            }

    def describe(self) -> Iterator[Metric]:
        for _, name, doc in FAMILIES:
            yield HistogramMetricFamily(name, doc, labels=LABELS)

    def collect(self) -> Iterator[Metric]:
        with self._fold_lock:
            self._fold()
            families = []
            for field, name, doc in FAMILIES:
                family = HistogramMetricFamily(name, doc, labels=LABELS)
                for (f, model, version), m in sorted(self._merged.items()):
                    if f != field:
                        continue
                    buckets = [(_le(b), c) for b, c in zip(m.bounds, m.counts, strict=True)] + [
                        ("+Inf", m.count)
                    ]
                    family.add_metric([model, version], buckets, m.sum)
                    if m.sum is None:  # add_metric writes _count only with a _sum
                        family.samples.append(
                            Sample(f"{name}_count", {"model": model, "version": version}, m.count)
                        )
                families.append(family)
        yield from families
