"""A small fake Kubernetes API server: Pods and EndpointSlices of namespaces, list and watch.

No real API server can run on these machines, so the Kubernetes discovery source is tested
against this one. It serves the documented JSON shapes and watch semantics that the source
relies on, and nothing else:

- `GET /api/v1/namespaces/{ns}/pods` and `GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices`,
  with `labelSelector` (equality terms `k=v`, comma-separated), answer a List whose
  `metadata.resourceVersion` is the store's current version;
- `?watch=true&resourceVersion=RV` streams newline-delimited events (`ADDED`, `MODIFIED`,
  `DELETED`) for changes after RV, one JSON object per line, the object's
  `metadata.resourceVersion` set to the version of that change;
- with `allowWatchBookmarks=true`, a `BOOKMARK` event every `bookmark_s`: an empty object
  of the watched kind, as Go serialises one (`addressType: ""`, `endpoints: null`), with only
  `metadata.resourceVersion` set;
- a watch from a version older than the compaction point answers `410 Gone` (a Status
  object), as a real API server does once etcd has compacted that history; `compact()` moves
  the point to now and ends every open watch with an `ERROR` event carrying a 410 Status,
  so clients must list again;
- `timeoutSeconds` ends a watch after that long.

Every request is counted (`lists`, `watches`) so a test can see a client list again.
It runs in its own thread with its own event loop, on a free loopback port.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
from typing import Any

from aiohttp import web

from tests.ports import free_port

KINDS = {
    "pods": ("/api/v1/namespaces/{ns}/pods", "Pod", "v1"),
    "endpointslices": (
        "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
        "EndpointSlice",
        "discovery.k8s.io/v1",
    ),
}


def _matches(labels: dict[str, str], selector: str) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.split("=", 1)
            if labels.get(k.strip().rstrip("=")) != v.strip():
                return False
        elif labels.get(term) is None:
            return False
    return True


class FakeKube:
    def __init__(self, bookmark_s: float = 1.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.bookmark_s = bookmark_s
        self.version = 100
        self.compacted = 0  # watches from a version below this get 410
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}  # (kind, ns, name) -> object
        self.history: list[tuple[int, str, str, str, dict[str, Any]]] = []  # (rv, kind, ns, type, obj)
        self.lists = 0
        self.watches = 0
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._changed: asyncio.Condition | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fake-kube")
        self._runner: web.AppRunner | None = None

    # ---- the store (called from the test's thread)

    def put(self, kind: str, ns: str, obj: dict[str, Any]) -> None:
        """Create or replace an object (ADDED or MODIFIED)."""
        name = obj["metadata"]["name"]
        with self._lock:
            self.version += 1
            obj = copy.deepcopy(obj)
            obj.setdefault("metadata", {})["resourceVersion"] = str(self.version)
            obj["metadata"]["namespace"] = ns
            kind_name, api = KINDS[kind][1], KINDS[kind][2]
            obj["kind"], obj["apiVersion"] = kind_name, api
            event = "MODIFIED" if (kind, ns, name) in self.objects else "ADDED"
            self.objects[(kind, ns, name)] = obj
            self.history.append((self.version, kind, ns, event, obj))
        self._notify()

    def delete(self, kind: str, ns: str, name: str) -> None:
        with self._lock:
            obj = self.objects.pop((kind, ns, name))
            self.version += 1
            obj = copy.deepcopy(obj)
            obj["metadata"]["resourceVersion"] = str(self.version)
            self.history.append((self.version, kind, ns, "DELETED", obj))
        self._notify()

    def compact(self) -> None:
        """Forget the history before now: every open watch ends with a 410 ERROR event, and
        a watch from an older version gets 410 Gone."""
        with self._lock:
            self.version += 1
            self.compacted = self.version
            self.history.clear()
        self._notify()

    def _notify(self) -> None:
        async def wake() -> None:
            assert self._changed is not None
            async with self._changed:
                self._changed.notify_all()

        if self._ready.is_set():
            asyncio.run_coroutine_threadsafe(wake(), self._loop).result(5)

    # ---- the server

    def start(self) -> FakeKube:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the fake API server did not start")
        return self

    def stop(self) -> None:
        async def down() -> None:
            if self._runner is not None:
                await self._runner.cleanup()

        if self._ready.is_set():
            asyncio.run_coroutine_threadsafe(down(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def kubeconfig(self) -> str:
        return json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                "users": [{"name": "fake", "user": {"token": "fake-token"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
                "current-context": "fake",
            }
        )

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._changed = asyncio.Condition()
        app = web.Application()
        for kind, (path, _, _) in KINDS.items():
            app.router.add_get(path, self._handler(kind))
        self._runner = web.AppRunner(app, shutdown_timeout=1.0, handler_cancellation=True)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    def _handler(self, kind: str):  # type: ignore[no-untyped-def]
        async def handle(request: web.Request) -> web.StreamResponse:
            ns = request.match_info["ns"]
            selector = request.query.get("labelSelector", "")
            if request.query.get("watch") in ("true", "1"):
                return await self._watch(request, kind, ns, selector)
            with self._lock:
                self.lists += 1
                items = [
                    o
                    for (k, n, _), o in self.objects.items()
                    if k == kind and n == ns and _matches(o["metadata"].get("labels", {}), selector)
                ]
                version = str(self.version)
            return web.json_response(
                {
                    "kind": KINDS[kind][1] + "List",
                    "apiVersion": KINDS[kind][2],
                    "metadata": {"resourceVersion": version},
                    "items": items,
                }
            )

        return handle

    async def _watch(self, request: web.Request, kind: str, ns: str, selector: str) -> web.StreamResponse:
        with self._lock:
            self.watches += 1
        since = int(request.query.get("resourceVersion") or 0)
        if since < self.compacted:
            return web.json_response(_gone(since), status=410)
        bookmarks = request.query.get("allowWatchBookmarks") in ("true", "1")
        timeout = float(request.query.get("timeoutSeconds") or 300)
        resp = web.StreamResponse(headers={"content-type": "application/json"})
        await resp.prepare(request)
        loop = asyncio.get_running_loop()
        ends = loop.time() + timeout
        sent = since
        compaction_seen = self.compacted
        assert self._changed is not None
        try:
            while loop.time() < ends:
                if self.compacted != compaction_seen:
                    await resp.write(json.dumps({"type": "ERROR", "object": _gone(sent)}).encode() + b"\n")
                    break
                with self._lock:
                    events = [e for e in self.history if e[0] > sent and e[1] == kind and e[2] == ns]
                for rv, _, _, etype, obj in events:
                    if _matches(obj["metadata"].get("labels", {}), selector):
                        await resp.write(json.dumps({"type": etype, "object": obj}).encode() + b"\n")
                    sent = rv
                if events:
                    continue  # look again before waiting: more may have come meanwhile
                async with self._changed:
                    try:
                        await asyncio.wait_for(self._changed.wait(), min(self.bookmark_s, ends - loop.time()))
                    except TimeoutError:
                        with self._lock:  # a bookmark only when nothing is left to send
                            idle = not any(e[0] > sent and e[1] == kind and e[2] == ns for e in self.history)
                            version = self.version
                        if bookmarks and idle and self.compacted == compaction_seen:
                            sent = max(sent, version)
                            mark = _bookmark(kind, sent)
                            await resp.write(
                                json.dumps({"type": "BOOKMARK", "object": mark}).encode() + b"\n"
                            )
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return resp


def _bookmark(kind: str, version: int) -> dict[str, Any]:
    """A BOOKMARK's object as the API server serialises it: an empty object of the watched
    kind (Go's zero values for fields without omitempty) with only its resourceVersion set."""
    meta = {"resourceVersion": str(version), "creationTimestamp": None}
    if kind == "endpointslices":
        return {
            "kind": "EndpointSlice",
            "apiVersion": "discovery.k8s.io/v1",
            "metadata": meta,
            "addressType": "",
            "endpoints": None,
        }
    return {"kind": "Pod", "apiVersion": "v1", "metadata": meta, "spec": {"containers": None}, "status": {}}


def _gone(since: int) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": f"too old resource version: {since}",
        "reason": "Expired",
        "code": 410,
    }


def pod(name: str, labels: dict[str, str], annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": labels, "annotations": annotations or {}, "uid": f"uid-{name}"},
        "spec": {"containers": [{"name": "server", "image": "vllm"}]},
    }


def slice_of(name: str, service: str, port: int, endpoints: list[dict[str, Any]]) -> dict[str, Any]:
    """An EndpointSlice; each endpoint: {ip, pod, ready, serving, terminating, zone}."""
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [
            {
                "addresses": [e["ip"]],
                "conditions": {
                    "ready": e.get("ready", True),
                    "serving": e.get("serving", True),
                    "terminating": e.get("terminating", False),
                },
                "targetRef": {"kind": "Pod", "name": e["pod"], "namespace": "models"},
                **({"zone": e["zone"]} if "zone" in e else {}),
            }
            for e in endpoints
        ],
    }
