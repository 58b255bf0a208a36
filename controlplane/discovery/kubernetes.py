"""Discover a version's servers from Kubernetes (the I/O shell): the EndpointSlices of the
pods a label selector picks, in one namespace, with lightkube.

Two list-then-watch loops, one for the selected Pods (their labels and annotations carry
`gpu`, `gpu_memory_gb`, `capacity`: the keys are `discovery.kubernetes.labels`) and one for
the namespace's EndpointSlices (addresses, ports, conditions, zone). An endpoint is a server
of the version when its `targetRef` is a selected pod:

- `ready`: a server;
- `serving` but not ready (terminating): a server to drain (EDS DRAINING, no new requests);
- otherwise: left out (a pod still starting, or failing its readiness probe), as a Service
  leaves it out.

Each watch starts from its list's `resourceVersion`, asks for bookmarks (so a reconnect
resumes from a recent version), and on `410 Gone` (the version was compacted away) lists
again. Any other failure (the API server unreachable, 403) keeps the last known set
(state.py), is counted and logged once, and the loop lists again after a backoff.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from pathlib import Path
from typing import Any

import structlog
from lightkube import AsyncClient, KubeConfig
from lightkube.resources.core_v1 import Pod
from lightkube.resources.discovery_v1 import EndpointSlice

from controlplane.discovery.source import SourceKey, SourceReports
from controlplane.discovery.state import Found
from controlplane.fleet.model import Discover, DiscoverySettings
from controlplane.net.http import kubernetes_client

log = structlog.get_logger("controlplane.discovery")

WATCH_TIMEOUT_S = 300  # the server ends a watch after this; lightkube resumes from the last version
BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)  # after failures in a row
HOLD_EMPTY_S = 10.0  # an empty selection must last this long before the version is emptied


class Gone(Exception):
    """410: the watch's version is compacted away; list again."""


class ApiFailure(Exception):
    """The API server answered with an error (other than 410)."""


def client_for(settings: DiscoverySettings) -> AsyncClient:
    """In-cluster config (the pod's service account), else `discovery.kubernetes.kubeconfig`,
    else $KUBECONFIG or ~/.kube/config."""
    if settings.kubeconfig:
        config = KubeConfig.from_file(Path(os.path.expanduser(settings.kubeconfig)))
    else:
        config = KubeConfig.from_env()
    return kubernetes_client(config, timeout_s=10.0, read_timeout_s=WATCH_TIMEOUT_S + 30)


def _request(client: AsyncClient, res: Any, d: Discover, selector: str | None, watch_from: str | None) -> Any:
    """An HTTP request to list (or, with `watch_from`, watch) `res` in the version's namespace.

    lightkube gives the configuration, credentials, TLS and URLs; the answers are read here
    as plain JSON. Its decoding into typed models rejects what a real API server sends in a
    BOOKMARK (an empty object of the kind, `containers: null` and all), and its public
    list/watch take selectors as dicts, not the selector text of the fleet file."""
    params: dict[str, Any] = {"labelSelector": selector}
    if watch_from is not None:
        params |= {
            "resourceVersion": watch_from,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": WATCH_TIMEOUT_S,
        }
    g: Any = client._client
    br = g.prepare_request(
        "list", res=res, namespace=d.namespace, watch=watch_from is not None, params=params
    )
    return g.build_adapter_request(br)


def _failure(status: int, body: str) -> Exception:
    if status == 410:
        return Gone(body[:200])
    return ApiFailure(f"HTTP {status}: {body[:200]}")


def _labelled(meta: dict[str, Any], key: str) -> str | None:
    value = (meta.get("labels") or {}).get(key) or (meta.get("annotations") or {}).get(key)
    return value if isinstance(value, str) else None


def _number(text: str | None) -> float | None:
    try:
        value = float(text) if text is not None else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) and value > 0 else None


def servers(
    d: Discover, settings: DiscoverySettings, pods: dict[str, Any], slices: dict[str, Any]
) -> tuple[Found, ...]:
    """The version's servers from the selected pods and the namespace's slices (API JSON)."""
    out: dict[str, Found] = {}
    for s in slices.values():
        port = d.port
        if d.port_name is not None:
            port = next((p.get("port") for p in s.get("ports") or () if p.get("name") == d.port_name), None)
        if not isinstance(port, int) or not 0 < port < 65536:
            continue
        for ep in s.get("endpoints") or ():
            ref = ep.get("targetRef") or {}
            pod = pods.get(ref.get("name", "")) if ref.get("kind") == "Pod" else None
            if pod is None:
                continue
            c = ep.get("conditions") or {}
            ready = c.get("ready") is not False  # unset: ready (the API's rule)
            serving = bool(c.get("serving"))
            if not ready and not serving:
                continue
            meta = pod.get("metadata") or {}
            for address in ep.get("addresses") or ():
                if not isinstance(address, str):
                    continue
                f = Found(
                    host=address,
                    port=port,
                    zone=ep.get("zone") if isinstance(ep.get("zone"), str) else None,
                    gpu=_labelled(meta, settings.gpu_label),
                    gpu_memory_gb=_number(_labelled(meta, settings.gpu_memory_label)),
                    capacity=_number(_labelled(meta, settings.capacity_label)),
                    terminating=not ready,
                    origin=f"pod {d.namespace}/{ref.get('name')}",
                )
                out[f.address] = f
    return tuple(out[a] for a in sorted(out))


async def _list(
    client: AsyncClient, res: Any, d: Discover, selector: str | None
) -> tuple[dict[str, Any], str]:
    g: Any = client._client  # lightkube's HTTP client (configured transport, auth, TLS)
    resp = await g.send(_request(client, res, d, selector, None))
    if resp.status_code >= 400:
        raise _failure(resp.status_code, resp.text)
    body = resp.json()
    items = {o["metadata"]["name"]: o for o in body.get("items") or ()}
    return items, str(body.get("metadata", {}).get("resourceVersion", ""))


async def _watch(
    client: AsyncClient,
    res: Any,
    d: Discover,
    selector: str | None,
    version: str,
    into: dict[str, Any],
    changed: asyncio.Event,
) -> None:
    """Follow changes from `version` into `into`, reconnecting from the latest version seen
    (bookmarks included) whenever the server ends the watch; raise Gone on 410."""
    while True:
        g: Any = client._client
        resp = await g.send(_request(client, res, d, selector, version), stream=True)
        try:
            if resp.status_code >= 400:
                await resp.aread()
                raise _failure(resp.status_code, resp.text)
            async for line in resp.aiter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    raise _failure(int(obj.get("code") or 500), str(obj.get("message", "")))
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind == "BOOKMARK":
                    continue
                name = (obj.get("metadata") or {}).get("name")
                if not name:
                    continue
                if kind == "DELETED":
                    into.pop(name, None)
                else:
                    into[name] = obj
                changed.set()
        finally:
            await resp.aclose()


async def watch_source(discovery: SourceReports, key: SourceKey, d: Discover) -> None:
    """List, then watch until a 410 or a failure; list again; for as long as the task runs."""
    failures = 0
    while True:
        fleet = discovery.fleet
        if fleet is None:
            return
        settings = fleet.discovery
        try:
            client = client_for(settings)
        except Exception as e:  # no config at all: say so, and look again later
            discovery.failed(key, f"no Kubernetes configuration: {e}")
            await asyncio.sleep(BACKOFF_S[-1])
            continue
        try:
            pods, pods_rv = await _list(client, Pod, d, d.selector)
            slices, slices_rv = await _list(client, EndpointSlice, d, None)
            failures = 0
            discovery.answered(key, servers(d, settings, pods, slices), HOLD_EMPTY_S)
            changed = asyncio.Event()
            watches = [
                asyncio.create_task(_watch(client, Pod, d, d.selector, pods_rv, pods, changed)),
                asyncio.create_task(_watch(client, EndpointSlice, d, None, slices_rv, slices, changed)),
            ]
            try:
                while True:
                    waiter = asyncio.create_task(changed.wait())
                    done, _ = await asyncio.wait([waiter, *watches], return_when=asyncio.FIRST_COMPLETED)
                    for t in watches:
                        if t in done:
                            waiter.cancel()
                            t.result()  # raises why it ended
                            raise ConnectionError("a watch ended")
                    changed.clear()
                    discovery.answered(key, servers(d, settings, pods, slices), HOLD_EMPTY_S)
            finally:
                for t in watches:
                    t.cancel()
        except Gone as e:
            log.info(
                "kubernetes watch expired (410); listing again", model=key[0], version=key[1], why=str(e)
            )
            continue
        except asyncio.CancelledError:
            raise
        except Exception as e:
            failures += 1
            discovery.failed(key, f"kubernetes API: {type(e).__name__}: {e}")
            await asyncio.sleep(BACKOFF_S[min(failures, len(BACKOFF_S)) - 1])
        finally:
            await client.close()
