"""A server closing its connection never costs a request (issue 32): through a real Envoy and
the control plane, to servers that close connections without a `Connection: close` first, in
the two ways real ones do: after KEEP_ALIVE_S idle, as cpp-httplib (llama.cpp) and uvicorn
(vLLM, SGLang) do, and right after every streamed response, as llama.cpp's server does.

A request the proxy sends on such a connection as the server closes it arrives on a closed
connection; Envoy answers it 503 (upstream_cx_destroy_remote_with_active_rq) and, rightly,
does not retry it: the request had been sent. Envoy closing idle connections first
(clusters.UPSTREAM_IDLE_TIMEOUT_S) and using an HTTP/1 connection for one request only
(UPSTREAM_HTTP1_REQUESTS_PER_CONNECTION) leave no such window. On loopback a server's close
takes microseconds to arrive, so the servers here widen the window, as a slow network or a
busy server would: their idle close takes LATENCY_S to reach the proxy, and their close after
a stream comes CLOSE_AFTER_STREAM_S after its last byte.
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import ControlPlane, Envoy, free_port, wait_until

pytestmark = pytest.mark.envoy

KEEP_ALIVE_S = 5.0  # cpp-httplib's and uvicorn's default
LATENCY_S = 0.4  # how long the server's close takes to reach the proxy
CLOSE_AFTER_STREAM_S = 0.002  # from a streamed response's last byte to the server's close


class KeepAliveServer:
    """HTTP/1.1 on 127.0.0.1 that answers every request 200 and keeps the connection, never
    sending `Connection: close`, until it has been idle for `keep_alive` s; then it closes it,
    and the close reaches the peer `latency` s later: bytes that arrive meanwhile are never
    read (`crossed` counts the connections that had such a request). With `stream`, each
    answer is a chunked event stream, and the connection is closed `stream` s after it."""

    def __init__(self, keep_alive: float, latency: float, stream: float | None = None) -> None:
        self.keep_alive = keep_alive
        self.latency = latency
        self.stream = stream
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests = 0
        self.idle_closes = 0  # connections this server closed for idleness
        self.peer_closes = 0  # connections the proxy closed first
        self.crossed = 0  # requests that arrived on a connection this server had closed
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def start(self) -> KeepAliveServer:
        self._thread.start()
        return self

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        with conn:
            while True:
                if b"\r\n\r\n" not in buf:
                    readable, _, _ = select.select([conn], [], [], self.keep_alive)
                    if not readable:  # idle for keep_alive: close, which takes `latency` to arrive
                        time.sleep(self.latency)
                        readable, _, _ = select.select([conn], [], [], 0)
                        self._count("crossed" if readable else "idle_closes")
                        return  # closing with unread bytes sends a reset
                    data = conn.recv(65536)
                    if not data:
                        self._count("peer_closes")
                        return
                    buf += data
                    continue
                head, _, rest = buf.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value.strip())
                while len(rest) < length:
                    data = conn.recv(65536)
                    if not data:
                        return
                    rest += data
                buf = rest[length:]
                if self.stream is not None:
                    conn.sendall(STREAM_HEAD)
                    time.sleep(0.001)  # the first token
                    conn.sendall(STREAM_TAIL)
                    self._count("requests")
                    time.sleep(self.stream)  # then the connection is closed, as llama.cpp's is
                    return
                body = b'{"ok":true}'
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    + f"content-length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                self._count("requests")

    def stop(self) -> None:
        self._stop = True
        self.sock.close()


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


# What llama.cpp's server sends for a streamed completion (its headers, Keep-Alive included).
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
    b"keep-alive: timeout=5, max=100\r\n\r\n" + _chunk(b'data: {"choices":[{"text":"hi"}]}\n\n')
)
STREAM_TAIL = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"


@pytest.fixture
def gateway(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[int, Envoy, KeepAliveServer]]:
    server = KeepAliveServer(KEEP_ALIVE_S, LATENCY_S, stream=getattr(request, "param", None)).start()
    listener = free_port()
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        f"listener: {{port: {listener}}}\n"
        "tiers: {small: {max_params_b: 15, timeout: 30s}}\n"
        "signals: {enabled: false}\n"
        "models:\n"
        f"  idle: {{params_b: 8, stable: v1, versions: {{v1: {{endpoints: ['{server.address}']}}}}}}\n"
    )
    cp = ControlPlane(fleet, tmp_path)
    envoy = Envoy("envoy-1", cp.xds, tmp_path, listener)
    try:
        cp.start()
        envoy.start()
        yield listener, envoy, server
    finally:
        envoy.stop()
        cp.stop()
        server.stop()


def post(conn: http.client.HTTPConnection) -> tuple[int, str]:
    body = json.dumps({"model": "idle", "prompt": "hi", "max_tokens": 1})
    conn.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
    r = conn.getresponse()
    return r.status, r.read().decode()


def test_requests_spaced_around_the_servers_keep_alive_timeout_all_succeed(
    gateway: tuple[int, Envoy, KeepAliveServer],
) -> None:
    listener, envoy, server = gateway
    conn = http.client.HTTPConnection("127.0.0.1", listener, timeout=10)
    wait_until(lambda: post(conn)[0] == 200, 20, "the model to be routed")
    # Just before the server's timeout (its connection still open: Envoy's own close counts),
    # then within the window where the server's close is on its way to the proxy.
    results = []
    for gap in (KEEP_ALIVE_S - 0.5, KEEP_ALIVE_S + LATENCY_S / 2, KEEP_ALIVE_S + LATENCY_S / 2):
        time.sleep(gap)
        results.append(post(conn))
    assert [status for status, _ in results] == [200, 200, 200], results
    assert envoy.stat("cluster.idle_v1.upstream_cx_destroy_remote_with_active_rq") == 0
    assert server.crossed == 0  # no request met a connection the server had closed
    assert server.idle_closes == 0  # Envoy closed every idle connection before the server did
    assert server.peer_closes >= 3


@pytest.mark.parametrize("gateway", [CLOSE_AFTER_STREAM_S], indirect=True)
def test_streams_from_a_server_that_closes_after_each_one_all_succeed(
    gateway: tuple[int, Envoy, KeepAliveServer],
) -> None:
    """Closed-loop clients, each sending its next request as soon as its stream ends: with
    connections reused, Envoy hands the connection of a stream just ended to a request waiting
    for one, and the server closes it under that request."""
    listener, envoy, server = gateway
    wait_until(
        lambda: post(http.client.HTTPConnection("127.0.0.1", listener, timeout=10))[0] == 200, 20, "routing"
    )
    statuses: list[int] = []
    lock = threading.Lock()
    until = time.monotonic() + 4.0

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", listener, timeout=10)
        while time.monotonic() < until:
            status, _ = post(conn)
            with lock:
                statuses.append(status)

    clients = [threading.Thread(target=client) for _ in range(8)]
    for t in clients:
        t.start()
    for t in clients:
        t.join()
    assert len(statuses) >= 200, len(statuses)  # enough requests for the race to show
    failed = len(statuses) - statuses.count(200)
    assert failed == 0, f"{failed} of {len(statuses)} failed: {sorted(set(statuses))}"
    assert envoy.stat("cluster.idle_v1.upstream_cx_destroy_remote_with_active_rq") == 0
    assert server.requests > len(statuses)  # each was answered by the server (and the first probe)
