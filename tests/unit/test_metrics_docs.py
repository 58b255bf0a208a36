"""Every metric the control plane registers is listed in docs/metrics.md, and nothing more."""

from __future__ import annotations

import re
from pathlib import Path

from controlplane.obs.metrics import Metrics
from controlplane.picker.service import PickerMetrics
from controlplane.quota.service import QuotaMetrics
from controlplane.signals.model_latency import ModelLatency
from controlplane.xds.cache import SnapshotCache
from controlplane.xds.server import XdsServer

ROOT = Path(__file__).resolve().parents[2]


def registered() -> set[str]:
    names = set()
    metrics = Metrics()
    XdsServer(SnapshotCache(), metrics)  # registers the collectors counted at scrape time
    ModelLatency(metrics.registry)  # the weight loop's (balancing/controller.py), merged at scrape time
    picker = PickerMetrics()  # `controlplane picker`'s own, on its --metrics-listen
    # The KV events' own families, which its index process counts and it exports once told
    # (picker/kv_process.py), are registered directly where it reads the events itself.
    in_process = PickerMetrics(kv_in_process=True)
    quota = QuotaMetrics()  # `controlplane ratelimit`'s own
    collected = [*picker.registry.collect(), *in_process.registry.collect(), *quota.registry.collect()]
    for metric in [*metrics.registry.collect(), *collected]:
        name = metric.name
        if metric.type == "counter":
            name += "_total"
        names.add(name)
    return names


def test_every_registered_metric_is_documented_and_every_documented_one_exists() -> None:
    doc = (ROOT / "docs" / "metrics.md").read_text()
    # Ours, and the process and Python collectors' (registered on our registry too).
    documented = set(re.findall(r"`((?:controlplane|process|python)_[a-z_0-9]+)`", doc))
    names = registered()
    assert len(names) > 30
    assert sorted(names - documented) == [], "registered but not in docs/metrics.md"
    assert sorted(documented - names) == [], "in docs/metrics.md but not registered"
