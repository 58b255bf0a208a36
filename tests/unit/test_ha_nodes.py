"""The published form of the node ids a replica serves (controlplane/ha/nodes.py), which
lets a load report reach another replica than its proxy's xDS stream and still count."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from controlplane.ha.nodes import DIGEST, NODES_MAX_PUBLISHED, decode, digest, encode


@given(st.sets(st.text(max_size=50), max_size=50), st.text(max_size=50))
def test_a_published_set_answers_membership(nodes: set[str], other: str) -> None:
    peers = decode(encode(nodes))
    assert all(digest(n) in peers for n in nodes)
    assert (digest(other) in peers) == (other in nodes)  # 64-bit digests: no collision here
    assert len(encode(nodes)) == DIGEST * len(nodes)


def test_a_torn_or_foreign_value_gives_only_whole_digests() -> None:
    assert decode(encode(["a"]) + b"torn") == {digest("a")}
    assert decode(b"") == frozenset()


def test_a_huge_set_is_cut_to_fit_one_etcd_request() -> None:
    assert NODES_MAX_PUBLISHED * DIGEST < 1_500_000
    assert encode(["x" * 1024]) and len(encode(["x" * 1024])) == DIGEST  # long ids cost 8 bytes
