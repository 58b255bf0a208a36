"""Demand forecasts for predictive pre-warm (pure: no I/O, no clock).

A server takes its cold start (pulling weights, loading them onto the GPU) to come up, so a
scaler that only reacts to demand is always that late for a rise. Many fleets' demand rises
at the same time every day. This room learns each model's demand by time of season and says
what it will be `lead` seconds from now, the lead being the model's observed cold start
(`ColdStarts`), so that replicas are asked for before the rise, not during it.

**History.** Per model, the mean arrival rate (requests per second offered to it: what
completed plus what its demand grew by, each round) per bucket of `bucket_s` (60 s), keyed
by wall-clock bucket number, so that it can be saved and survive restarts (the shell
persists `dump()`); up to `SEASONS_KEPT` seasons are kept. Arrivals rather than demand,
because demand (requests running and waiting) depends on the replicas the model had: a
late scale-up shows as a queue, and a forecast learnt from queues would chase its own
mistakes. The forecast rate becomes demand by Little's law: rate x the model's observed time
per request in a slot (running / completion rate).

**Methods**, each run as one pass over the series that yields, at every bucket, the forecast
made `h` buckets earlier (for the backtest) and the forecasts ahead of the last bucket:
- `naive`: the last value. It is what the reactive scaler already knows: the baseline;
- `seasonal`: the mean of the same bucket in past seasons, plus the mean residual of the
  latest buckets against that profile (a level shift or trend since the past seasons);
- `holt_winters`: additive Holt-Winters with a damped trend.

**Chosen by measurement.** Every refit backtests each method at the lead's horizon over the
latest season and takes the one with the lowest mean absolute error, and only if it beats
`naive` by `TRUST_MARGIN`: a forecast that does not beat "what is happening now" is worse
than none (it costs GPUs), so then no forecast is given and the reactive scaler alone
decides. Until a model has one season and a half of history, there is nothing to trust.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

METHODS = ("seasonal", "holt_winters")  # the candidates; naive is the baseline
SEASONS_KEPT = 3
TRUST_MARGIN = 0.9  # a method is used only if its error is at most this share of naive's
MIN_HISTORY_SEASONS = 1.5
HW_ALPHA, HW_BETA, HW_GAMMA, HW_PHI = 0.3, 0.05, 0.3, 0.9
RESIDUAL_BUCKETS = 3  # the seasonal method's level shift: mean residual of this many buckets
COLD_STARTS_KEPT = 16
MAX_ROUND_GAP_S = 60.0  # rounds further apart than this give no rate


@dataclass(frozen=True)
class Fit:
    """One refit of a model's forecast."""

    method: str  # the method used, or "" when none is trusted
    ahead: tuple[float, ...]  # the chosen method's forecasts for buckets last+1 ... last+h
    last: int  # the last complete bucket the fit saw
    errors: Mapping[str, float]  # backtest mean absolute error per method, naive included
    reason: str


# ---- the methods: one pass each -------------------------------------------------------------


def naive(values: list[float], m: int, h: int) -> tuple[list[float | None], list[float]]:
    """(backtest forecasts, forecasts ahead) of the last value."""
    back: list[float | None] = [None] * len(values)
    for j in range(h, len(values)):
        back[j] = values[j - h]
    return back, [values[-1]] * h if values else []


def seasonal(values: list[float], m: int, h: int) -> tuple[list[float | None], list[float]]:
    """Profile of the same bucket in past seasons + the latest mean residual against it."""
    n = len(values)

    def profile(j: int, known: int) -> float | None:
        """Mean of values[j - k*m] over past seasons that are known by index `known`."""
        k = max(1, math.ceil((j - known) / m))
        got = [values[j - q * m] for q in range(k, k + SEASONS_KEPT) if 0 <= j - q * m <= known]
        return sum(got) / len(got) if got else None

    def forecast(j: int, known: int) -> float | None:
        base = profile(j, known)
        if base is None:
            return None
        residuals = []
        for q in range(RESIDUAL_BUCKETS):
            i = known - q
            p = profile(i, known - q - 1) if i >= 0 else None  # as it was forecast then
            if p is not None:
                residuals.append(values[i] - p)
        shift = sum(residuals) / len(residuals) if residuals else 0.0
        return max(0.0, base + shift)

    back: list[float | None] = [None] * n
    for j in range(h, n):
        back[j] = forecast(j, j - h)
    ahead = [forecast(n - 1 + k, n - 1) for k in range(1, h + 1)] if n else []
    return back, [a if a is not None else values[-1] for a in ahead]


def holt_winters(values: list[float], m: int, h: int) -> tuple[list[float | None], list[float]]:
    """Additive Holt-Winters, damped trend; initialised on the first season."""
    n = len(values)
    back: list[float | None] = [None] * n
    if n < m + 1:
        return back, [values[-1]] * h if values else []
    level = sum(values[:m]) / m
    trend = 0.0
    season = [v - level for v in values[:m]]

    def ahead_of(level: float, trend: float, t: int, k: int) -> float:
        damp = sum(HW_PHI**i for i in range(1, k + 1))
        return max(0.0, level + damp * trend + season[(t + k) % m])

    for t in range(m, n):
        if t - 1 + h < n:  # the forecast made at t-1 for t-1+h, kept for the backtest
            back[t - 1 + h] = ahead_of(level, trend, t - 1, h)
        x = values[t]
        prev = level
        level = HW_ALPHA * (x - season[t % m]) + (1 - HW_ALPHA) * (prev + HW_PHI * trend)
        trend = HW_BETA * (level - prev) + (1 - HW_BETA) * HW_PHI * trend
        season[t % m] = HW_GAMMA * (x - level) + (1 - HW_GAMMA) * season[t % m]
    return back, [ahead_of(level, trend, n - 1, k) for k in range(1, h + 1)]


_RUN = {"naive": naive, "seasonal": seasonal, "holt_winters": holt_winters}


def fit(
    values: list[float], m: int, h: int, method: str = "auto"
) -> tuple[str, list[float], dict[str, float], str]:
    """Backtest at horizon `h` over the latest season; (method, forecasts ahead, errors, why).
    `method` "auto" picks by error; a named method is used if it has enough history."""
    n = len(values)
    h = max(1, h)
    if n < MIN_HISTORY_SEASONS * m + h:
        return "", [], {}, f"learning: {n} of {math.ceil(MIN_HISTORY_SEASONS * m + h)} buckets of history"
    window = range(max(h, n - m), n)
    errors: dict[str, float] = {}
    aheads: dict[str, list[float]] = {}
    for name in ("naive", *METHODS):
        back, ahead = _RUN[name](values, m, h)
        pairs = [(back[j], values[j]) for j in window if back[j] is not None]
        if len(pairs) < max(2, len(window) // 2):
            continue
        errors[name] = sum(abs(f - x) for f, x in pairs if f is not None) / len(pairs)
        aheads[name] = ahead
    base = errors.get("naive")
    candidates = [name for name in METHODS if name in errors and (method in ("auto", name))]
    if base is None or not candidates:
        return "", [], errors, "learning: not enough history to backtest"
    best = min(candidates, key=lambda name: errors[name])
    if method == "auto" and errors[best] > TRUST_MARGIN * base:
        return (
            "",
            [],
            errors,
            (f"no method beats the last value: {best} error {errors[best]:.2f} vs {base:.2f}"),
        )
    return best, aheads[best], errors, f"{best}: backtest error {errors[best]:.2f} (last value {base:.2f})"


# ---- per model history ----------------------------------------------------------------------


class History:
    """One model's demand per bucket (wall-clock bucket numbers), the current bucket open."""

    def __init__(self, bucket_s: float, season_s: float) -> None:
        self.bucket_s = bucket_s
        self.m = max(2, round(season_s / bucket_s))
        self.buckets: dict[int, float] = {}
        self._open: tuple[int, float, int] | None = None  # bucket, sum, samples

    def add(self, wall: float, demand: float) -> bool:
        """Fold in a sample; True when a bucket was completed by it."""
        b = math.floor(wall / self.bucket_s)
        closed = False
        if self._open is not None and self._open[0] != b:
            ob, total, count = self._open
            if b > ob:  # (a clock stepped back drops the open bucket instead)
                self.buckets[ob] = total / count
                closed = True
            self._open = None
        if self._open is None:
            self._open = (b, 0.0, 0)
        ob, total, count = self._open
        self._open = (ob, total + demand, count + 1)
        keep_from = b - SEASONS_KEPT * self.m
        if closed and self.buckets and min(self.buckets) < keep_from:
            for old in [k for k in self.buckets if k < keep_from]:
                del self.buckets[old]
        return closed

    def series(self) -> tuple[list[float], int]:
        """The complete buckets as a contiguous series ending at the last one, gaps (the
        control plane was down) filled with the same bucket a season before, else the
        previous value; and the last bucket's number."""
        if not self.buckets:
            return [], -1
        first, last = min(self.buckets), max(self.buckets)
        out: list[float] = []
        for b in range(first, last + 1):
            v = self.buckets.get(b)
            if v is None:
                i = b - first
                v = out[i - self.m] if i >= self.m else (out[-1] if out else 0.0)
            out.append(v)
        return out, last

    def dump(self) -> dict[str, Any]:
        buckets = {str(k): v for k, v in self.buckets.items()}
        return {"bucket_s": self.bucket_s, "m": self.m, "buckets": buckets}

    @classmethod
    def load(cls, data: Mapping[str, Any], bucket_s: float, season_s: float) -> History | None:
        """A saved history if it was taken with the same bucket and season, else None."""
        h = cls(bucket_s, season_s)
        try:
            if float(data.get("bucket_s", -1)) != bucket_s or int(data.get("m", -1)) != h.m:
                return None
            for k, v in dict(data.get("buckets", {})).items():
                value = float(v)
                if math.isfinite(value) and value >= 0:
                    h.buckets[int(k)] = value
        except (TypeError, ValueError):
            return None  # a damaged file: start afresh rather than fail
        return h


class ColdStarts:
    """Each model's observed cold starts (a server joined, or was started, until it was first
    ready); the lead is the 90th percentile of the latest ones."""

    def __init__(self) -> None:
        self.seen: dict[str, deque[float]] = {}

    def observe(self, model: str, seconds: float) -> None:
        if math.isfinite(seconds) and 0 <= seconds < 86400:
            self.seen.setdefault(model, deque(maxlen=COLD_STARTS_KEPT)).append(seconds)

    def lead(self, model: str, default: float) -> tuple[float, bool]:
        """(seconds, observed): the p90 of what was seen, else `default`."""
        seen = sorted(self.seen.get(model, ()))
        if not seen:
            return default, False
        return seen[min(len(seen) - 1, math.ceil(0.9 * len(seen)) - 1)], True


@dataclass(frozen=True)
class Settings:
    """A model's predictive keys (fleet ScalingPolicy)."""

    bucket_s: float
    season_s: float
    method: str  # auto, seasonal, holt_winters
    cold_start_s: float  # assumed until one is observed


@dataclass(frozen=True)
class Prediction:
    demand: float  # the highest forecast demand from now to the lead (rate x service time)
    method: str
    lead_s: float
    lead_observed: bool
    rate: float = 0.0  # the highest forecast arrival rate (requests/s)
    service_s: float = 0.0  # the model's observed time per request in a slot


@dataclass
class _Flow:
    """What the last round saw of one model, to turn counts into rates."""

    wall: float
    demand: float
    running: float
    service_s: float | None = None  # EWMA of running / completion rate (Little's law)


class Forecaster:
    """Every model's history, cold starts and latest fit."""

    def __init__(self, refits_per_round: int = 2) -> None:
        self.histories: dict[str, History] = {}
        self.cold_starts = ColdStarts()
        self.fits: dict[str, Fit] = {}
        self._due: set[str] = set()  # models whose history gained a bucket since their fit
        self.refits_per_round = refits_per_round
        self._flows: dict[str, _Flow] = {}
        self._saved: dict[str, Mapping[str, Any]] = {}  # restored histories not claimed yet
        self._saved_cold: dict[str, list[Any]] = {}

    def record(
        self,
        model: str,
        settings: Settings,
        wall: float,
        demand: float,
        running: float = 0.0,
        completed: float = 0.0,
    ) -> None:
        """One round of a model: its demand (running + waiting + held), what runs, and the
        requests completed since the last round. Arrivals are what completed plus what the
        demand grew by (what came in either finished or is still there), so the history is
        the traffic the model was offered, whatever replicas it had."""
        h = self.histories.get(model)
        m = max(2, round(settings.season_s / settings.bucket_s))
        if h is None or h.bucket_s != settings.bucket_s or h.m != m:
            h = self.histories[model] = self._restored(model, settings)
            self.fits.pop(model, None)
        demand, running, completed = (
            max(0.0, x) if math.isfinite(x) else 0.0 for x in (demand, running, completed)
        )
        prev = self._flows.get(model)
        flow = self._flows[model] = _Flow(wall, demand, running, prev.service_s if prev else None)
        if prev is None:
            return
        dt = wall - prev.wall
        if not 0 < dt <= MAX_ROUND_GAP_S:
            return  # the first round after a pause: no rate from it
        rate = max(0.0, completed + demand - prev.demand) / dt
        busy = (running + prev.running) / 2
        if completed > 0 and busy > 0:
            service = busy / (completed / dt)
            flow.service_s = service if prev.service_s is None else 0.8 * prev.service_s + 0.2 * service
        if h.add(wall, rate) or model not in self.fits:
            self._due.add(model)

    def refit(self, settings_of: Mapping[str, Settings]) -> list[str]:
        """Refit up to `refits_per_round` models whose history gained a bucket (bounded work
        per round: one refit is a pass over up to SEASONS_KEPT seasons of buckets)."""
        done = []
        for model in sorted(self._due)[: self.refits_per_round]:
            self._due.discard(model)
            s = settings_of.get(model)
            h = self.histories.get(model)
            if s is None or h is None:
                continue
            values, last = h.series()
            lead, _ = self.cold_starts.lead(model, s.cold_start_s)
            steps = min(h.m, max(1, math.ceil(lead / h.bucket_s)))
            method, ahead, errors, why = fit(values, h.m, steps, s.method)
            self.fits[model] = Fit(method, tuple(ahead), last, errors, why)
            done.append(model)
        return done

    def predict(self, model: str, settings: Settings, wall: float) -> Prediction | None:
        """The highest forecast demand from the current bucket to the lead, or None when no
        method is trusted (or the fit is more than a lead old)."""
        f = self.fits.get(model)
        h = self.histories.get(model)
        if f is None or h is None or not f.method or not f.ahead:
            return None
        lead, observed = self.cold_starts.lead(model, settings.cold_start_s)
        now_b = math.floor(wall / h.bucket_s)
        steps = max(1, math.ceil(lead / h.bucket_s))
        first = now_b - f.last  # index of the current bucket in `ahead` (1 = just after last)
        window = [f.ahead[k - 1] for k in range(max(1, first), first + steps + 1) if 1 <= k <= len(f.ahead)]
        flow = self._flows.get(model)
        if not window or flow is None or flow.service_s is None:
            return None  # no forecast in reach, or no service time seen yet to size it
        rate = max(window)
        return Prediction(rate * flow.service_s, f.method, lead, observed, rate, flow.service_s)

    def retain(self, models: Iterable[str]) -> None:
        keep = set(models)
        self._due &= keep
        for d in (self.histories, self.fits, self._flows, self.cold_starts.seen):
            for gone in [k for k in d if k not in keep]:
                del d[gone]

    def dump(self) -> dict[str, Any]:
        return {
            "version": 1,
            "models": {m: h.dump() for m, h in self.histories.items()},
            "cold_starts": {m: list(v) for m, v in self.cold_starts.seen.items()},
        }

    def restore(self, data: Mapping[str, Any]) -> int:
        """Take a saved `dump()`: each model's history comes back when the model is next
        recorded with the same bucket and season (else it starts afresh). Returns how many
        models it holds."""
        models = data.get("models", {}) if isinstance(data, Mapping) else {}
        cold = data.get("cold_starts", {}) if isinstance(data, Mapping) else {}
        self._saved = {m: h for m, h in dict(models).items() if isinstance(h, Mapping)}
        self._saved_cold = {m: v for m, v in dict(cold).items() if isinstance(v, list)}
        return len(self._saved)

    def _restored(self, model: str, settings: Settings) -> History:
        saved = self._saved.pop(model, None)
        h = History.load(saved, settings.bucket_s, settings.season_s) if saved is not None else None
        for v in self._saved_cold.pop(model, [])[-COLD_STARTS_KEPT:]:
            if isinstance(v, (int, float)):
                self.cold_starts.observe(model, float(v))
        return h if h is not None else History(settings.bucket_s, settings.season_s)
