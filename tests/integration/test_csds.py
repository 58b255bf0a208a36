"""CSDS: standard Envoy tooling asks the control plane for each proxy's config status."""

from __future__ import annotations

import grpc
from envoy.admin.v3 import config_dump_shared_pb2
from envoy.config.cluster.v3 import cluster_pb2
from envoy.service.status.v3 import csds_pb2, csds_pb2_grpc
from envoy.type.matcher.v3 import node_pb2, string_pb2

from controlplane.routing.translate import CLUSTER, ENDPOINT, LISTENER, ROUTE
from tests.integration.conftest import Stack
from tests.integration.harness import wait_until

MODELS = {"llama": {"v1": ["l1"], "v2": ["l2"]}}


def fetch(
    stub: csds_pb2_grpc.ClientStatusDiscoveryServiceStub, **kw: object
) -> csds_pb2.ClientStatusResponse:
    return stub.FetchClientStatus(csds_pb2.ClientStatusRequest(**kw), timeout=5)  # type: ignore[arg-type]


def test_csds_reports_each_proxys_resources_and_nacks(stack: Stack) -> None:
    stack.write(MODELS)
    stack.start()
    assert stack.cp is not None
    channel = grpc.insecure_channel(stack.cp.xds)
    stub = csds_pb2_grpc.ClientStatusDiscoveryServiceStub(channel)
    try:

        def synced() -> bool:
            [cfg] = fetch(stub).config
            return {g.config_status for g in cfg.generic_xds_configs} == {csds_pb2.SYNCED}

        wait_until(synced, 5, "every type to be SYNCED")
        [cfg] = fetch(stub).config
        assert cfg.node.id == "envoy-1"
        held = {(g.type_url, g.name) for g in cfg.generic_xds_configs}
        assert {(CLUSTER, "llama@v1"), (CLUSTER, "llama@v2"), (ENDPOINT, "llama@v1")} <= held
        assert (LISTENER, "inference") in held and (ROUTE, "inference") in held
        assert all(g.client_status == config_dump_shared_pb2.ACKED for g in cfg.generic_xds_configs)
        cluster = next(g for g in cfg.generic_xds_configs if g.name == "llama@v1" and g.type_url == CLUSTER)
        c = cluster_pb2.Cluster()
        assert cluster.xds_config.Unpack(c) and c.name == "llama@v1"
        bare = fetch(stub, exclude_resource_contents=True).config[0]
        assert not any(g.HasField("xds_config") for g in bare.generic_xds_configs)
        other = node_pb2.NodeMatcher(node_id=string_pb2.StringMatcher(prefix="sidecar-"))
        assert list(fetch(stub, node_matchers=[other]).config) == []
        mine = node_pb2.NodeMatcher(node_id=string_pb2.StringMatcher(exact="envoy-1"))
        assert len(fetch(stub, node_matchers=[mine]).config) == 1

        # A config Envoy rejects shows as NACKED with Envoy's own message.
        stack.write(MODELS, extra_model_keys={"llama": "cluster_overrides: {connect_timeout: -1s}"})

        def nacked() -> list[csds_pb2.ClientConfig.GenericXdsConfig]:
            [cfg] = fetch(stub).config
            return [g for g in cfg.generic_xds_configs if g.client_status == config_dump_shared_pb2.NACKED]

        wait_until(lambda: bool(nacked()), 5, "the NACK to show")
        [g] = nacked()
        assert g.type_url == CLUSTER and g.config_status == csds_pb2.ERROR
        assert "Expected positive duration" in g.error_state.details
    finally:
        channel.close()
