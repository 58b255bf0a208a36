"""Probe settings per target (signals/probe.py): resolution from the fleet, ports, and what
counts as an answer."""

from __future__ import annotations

import pytest

from controlplane.fleet import parse_fleet
from controlplane.signals.probe import Probe, ProbeResult, at_port, probes_of


@pytest.mark.parametrize(
    ("address", "port", "want"),
    [
        ("127.0.0.1:8000", 8002, "127.0.0.1:8002"),
        ("[::1]:8000", 8002, "[::1]:8002"),
        ("127.0.0.1:8000", None, "127.0.0.1:8000"),
    ],
)
def test_at_port(address: str, port: int | None, want: str) -> None:
    assert at_port(address, port) == want


def test_probes_of_resolves_each_target() -> None:
    fleet = parse_fleet(
        "listener: {port: 10000}\ntiers: {small: {}}\n"
        "signals: {health_path: /ready, metrics_path: /m}\nmodels:\n"
        "  t: {params_b: 1, stable: v1, metrics: {port: 8002, scheme: https},\n"
        "      versions: {v1: {endpoints: ['127.0.0.1:8000']},\n"
        "                 v2: {health: none, endpoints: ['127.0.0.2:8000']}}}\n"
        "  g: {params_b: 1, stable: v1, protocol: http2, metrics: none,\n"
        "      versions: {v1: {health: {grpc: {service: infer, port: 9}}, endpoints: ['127.0.0.3:8001']}}}\n"
    )
    p = probes_of(fleet)
    assert p[("t", "127.0.0.1:8000")] == Probe(
        health_path="/ready", metrics_path="/m", metrics_port=8002, metrics_scheme="https"
    )
    assert p[("t", "127.0.0.2:8000")].health == "none"
    assert p[("g", "127.0.0.3:8001")] == Probe(
        health="grpc",
        health_path="/ready",
        health_port=9,
        grpc_service="infer",
        metrics=False,
        metrics_path="/m",
    )


@pytest.mark.parametrize(
    ("result", "reached"),
    [
        (ProbeResult(200, None, 200, b"", None), True),
        (ProbeResult(None, "timed out", 500, None, None), True),  # the page's server answered
        (ProbeResult(503, None, None, None, "refused"), True),  # health answered: not ready, but seen
        (ProbeResult(None, "timed out", None, None, "timed out"), False),
        (ProbeResult(None, "refused", None, None, None), False),  # metrics: none; health unanswered
        (ProbeResult(), True),  # nothing probed: nothing went unanswered
    ],
)
def test_what_counts_as_an_answer(result: ProbeResult, reached: bool) -> None:
    assert result.reached is reached


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when the block ends: nothing listens


@pytest.mark.parametrize(
    ("probe", "refused"),
    [
        (Probe(), True),  # health on the serving port
        (Probe(health="none"), True),  # no health probe: the page on the serving port
        (Probe(health_port=1), False),  # health elsewhere: says nothing of the serving port
        (Probe(health="none", metrics_port=1), False),
    ],
)
def test_a_refused_serving_port_is_told_apart(probe: Probe, refused: bool) -> None:
    import asyncio

    import aiohttp

    from controlplane.signals.probe import Prober

    async def go() -> ProbeResult:
        async with aiohttp.ClientSession() as session:
            prober = Prober(session)
            try:
                return await prober.probe(f"127.0.0.1:{_closed_port()}", probe, 1.0)
            finally:
                await prober.close()

    r = asyncio.run(go())
    assert not r.reached
    assert r.serving_refused is refused, r


def test_a_timeout_is_not_a_refusal() -> None:
    import asyncio
    import socket

    import aiohttp

    from controlplane.signals.probe import Prober

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)  # accepts (the kernel's backlog) but never answers

    async def go() -> ProbeResult:
        async with aiohttp.ClientSession() as session:
            return await Prober(session).probe(f"127.0.0.1:{listener.getsockname()[1]}", Probe(), 0.3)

    try:
        r = asyncio.run(go())
    finally:
        listener.close()
    assert not r.reached and not r.serving_refused
