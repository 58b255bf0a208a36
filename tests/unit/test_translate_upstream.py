"""Envoy never sends a request on a connection a server is closing (issue 32): every generated
cluster closes idle upstream connections before the servers do (Envoy's own default keeps them
an hour), and an HTTP/1 model cluster carries one request per connection (llama.cpp closes its
connection after every streamed response). A request that meets such a close fails with a 503
that is not retried (tests/integration/test_upstream_connections.py)."""

from __future__ import annotations

from envoy.config.cluster.v3 import cluster_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2

from controlplane.fleet import parse_fleet
from controlplane.resources import names
from controlplane.routing.clusters import (
    HTTP_PROTOCOL_OPTIONS,
    UPSTREAM_HTTP1_REQUESTS_PER_CONNECTION,
    UPSTREAM_IDLE_TIMEOUT_S,
)
from controlplane.routing.incremental import IncrementalTranslator
from controlplane.routing.translate import CLUSTER, RoutingOverlay, translate
from tests.fleets import BASIC

# The keep-alive timeout of cpp-httplib (llama.cpp's server) and uvicorn (vLLM, SGLang).
SERVER_KEEP_ALIVE_S = 5.0


def _options(c: object) -> http_protocol_options_pb2.HttpProtocolOptions:
    assert isinstance(c, cluster_pb2.Cluster)
    opts = http_protocol_options_pb2.HttpProtocolOptions()
    assert c.typed_extension_protocol_options[HTTP_PROTOCOL_OPTIONS].Unpack(opts)
    return opts


def _idle_s(opts: http_protocol_options_pb2.HttpProtocolOptions) -> float:
    assert opts.common_http_protocol_options.HasField("idle_timeout")
    return opts.common_http_protocol_options.idle_timeout.ToNanoseconds() / 1e9


def test_every_cluster_closes_idle_connections_before_the_servers_keep_alive_ends() -> None:
    text = BASIC + "  grpc-model:\n    params_b: 1\n    protocol: http2\n    stable: v1\n"
    text += "    versions:\n      v1:\n        endpoints: [{address: 127.0.0.1:8201}]\n"
    overlay = RoutingOverlay(hold_address="127.0.0.1:18002")
    clusters = translate(parse_fleet(text), overlay=overlay).by_type[CLUSTER]
    assert set(clusters) == {"llama-3-8b@v1", "llama-3-8b@v2", "grpc-model@v1", names.HOLD_CLUSTER}
    assert 0 < UPSTREAM_IDLE_TIMEOUT_S <= SERVER_KEEP_ALIVE_S - 1.0  # a margin for latency
    for name, c in clusters.items():
        opts = _options(c)
        assert _idle_s(opts) == UPSTREAM_IDLE_TIMEOUT_S, name
        # The protocol is stated (Envoy requires it with these options): HTTP/1.1 by default.
        if name == "grpc-model@v1":
            assert opts.explicit_http_config.HasField("http2_protocol_options")
        else:
            assert opts.explicit_http_config.HasField("http_protocol_options"), name


def test_http1_model_clusters_carry_one_request_per_connection() -> None:
    """Not HTTP/2 (multiplexed; a server closes it with GOAWAY), nor the holding service's
    cluster (aiohttp keeps its connections after every response)."""
    text = BASIC + "  grpc-model:\n    params_b: 1\n    protocol: http2\n    stable: v1\n"
    text += "    versions:\n      v1:\n        endpoints: [{address: 127.0.0.1:8201}]\n"
    overlay = RoutingOverlay(hold_address="127.0.0.1:18002")
    clusters = translate(parse_fleet(text), overlay=overlay).by_type[CLUSTER]
    assert UPSTREAM_HTTP1_REQUESTS_PER_CONNECTION == 1
    per_connection = {
        name: _options(c).common_http_protocol_options.max_requests_per_connection.value
        for name, c in clusters.items()
    }
    assert per_connection == {
        "llama-3-8b@v1": 1,
        "llama-3-8b@v2": 1,
        "grpc-model@v1": 0,
        names.HOLD_CLUSTER: 0,
    }


def test_incremental_translation_gives_the_same_clusters() -> None:
    fleet = parse_fleet(BASIC)
    full = translate(fleet).by_type[CLUSTER]
    inc = IncrementalTranslator().translate(fleet, {}).by_type[CLUSTER]
    assert {n: c.SerializeToString(deterministic=True) for n, c in inc.items()} == {
        n: c.SerializeToString(deterministic=True) for n, c in full.items()
    }


def test_a_model_behind_a_shorter_keep_alive_sets_its_own_through_cluster_overrides() -> None:
    """An operator whose servers close idle connections sooner (gunicorn: 2 s), or who wants
    connections reused, overrides the whole protocol options entry: a map entry is replaced,
    not merged."""
    override = (
        "stable: v1\n    cluster_overrides:\n      typed_extension_protocol_options:\n"
        f"        {HTTP_PROTOCOL_OPTIONS}:\n"
        f'          "@type": type.googleapis.com/{HTTP_PROTOCOL_OPTIONS}\n'
        "          common_http_protocol_options: {idle_timeout: 1.5s}\n"
        "          explicit_http_config: {http_protocol_options: {}}"
    )
    c = translate(parse_fleet(BASIC.replace("stable: v1", override))).by_type[CLUSTER]["llama-3-8b@v1"]
    opts = _options(c)
    assert _idle_s(opts) == 1.5
    assert opts.explicit_http_config.HasField("http_protocol_options")
    assert not opts.common_http_protocol_options.HasField("max_requests_per_connection")  # reused
