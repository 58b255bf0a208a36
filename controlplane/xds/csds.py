"""Client Status Discovery Service (CSDS): each connected proxy's config, as Envoy tooling asks.

`envoy.service.status.v3.ClientStatusDiscoveryService` on the xDS port answers, per
connected stream (node), every resource the proxy has ACKed: its type, name, version, the
client status (ACKED, or NACKED with the error) and the config status of the type (SYNCED,
STALE, NOT_SENT, ERROR for a NACK). Node matchers select proxies by node id (exact, prefix,
suffix, regex). Resource contents are included unless `exclude_resource_contents` is set.
The same registry feeds `cpctl proxies` and `/debug/proxies`.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterable
from typing import Any

from envoy.admin.v3 import config_dump_shared_pb2
from envoy.config.core.v3 import base_pb2
from envoy.service.status.v3 import csds_pb2, csds_pb2_grpc
from envoy.type.matcher.v3 import node_pb2, string_pb2
from google.protobuf import any_pb2

from controlplane.routing.translate import TYPE_URLS
from controlplane.xds.server import ConnectedStream, ProxyRegistry

SERVICE_NAME = "envoy.service.status.v3.ClientStatusDiscoveryService"
_CONFIG_STATUS = {
    "SYNCED": csds_pb2.SYNCED,
    "STALE": csds_pb2.STALE,
    "NOT_SENT": csds_pb2.NOT_SENT,
    "NACKED": csds_pb2.ERROR,
}


def _string_matches(m: string_pb2.StringMatcher, value: str) -> bool:
    kind = m.WhichOneof("match_pattern")
    if kind == "safe_regex":
        return re.fullmatch(m.safe_regex.regex, value) is not None

    def fold(s: str) -> str:
        return s.lower() if m.ignore_case else s

    v = fold(value)
    if kind == "exact":
        return v == fold(m.exact)
    if kind == "prefix":
        return v.startswith(fold(m.prefix))
    if kind == "suffix":
        return v.endswith(fold(m.suffix))
    if kind == "contains":
        return fold(m.contains) in v
    return True  # no pattern: matches everything


def node_matches(matchers: Iterable[node_pb2.NodeMatcher], node_id: str) -> bool:
    """True when any matcher selects the node id (no matchers: every node)."""
    ms = list(matchers)
    return not ms or any(not m.HasField("node_id") or _string_matches(m.node_id, node_id) for m in ms)


def client_config(stream: ConnectedStream, with_contents: bool = True) -> csds_pb2.ClientConfig:
    """One stream's view: per type, each resource the proxy holds."""
    proto = stream.protocol
    cfg = csds_pb2.ClientConfig(
        node=base_pb2.Node(id=proto.node_id, cluster=stream.cluster, user_agent_name=stream.user_agent)
    )
    for type_url in TYPE_URLS:
        ts = proto.types.get(type_url)
        if ts is None or not ts.requested:
            continue
        status = proto.status(type_url)
        config_status = _CONFIG_STATUS.get(status, csds_pb2.UNKNOWN)
        for name, version in sorted(ts.acked.items()):
            g = cfg.generic_xds_configs.add(
                type_url=type_url,
                name=name,
                version_info=version,
                config_status=config_status,
                client_status=config_dump_shared_pb2.ACKED,
            )
            if with_contents:
                res = ts.acked_res.get(name) or proto.snapshot.get(type_url, name)
                if res is not None and res.version == version and res.message is not None:
                    a = any_pb2.Any()
                    a.Pack(res.message)
                    g.xds_config.CopyFrom(a)
        if ts.last_nacked:
            # What it rejected is not held: one entry says so, with the proxy's error.
            g = cfg.generic_xds_configs.add(
                type_url=type_url,
                config_status=csds_pb2.ERROR,
                client_status=config_dump_shared_pb2.NACKED,
            )
            g.error_state.details = ts.last_error
    return cfg


class ClientStatusServer(csds_pb2_grpc.ClientStatusDiscoveryServiceServicer):  # type: ignore[misc]
    def __init__(self, registry: ProxyRegistry) -> None:
        self.registry = registry

    def status(self, request: csds_pb2.ClientStatusRequest) -> csds_pb2.ClientStatusResponse:
        configs = [
            client_config(s, not request.exclude_resource_contents)
            for s in sorted(self.registry.streams.values(), key=lambda s: s.stream_id)
            if node_matches(request.node_matchers, s.protocol.node_id)
        ]
        return csds_pb2.ClientStatusResponse(config=configs)

    async def FetchClientStatus(
        self, request: csds_pb2.ClientStatusRequest, context: Any
    ) -> csds_pb2.ClientStatusResponse:
        return self.status(request)

    async def StreamClientStatus(
        self, request_iterator: AsyncIterator[csds_pb2.ClientStatusRequest], context: Any
    ) -> AsyncIterator[csds_pb2.ClientStatusResponse]:
        async for request in request_iterator:
            yield self.status(request)
