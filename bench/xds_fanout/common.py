"""Shared pieces of the xDS fan-out benchmark: the fleet and process measurements."""

from __future__ import annotations

import contextlib
import os
import random

from controlplane.fleet.model import Endpoint, Fleet, ListenerSpec, Model, Tier, Version

ADS = "/envoy.service.discovery.v3.AggregatedDiscoveryService/"
SOTW_METHOD = ADS + "StreamAggregatedResources"
DELTA_METHOD = ADS + "DeltaAggregatedResources"


def bench_fleet(clusters: int, endpoints: int, addresses: list[str] | None = None) -> Fleet:
    """`clusters` models with one version each, `endpoints` endpoints spread evenly, on
    loopback addresses (127.x.y.z: nothing is sent anywhere else, even when scraped), or
    on `addresses` (host:port) in order."""
    if addresses:
        endpoints = len(addresses)
    per = max(1, endpoints // clusters)
    models = []
    n = 0
    for c in range(clusters):
        eps = []
        for _ in range(per):
            if addresses:
                host, _, port = addresses[n].rpartition(":")
                eps.append(Endpoint(host=host, port=int(port)))
            else:
                eps.append(Endpoint(host=f"127.{n // 65536 % 256 + 1}.{n // 256 % 256}.{n % 256}", port=8000))
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


def descendants(pid: int) -> list[int]:
    """Every process under `pid` (its collector processes, for CPU accounting)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of `pid` and every live process under it."""
    total = 0.0
    for p in (pid, *descendants(pid)):
        with contextlib.suppress(OSError):
            total += cpu_seconds(p)
    return total
