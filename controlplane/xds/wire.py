"""Hand-rolled protobuf framing for xDS responses.

A resource is serialised once per version; a response to any stream is then the
concatenation of pre-encoded fields plus a small header (version, type, nonce).
The bytes equal what DiscoveryResponse.SerializeToString would produce.
"""

from __future__ import annotations

from collections.abc import Iterable

_LEN = 2  # wire type: length-delimited


def varint(n: int) -> bytes:
    """Protobuf base-128 varint of a non-negative int."""
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (string, bytes or sub-message)."""
    return varint(number << 3 | _LEN) + varint(len(payload)) + payload


def string_field(number: int, text: str) -> bytes:
    """A string field, omitted when empty, as proto3 does."""
    return field(number, text.encode()) if text else b""


def any_bytes(type_url: str, value: bytes) -> bytes:
    """google.protobuf.Any{type_url, value}."""
    return string_field(1, type_url) + (field(2, value) if value else b"")


def sotw_resource_field(any_payload: bytes) -> bytes:
    """DiscoveryResponse.resources (field 2) entry."""
    return field(2, any_payload)


def delta_resource_field(name: str, version: str, any_payload: bytes) -> bytes:
    """DeltaDiscoveryResponse.resources (field 2) entry: Resource{version=1, resource=2, name=3}."""
    return field(2, string_field(1, version) + field(2, any_payload) + string_field(3, name))


def sotw_response(version: str, type_url: str, nonce: str, resources: Iterable[bytes]) -> bytes:
    """A serialised DiscoveryResponse from pre-encoded resource fields."""
    return b"".join((string_field(1, version), *resources, string_field(4, type_url), string_field(5, nonce)))


def delta_response(
    system_version: str,
    type_url: str,
    nonce: str,
    resources: Iterable[bytes],
    removed: Iterable[str],
) -> bytes:
    """A serialised DeltaDiscoveryResponse from pre-encoded resource fields."""
    return b"".join(
        (
            string_field(1, system_version),
            *resources,
            string_field(4, type_url),
            string_field(5, nonce),
            *(string_field(6, name) for name in removed),
        )
    )
