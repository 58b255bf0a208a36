"""Shared pieces of the xDS fan-out benchmark: the fleet and process measurements."""

from __future__ import annotations

import os
import random

from controlplane.fleet.model import Endpoint, Fleet, ListenerSpec, Model, Tier, Version

ADS = "/envoy.service.discovery.v3.AggregatedDiscoveryService/"
SOTW_METHOD = ADS + "StreamAggregatedResources"
DELTA_METHOD = ADS + "DeltaAggregatedResources"


def bench_fleet(clusters: int, endpoints: int) -> Fleet:
    """`clusters` models with one version each, `endpoints` endpoints spread evenly."""
    per = max(1, endpoints // clusters)
    models = []
    n = 0
    for c in range(clusters):
        eps = []
        for _ in range(per):
            eps.append(Endpoint(host=f"10.{n // 65536 % 256}.{n // 256 % 256}.{n % 256}", port=8000))
            n += 1
        models.append(
            Model(name=f"m{c}", tier="all", stable="v1", versions=(Version("v1", tuple(eps)),), params_b=8)
        )
    return Fleet(
        listener=ListenerSpec(port=10000),
        tiers=(Tier("all", None),),
        models=tuple(models),
    )


def new_weights(fleet: Fleet, cluster_index: int, seed: int) -> tuple[str, dict[str, int]]:
    """Random weights for one cluster: (cluster name, address -> weight)."""
    model = fleet.models[cluster_index % len(fleet.models)]
    rng = random.Random(seed)
    return f"{model.name}@v1", {e.address: rng.randint(1, 100) for e in model.versions[0].endpoints}


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks
