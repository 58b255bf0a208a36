from __future__ import annotations

from envoy.service.discovery.v3 import discovery_pb2
from hypothesis import given
from hypothesis import strategies as st

from controlplane.xds import wire

names = st.text(min_size=1, max_size=30)
payloads = st.binary(max_size=300)


@given(st.integers(0, 2**64 - 1))
def test_varint_round_trips_through_protobuf(n: int) -> None:
    from google.protobuf.internal import decoder

    value, pos = decoder._DecodeVarint(wire.varint(n), 0)
    assert (value, pos) == (n, len(wire.varint(n)))


@given(st.text(max_size=20), names, st.text(max_size=10), st.lists(st.tuples(names, payloads), max_size=5))
def test_sotw_response_equals_protobuf_serialisation(
    version: str, type_url: str, nonce: str, resources: list[tuple[str, bytes]]
) -> None:
    ours = wire.sotw_response(
        version, type_url, nonce, [wire.sotw_resource_field(wire.any_bytes(t, v)) for t, v in resources]
    )
    msg = discovery_pb2.DiscoveryResponse(version_info=version, type_url=type_url, nonce=nonce)
    for t, v in resources:
        msg.resources.add(type_url=t, value=v)
    assert discovery_pb2.DiscoveryResponse.FromString(ours) == msg
    assert ours == msg.SerializeToString()


@given(
    st.text(max_size=20),
    names,
    st.text(max_size=10),
    st.lists(st.tuples(names, st.text(max_size=8), names, payloads), max_size=5),
    st.lists(names, max_size=3),
)
def test_delta_response_equals_protobuf_serialisation(
    version: str, type_url: str, nonce: str, resources: list[tuple[str, str, str, bytes]], removed: list[str]
) -> None:
    ours = wire.delta_response(
        version,
        type_url,
        nonce,
        [wire.delta_resource_field(n, ver, wire.any_bytes(t, v)) for n, ver, t, v in resources],
        removed,
    )
    msg = discovery_pb2.DeltaDiscoveryResponse(
        system_version_info=version, type_url=type_url, nonce=nonce, removed_resources=removed
    )
    for n, ver, t, v in resources:
        r = msg.resources.add(name=n, version=ver)
        r.resource.type_url = t
        r.resource.value = v
    assert discovery_pb2.DeltaDiscoveryResponse.FromString(ours) == msg


# ---- the per-stream inbox ------------------------------------------------------------------


def test_the_inbox_stops_reading_at_its_byte_bound_and_resumes_when_drained() -> None:
    """Requests read ahead are bounded in bytes, not only in count: 64 requests of 4 MB each
    would be 256 MB per stream (a client that does not read its responses grew us 220 MB)."""
    from envoy.service.discovery.v3 import discovery_pb2

    from controlplane.xds.server import Inbox

    inbox = Inbox(max_requests=64, max_bytes=1 << 20)
    big = discovery_pb2.DiscoveryRequest(type_url="t", resource_names=["x" * 1000] * 400)  # ~400 KB
    inbox.put(big)
    inbox.put(big)
    assert inbox.room.is_set()
    inbox.put(big)  # past 1 MiB: no more is read until the protocol takes these
    assert not inbox.room.is_set() and inbox.bytes >= 1 << 20
    inbox.drained()
    assert not inbox.room.is_set()  # nothing taken yet
    while inbox:
        assert inbox.take() is big
    inbox.drained()
    assert inbox.room.is_set() and inbox.bytes == 0


def test_the_inbox_still_bounds_the_count_of_small_requests() -> None:
    from envoy.service.discovery.v3 import discovery_pb2

    from controlplane.xds.server import Inbox

    inbox = Inbox(max_requests=3, max_bytes=1 << 20)
    for _ in range(3):
        inbox.put(discovery_pb2.DiscoveryRequest(type_url="t"))
    assert not inbox.room.is_set() and len(inbox) == 3
