"""KEDA's external scaler on --scaler-listen (issue 17): a real grpcio client, discovering the
service through server reflection as grpcurl does, against `controlplane serve` scraping an
emulated server. With 40 requests waiting on the model's only server, ceil(value / target)
is at least 2; once the model is idle, IsActive turns false (and StreamIsActive pushes it)
within the idle grace."""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from controlplane.keda import externalscaler_pb2 as pb
from controlplane.keda import externalscaler_pb2_grpc as pb_grpc
from tests.integration.harness import ControlPlane, Emulator, free_port, wait_until


def _reflected_methods(channel: grpc.Channel) -> set[str]:
    """The ExternalScaler's methods, as a reflection client (grpcurl) sees them."""
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    asks = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="externalscaler.ExternalScaler"),
    ]
    listed, described = list(stub.ServerReflectionInfo(iter(asks), timeout=5))
    assert "externalscaler.ExternalScaler" in {s.name for s in listed.list_services_response.service}
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(b)
        for b in described.file_descriptor_response.file_descriptor_proto
    ]
    return {m.name for f in files for s in f.service if s.name == "ExternalScaler" for m in s.method}


def test_keda_reads_desired_replicas_and_activity(tmp_path: Path) -> None:
    server = Emulator("s1", tmp_path, "llama", slots=1, decode_ms_per_token=1, phantom_output_tokens=50)
    config = tmp_path / "fleet.yaml"
    config.write_text(
        f"listener: {{port: {free_port()}}}\n"
        "tiers: {small: {autoscaling: {min: 0, idle_grace: 3s, stable_window: 10s, panic_window: 2s}}}\n"
        "models: {llama: {params_b: 8, stable: v1,\n"
        f"  versions: {{v1: {{endpoints: ['{server.address}']}}}}}}}}\n"
    )
    scaler_port = free_port()
    cp = ControlPlane(config, tmp_path, extra_args=["--scaler-listen", f"127.0.0.1:{scaler_port}"]).start()
    pushed: list[bool] = []
    try:
        with grpc.insecure_channel(f"127.0.0.1:{scaler_port}") as channel:
            assert _reflected_methods(channel) == {
                "IsActive",
                "StreamIsActive",
                "GetMetricSpec",
                "GetMetrics",
            }
            stub = pb_grpc.ExternalScalerStub(channel)
            ref = pb.ScaledObjectRef(name="llama", namespace="models", scalerMetadata={"model": "llama"})

            stream = stub.StreamIsActive(ref, timeout=60)

            def read() -> None:
                with contextlib.suppress(grpc.RpcError):  # cancelled at the end
                    pushed.extend(r.result for r in stream)

            reader = threading.Thread(target=read, daemon=True)
            reader.start()

            server.set_faults(backlog=41)  # 1 running, 40 waiting
            [spec] = stub.GetMetricSpec(ref, timeout=5).metricSpecs
            assert spec.metricName == "desired-replicas-llama" and spec.targetSizeFloat == 1.0

            # As the docs show it: grpcurl, through reflection (no .proto given).
            grpcurl_bin = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or "grpcurl"
            at = f"127.0.0.1:{scaler_port}"
            ref_json = '{"scalerMetadata": {"model": "llama"}}'

            def grpcurl(method: str, data: str) -> dict[str, Any]:
                out = subprocess.run(
                    [grpcurl_bin, "-plaintext", "-d", data, at, f"externalscaler.ExternalScaler/{method}"],
                    capture_output=True,
                    text=True,
                    timeout=20,
                )
                assert out.returncode == 0, out.stderr
                return json.loads(out.stdout)  # type: ignore[no-any-return]

            def grpcurl_wants() -> float:
                target = grpcurl("GetMetricSpec", ref_json)["metricSpecs"][0]["targetSizeFloat"]
                data = f'{{"scaledObjectRef": {ref_json}, "metricName": "desired-replicas-llama"}}'
                value = grpcurl("GetMetrics", data)["metricValues"][0]["metricValueFloat"]
                return math.ceil(value / target)

            def wants() -> float:
                [value] = stub.GetMetrics(
                    pb.GetMetricsRequest(scaledObjectRef=ref, metricName=spec.metricName), timeout=5
                ).metricValues
                return math.ceil(value.metricValueFloat / spec.targetSizeFloat)

            wait_until(lambda: wants() >= 2, 10, "40 waiting requests to want 2 replicas or more")
            assert grpcurl_wants() >= 2
            assert stub.IsActive(ref, timeout=5).result
            assert cp.metric("controlplane_model_desired_replicas", model="llama") >= 2

            server.set_faults(backlog=0)
            took = wait_until(lambda: not stub.IsActive(ref, timeout=5).result, 30, "IsActive to turn false")
            print(f"inactive {took:.1f}s after the backlog was cleared")
            wait_until(lambda: pushed and pushed[-1] is False, 5, "StreamIsActive to push false")
            assert True in pushed  # it said active while the work was there
            assert wants() == 0  # min 0: no replica wanted once idle
            stream.cancel()

            for meta, code in (
                ({}, grpc.StatusCode.INVALID_ARGUMENT),
                ({"model": "nope"}, grpc.StatusCode.NOT_FOUND),
                ({"model": "llama", "version": "v9"}, grpc.StatusCode.NOT_FOUND),
            ):
                with pytest.raises(grpc.RpcError) as e:
                    stub.IsActive(pb.ScaledObjectRef(scalerMetadata=meta), timeout=5)
                assert e.value.code() == code, e.value.details()
                assert "scalerMetadata." in (e.value.details() or "")
    finally:
        cp.stop()
        server.stop()
