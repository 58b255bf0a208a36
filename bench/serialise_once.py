"""Serialise once, frame per stream, against serialising a response per stream.

Run: .venv/bin/python bench/serialise_once.py [--streams N] [--endpoints N]

Builds an EDS update for a fleet, then produces the bytes every stream would be sent:
  baseline: a DiscoveryResponse message per stream, SerializeToString per stream
            (what a control plane that builds responses per stream does);
  ours:     each resource serialised once into the snapshot, responses framed from the
            pre-encoded fields (controlplane.xds.wire), as the server does.
Both are measured in the same run; the ratio is what to read, not the absolute times.
"""

from __future__ import annotations

import argparse
import time

from envoy.service.discovery.v3 import discovery_pb2

from controlplane.fleet import parse_fleet
from controlplane.routing.translate import ENDPOINT, translate
from controlplane.xds import wire
from controlplane.xds.snapshot import build_snapshot


def fleet_text(clusters: int, endpoints: int) -> str:
    per = max(1, endpoints // clusters)
    lines = ["listener: {port: 10000}", "tiers:", "  all: {timeout: 60s}", "models:"]
    for c in range(clusters):
        addrs = ", ".join(f"'10.{c // 250}.{c % 250}.{i % 250}:{8000 + i // 250}'" for i in range(per))
        lines += [
            f"  m{c}:",
            "    params_b: 8",
            "    stable: v1",
            "    versions:",
            f"      v1: {{endpoints: [{addrs}]}}",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--clusters", type=int, default=20)
    p.add_argument("--endpoints", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    desired = translate(parse_fleet(fleet_text(a.clusters, a.endpoints)))
    messages = desired.by_type[ENDPOINT]

    def baseline() -> int:
        total = 0
        for s in range(a.streams):
            resp = discovery_pb2.DiscoveryResponse(version_info="1", type_url=ENDPOINT, nonce=str(s))
            for msg in messages.values():
                resp.resources.add().Pack(msg)
            total += len(resp.SerializeToString())
        return total

    def ours() -> int:
        snap = build_snapshot(desired, 1, 0.0)
        fields = [r.sotw_field for r in snap.resources[ENDPOINT].values()]
        total = 0
        for s in range(a.streams):
            total += len(wire.sotw_response("1", ENDPOINT, str(s), fields))
        return total

    def best(fn: object) -> tuple[float, int]:
        times, size = [], 0
        for _ in range(a.repeat):
            t = time.perf_counter()
            size = fn()  # type: ignore[operator]
            times.append(time.perf_counter() - t)
        return min(times), size

    tb, sb = best(baseline)
    to, so = best(ours)
    print(f"{a.streams} streams, {a.clusters} clusters, {a.endpoints} endpoints, best of {a.repeat}")
    print(f"  baseline (serialise per stream): {tb * 1000:9.1f} ms  {sb / a.streams / 1024:8.1f} KiB/stream")
    print(f"  ours (serialise once, frame):    {to * 1000:9.1f} ms  {so / a.streams / 1024:8.1f} KiB/stream")
    print(f"  ratio baseline/ours: {tb / to:.1f}x  (bytes equal per stream: {abs(sb - so) < a.streams * 8})")


if __name__ == "__main__":
    main()
