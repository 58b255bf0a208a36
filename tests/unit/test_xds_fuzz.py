"""Property-based fuzzing of the per-stream xDS protocol (issue 16): any sequence of requests
(state of the world or delta; any type URL, names, nonces, NACKs, node ids) is answered with
protocol events, never an exception, and what a stream holds stays within its bounds."""

from __future__ import annotations

import os

from envoy.service.discovery.v3 import discovery_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.routing.translate import CLUSTER, ENDPOINT, LISTENER, ROUTE
from controlplane.xds.events import (
    Ack,
    Nack,
    NackCleared,
    NodeIdentified,
    Refused,
    Send,
    StaleNonce,
    UnknownType,
)
from controlplane.xds.protocol import MAX_NAMES_PER_TYPE, XdsStream
from tests.unit.test_xds_protocol import ONE, TWO, snap

N = int(os.environ.get("FUZZ_EXAMPLES", "200"))
TYPES = [CLUSTER, ENDPOINT, LISTENER, ROUTE, "", "type.googleapis.com/x.Unknown", "\x00" * 3]
NAMES = ["a@v1", "b@v1", "*", "", "inference", "nope", "a@v1\x00", "x" * 300]
EVENTS = (Send, Ack, Nack, NackCleared, StaleNonce, UnknownType, NodeIdentified, Refused)

request = st.fixed_dictionaries(
    {
        "type_url": st.sampled_from(TYPES),
        "names": st.lists(st.sampled_from(NAMES), max_size=5),
        "unsubscribe": st.lists(st.sampled_from(NAMES), max_size=3),
        "nonce": st.one_of(st.just(""), st.just("latest"), st.text(max_size=8)),
        "error": st.one_of(st.just(""), st.text(max_size=20)),
        "node": st.one_of(st.just(""), st.sampled_from(["n1", "n2"]), st.text(max_size=10)),
        "initial": st.dictionaries(st.sampled_from(NAMES), st.text(max_size=6), max_size=3),
    }
)


def build(r: dict[str, object], delta: bool, latest: str) -> object:
    nonce = latest if r["nonce"] == "latest" else str(r["nonce"])
    if delta:
        m = discovery_pb2.DeltaDiscoveryRequest(
            type_url=str(r["type_url"]),
            resource_names_subscribe=list(r["names"]),  # type: ignore[call-overload]
            resource_names_unsubscribe=list(r["unsubscribe"]),  # type: ignore[call-overload]
            initial_resource_versions=dict(r["initial"]),  # type: ignore[call-overload]
            response_nonce=nonce,
        )
    else:
        m = discovery_pb2.DiscoveryRequest(
            type_url=str(r["type_url"]),
            resource_names=list(r["names"]),  # type: ignore[call-overload]
            response_nonce=nonce,
        )
    if r["error"]:
        m.error_detail.code = 3
        m.error_detail.message = str(r["error"])
    if r["node"]:
        m.node.id = str(r["node"])
    return m


@settings(max_examples=N, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.booleans(), st.lists(st.one_of(request, st.sampled_from(["snap1", "snap2"])), max_size=25))
def test_any_request_sequence_gets_protocol_events(delta: bool, steps: list[object]) -> None:
    s = XdsStream(snap(ONE), delta=delta)
    latest = ""
    gen = 1
    for t, step in enumerate(steps):
        if step in ("snap1", "snap2"):
            gen += 1
            events = s.set_snapshot(snap(ONE if step == "snap1" else TWO, gen=gen), float(t))
        else:
            events = s.receive(build(step, delta, latest), float(t))  # type: ignore[arg-type]
        assert all(isinstance(e, EVENTS) for e in events)
        for e in events:
            if isinstance(e, Send):
                latest = e.nonce
            if isinstance(e, Refused):
                return  # the stream ends there
        for ts in s.types.values():
            assert len(ts.names) <= MAX_NAMES_PER_TYPE
            assert len(ts.last_error or "") < 5000
