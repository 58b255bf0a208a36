"""A minimal OpenAI-shaped HTTP backend that says who it is.

It answers every POST with a small completion naming itself (body field `backend`, header
`x-backend`), and GET /health and /v1/models. It stands in for an inference server where
only routing matters (the xDS core's tests and demo); it does not model GPU load.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A peer closing its keep-alive connection (the scraper, Envoy) is not an error."""


class EchoBackend:
    """One backend on host:port (port 0 picks a free one), served from a thread."""

    def __init__(self, name: str, model: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.name = name
        self.model = model
        self.requests = 0
        backend = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body go out without a 40 ms delay

            def do_GET(self) -> None:
                if self.path.startswith("/health"):
                    self._json(200, {"status": "ok"})
                elif self.path.startswith("/v1/models"):
                    self._json(200, {"object": "list", "data": [{"id": backend.model, "object": "model"}]})
                else:
                    self._json(404, {"error": {"message": "not found"}})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw or b"{}")
                except ValueError:
                    body = {}
                with _lock:
                    backend.requests += 1
                self._json(
                    200,
                    {
                        "id": f"cmpl-{backend.name}-{backend.requests}",
                        "object": "text_completion",
                        "model": body.get("model", backend.model)
                        if isinstance(body, dict)
                        else backend.model,
                        "backend": backend.name,
                        "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                    },
                )

            def _json(self, code: int, obj: Any) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("x-backend", backend.name)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = _QuietServer((host, port), Handler)
        self._server.daemon_threads = True
        self.host = host
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, daemon=True, name=f"backend-{name}"
        )

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> EchoBackend:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


_lock = threading.Lock()
