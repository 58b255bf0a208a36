"""The holding service on loopback against a real HTTP server (aiohttp): a held request keeps
its method, path, headers and body; a streamed response streams; the bounds answer in
OpenAI's error shape; a header cannot mint metric series."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from controlplane.hold.service import HoldingService
from controlplane.obs.metrics import HoldMetrics
from controlplane.resources.names import HOLD_MODEL_HEADER
from tests.ports import free_port


class Backend:
    """A server that echoes what it got, and streams /stream in three timed chunks."""

    def __init__(self) -> None:
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, daemon=True)
        started = threading.Event()
        self._started = started
        self.thread.start()
        started.wait(5)

    def _run(self) -> None:
        async def echo(request: web.Request) -> web.StreamResponse:
            if request.path == "/stream":
                r = web.StreamResponse(headers={"content-type": "text/event-stream"})
                await r.prepare(request)
                for i in range(3):
                    await r.write(f"data: {i} {time.monotonic()}\n\n".encode())
                    await asyncio.sleep(0.3)
                await r.write_eof()
                return r
            body = await request.read()
            return web.json_response(
                {
                    "method": request.method,
                    "path": str(request.rel_url),
                    "body": body.decode(),
                    "headers": {k.lower(): v for k, v in request.headers.items()},
                }
            )

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", echo)
        runner = web.AppRunner(app, access_log=None)
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._started.set()
        self.loop.run_forever()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def rig() -> Iterator[
    tuple[HoldingService, dict[str, tuple[tuple[str, int], ...]], Backend, CollectorRegistry]
]:
    backend = Backend()
    ready: dict[str, tuple[tuple[str, int], ...]] = {}
    registry = CollectorRegistry()
    service = HoldingService(
        lambda: dict(ready),
        lambda model: 2 if model == "m" else None,
        lambda model: 3.0,
        HoldMetrics(registry),
        max_body=lambda model: 100,
    )
    service.start("127.0.0.1", 0)
    try:
        yield service, ready, backend, registry
    finally:
        service.stop()
        backend.stop()


def call(
    port: int, path: str, body: bytes = b"{}", model: str = "m", **headers: str
) -> tuple[int, dict[str, str], bytes, list[float]]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", path, body=body, headers={HOLD_MODEL_HEADER: model, **headers})
    r = conn.getresponse()
    chunks, arrived = [], []
    while chunk := r.read1(65536):
        chunks.append(chunk)
        arrived.append(time.monotonic())
    conn.close()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, b"".join(chunks), arrived


def test_a_held_request_goes_on_as_it_came_once_a_server_is_ready(rig) -> None:  # type: ignore[no-untyped-def]
    service, ready, backend, registry = rig
    threading.Timer(0.5, lambda: ready.update(m=((f"127.0.0.1:{backend.port}", 1),))).start()
    started = time.monotonic()
    status, _, body, _ = call(
        service.port, "/v1/completions?x=1", b'{"prompt": "hi"}', authorization="Bearer t"
    )
    assert status == 200 and time.monotonic() - started >= 0.45
    got = json.loads(body)
    assert (
        got["method"] == "POST" and got["path"] == "/v1/completions?x=1" and got["body"] == '{"prompt": "hi"}'
    )
    assert got["headers"]["authorization"] == "Bearer t" and HOLD_MODEL_HEADER not in got["headers"]
    assert (
        registry.get_sample_value("controlplane_hold_requests_total", {"model": "m", "outcome": "forwarded"})
        == 1
    )


def test_a_streamed_response_streams(rig) -> None:  # type: ignore[no-untyped-def]
    service, ready, backend, _ = rig
    ready["m"] = ((f"127.0.0.1:{backend.port}", 1),)
    status, headers, body, arrived = call(service.port, "/stream")
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert body.count(b"data:") == 3
    assert arrived[-1] - arrived[0] >= 0.4  # chunks came as written, not all at the end


def test_the_bounds_answer_in_openai_shape_and_unknown_models_mint_no_series(rig) -> None:  # type: ignore[no-untyped-def]
    service, _, _, registry = rig
    status, _, body, _ = call(service.port, "/", model="x" * 500)
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"
    assert (
        registry.get_sample_value(
            "controlplane_hold_requests_total", {"model": "(unknown)", "outcome": "unknown_model"}
        )
        == 1
    )
    status, _, body, _ = call(service.port, "/", body=b"x" * 101)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    results: list[tuple[int, dict[str, str], bytes]] = []
    threads = [threading.Thread(target=lambda: results.append(call(service.port, "/")[:3])) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    statuses = sorted(r[0] for r in results)
    assert statuses == [429, 503, 503]  # hold_max 2; the two held time out (no server, 3 s)
    for _, headers, body in results:
        assert headers["retry-after"] == "1" and json.loads(body)["error"]["code"] == "model_warming"
    sample = registry.get_sample_value
    assert sample("controlplane_hold_requests_total", {"model": "m", "outcome": "timeout"}) == 2
    assert sample("controlplane_hold_requests_total", {"model": "m", "outcome": "full"}) == 1
