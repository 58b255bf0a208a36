"""picker/request.py: what an ext_proc message asks, read within the bounds (pure)."""

from __future__ import annotations

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane import limits
from controlplane.picker.request import (
    CLUSTER,
    CLUSTER_ATTRIBUTE,
    PREFIX,
    PREFIX_KEY,
    REQUEST_ID_MAX_CHARS,
    SUBSET,
    SUBSET_HEADER,
    Ask,
    Refused,
    read_ask,
)
from controlplane.resources.names import METADATA_NS, SUBSET_METADATA_NS

FILTER = "envoy.filters.http.ext_proc"


def message(
    cluster: str | None = "m@v1",
    prefix: str | None = None,
    subset_list: list[str] | None = None,
    subset_text: str | None = None,
    headers: dict[str, bytes] | None = None,
) -> ep.ProcessingRequest:
    req = ep.ProcessingRequest(request_headers=ep.HttpHeaders())
    if cluster is not None:
        req.attributes[FILTER].fields[CLUSTER_ATTRIBUTE].string_value = cluster
    if prefix is not None:
        req.metadata_context.filter_metadata[METADATA_NS].fields[PREFIX_KEY].string_value = prefix
    if subset_list is not None:
        value = req.metadata_context.filter_metadata[SUBSET_METADATA_NS].fields[SUBSET_HEADER]
        value.list_value.CopyFrom(
            struct_pb2.ListValue(values=[struct_pb2.Value(string_value=a) for a in subset_list])
        )
    if subset_text is not None:
        req.metadata_context.filter_metadata[SUBSET_METADATA_NS].fields[
            SUBSET_HEADER
        ].string_value = subset_text
    for key, raw in (headers or {}).items():
        req.request_headers.headers.headers.add(key=key, raw_value=raw)
    return req


def test_what_a_request_asks() -> None:
    got = read_ask(
        message(
            prefix="You are a helpful assistant",
            headers={"x-request-id": b"r-1", SUBSET_HEADER: b" 127.0.0.1:1, 127.0.0.1:2 ,,"},
        )
    )
    assert got == Ask("m@v1", "You are a helpful assistant", frozenset({"127.0.0.1:1", "127.0.0.1:2"}), "r-1")
    assert read_ask(message(cluster=None)) == Ask("")
    assert read_ask(message(headers={SUBSET_HEADER: b" , "})) == Ask("m@v1")  # names none: no hint


def test_the_subset_hint_from_metadata_wins_over_the_header() -> None:
    got = read_ask(message(subset_list=["127.0.0.1:3"], headers={SUBSET_HEADER: b"127.0.0.1:4"}))
    assert isinstance(got, Ask) and got.subset == {"127.0.0.1:3"}
    got = read_ask(message(subset_text="127.0.0.1:5,127.0.0.1:6"))
    assert isinstance(got, Ask) and got.subset == {"127.0.0.1:5", "127.0.0.1:6"}


def test_a_prefix_key_up_to_its_bound_is_taken_one_byte_more_is_refused() -> None:
    cap = limits.PICKER_PREFIX_KEY_MAX_BYTES
    at = read_ask(message(prefix="x" * cap))
    assert isinstance(at, Ask) and len(at.prefix) == cap
    assert read_ask(message(prefix="x" * (cap + 1))) == Refused(PREFIX, f"more than {cap} bytes")
    # Counted in bytes: a key of few characters but many bytes is refused too.
    wide = "\u20ac" * (cap // 3 + 1)  # 3 bytes each
    assert len(wide) <= cap
    got = read_ask(message(prefix=wide))
    assert isinstance(got, Refused) and got.input == PREFIX


@pytest.mark.parametrize(
    "kw",
    [
        {"subset_list": [f"127.0.0.1:{p}" for p in range(limits.PICKER_SUBSET_MAX_ADDRESSES + 1)]},
        {"subset_text": ",".join(f"127.0.0.1:{p}" for p in range(limits.PICKER_SUBSET_MAX_ADDRESSES + 1))},
        {"headers": {SUBSET_HEADER: b"127.0.0.1:1," * (limits.PICKER_SUBSET_MAX_ADDRESSES + 1)}},
        {"subset_list": ["127.0.0.1:1" + " " * limits.PICKER_SUBSET_MAX_BYTES]},
        {"subset_text": "x" * (limits.PICKER_SUBSET_MAX_BYTES + 1)},
        {"headers": {SUBSET_HEADER: b"y" * (3 << 20)}},  # a 3 MB header
        {"headers": {SUBSET_HEADER: b"," * (limits.PICKER_SUBSET_MAX_ADDRESSES + 1)}},
    ],
    ids=["list", "text", "header", "list-bytes", "text-bytes", "3MB-header", "commas"],
)
def test_a_subset_hint_past_its_bounds_is_refused_however_it_comes(kw: dict[str, object]) -> None:
    got = read_ask(message(**kw))  # type: ignore[arg-type]
    assert isinstance(got, Refused) and got.input == SUBSET, got


def test_the_largest_subset_hint_allowed_is_taken() -> None:
    n = limits.PICKER_SUBSET_MAX_ADDRESSES
    got = read_ask(message(subset_list=[f"127.0.0.{p % 250}:{p}" for p in range(n)]))
    assert isinstance(got, Ask) and got.subset is not None and len(got.subset) == n


def test_a_cluster_name_past_its_bound_is_refused_and_a_request_id_is_cut() -> None:
    n = limits.PICKER_CLUSTER_MAX_CHARS
    assert isinstance(read_ask(message(cluster="c" * n)), Ask)
    assert read_ask(message(cluster="c" * (n + 1))).input == CLUSTER  # type: ignore[union-attr]
    got = read_ask(message(headers={"x-request-id": b"r" * 10_000}))
    assert isinstance(got, Ask) and got.request_id == "r" * REQUEST_ID_MAX_CHARS


def test_ten_thousand_headers_and_binary_values_are_read_without_error() -> None:
    headers = {f"h-{i}": b"v" for i in range(10_000)}
    headers[SUBSET_HEADER] = b"\xff\xfe127.0.0.1:1"
    got = read_ask(message(headers=headers))
    assert isinstance(got, Ask) and got.subset is not None and len(got.subset) == 1


@settings(max_examples=200, deadline=None)
@given(
    cluster=st.one_of(st.none(), st.text(max_size=40)),
    prefix=st.one_of(st.none(), st.text(max_size=200)),
    subset=st.one_of(st.none(), st.lists(st.text(max_size=30), max_size=20)),
    header=st.one_of(st.none(), st.binary(max_size=300)),
)
def test_any_message_is_an_ask_or_a_refusal_never_an_error(
    cluster: str | None, prefix: str | None, subset: list[str] | None, header: bytes | None
) -> None:
    req = message(cluster, prefix, subset, headers={SUBSET_HEADER: header} if header is not None else None)
    got = read_ask(req)
    assert isinstance(got, Ask | Refused)
    if isinstance(got, Ask):
        assert got.subset is None or (got.subset and all(a == a.strip() and a for a in got.subset))


def test_an_empty_message_asks_nothing() -> None:
    assert read_ask(ep.ProcessingRequest()) == Ask("")
