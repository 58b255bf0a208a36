"""Per-entry make-before-break for route configurations (pure).

One RouteConfiguration carries every model's routes on the gateway. If a single cluster
it names is not ready on a proxy (still warming, or rejected by that proxy), holding the
whole configuration back would also hold every other model's change, and a version
replaced meanwhile would keep its old route forever. Instead each route entry is judged
on its own: an entry whose clusters are ready goes out as desired; one that is not keeps
the proxy's current entry of the same name, or is left out if the proxy has none (a new
model whose cluster the proxy refused: its requests fall through to the unknown-model
route rather than to a cluster that is not there).
"""

from __future__ import annotations

from collections.abc import Set

from envoy.config.route.v3 import route_components_pb2, route_pb2

from controlplane.routing.translate import entry_refs


def blend_routes(
    desired: route_pb2.RouteConfiguration,
    held: route_pb2.RouteConfiguration | None,
    ready: Set[str],
) -> route_pb2.RouteConfiguration:
    """`desired`, with each entry that names a cluster outside `ready` replaced by the held
    entry of the same name (what the proxy routes with now), or dropped if there is none.

    Entries are matched by virtual host and route name; an unnamed entry is kept from
    `held` only when it is identical there."""
    held_hosts = {vh.name: vh for vh in held.virtual_hosts} if held is not None else {}
    out = route_pb2.RouteConfiguration()
    out.CopyFrom(desired)
    for vh in out.virtual_hosts:
        if all(entry_refs(r) <= ready for r in vh.routes):
            continue
        old = held_hosts.get(vh.name)
        old_by_name = {r.name: r for r in old.routes if r.name} if old is not None else {}
        old_unnamed = [r for r in old.routes if not r.name] if old is not None else []
        kept: list[route_components_pb2.Route] = []
        for r in vh.routes:
            if entry_refs(r) <= ready:
                kept.append(r)
            elif r.name and r.name in old_by_name:
                kept.append(old_by_name[r.name])
            elif not r.name and r in old_unnamed:
                kept.append(r)
        del vh.routes[:]
        vh.routes.extend(kept)
    return out
