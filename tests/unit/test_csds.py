from __future__ import annotations

import re
from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.status.v3 import csds_pb2
from envoy.type.matcher.v3 import node_pb2, number_pb2, regex_pb2, string_pb2, struct_pb2, value_pb2
from envoy.type.v3 import range_pb2
from xds.core.v3 import extension_pb2

from controlplane.xds import csds
from controlplane.xds.csds import (
    MAX_REGEX_LENGTH,
    MAX_REGEXES_PER_REQUEST,
    NodeMatcherError,
    compile_node_matchers,
    node_matches,
)
from controlplane.xds.server import ProxyRegistry

V = value_pb2.ValueMatcher


def node(node_id: str = "", **metadata: Any) -> base_pb2.Node:
    n = base_pb2.Node(id=node_id)
    n.metadata.update(metadata)
    return n


def regex(pattern: str, **kw: Any) -> string_pb2.StringMatcher:
    return string_pb2.StringMatcher(safe_regex=regex_pb2.RegexMatcher(regex=pattern), **kw)


def by_id(matcher: string_pb2.StringMatcher) -> node_pb2.NodeMatcher:
    return node_pb2.NodeMatcher(node_id=matcher)


def meta(value: value_pb2.ValueMatcher, *path: str) -> struct_pb2.StructMatcher:
    segments = [struct_pb2.StructMatcher.PathSegment(key=k) for k in path]
    return struct_pb2.StructMatcher(path=segments, value=value)


def by_meta(
    *structs: struct_pb2.StructMatcher, node_id: string_pb2.StringMatcher | None = None
) -> node_pb2.NodeMatcher:
    m = node_pb2.NodeMatcher(node_metadatas=structs)
    if node_id is not None:
        m.node_id.CopyFrom(node_id)
    return m


def refused(matchers: list[node_pb2.NodeMatcher]) -> str:
    with pytest.raises(NodeMatcherError) as e:
        compile_node_matchers(matchers)
    return str(e.value)


# --- node id -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("matcher", "node_id", "expected"),
    [
        (string_pb2.StringMatcher(exact="gw-1"), "gw-1", True),
        (string_pb2.StringMatcher(exact="gw-1"), "gw-10", False),
        (string_pb2.StringMatcher(exact=""), "", True),
        (string_pb2.StringMatcher(prefix="gw-"), "gw-10", True),
        (string_pb2.StringMatcher(prefix="gw-"), "sidecar-gw-1", False),
        (string_pb2.StringMatcher(suffix="-b"), "gw-a", False),
        (string_pb2.StringMatcher(suffix="-b"), "gw-b", True),
        (string_pb2.StringMatcher(contains="side"), "my-sidecar", True),
        (string_pb2.StringMatcher(contains="side"), "gateway", False),
        (string_pb2.StringMatcher(exact="GW-1", ignore_case=True), "gw-1", True),
        (string_pb2.StringMatcher(prefix="GW-", ignore_case=True), "gw-2", True),
        (string_pb2.StringMatcher(suffix="-B", ignore_case=True), "gw-b", True),
        (string_pb2.StringMatcher(contains="SIDE", ignore_case=True), "my-sidecar", True),
        (string_pb2.StringMatcher(exact="GW-1"), "gw-1", False),
        (regex(r"gw-\d+"), "gw-42", True),
        (regex(r"gw-\d+"), "gw-x", False),
        (regex(r"gw-\d"), "gw-12", False),  # full match, not search
        (regex(r"gw-\d"), "my-gw-1", False),
        (regex(r"(?i)GW-\d"), "gw-1", True),
        (regex("GW-1", ignore_case=True), "gw-1", False),  # ignore_case has no effect on regex (Envoy)
        (regex(r"\pL+-\d"), "héllo-1", True),  # Unicode classes: RE2 syntax
        (regex(r"\pL+-\d"), "h3llo-1", False),
        (regex(r"\p{Greek}+"), "αβγ", True),
        (regex(r"[[:alpha:]]+\z"), "abc", True),  # POSIX class and \z: RE2, not Python
        (regex(""), "", True),
        (regex(""), "x", False),
    ],
)
def test_node_id_matchers(matcher: string_pb2.StringMatcher, node_id: str, expected: bool) -> None:
    assert node_matches([by_id(matcher)], node(node_id)) is expected


def test_no_matcher_selects_every_node_and_any_match_is_enough() -> None:
    assert node_matches([], node("anything"))
    assert node_matches([], None)
    ms = [by_id(string_pb2.StringMatcher(exact="a")), by_id(string_pb2.StringMatcher(exact="b"))]
    assert node_matches(ms, node("b")) and not node_matches(ms, node("c"))
    assert node_matches([node_pb2.NodeMatcher()], node("x"))  # an empty NodeMatcher: no condition


def test_no_node_yet_is_a_node_with_empty_id_and_metadata() -> None:
    assert node_matches([by_id(string_pb2.StringMatcher(exact=""))], None)
    assert not node_matches([by_id(string_pb2.StringMatcher(prefix="gw"))], None)
    assert not node_matches([by_meta(meta(V(present_match=True), "zone"))], None)


# --- RE2 ---------------------------------------------------------------------------------


def test_regexes_run_on_re2_not_python_re() -> None:
    # Valid RE2 that Python's re refuses: it can only match through RE2.
    with pytest.raises(re.error):
        re.compile(r"\pL")
    assert node_matches([by_id(regex(r"\pL"))], node("é"))
    # Valid Python re that RE2 refuses (a backreference, a lookahead): refused, not run.
    assert re.fullmatch(r"(a)\1", "aa")
    msg = refused([by_id(regex(r"(a)\1"))])
    assert msg.startswith("node_matchers[0].node_id.safe_regex.regex: invalid RE2 regex '(a)\\\\1'")
    assert "invalid escape sequence: \\1" in msg
    assert "invalid perl operator: (?=" in refused([by_id(regex(r"gw(?=-1)"))])


def test_catastrophic_backtracking_pattern_is_just_a_non_match() -> None:
    # (a+)+b takes Python's re minutes here; RE2 answers in linear time. No timing asserted:
    # that it runs at all shows the engine is not backtracking.
    ms = [by_id(regex("(a+)+b"))]
    assert not node_matches(ms, node("a" * 30))
    assert node_matches(ms, node("a" * 30 + "b"))


@pytest.mark.parametrize(
    ("pattern", "reason"),
    [
        ("(", "missing ): ("),
        ("[a-", "missing ]: [a-"),
        ("a**", "bad repetition operator: **"),
        ("a{1001}", "invalid repetition size: {1001}"),
        (r"\pL{1000}", "pattern too large - compile failed"),
    ],
)
def test_invalid_regex_names_the_matcher_and_re2s_reason(pattern: str, reason: str) -> None:
    msg = refused([by_id(string_pb2.StringMatcher(exact="ok")), by_id(regex(pattern))])
    assert msg.startswith("node_matchers[1].node_id.safe_regex.regex: invalid RE2 regex")
    assert reason in msg


def test_regex_length_is_bounded() -> None:
    assert node_matches([by_id(regex("a" * MAX_REGEX_LENGTH))], node("a" * MAX_REGEX_LENGTH))
    msg = refused([by_id(regex("a" * (MAX_REGEX_LENGTH + 1)))])
    assert msg == (
        f"node_matchers[0].node_id.safe_regex.regex: regex is {MAX_REGEX_LENGTH + 1} characters, "
        f"longer than the limit of {MAX_REGEX_LENGTH}"
    )


def test_each_distinct_regex_is_compiled_once_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    compiled: list[str] = []
    real = csds.re2.compile

    def counting(pattern: str, options: Any = None) -> Any:
        compiled.append(pattern)
        return real(pattern, options)

    monkeypatch.setattr(csds.re2, "compile", counting)
    same = [by_id(regex(r"gw-\d+")) for _ in range(200)]
    same.append(by_meta(meta(V(string_match=regex(r"gw-\d+")), "k")))
    predicate = compile_node_matchers(same)
    for i in range(10):
        predicate(node(f"x{i}"))
    assert compiled == [r"gw-\d+"]


def test_distinct_regexes_per_request_are_bounded() -> None:
    ok = [by_id(regex(f"gw-{i}")) for i in range(MAX_REGEXES_PER_REQUEST)]
    assert node_matches(ok, node("gw-3"))
    msg = refused([*ok, by_id(regex("one-more"))])
    assert msg.startswith(f"node_matchers[{MAX_REGEXES_PER_REQUEST}].node_id.safe_regex.regex: more than")


# --- string matchers that cannot be honoured -------------------------------------------------


def test_string_matcher_without_pattern_or_custom_is_refused() -> None:
    assert "node_matchers[0].node_id: no match pattern set" in refused([by_id(string_pb2.StringMatcher())])
    custom = string_pb2.StringMatcher(custom=extension_pb2.TypedExtensionConfig(name="lua"))
    assert refused([by_id(custom)]).startswith(
        "node_matchers[0].node_id: custom string matcher 'lua' is not supported"
    )


def test_fields_unknown_to_this_server_are_refused_not_ignored() -> None:
    # Field 9 of NodeMatcher does not exist here: it might narrow the match in a newer API.
    m = node_pb2.NodeMatcher.FromString(
        by_id(string_pb2.StringMatcher(exact="a")).SerializeToString() + b"\x48\x01"
    )
    assert refused([m]) == "node_matchers[0]: field number(s) [9] not supported by this server"
    v = V.FromString(b"\x40\x01")  # ValueMatcher field 8: a kind newer than ours
    assert "node_metadatas[0].value: field number(s) [8]" in refused([by_meta(meta(v, "k"))])


# --- node metadata -------------------------------------------------------------------------

GPU = node(
    "gw-1",
    zone="us-east1-b",
    gpus=8,
    spot=False,
    owner=None,
    tags=["canary", "a100"],
    hw={"gpu": {"kind": "H100", "count": 4}, "mem_gb": 80},
    note="true",
)


NULL = V(null_match=V.NullMatch())


def text(**kw: Any) -> value_pb2.ValueMatcher:
    return V(string_match=string_pb2.StringMatcher(**kw))


def number(exact: float) -> value_pb2.ValueMatcher:
    return V(double_match=number_pb2.DoubleMatcher(exact=exact))


def number_in(start: float, end: float) -> value_pb2.ValueMatcher:
    return V(double_match=number_pb2.DoubleMatcher(range=range_pb2.DoubleRange(start=start, end=end)))


def one_of(item: value_pb2.ValueMatcher) -> value_pb2.ValueMatcher:
    return V(list_match=value_pb2.ListMatcher(one_of=item))


def any_of(*alternatives: value_pb2.ValueMatcher) -> value_pb2.ValueMatcher:
    return V(or_match=value_pb2.OrMatcher(value_matchers=alternatives))


@pytest.mark.parametrize(
    ("struct", "expected"),
    [
        (meta(NULL, "owner"), True),
        (meta(NULL, "zone"), False),
        (meta(NULL, "missing"), False),
        (meta(number(8), "gpus"), True),
        (meta(number(4), "gpus"), False),
        (meta(number_in(4, 9), "gpus"), True),
        (meta(number_in(8, 9), "gpus"), True),
        (meta(number_in(1, 8), "gpus"), False),  # half-open, as in Envoy: the end is excluded
        (meta(number(8), "zone"), False),  # not a number
        (meta(text(prefix="us-east1"), "zone"), True),
        (meta(text(exact="US-EAST1-B", ignore_case=True), "zone"), True),
        (meta(V(string_match=regex(r"[a-z]+-\pL+\d-[a-z]")), "zone"), True),
        (meta(V(string_match=regex("eu-.*")), "zone"), False),
        (meta(text(exact="8"), "gpus"), False),  # not a string
        (meta(V(bool_match=False), "spot"), True),
        (meta(V(bool_match=True), "spot"), False),
        (meta(V(bool_match=True), "note"), False),  # the string "true" is not a bool
        (meta(V(present_match=True), "zone"), True),
        (meta(V(present_match=True), "owner"), True),  # null is a value
        (meta(V(present_match=True), "hw"), True),
        (meta(V(present_match=True), "missing"), False),
        (meta(V(present_match=False), "missing"), False),  # as in Envoy: false matches nothing
        (meta(V(present_match=False), "zone"), False),
        (meta(one_of(text(exact="canary")), "tags"), True),
        (meta(one_of(text(exact="h100")), "tags"), False),
        (meta(one_of(text(exact="us-east1-b")), "zone"), False),  # not a list
        (meta(any_of(V(bool_match=True), NULL), "owner"), True),
        (meta(any_of(V(bool_match=True), NULL), "spot"), False),
        (meta(any_of(), "zone"), False),  # no alternative: nothing
        # Nested paths walk structs; a missing key or a non-struct on the way is "no value".
        (meta(text(exact="H100"), "hw", "gpu", "kind"), True),
        (meta(number(80), "hw", "mem_gb"), True),
        (meta(V(present_match=True), "hw", "gpu"), True),
        (meta(V(present_match=True), "hw", "cpu", "kind"), False),
        (meta(V(present_match=True), "zone", "x"), False),
        (meta(V(present_match=True), "tags", "0"), False),
        (meta(text(exact="H100"), "kind"), False),
    ],
)
def test_node_metadata_matchers(struct: struct_pb2.StructMatcher, expected: bool) -> None:
    before = GPU.SerializeToString(deterministic=True)
    assert node_matches([by_meta(struct)], GPU) is expected
    assert GPU.SerializeToString(deterministic=True) == before  # lookups add no keys


def test_a_node_matcher_needs_its_id_and_every_metadata_matcher() -> None:
    zone = meta(text(prefix="us-"), "zone")
    eight = meta(number(8), "gpus")
    four = meta(number(4), "gpus")
    assert node_matches([by_meta(zone, eight)], GPU)
    assert not node_matches([by_meta(zone, four)], GPU)
    assert node_matches([by_meta(zone, node_id=string_pb2.StringMatcher(prefix="gw-"))], GPU)
    assert not node_matches([by_meta(zone, node_id=string_pb2.StringMatcher(prefix="sidecar-"))], GPU)
    # Matchers are alternatives: one that selects is enough.
    assert node_matches([by_meta(four), by_meta(zone)], GPU)
    assert not node_matches([by_meta(zone)], node("gw-1"))  # no metadata at all


@pytest.mark.parametrize(
    ("matcher", "message"),
    [
        (
            by_meta(meta(V(bool_match=True))),
            "node_matchers[0].node_metadatas[0].path: at least one key is required",
        ),
        (
            by_meta(
                struct_pb2.StructMatcher(
                    path=[struct_pb2.StructMatcher.PathSegment()], value=V(bool_match=True)
                )
            ),
            "node_matchers[0].node_metadatas[0].path[0]: a path segment needs a non-empty key",
        ),
        (
            by_meta(struct_pb2.StructMatcher(path=[struct_pb2.StructMatcher.PathSegment(key="k")])),
            "node_matchers[0].node_metadatas[0].value: required",
        ),
        (by_meta(meta(V(), "k")), "node_matchers[0].node_metadatas[0].value: no match pattern set"),
        (
            by_meta(meta(V(bool_match=True), "a"), meta(V(double_match=number_pb2.DoubleMatcher()), "b")),
            "node_matchers[0].node_metadatas[1].value.double_match: no match pattern set (exact or range)",
        ),
        (
            by_meta(meta(V(list_match=value_pb2.ListMatcher()), "k")),
            "node_matchers[0].node_metadatas[0].value.list_match: no match pattern set (one_of)",
        ),
        (
            by_meta(meta(one_of(V()), "k")),
            "node_matchers[0].node_metadatas[0].value.list_match.one_of: no match pattern set",
        ),
        (
            by_meta(meta(text(), "k")),
            "node_matchers[0].node_metadatas[0].value.string_match: no match pattern set",
        ),
    ],
)
def test_metadata_matchers_that_cannot_be_honoured_are_refused(
    matcher: node_pb2.NodeMatcher, message: str
) -> None:
    assert refused([matcher]).startswith(message)


def test_a_bad_regex_deep_in_a_metadata_matcher_is_named_by_its_path() -> None:
    deep = any_of(V(bool_match=True), V(string_match=regex(r"(x)\1")))
    msg = refused([by_id(string_pb2.StringMatcher(exact="a")), by_meta(meta(deep, "k"))])
    assert msg.startswith(
        "node_matchers[1].node_metadatas[0].value.or_match.value_matchers[1].string_match.safe_regex.regex: "
        "invalid RE2 regex"
    )


def test_bad_matchers_are_refused_even_with_no_proxy_connected() -> None:
    server = csds.ClientStatusServer(ProxyRegistry())
    assert list(server.status(csds_pb2.ClientStatusRequest()).config) == []
    with pytest.raises(NodeMatcherError, match="invalid RE2 regex"):
        server.status(csds_pb2.ClientStatusRequest(node_matchers=[by_id(regex("("))]))
