"""The rollouts' metrics: each version's share of traffic and Envoy cluster name (every
replica), and the rollouts' phases, steps, weights, analysis figures and drains (the leader
only). Each family keeps exactly the series of what exists now: a version, rollout or model
that left has its series removed."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from prometheus_client.utils import floatToGoString

from controlplane.fleet.model import Fleet
from controlplane.obs.metrics import PHASES, Metrics
from controlplane.resources.names import cluster_name, stat_name
from controlplane.rollout.analysis import VersionFigures
from controlplane.rollout.machine import Rollout
from controlplane.rollout.overlay import EndpointDrain, active
from controlplane.routing.translate import RoutingOverlay


class RolloutSeries:
    """The series exported so far, so that those of what left can be removed."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._weights_exported: set[tuple[str, str]] = set()  # version_weight series set
        self._analysed_exported: set[tuple[str, str, str]] = set()  # analysis_* series set
        self._routing_exported: set[tuple[str, str]] = set()  # version_traffic series set

    def export_routing(self, fleet: Fleet, overlay: RoutingOverlay) -> None:
        """Every replica serves the same routes: each version's share of its model's traffic,
        and the Envoy cluster name of each version (for joins with Envoy's stats)."""
        m = self.metrics
        exported: set[tuple[str, str]] = set()
        for model in fleet.models:
            slo = fleet.slo_of(model)
            for sli, objective in (
                ("availability", slo.availability),
                ("ttft", slo.ttft_objective),
                ("tpot", slo.tpot_objective),
            ):
                m.slo_objective.labels(model.name, sli).set(objective)
            for sli, threshold in (("ttft", slo.ttft_s), ("tpot", slo.tpot_s)):
                # Only the current threshold's series: a changed one must not linger beside it.
                with m.slo_threshold._lock:
                    stale = [k for k in m.slo_threshold._metrics if k[:2] == (model.name, sli)]
                le = floatToGoString(threshold)  # type: ignore[no-untyped-call]
                for key in stale:
                    if key[2] != le:
                        m.slo_threshold.remove(*key)
                m.slo_threshold.labels(model.name, sli, le).set(threshold)
            split = dict(overlay.splits.get(model.name, ())) or {model.stable: 100}
            total = sum(split.values()) or 1
            for v in model.versions:
                m.version_traffic.labels(model.name, v.name).set(split.get(v.name, 0) / total)
                m.cluster_info.labels(stat_name(cluster_name(model.name, v.name)), model.name, v.name).set(1)
                exported.add((model.name, v.name))
        for model_name, version in self._routing_exported - exported:
            with contextlib.suppress(KeyError):
                m.version_traffic.remove(model_name, version)
            with contextlib.suppress(KeyError):
                m.cluster_info.remove(stat_name(cluster_name(model_name, version)), model_name, version)
        self._routing_exported = exported

    def export(
        self,
        fleet: Fleet | None,
        rollouts: Mapping[str, Rollout],
        drains: Mapping[str, EndpointDrain],
        figures: Mapping[str, tuple[VersionFigures, VersionFigures]],
        leader: bool,
    ) -> None:
        """The rollouts' and drains' series: only the leader exports them, so a former
        leader's do not stay frozen beside the new one's."""
        rm = self.metrics.rollouts
        # A model that left the file keeps its rollout record (history), not its series.
        served = {m.name for m in fleet.models} if fleet is not None else set(rollouts)
        if not leader:
            served = set()
        weights: set[tuple[str, str]] = set()
        analysed: set[tuple[str, str, str]] = set()
        for model, r in rollouts.items():
            if model not in served:
                for p in PHASES:
                    with contextlib.suppress(KeyError):
                        rm.phase.remove(model, p)
                with contextlib.suppress(KeyError):
                    rm.step.remove(model)
                continue
            for p in PHASES:
                rm.phase.labels(model, p).set(1 if r.phase == p else 0)
            rm.step.labels(model).set(r.step + 1)
            for v, w in r.weights.items():
                rm.version_weight.labels(model, v).set(w / 100.0)
                weights.add((model, v))
            f = figures.get(model)
            # A finished rollout has no step to judge: its last figures would mislead.
            if f is not None and active(r):
                for role, version, fig in (("canary", r.spec.canary, f[0]), ("stable", r.spec.stable, f[1])):
                    rm.analysis_error_ratio.labels(model, version, role).set(fig.error_rate)
                    rm.analysis_requests.labels(model, version, role).set(round(fig.requests))
                    if fig.p99_s is not None:
                        rm.analysis_p99.labels(model, version, role).set(fig.p99_s)
                    else:
                        with contextlib.suppress(KeyError):
                            rm.analysis_p99.remove(model, version, role)
                    analysed.add((model, version, role))
        # Versions of an earlier rollout of the model that this one does not name.
        for model, v in self._weights_exported - weights:
            with contextlib.suppress(KeyError):
                rm.version_weight.remove(model, v)
        self._weights_exported = weights
        for key in self._analysed_exported - analysed:
            for family in (rm.analysis_error_ratio, rm.analysis_requests, rm.analysis_p99):
                with contextlib.suppress(KeyError):
                    family.remove(*key)
        self._analysed_exported = analysed
        for state in ("draining", "drained"):
            if leader:
                rm.draining.labels(state).set(sum(1 for d in drains.values() if d.state == state))
            else:
                with contextlib.suppress(KeyError):
                    rm.draining.remove(state)
