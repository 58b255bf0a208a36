"""The status HTTP port against careless and hostile clients (issue 16, F12): a half-sent
request or a TLS hello is cut off after the timeout; HEAD is answered; connections beyond
the bound are closed at once instead of each holding a thread. A real socket client."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

from controlplane import limits
from controlplane.obs.http import StatusHTTPServer
from controlplane.obs.metrics import Metrics

T = TypeVar("T")


class NoProxies:
    def on_loop(self, read: Callable[[], T], timeout_s: float = 5.0) -> T:
        return read()

    def describe(self) -> list[dict[str, Any]]:
        return []


@pytest.fixture
def server() -> Iterator[StatusHTTPServer]:
    s = StatusHTTPServer("127.0.0.1:0", Metrics(), NoProxies(), timeout_s=0.5)
    s.start()
    try:
        yield s
    finally:
        s.stop()


def talk(port: int, data: bytes, wait: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as c:
        c.sendall(data)
        chunks = []
        while chunk := c.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def test_head_is_answered_without_a_body(server: StatusHTTPServer) -> None:
    reply = talk(server.port, b"HEAD /healthz HTTP/1.0\r\n\r\n")
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") and b"Content-Length: 3" in head and body == b""


@pytest.mark.parametrize(
    "partial", [b"GET /metrics HTTP/1.1\r\nHost: x\r\n", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", b""]
)
def test_a_half_sent_request_is_cut_off_after_the_timeout(server: StatusHTTPServer, partial: bytes) -> None:
    started = time.monotonic()
    talk(server.port, partial)  # returns when the server closes the connection
    assert time.monotonic() - started < 4.0  # the 0.5 s timeout, not the client's 5 s
    assert talk(server.port, b"GET /healthz HTTP/1.0\r\n\r\n").endswith(b"ok\n")


def test_connections_beyond_the_bound_are_closed_at_once(server: StatusHTTPServer) -> None:
    held = [
        socket.create_connection(("127.0.0.1", server.port))
        for _ in range(limits.STATUS_HTTP_MAX_CONNECTIONS)
    ]
    try:
        time.sleep(0.2)  # every one has its thread now
        # Closed unanswered: had it waited for a slot, it would have been answered once the
        # held ones timed out (0.5 s).
        assert talk(server.port, b"GET /healthz HTTP/1.0\r\n\r\n", wait=3.0) == b""
    finally:
        for c in held:
            c.close()
    time.sleep(0.8)  # the held ones time out and free their slots
    assert talk(server.port, b"GET /healthz HTTP/1.0\r\n\r\n").endswith(b"ok\n")
