from __future__ import annotations

import pytest
from envoy.type.matcher.v3 import node_pb2, regex_pb2, string_pb2

from controlplane.xds.csds import node_matches


@pytest.mark.parametrize(
    ("matcher", "node", "expected"),
    [
        (string_pb2.StringMatcher(exact="gw-1"), "gw-1", True),
        (string_pb2.StringMatcher(exact="gw-1"), "gw-10", False),
        (string_pb2.StringMatcher(prefix="gw-"), "gw-10", True),
        (string_pb2.StringMatcher(suffix="-b"), "gw-a", False),
        (string_pb2.StringMatcher(contains="side"), "my-sidecar", True),
        (string_pb2.StringMatcher(exact="GW-1", ignore_case=True), "gw-1", True),
        (string_pb2.StringMatcher(safe_regex=regex_pb2.RegexMatcher(regex=r"gw-\d+")), "gw-42", True),
        (string_pb2.StringMatcher(safe_regex=regex_pb2.RegexMatcher(regex=r"gw-\d+")), "gw-x", False),
    ],
)
def test_node_matchers(matcher: string_pb2.StringMatcher, node: str, expected: bool) -> None:
    assert node_matches([node_pb2.NodeMatcher(node_id=matcher)], node) is expected


def test_no_matcher_selects_every_node_and_any_match_is_enough() -> None:
    assert node_matches([], "anything")
    ms = [
        node_pb2.NodeMatcher(node_id=string_pb2.StringMatcher(exact="a")),
        node_pb2.NodeMatcher(node_id=string_pb2.StringMatcher(exact="b")),
    ]
    assert node_matches(ms, "b") and not node_matches(ms, "c")
