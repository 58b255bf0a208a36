"""CSDS: standard Envoy tooling asks the control plane for each proxy's config status."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from envoy.admin.v3 import config_dump_shared_pb2
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from envoy.service.status.v3 import csds_pb2, csds_pb2_grpc
from envoy.type.matcher.v3 import node_pb2, regex_pb2, string_pb2, struct_pb2, value_pb2

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

        # Envoy refuses such a response whole, naming nothing: the control plane finds the
        # rejected clusters (re-sending the changes half at a time) and names each.
        wait_until(
            lambda: {g.name for g in nacked()} == {"llama@v1", "llama@v2"}, 10, "the NACKs to name both"
        )
        for g in nacked():
            assert g.type_url == CLUSTER and g.config_status == csds_pb2.ERROR
            assert "Expected positive duration" in g.error_state.details
            assert g.error_state.version_info  # the version it refused
    finally:
        channel.close()


def by_regex(pattern: str) -> node_pb2.NodeMatcher:
    return node_pb2.NodeMatcher(
        node_id=string_pb2.StringMatcher(safe_regex=regex_pb2.RegexMatcher(regex=pattern))
    )


def by_role(role: str) -> node_pb2.NodeMatcher:
    path = [struct_pb2.StructMatcher.PathSegment(key="role")]
    value = value_pb2.ValueMatcher(string_match=string_pb2.StringMatcher(exact=role))
    return node_pb2.NodeMatcher(node_metadatas=[struct_pb2.StructMatcher(path=path, value=value)])


def invalid_argument(call: Callable[[], object]) -> str:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    return str(e.value.details())


def test_csds_node_matchers_use_re2_and_node_metadata(stack: Stack) -> None:
    """A regex that backtracks for minutes in Python's re answers at once; bad ones are refused."""
    stack.write(MODELS)
    stack.start()
    assert stack.cp is not None
    channel = grpc.insecure_channel(stack.cp.xds)
    stub = csds_pb2_grpc.ClientStatusDiscoveryServiceStub(channel)
    long_id = "a" * 40  # (a+)+b against it: 2**40 paths for a backtracking engine
    probe_node = base_pb2.Node(id=long_id)
    probe_node.metadata.update({"role": "probe", "gpus": 8})
    done = threading.Event()

    def probe_requests() -> Iterator[discovery_pb2.DiscoveryRequest]:
        yield discovery_pb2.DiscoveryRequest(node=probe_node, type_url=CLUSTER)
        done.wait(30)  # holds the stream open, as a proxy does

    probe = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources(probe_requests())
    try:

        def ids(**kw: object) -> list[str]:
            return sorted(c.node.id for c in fetch(stub, **kw).config)

        wait_until(lambda: ids() == sorted(["envoy-1", long_id]), 5, "Envoy and the probe stream")

        started = time.perf_counter()
        assert ids(node_matchers=[by_regex("(a+)+b")]) == []
        assert time.perf_counter() - started < 1.0  # the backtracking engine takes minutes
        assert ids(node_matchers=[by_regex("(a+)+")]) == [long_id]
        assert ids(node_matchers=[by_regex(r"\pL+-\d")]) == ["envoy-1"]  # RE2 syntax, not Python's

        details = invalid_argument(lambda: fetch(stub, node_matchers=[by_regex(r"(a)\1")]))
        assert details.startswith("node_matchers[0].node_id.safe_regex.regex: invalid RE2 regex")
        assert "invalid escape sequence" in details
        details = invalid_argument(lambda: fetch(stub, node_matchers=[by_regex("a" * 1025)]))
        assert "1025 characters, longer than the limit of 1024" in details

        # Node metadata selects the probe (and not Envoy, which sends none); AND with the id.
        assert ids(node_matchers=[by_role("probe")]) == [long_id]
        assert ids(node_matchers=[by_role("gateway")]) == []
        both = by_role("probe")
        both.node_id.CopyFrom(string_pb2.StringMatcher(prefix="envoy-"))
        assert ids(node_matchers=[both]) == []
        empty_value = node_pb2.NodeMatcher(
            node_metadatas=[struct_pb2.StructMatcher(path=[struct_pb2.StructMatcher.PathSegment(key="role")])]
        )
        details = invalid_argument(lambda: fetch(stub, node_matchers=[empty_value]))
        assert details == "node_matchers[0].node_metadatas[0].value: required"

        # The stream form answers good requests and ends with INVALID_ARGUMENT on a bad one.
        requests = [
            csds_pb2.ClientStatusRequest(node_matchers=[by_role("probe")]),
            csds_pb2.ClientStatusRequest(node_matchers=[by_regex("(")]),
        ]
        answers = stub.StreamClientStatus(iter(requests), timeout=5)
        first = next(answers)
        assert [c.node.id for c in first.config] == [long_id]
        details = invalid_argument(lambda: next(answers))
        assert details.startswith("node_matchers[0].node_id.safe_regex.regex: invalid RE2 regex '('")
        # The probe's xDS stream is untouched by the refusals.
        assert ids(node_matchers=[by_regex("a{40}")]) == [long_id]
    finally:
        done.set()
        probe.cancel()
        channel.close()
