"""Client Status Discovery Service (CSDS): each connected proxy's config, as Envoy tooling asks.

`envoy.service.status.v3.ClientStatusDiscoveryService` on the xDS port answers, per
connected stream (node), every resource the proxy has ACKed: its type, name, version, the
client status (ACKED, or NACKED with the error) and the config status of the type (SYNCED,
STALE, NOT_SENT, ERROR for a NACK). Node matchers select proxies by node id (exact, prefix,
suffix, contains, RE2 regex) and by node metadata, with Envoy's semantics. Resource contents
are included unless `exclude_resource_contents` is set. The same registry feeds
`cpctl proxies` and `/debug/proxies`.

The port is unauthenticated, so a request's matchers are checked and compiled before any
node is looked at: regexes run on RE2 (linear time, bounded memory and pattern length), and
a matcher this server cannot honour is refused with INVALID_ARGUMENT, never ignored.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import grpc
import re2
from envoy.admin.v3 import config_dump_shared_pb2
from envoy.config.core.v3 import base_pb2
from envoy.service.status.v3 import csds_pb2, csds_pb2_grpc
from envoy.type.matcher.v3 import node_pb2, number_pb2, string_pb2, struct_pb2, value_pb2
from google.protobuf import any_pb2, message, unknown_fields
from google.protobuf import struct_pb2 as pb_struct

from controlplane.resources.types import TYPE_URLS
from controlplane.xds.server import ConnectedStream, ProxyRegistry

SERVICE_NAME = "envoy.service.status.v3.ClientStatusDiscoveryService"
_CONFIG_STATUS = {
    "SYNCED": csds_pb2.SYNCED,
    "STALE": csds_pb2.STALE,
    "NOT_SENT": csds_pb2.NOT_SENT,
    "NACKED": csds_pb2.ERROR,
}

MAX_REGEX_LENGTH = 1024  # characters; node ids and metadata values are short
MAX_REGEXES_PER_REQUEST = 32  # distinct patterns: each compile costs up to a few ms
REGEX_MAX_MEM = 1 << 20  # RE2's budget per pattern (program and DFA cache), bytes

NodePredicate = Callable[[base_pb2.Node], bool]
_ValuePredicate = Callable[[pb_struct.Value], bool]
_StringPredicate = Callable[[str], bool]


class NodeMatcherError(ValueError):
    """A node matcher this server cannot honour; the message names which one and why."""


def _regex_options() -> Any:
    opts = re2.Options()
    opts.max_mem = REGEX_MAX_MEM
    opts.log_errors = False  # the error goes back to the caller, not to stderr
    return opts


_REGEX_OPTIONS = _regex_options()


def _reject_unknown_fields(m: message.Message, where: str) -> None:
    # A field from a newer API than ours would otherwise be dropped, and the matcher widened.
    numbers = sorted({f.field_number for f in unknown_fields.UnknownFieldSet(m)})
    if numbers:
        raise NodeMatcherError(f"{where}: field number(s) {numbers} not supported by this server")


class _MatcherCompiler:
    """Checks and compiles one request's matchers; each distinct regex is compiled once."""

    def __init__(self) -> None:
        self.regexes: dict[str, Any] = {}

    def regex(self, pattern: str, where: str) -> _StringPredicate:
        compiled = self.regexes.get(pattern)
        if compiled is None:
            if len(pattern) > MAX_REGEX_LENGTH:
                raise NodeMatcherError(
                    f"{where}: regex is {len(pattern)} characters, longer than the limit of "
                    f"{MAX_REGEX_LENGTH}"
                )
            if len(self.regexes) >= MAX_REGEXES_PER_REQUEST:
                raise NodeMatcherError(
                    f"{where}: more than {MAX_REGEXES_PER_REQUEST} distinct regexes in one request"
                )
            try:
                compiled = re2.compile(pattern, _REGEX_OPTIONS)
            except re2.error as e:
                reason = e.args[0] if e.args else "unknown error"
                if isinstance(reason, bytes):
                    reason = reason.decode("utf-8", "replace")
                hint = f" (RE2 memory budget {REGEX_MAX_MEM} bytes)" if "too large" in reason else ""
                raise NodeMatcherError(f"{where}: invalid RE2 regex {pattern!r}: {reason}{hint}") from None
            self.regexes[pattern] = compiled
        fullmatch = compiled.fullmatch
        return lambda s: fullmatch(s) is not None

    def string(self, m: string_pb2.StringMatcher, where: str) -> _StringPredicate:
        _reject_unknown_fields(m, where)
        kind = m.WhichOneof("match_pattern")
        if kind == "safe_regex":
            _reject_unknown_fields(m.safe_regex, f"{where}.safe_regex")
            # ignore_case does not apply to safe_regex (as in Envoy): use (?i) in the pattern.
            return self.regex(m.safe_regex.regex, f"{where}.safe_regex.regex")
        if kind is None:
            raise NodeMatcherError(
                f"{where}: no match pattern set (exact, prefix, suffix, contains, safe_regex)"
            )
        if kind == "custom":
            raise NodeMatcherError(
                f"{where}: custom string matcher {m.custom.name!r} is not supported "
                "(use exact, prefix, suffix, contains or safe_regex)"
            )

        def fold(s: str) -> str:
            return s.lower() if m.ignore_case else s

        want = fold(getattr(m, kind))
        if kind == "exact":
            return lambda s: fold(s) == want
        if kind == "prefix":
            return lambda s: fold(s).startswith(want)
        if kind == "suffix":
            return lambda s: fold(s).endswith(want)
        if kind == "contains":
            return lambda s: want in fold(s)
        raise NodeMatcherError(f"{where}: string matcher kind {kind!r} is not supported")

    def double(self, m: number_pb2.DoubleMatcher, where: str) -> Callable[[float], bool]:
        _reject_unknown_fields(m, where)
        kind = m.WhichOneof("match_pattern")
        if kind == "exact":
            exact = m.exact
            return lambda v: v == exact
        if kind == "range":
            _reject_unknown_fields(m.range, f"{where}.range")
            start, end = m.range.start, m.range.end
            return lambda v: start <= v < end  # half-open, as in Envoy
        raise NodeMatcherError(f"{where}: no match pattern set (exact or range)")

    def value(self, m: value_pb2.ValueMatcher, where: str) -> _ValuePredicate:
        """Envoy's ValueMatcher; a missing value (path not found) is a Value with no kind."""
        _reject_unknown_fields(m, where)
        kind = m.WhichOneof("match_pattern")
        if kind == "null_match":
            return lambda v: v.WhichOneof("kind") == "null_value"
        if kind == "bool_match":
            want = m.bool_match
            return lambda v: v.WhichOneof("kind") == "bool_value" and v.bool_value == want
        if kind == "present_match":
            # As in Envoy: true matches any value at the path; false matches nothing.
            present = m.present_match
            return lambda v: present and v.WhichOneof("kind") is not None
        if kind == "double_match":
            number = self.double(m.double_match, f"{where}.double_match")
            return lambda v: v.WhichOneof("kind") == "number_value" and number(v.number_value)
        if kind == "string_match":
            string = self.string(m.string_match, f"{where}.string_match")
            return lambda v: v.WhichOneof("kind") == "string_value" and string(v.string_value)
        if kind == "list_match":
            _reject_unknown_fields(m.list_match, f"{where}.list_match")
            if m.list_match.WhichOneof("match_pattern") != "one_of":
                raise NodeMatcherError(f"{where}.list_match: no match pattern set (one_of)")
            item = self.value(m.list_match.one_of, f"{where}.list_match.one_of")
            return lambda v: (
                v.WhichOneof("kind") == "list_value" and any(item(x) for x in v.list_value.values)
            )
        if kind == "or_match":
            _reject_unknown_fields(m.or_match, f"{where}.or_match")
            alternatives = [
                self.value(alt, f"{where}.or_match.value_matchers[{i}]")
                for i, alt in enumerate(m.or_match.value_matchers)
            ]
            return lambda v: any(alt(v) for alt in alternatives)
        if kind is None:
            raise NodeMatcherError(f"{where}: no match pattern set")
        raise NodeMatcherError(f"{where}: value matcher kind {kind!r} is not supported")

    def struct(self, m: struct_pb2.StructMatcher, where: str) -> Callable[[pb_struct.Struct], bool]:
        _reject_unknown_fields(m, where)
        path: list[str] = []
        for i, seg in enumerate(m.path):
            _reject_unknown_fields(seg, f"{where}.path[{i}]")
            if seg.WhichOneof("segment") != "key" or not seg.key:
                raise NodeMatcherError(f"{where}.path[{i}]: a path segment needs a non-empty key")
            path.append(seg.key)
        if not path:
            raise NodeMatcherError(f"{where}.path: at least one key is required")
        if not m.HasField("value"):
            raise NodeMatcherError(f"{where}.value: required")
        matches = self.value(m.value, f"{where}.value")
        return lambda s: matches(_lookup(s, path))

    @staticmethod
    def _metadata(matches: Callable[[pb_struct.Struct], bool]) -> NodePredicate:
        return lambda n: matches(n.metadata)

    def node(self, m: node_pb2.NodeMatcher, where: str) -> NodePredicate:
        _reject_unknown_fields(m, where)
        checks: list[NodePredicate] = []
        if m.HasField("node_id"):
            node_id = self.string(m.node_id, f"{where}.node_id")
            checks.append(lambda n: node_id(n.id))
        for i, sm in enumerate(m.node_metadatas):
            checks.append(self._metadata(self.struct(sm, f"{where}.node_metadatas[{i}]")))
        return lambda n: all(check(n) for check in checks)


_MISSING = pb_struct.Value()  # no kind: what a path that leads nowhere yields


def _lookup(s: pb_struct.Struct, path: list[str]) -> pb_struct.Value:
    """The value at `path`, or a Value with no kind; never adds keys to the node's metadata."""
    value = _MISSING
    fields = s.fields
    for i, key in enumerate(path):
        if key not in fields:
            return _MISSING
        value = fields[key]
        if i < len(path) - 1:
            if value.WhichOneof("kind") != "struct_value":
                return _MISSING
            fields = value.struct_value.fields
    return value


_EMPTY_NODE = base_pb2.Node()


def compile_node_matchers(matchers: Iterable[node_pb2.NodeMatcher]) -> NodePredicate:
    """A predicate selecting the nodes any matcher selects (no matchers: every node).

    Raises NodeMatcherError, naming the matcher and the reason, for a matcher that cannot be
    honoured: a bad or too long regex, a missing pattern, an unsupported kind.
    """
    compiler = _MatcherCompiler()
    predicates = [compiler.node(m, f"node_matchers[{i}]") for i, m in enumerate(matchers)]
    if not predicates:
        return lambda n: True
    return lambda n: any(p(n) for p in predicates)


def node_matches(matchers: Iterable[node_pb2.NodeMatcher], node: base_pb2.Node | None) -> bool:
    """True when any matcher selects the node; None is a node with no id and no metadata."""
    return compile_node_matchers(matchers)(node if node is not None else _EMPTY_NODE)


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
                version_info=ts.version_info(name, proto.delta),
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
            # What it rejected is not held: an entry per rejected resource (its name and the
            # version it refused), or one without a name while the culprit is still being
            # found, each with the proxy's error.
            for name, version in sorted(ts.rejected.items()) or [("", "")]:
                g = cfg.generic_xds_configs.add(
                    type_url=type_url,
                    name=name,
                    config_status=csds_pb2.ERROR,
                    client_status=config_dump_shared_pb2.NACKED,
                )
                g.error_state.details = ts.last_error
                g.error_state.version_info = version
    return cfg


class ClientStatusServer(csds_pb2_grpc.ClientStatusDiscoveryServiceServicer):  # type: ignore[misc]
    def __init__(self, registry: ProxyRegistry) -> None:
        self.registry = registry

    def status(self, request: csds_pb2.ClientStatusRequest) -> csds_pb2.ClientStatusResponse:
        """The selected proxies' configs; raises NodeMatcherError before looking at any node."""
        selects = compile_node_matchers(request.node_matchers)
        configs = [
            client_config(s, not request.exclude_resource_contents)
            for s in sorted(self.registry.streams.values(), key=lambda s: s.stream_id)
            if selects(s.protocol.node if s.protocol.node is not None else _EMPTY_NODE)
        ]
        return csds_pb2.ClientStatusResponse(config=configs)

    async def FetchClientStatus(
        self, request: csds_pb2.ClientStatusRequest, context: Any
    ) -> csds_pb2.ClientStatusResponse:
        try:
            return self.status(request)
        except NodeMatcherError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            raise  # abort() raises; this is not reached

    async def StreamClientStatus(
        self, request_iterator: AsyncIterator[csds_pb2.ClientStatusRequest], context: Any
    ) -> AsyncIterator[csds_pb2.ClientStatusResponse]:
        async for request in request_iterator:
            try:
                response = self.status(request)
            except NodeMatcherError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
                raise  # abort() raises; this is not reached
            yield response
