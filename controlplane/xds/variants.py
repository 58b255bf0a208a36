"""Snapshot resources as one kind of proxy must get them, serialised once and shared by every
stream in that state: adapted to the features a proxy lacks (capabilities.py), and routes
with their not-yet-ready entries held back for make-before-break (routing/blend.py). Bounded
caches, oldest out first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

from envoy.config.route.v3 import route_pb2

from controlplane.resources.types import ROUTE
from controlplane.routing.blend import blend_routes
from controlplane.xds import capabilities
from controlplane.xds.snapshot import SnapshotResource, encode_resource

_ADAPTED: OrderedDict[tuple[str, str, frozenset[str]], SnapshotResource] = OrderedDict()


def adapted(res: SnapshotResource, missing: frozenset[str]) -> SnapshotResource:
    """`res` without the features a proxy lacks, serialised once per (resource, lack)."""
    lacking = res.needs & missing
    if not lacking or res.message is None:
        return res
    key = (res.type_url, res.version, frozenset(lacking))
    found = _ADAPTED.get(key)
    if found is None:
        found = encode_resource(
            res.type_url, res.name, capabilities.adapt(res.type_url, res.message, lacking)
        )
        _ADAPTED[key] = found
        if len(_ADAPTED) > 4096:
            _ADAPTED.popitem(last=False)
    return found


# Per (snapshot dict, what a proxy lacks): that dict adapted, shared by every stream of that
# kind (the dict is kept alive by the entry, so its id cannot be reused while cached).
_ADAPTED_ALL: OrderedDict[
    tuple[int, frozenset[str]], tuple[Mapping[str, SnapshotResource], dict[str, SnapshotResource]]
] = OrderedDict()


def adapted_all(
    every: Mapping[str, SnapshotResource], missing: frozenset[str]
) -> dict[str, SnapshotResource]:
    """Every resource of a type as a proxy lacking `missing` can take them, built once per
    snapshot and lack rather than once per stream and response."""
    key = (id(every), missing)
    found = _ADAPTED_ALL.get(key)
    if found is not None and found[0] is every:
        _ADAPTED_ALL.move_to_end(key)
        return found[1]
    built = {n: adapted(r, missing) for n, r in every.items()}
    _ADAPTED_ALL[key] = (every, built)
    if len(_ADAPTED_ALL) > 16:
        _ADAPTED_ALL.popitem(last=False)
    return built


_BLENDS: OrderedDict[tuple[str, str, frozenset[str]], SnapshotResource] = OrderedDict()


def blended(desired: SnapshotResource, held: SnapshotResource | None, ready: set[str]) -> SnapshotResource:
    """`desired` with its not-ready entries held back (routing/blend.py), serialised once
    per (desired, held, missing clusters) and shared by every stream in that state."""
    missing = frozenset(desired.refs - ready)
    key = (desired.version, held.version if held is not None else "", missing)
    found = _BLENDS.get(key)
    if found is not None:
        _BLENDS.move_to_end(key)
        return found
    assert isinstance(desired.message, route_pb2.RouteConfiguration)
    held_msg = held.message if held is not None else None
    assert held_msg is None or isinstance(held_msg, route_pb2.RouteConfiguration)
    msg = blend_routes(desired.message, held_msg, ready)
    res = encode_resource(ROUTE, desired.name, msg)
    if held is not None and res.version == held.version:
        res = held
    _BLENDS[key] = res
    if len(_BLENDS) > 256:
        _BLENDS.popitem(last=False)
    return res
