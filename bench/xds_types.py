"""Build and serialise one 2,000-endpoint ClusterLoadAssignment with each Python binding of
the Envoy API: xds-protos (protobuf's C implementation, what the control plane uses) and
envoy-data-plane (betterproto2 dataclasses). Prints the time of each and their ratio,
measured in the same run, and checks the bytes are identical.

    .venv/bin/pip install -e '.[bench]'      # adds envoy-data-plane
    .venv/bin/python bench/xds_types.py
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

ENDPOINTS = 2000
ROUNDS = 7


def with_xds_protos() -> bytes:
    from envoy.config.core.v3 import address_pb2
    from envoy.config.endpoint.v3 import endpoint_pb2

    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name="llama-3-8b@v1")
    loc = cla.endpoints.add()
    for i in range(ENDPOINTS):
        lb = loc.lb_endpoints.add()
        lb.endpoint.address.socket_address.CopyFrom(
            address_pb2.SocketAddress(address=f"10.{i // 250}.{i % 250}.1", port_value=8000)
        )
        lb.load_balancing_weight.value = 1 + i % 100
    return cla.SerializeToString(deterministic=True)


def with_envoy_data_plane() -> bytes:
    from envoy_data_plane.envoy.config.core.v3 import Address, SocketAddress
    from envoy_data_plane.envoy.config.endpoint.v3 import (
        ClusterLoadAssignment,
        Endpoint,
        LbEndpoint,
        LocalityLbEndpoints,
    )

    eps = [
        LbEndpoint(
            endpoint=Endpoint(
                address=Address(
                    socket_address=SocketAddress(address=f"10.{i // 250}.{i % 250}.1", port_value=8000)
                )
            ),
            load_balancing_weight=1 + i % 100,
        )
        for i in range(ENDPOINTS)
    ]
    cla = ClusterLoadAssignment(
        cluster_name="llama-3-8b@v1", endpoints=[LocalityLbEndpoints(lb_endpoints=eps)]
    )
    return bytes(cla)


def timed(fn: Callable[[], bytes]) -> tuple[float, bytes]:
    out = fn()  # warm: imports, caches
    times = []
    for _ in range(ROUNDS):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main() -> int:
    try:
        import envoy_data_plane  # noqa: F401
    except ImportError:
        print(
            "bench/xds_types.py: needs envoy-data-plane: .venv/bin/pip install -e '.[bench]'", file=sys.stderr
        )
        return 2
    base_s, base = timed(with_xds_protos)
    other_s, other = timed(with_envoy_data_plane)
    print(f"{ENDPOINTS}-endpoint ClusterLoadAssignment, build + serialise, median of {ROUNDS}:")
    print(f"  xds-protos        {base_s * 1000:8.1f} ms")
    print(f"  envoy-data-plane  {other_s * 1000:8.1f} ms   ({other_s / base_s:.0f}x xds-protos)")
    print(f"  identical bytes: {base == other} ({len(base)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
