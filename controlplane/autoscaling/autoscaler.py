"""Desired replicas for every model of the fleet, and for each of its versions (pure).

`Autoscaler.update` takes each cluster's loads as the weigher saw them this round and
hands a demand sample to one `Scaler` per model and one per version (a rollout scales its
canary and its stable apart; KEDA's `scalerMetadata.version` selects one). Demand is what
the servers run plus what waits on them, plus requests held for the model while it has no
ready server (`held`). A replica counts as ready when its server says so and it has weight
(held-out servers do not serve).

With `predictive: true`, each model's demand also feeds its forecast (forecast.py): the
demand forecast up to its observed cold start ahead is a floor under its desired replicas.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from controlplane.autoscaling.forecast import Forecaster, Settings
from controlplane.autoscaling.kpa import Decision, Scaler
from controlplane.fleet.model import Fleet, ScalingPolicy
from controlplane.signals.load import EndpointLoad, counted

MODEL = ""  # the version key of a whole model's decision


class ClusterLoads(Protocol):
    """What the autoscaler needs of one cluster's round (balancing.weigher.ClusterView has it)."""

    @property
    def model(self) -> str: ...
    @property
    def version(self) -> str: ...
    @property
    def loads(self) -> tuple[EndpointLoad, ...]: ...
    @property
    def weights(self) -> Mapping[str, int]: ...


def settings_of(policy: ScalingPolicy) -> Settings:
    return Settings(policy.forecast_bucket_s, policy.season_s, policy.forecast_method, policy.cold_start_s)


class Autoscaler:
    def __init__(self) -> None:
        self.forecaster = Forecaster()
        self._scalers: dict[tuple[str, str], Scaler] = {}
        # (model, version or MODEL) -> the last decision
        self.decisions: dict[tuple[str, str], Decision] = {}

    def update(
        self,
        fleet: Fleet,
        clusters: Iterable[ClusterLoads],
        now: float,
        slots: Callable[[str, str], float | None] = lambda model, address: None,
        held: Mapping[str, float] | None = None,
        wall: float | None = None,
        completed: Mapping[str, float] | None = None,
    ) -> dict[tuple[str, str], Decision]:
        """One round: every model's and version's decision (also kept in `decisions`).
        `wall`: the wall-clock time, for the forecasts' history (None: no predictive);
        `completed`: requests each model finished since the last round (its arrivals)."""
        held = held or {}
        predictive: dict[str, Settings] = {}
        by_model: dict[str, list[ClusterLoads]] = {}
        for c in clusters:
            by_model.setdefault(c.model, []).append(c)
        decisions: dict[tuple[str, str], Decision] = {}
        for model in fleet.models:
            policy = fleet.scaling_of(model)
            mine = by_model.get(model.name, [])
            seen = [s for c in mine for ld in c.loads if (s := slots(model.name, ld.address))]
            model_slots = statistics.median(seen) if seen else None  # one liar moves it little
            total_demand = float(held.get(model.name, 0.0))
            total_ready = 0
            total_running = 0.0
            for c in mine:
                demand = sum(counted(ld.running) + counted(ld.waiting) for ld in c.loads)
                total_running += sum(counted(ld.running) for ld in c.loads)
                ready = sum(1 for ld in c.loads if ld.ready and c.weights.get(ld.address, 0) > 0)
                total_demand += demand
                total_ready += ready
                scaler = self._scalers.setdefault((model.name, c.version), Scaler())
                decisions[(model.name, c.version)] = scaler.decide(policy, now, demand, ready, model_slots)
            prediction = None
            if policy.predictive and wall is not None:
                settings = predictive[model.name] = settings_of(policy)
                done = (completed or {}).get(model.name, 0.0)
                self.forecaster.record(model.name, settings, wall, total_demand, total_running, done)
                prediction = self.forecaster.predict(model.name, settings, wall)
            scaler = self._scalers.setdefault((model.name, MODEL), Scaler())
            decisions[(model.name, MODEL)] = scaler.decide(
                policy, now, total_demand, total_ready, model_slots, prediction
            )
        self.forecaster.retain(predictive)
        self.forecaster.refit(predictive)
        for gone in self._scalers.keys() - decisions.keys():
            del self._scalers[gone]
        self.decisions = decisions
        return decisions
