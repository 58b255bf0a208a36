"""The holding service (thin I/O shell): requests for a model with no ready server wait here,
and go on to a server as soon as one is ready.

Envoy routes a holding model's requests here (hold/policy.py decides which, routing/translate
how), naming the model in `x-controlplane-hold-model`. Each request:

1. is refused at once with 429 and `Retry-After` if the model already holds
   `autoscaling.hold_max` requests (OpenAI's error shape);
2. waits until the model has a ready server (the reconciler's last snapshot says which),
   within the route's timeout (Envoy's `x-envoy-expected-rq-timeout-ms`), else gets 503 with
   `Retry-After`. With no server known ready, each of the model's servers is tried in turn:
   one that refuses the connection or answers 503 (still loading) is tried again a quarter
   second later, so the first warm server is found at once, not at the next signals round;
3. is sent on to one of them (weighted as Envoy would), method, path, headers and body as
   they came, and the response streams back as the server writes it (SSE included).

Held requests count as the model's demand, so the autoscaler wakes it. The service runs on
its own thread and event loop: holding many requests never slows the xDS loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading
import time
from collections.abc import Callable, Mapping

import aiohttp
import structlog
from aiohttp import web

from controlplane.net.http import client_session
from controlplane.obs.metrics import HoldMetrics
from controlplane.resources.names import HOLD_MODEL_HEADER

log = structlog.get_logger("controlplane.hold")

POLL_S = 0.05  # how often a held request looks for a ready server
RETRY_AFTER_S = 1
RETRY_BACKOFF_S = 0.25  # a server that refused or answered 503 is tried again after this
_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
}

Ready = Mapping[str, tuple[tuple[str, int], ...]]  # model -> (address, weight)


def _error(status: int, message: str, kind: str, code: str, retry: bool) -> web.Response:
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}})
    headers = {"retry-after": str(RETRY_AFTER_S)} if retry else {}
    return web.Response(status=status, text=body, content_type="application/json", headers=headers)


class HoldingService:
    def __init__(
        self,
        ready: Callable[[], Ready],
        hold_max: Callable[[str], int | None],
        timeout_s: Callable[[str], float],
        metrics: HoldMetrics,
        candidates: Callable[[], Ready] = dict,
        on_held: Callable[[str], object] = lambda model: None,
        max_body: Callable[[str], int] = lambda model: 8 << 20,
    ) -> None:
        self.max_body = max_body  # the model's max_body_bytes (Envoy enforces it too)
        self.ready = ready  # read from this service's thread: replaced whole, never mutated
        # Every server the model's requests may go to, ready or not yet: with none ready, each
        # is tried in turn (a loading one answers 503 or refuses, and is tried again soon), so
        # a warm server is found within RETRY_BACKOFF_S, not at the next signals round.
        self.candidates = candidates
        self.on_held = on_held  # a model's first held request (called on this service's thread)
        self.hold_max = hold_max  # None: the fleet has no such model
        self.timeout_s = timeout_s
        self.metrics = metrics
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    # ---- the held counts (any thread) ---------------------------------------------------

    def held(self) -> dict[str, float]:
        with self._lock:
            return {m: float(n) for m, n in self._held.items() if n}

    def _take(self, model: str, limit: int) -> bool:
        with self._lock:
            n = self._held.get(model, 0)
            if n >= limit:
                return False
            self._held[model] = n + 1
            self.metrics.held.labels(model).set(n + 1)
        if n == 0:
            self.on_held(model)
        return True

    def _release(self, model: str) -> None:
        # The count is set, not decremented: the series of a model that left the fleet is
        # removed (Metrics.retain_models) while its last requests may still be held.
        with self._lock:
            n = self._held[model] = self._held[model] - 1
            self.metrics.held.labels(model).set(n)

    # ---- serving ------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        model = request.headers.get(HOLD_MODEL_HEADER, "")
        limit = self.hold_max(model) if model else None
        if limit is None:
            # Not the model as a label: anyone reaching the port could mint series at will.
            self.metrics.outcomes.labels("(unknown)", "unknown_model").inc()
            return _error(404, "The model does not exist on this gateway.", "invalid_request_error",
                          "model_not_found", retry=False)  # fmt: skip
        largest = self.max_body(model)
        if request.content_length is not None and request.content_length > largest:
            message = f"The request body is larger than model {model}'s max_body_bytes ({largest})."
            return _error(413, message, "invalid_request_error", "request_too_large", retry=False)
        if not self._take(model, limit):
            self.metrics.outcomes.labels(model, "full").inc()
            return _error(
                429,
                f"Model {model} has no ready server and already holds {limit} requests; retry after "
                "the Retry-After delay.",
                "rate_limit_exceeded", "model_warming", retry=True,
            )  # fmt: skip
        try:
            return await self._hold_and_forward(request, model)
        finally:
            self._release(model)

    def _deadline(self, request: web.Request, model: str, started: float) -> float:
        budget = self.timeout_s(model)
        expected = request.headers.get("x-envoy-expected-rq-timeout-ms", "")
        if expected.isdigit():
            budget = min(budget, int(expected) / 1000)
        return started + max(0.0, budget - 0.1)  # answer before Envoy's own timeout does

    async def _hold_and_forward(self, request: web.Request, model: str) -> web.StreamResponse:
        started = time.monotonic()
        deadline = self._deadline(request, model, started)
        body = await request.read()
        if len(body) > self.max_body(model):  # sent without a length
            message = f"The request body is larger than model {model}'s max_body_bytes."
            return _error(413, message, "invalid_request_error", "request_too_large", retry=False)
        backoff: dict[str, float] = {}  # a server that refused the connection: not before then
        last_error = ""
        had_ready = False  # a server the signals call ready was there (and failed us)
        while True:
            now = time.monotonic()
            ready = self.ready().get(model, ())
            # With none known ready, each of its servers in turn (a loading one answers 503).
            pool = ready or self.candidates().get(model, ())
            servers = [(a, w) for a, w in pool if backoff.get(a, 0.0) <= now]
            had_ready = had_ready or bool(ready and servers)
            if servers:
                address = random.choices([a for a, _ in servers], weights=[w for _, w in servers])[0]
                try:
                    upstream = await self._open(request, address, body)
                except (TimeoutError, aiohttp.ClientConnectionError) as e:
                    # Not listening yet (or gone): another server, or this one a little later,
                    # until the deadline.
                    backoff[address] = time.monotonic() + RETRY_BACKOFF_S
                    last_error = f"{address}: {type(e).__name__}"
                    continue
                if upstream.status == 503:
                    # Not ready after all (still loading): it served nothing; wait on.
                    upstream.release()
                    backoff[address] = time.monotonic() + RETRY_BACKOFF_S
                    last_error = f"{address}: 503"
                    continue
                self.metrics.wait.observe(time.monotonic() - started)
                self.metrics.outcomes.labels(model, "forwarded").inc()
                return await self._relay(request, upstream)
            if time.monotonic() >= deadline:
                outcome = "upstream_error" if had_ready and last_error else "timeout"
                self.metrics.outcomes.labels(model, outcome).inc()
                message = (
                    f"No server of model {model} became ready within {time.monotonic() - started:.0f}s"
                    + (f" (last: {last_error})" if last_error else "")
                    + "; retry after the Retry-After delay."
                )
                return _error(503, message, "server_error", "model_warming", retry=True)
            await asyncio.sleep(POLL_S)

    async def _open(self, request: web.Request, address: str, body: bytes) -> aiohttp.ClientResponse:
        """Send the request to `address`; the response once its headers arrived."""
        assert self._session is not None
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() not in _HOP and k.lower() != HOLD_MODEL_HEADER
        }
        return await self._session.request(
            request.method,
            f"http://{address}{request.rel_url}",
            headers=headers,
            data=body,
            allow_redirects=False,
        )

    async def _relay(self, request: web.Request, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
        """Stream the server's response back as it comes (SSE included)."""
        try:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for k, v in upstream.headers.items():
                if k.lower() not in _HOP:
                    response.headers.add(k, v)
            response.enable_chunked_encoding()
            await response.prepare(request)
            with contextlib.suppress(ConnectionError, aiohttp.ClientError):
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
            return response
        finally:
            upstream.release()

    # ---- the thread ---------------------------------------------------------------------

    def start(self, host: str, port: int) -> int:
        """Listen on its own thread and event loop; return the bound port."""
        started = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._serve(host, port))
            except BaseException as e:
                failed.append(e)
                with contextlib.suppress(Exception):
                    loop.run_until_complete(self._close())
                loop.close()
                self._session = self._runner = None
                started.set()
                return
            started.set()
            loop.run_forever()
            loop.run_until_complete(self._close())
            loop.close()

        self._thread = threading.Thread(target=run, name="hold", daemon=True)
        self._thread.start()
        started.wait(10)
        if failed:
            raise OSError(f"--hold-listen {host}:{port}: cannot listen ({failed[0]})")
        return self.port

    async def _serve(self, host: str, port: int) -> None:
        app = web.Application(client_max_size=1 << 30)  # Envoy's max_body_bytes bounds bodies
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1] if sockets else port
        self._session = client_session(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=2), auto_decompress=False
        )

    async def _close(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()

    def stop(self) -> None:
        loop = self._loop
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(5)
