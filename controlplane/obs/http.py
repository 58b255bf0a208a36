"""A small HTTP server for /metrics (Prometheus), /healthz, /debug/proxies and
/debug/discovery (JSON)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from controlplane import limits
from controlplane.obs.metrics import Metrics

T = TypeVar("T")


class ProxyDescriber(Protocol):
    def describe(self) -> list[dict[str, Any]]: ...

    def on_loop(self, read: Callable[[], T], timeout_s: float = ...) -> T: ...


def split_host_port(listen: str) -> tuple[str, int]:
    """'HOST:PORT' or '[v6]:PORT' -> (host, port); raise ValueError with the reason."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {listen!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


class _SharedRendering:
    """The metrics page, rendered once for every scraper that asks while a rendering is under
    way: a burst of scrapes shares one rendering instead of each holding the interpreter
    (and with it the event loop that serves xDS) for its own. A scrape that arrives when
    none is under way gets a fresh one."""

    def __init__(self, render: Callable[[], bytes]) -> None:
        self.render = render
        self._cond = threading.Condition()
        self._rendering = False
        self._done = 0
        self._page = b""

    def get(self) -> bytes:
        with self._cond:
            if self._rendering:
                done = self._done
                while self._rendering and self._done == done:
                    self._cond.wait()
                if self._done != done:
                    return self._page
            self._rendering = True
        page: bytes | None = None
        try:
            page = self.render()
            return page
        finally:
            with self._cond:
                if page is not None:
                    self._page = page
                    self._done += 1
                self._rendering = False
                self._cond.notify_all()


class StatusHTTPServer:
    """Serves metrics and status from a background thread."""

    def __init__(
        self,
        listen: str,
        metrics: Metrics,
        proxies: ProxyDescriber,
        timeout_s: float = limits.STATUS_HTTP_TIMEOUT_S,
        discovery: Callable[[], Any] = lambda: (),
    ) -> None:
        host, port = split_host_port(listen)
        registry = metrics.registry
        page = _SharedRendering(lambda: generate_latest(registry))

        class Handler(BaseHTTPRequestHandler):
            # A client that sends half a request (or a TLS hello, or nothing) is cut off after
            # this, so it cannot hold a thread for ever.
            timeout = timeout_s

            def do_GET(self) -> None:
                self._send(*self._route())

            def do_HEAD(self) -> None:
                self._send(*self._route(), head=True)

            def _route(self) -> tuple[int, str, bytes]:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    return 200, CONTENT_TYPE_LATEST, page.get()
                if path == "/healthz":
                    return 200, "text/plain", b"ok\n"
                if path == "/debug/proxies":
                    return 200, "application/json", json.dumps(_describe(proxies), indent=2).encode() + b"\n"
                if path == "/debug/discovery":
                    body = json.dumps({"sources": list(discovery())}, indent=2).encode() + b"\n"
                    return 200, "application/json", body
                return (
                    404,
                    "text/plain",
                    b"not found: try /metrics, /healthz, /debug/proxies, /debug/discovery\n",
                )

            def _send(self, code: int, ctype: str, body: bytes, head: bool = False) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = _Server((host, port), Handler)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="status-http")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # Prometheus servers, dashboards and people at once: a deep accept queue, so a burst of
    # scrapes waits its turn instead of being refused.
    request_queue_size = 1024

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._slots = threading.BoundedSemaphore(limits.STATUS_HTTP_MAX_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        # At most so many connections served at once: more are closed at once rather than
        # each holding a thread (the status port is for a few scrapers and people).
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def _describe(proxies: ProxyDescriber) -> list[dict[str, Any]]:
    # The streams live on the event loop: read them there, never from this thread.
    return proxies.on_loop(proxies.describe)
