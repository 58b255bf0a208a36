"""A proxyless gRPC client (grpcio's own xDS support) for the integration tests.

Usage: GRPC_XDS_BOOTSTRAP=... python grpc_xds_client.py TARGET SERVICE [SERVICE...]
For each SERVICE in turn it calls grpc.health.v1 Check(service=SERVICE) on TARGET until a
backend that registered SERVICE answers SERVING, prints "reached SERVICE", then waits for a
line on stdin before going on to the next one.
"""

from __future__ import annotations

import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main() -> int:
    target, services = sys.argv[1], sys.argv[2:]
    channel = grpc.insecure_channel(target)
    stub = health_pb2_grpc.HealthStub(channel)
    for i, service in enumerate(services):
        deadline = time.monotonic() + 20
        while True:
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.RpcError as e:
                if time.monotonic() > deadline:
                    print(f"failed {service}: {e.code()} {e.details()}", flush=True)
                    return 1
            time.sleep(0.05)
        print(f"reached {service}", flush=True)
        if i + 1 < len(services):
            sys.stdin.readline()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
