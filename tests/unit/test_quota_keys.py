"""Bucket keys that no name can make collide (issue 41, finding 3; issue 40's status parsing):
Redis keys with each name percent-encoded, parsed back exactly; in memory, (tenant, model,
kind) tuples. And the status's pages (quota/status.py): tokens, sizes, every bucket once."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.fleet.model import QuotaLimit, QuotaSpec
from controlplane.quota.limiter import Limiter
from controlplane.quota.redis_store import bucket_key, parse_bucket_key
from controlplane.quota.status import (
    MAX_PAGE_SIZE,
    PageTokenInvalid,
    QuotaStatus,
    decode_token,
    encode_token,
    memory_page,
)
from controlplane.v1 import quota_pb2

names = st.text(max_size=40)


def test_the_findings_names_are_four_keys() -> None:
    pairs = [("llama3", "8b:acme"), ("llama3:8b", "acme"), ("llama3", "8b%3Aacme"), ("llama3%3A8b", "acme")]
    keys = {bucket_key("requests", m, t) for m, t in pairs}
    assert len(keys) == 4
    assert bucket_key("requests", "llama3:8b", "acme") == "quota2:requests:llama3%3A8b:acme"
    for m, t in pairs:
        assert parse_bucket_key(bucket_key("tokens", m, t)) == ("tokens", m, t)


@given(st.sampled_from(["requests", "tokens"]), names, names)
def test_every_key_parses_back_to_its_names(kind: str, model: str, tenant: str) -> None:
    key = bucket_key(kind, model, tenant)
    assert key.count(":") == 3  # every ':' of a name is encoded
    assert parse_bucket_key(key) == (kind, model, tenant)


@given(names, names, names, names)
def test_different_names_never_share_a_key(m1: str, t1: str, m2: str, t2: str) -> None:
    if (m1, t1) != (m2, t2):
        assert bucket_key("requests", m1, t1) != bucket_key("requests", m2, t2)


@pytest.mark.parametrize(
    "key",
    [
        "quota:requests:llama3:8b:acme",  # the old scheme: never read, expires on its own
        "quota2:requests:a:b:c",
        "quota2:bogus:a:b",
        "quota2:requests:a b:c",  # a byte _encode would have encoded
        "quota2:requests:a%3a:c",  # lower-case escape: not one _encode made
        "quota2:requests:a%2:c",
        "other:key",
    ],
)
def test_keys_the_store_did_not_make_are_ignored(key: str) -> None:
    assert parse_bucket_key(key) is None


def test_memory_buckets_are_tuples_so_colons_cannot_collide() -> None:
    q = QuotaSpec(default=QuotaLimit(requests_per_minute=6), endpoints=(("127.0.0.1", 1),))
    limiter = Limiter(q)
    assert [limiter.check("8b:acme", "llama3", now=0.0).allowed for _ in range(7)][-1] is False
    assert limiter.check("acme", "llama3:8b", now=0.0).remaining == 5


@given(
    st.sets(
        st.tuples(
            st.sampled_from(["", "a", "b:c", "d"]),
            st.sampled_from(["m", "m:1"]),
            st.sampled_from(["requests", "tokens"]),
        )
    ),
    st.integers(1, 5),
    st.sampled_from([None, "a", "b:c"]),
)
def test_memory_pages_give_every_bucket_once_in_order(
    keys: set[tuple[str, str, str]], size: int, tenant: str | None
) -> None:
    seen: list[tuple[str, str, str]] = []
    after = None
    while True:
        page, more = memory_page(keys, tenant, after, size)
        assert len(page) <= size
        seen += page
        if not more:
            break
        after = page[-1]
    assert seen == sorted(k for k in keys if tenant is None or k[0] == tenant)


def test_page_tokens_round_trip_and_strangers_are_refused() -> None:
    assert decode_token(encode_token({"cursor": 5})) == {"cursor": 5}
    for bad in ("!!", "bm90IGpzb24", "bm90IGpzb24=", "x" * 9000):  # not base64, not JSON, too long
        with pytest.raises(PageTokenInvalid):
            decode_token(bad)
    import base64

    with pytest.raises(PageTokenInvalid):
        decode_token(base64.urlsafe_b64encode(b"[1, 2]").decode())  # JSON, but not an object


class Context:
    """What the servicer reads of a grpc.aio context, and its abort."""

    def __init__(self, token: str) -> None:
        self.metadata = (("authorization", f"Bearer {token}"),)

    def invocation_metadata(self) -> Any:
        return self.metadata

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code


class Service:
    def __init__(self, limiter: Limiter) -> None:
        self.limiter = limiter
        self.store = None
        self.token: str | None = "t0k"


def call(service: Service, token: str = "t0k", **request: Any) -> quota_pb2.QuotaStatusResponse:
    return asyncio.run(QuotaStatus(service).Status(quota_pb2.QuotaStatusRequest(**request), Context(token)))


def test_the_status_rpc_pages_checks_its_token_and_names_bad_fields() -> None:
    q = QuotaSpec(default=QuotaLimit(requests_per_minute=6), endpoints=(("127.0.0.1", 1),))
    limiter = Limiter(q)
    import time

    now = time.monotonic()
    for i in range(2500):
        limiter.check(f"t{i:04d}", "chat", now)
    service = Service(limiter)
    rows, token, pages = [], "", 0
    while True:
        got = call(service, page_size=5000, page_token=token)  # more than the most: the most
        assert len(got.buckets) <= MAX_PAGE_SIZE
        rows += got.buckets
        pages += 1
        token = got.next_page_token
        if not token:
            break
    assert pages == 3 and len({r.tenant for r in rows}) == 2500
    assert rows[0].limit_per_minute == 6 and rows[0].remaining == 5
    assert [r.tenant for r in call(service, tenant="t0007").buckets] == ["t0007"]
    with pytest.raises(Aborted, match="UNAUTHENTICATED: a wrong or missing bearer token"):
        call(service, token="nope")
    with pytest.raises(Aborted, match="INVALID_ARGUMENT: page_token: not a token this service gave"):
        call(service, page_token="garbage")
    with pytest.raises(Aborted, match="INVALID_ARGUMENT: page_token: a token of a service on Redis"):
        call(service, page_token=encode_token({"cursor": 7}))
    with pytest.raises(Aborted, match="INVALID_ARGUMENT: tenant: longer than 256 bytes"):
        call(service, tenant="x" * 300)
    service.token = None
    with pytest.raises(Aborted, match="UNAUTHENTICATED: status needs a token"):
        call(service)
