"""How each server is asked about readiness and load, and the asking itself (I/O shell).

The fleet says per model or version (`health:` and `metrics:`, fleet/model.py) how its
servers are probed: HTTP GET of a health path, a grpc.health.v1 Check, or nothing; and
where the Prometheus page is (path, port, scheme), or that there is none. `probes_of`
turns that into one picklable `Probe` per scrape target, which the collector processes
receive with their share of the targets; `Prober` runs one probe.

A gRPC health answer is mapped to the HTTP status the signal store understands: SERVING
200, UNIMPLEMENTED (the server has no health service) 404, any other answer 503. No answer
(refused, timeout, UNAVAILABLE) is an error, as for HTTP: the server is out of sight, not
unready.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from yarl import URL

from controlplane.fleet.model import Fleet, format_address

EndpointKey = tuple[str, str]  # (model, address), as in signals.store
MAX_PAGE_BYTES = 4 << 20  # a metrics page larger than this is refused, not buffered


@dataclass(frozen=True)
class Probe:
    """How one target is probed (the fleet's health and metrics settings, resolved)."""

    health: str = "http"  # http | grpc | none
    health_path: str = "/health"
    health_port: int | None = None  # None: the serving port
    grpc_service: str = ""
    metrics: bool = True
    metrics_path: str = "/metrics"
    metrics_port: int | None = None
    metrics_scheme: str = "http"


def probes_of(fleet: Fleet) -> dict[EndpointKey, Probe]:
    """Every scrape target's probe (the first version listing an address decides)."""
    out: dict[EndpointKey, Probe] = {}
    for m in fleet.models:
        for v in m.versions:
            h, mp = fleet.health_of(m, v), fleet.metrics_of(m, v)
            probe = Probe(
                health=h.kind,
                health_path=h.path or fleet.signals.health_path,
                health_port=h.port,
                grpc_service=h.service,
                metrics=mp.enabled,
                metrics_path=mp.path or fleet.signals.metrics_path,
                metrics_port=mp.port,
                metrics_scheme=mp.scheme,
            )
            for ep in v.endpoints:
                out.setdefault((m.name, ep.address), probe)
    return out


def at_port(address: str, port: int | None) -> str:
    """The address with its port replaced (`host:port`, `[v6]:port`); unchanged for None."""
    if port is None:
        return address
    host = address.rpartition(":")[0]
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return format_address(host, port)


async def fetch(
    session: aiohttp.ClientSession,
    url: URL | str,
    path: str,
    timeout: aiohttp.ClientTimeout,
    *,
    want_body: bool,
) -> tuple[int | None, bytes | None, str | None]:
    """One GET: (status, body, error); error is set when no usable HTTP answer came in time.
    A body over MAX_PAGE_BYTES is refused, not buffered."""
    try:
        async with session.get(url, timeout=timeout, ssl=False) as resp:  # https: not verified
            if not want_body:
                return resp.status, None, None
            if resp.content_length is not None and resp.content_length > MAX_PAGE_BYTES:
                return resp.status, None, f"page of {resp.content_length} bytes is over the limit"
            body = await read_page(resp.content, MAX_PAGE_BYTES)
            if body is None:
                return resp.status, None, f"page is over the {MAX_PAGE_BYTES} byte limit"
            return resp.status, body, None
    except TimeoutError:
        return None, None, f"GET {path} timed out after {timeout.total:g}s"
    except aiohttp.ClientError as e:
        return None, None, f"GET {path} failed: {e.__class__.__name__}: {e}"
    except OSError as e:
        return None, None, f"GET {path} failed: {e}"


async def read_page(content: aiohttp.StreamReader, limit: int) -> bytes | None:
    """The whole body, however many reads it arrives in (`read(n)` returns what has arrived,
    not n bytes), or None once it is over `limit` bytes."""
    chunks: list[bytes] = []
    total = 0
    while True:
        chunk = await content.read(1 << 16)
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        if total > limit:
            return None
        chunks.append(chunk)


_NO_ANSWER = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


@dataclass(frozen=True)
class ProbeResult:
    """One probe of one target: the health answer (an HTTP status, gRPC mapped) or why none
    came; the metrics page's status and body or why none came. None/None: not probed."""

    health_status: int | None = None
    health_error: str | None = None
    metrics_status: int | None = None
    body: bytes | None = None
    metrics_error: str | None = None

    @property
    def reached(self) -> bool:
        """Some probe got an answer (or nothing was probed, so nothing went unanswered)."""
        probed = (self.health_status, self.health_error, self.metrics_status, self.metrics_error)
        return self.health_status is not None or self.metrics_status is not None or probed == (None,) * 4


class Prober:
    """Runs probes over one HTTP session and one gRPC channel per health target."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session
        self._urls: dict[tuple[str, str, str], URL] = {}
        self._timeouts: dict[float, aiohttp.ClientTimeout] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def close(self) -> None:
        for ch in self._channels.values():
            with contextlib.suppress(Exception):
                await ch.close()
        self._channels.clear()

    async def forget(self, keep: set[str]) -> None:
        """Close gRPC channels to health targets no longer probed."""
        for target in [t for t in self._channels if t not in keep]:
            with contextlib.suppress(Exception):
                await self._channels.pop(target).close()

    async def probe(
        self, address: str, p: Probe, timeout_s: float, *, health_first: bool = False
    ) -> ProbeResult:
        """Health and metrics at once; `health_first`: the target did not answer last time,
        so ask for health alone and read the page only if it answers."""
        if health_first and p.health != "none":
            h_status, h_err = await self.health(address, p, timeout_s)
            if h_status is None:
                return ProbeResult(None, h_err, None, None, h_err if p.metrics else None)
            m_status, body, m_err = await self.metrics(address, p, timeout_s)
            return ProbeResult(h_status, None, m_status, body, m_err)
        (h_status, h_err), (m_status, body, m_err) = await asyncio.gather(
            self.health(address, p, timeout_s), self.metrics(address, p, timeout_s)
        )
        return ProbeResult(h_status, h_err, m_status, body, m_err)

    async def health(self, address: str, p: Probe, timeout_s: float) -> tuple[int | None, str | None]:
        if p.health == "none":
            return None, None
        target = at_port(address, p.health_port)
        if p.health == "grpc":
            return await self._grpc_health(target, p.grpc_service, timeout_s)
        status, _, error = await fetch(
            self.session, self._url("http", target, p.health_path), p.health_path, self._timeout(timeout_s),
            want_body=False,
        )  # fmt: skip
        return status, error

    async def metrics(
        self, address: str, p: Probe, timeout_s: float
    ) -> tuple[int | None, bytes | None, str | None]:
        if not p.metrics:
            return None, None, None
        target = at_port(address, p.metrics_port)
        url = self._url(p.metrics_scheme, target, p.metrics_path)
        return await fetch(self.session, url, p.metrics_path, self._timeout(timeout_s), want_body=True)

    async def _grpc_health(
        self, target: str, service: str, timeout_s: float
    ) -> tuple[int | None, str | None]:
        ch = self._channels.get(target)
        if ch is None:
            ch = self._channels[target] = grpc.aio.insecure_channel(target)
        stub = health_pb2_grpc.HealthStub(ch)
        try:
            r = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() in _NO_ANSWER:
                return None, f"gRPC health Check failed: {e.code().name}: {e.details()}"
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                return 404, None  # no health service: ready, as an HTTP server without /health
            return 503, None
        return (200 if r.status == health_pb2.HealthCheckResponse.SERVING else 503), None

    def _url(self, scheme: str, authority: str, path: str) -> URL:
        key = (scheme, authority, path)
        url = self._urls.get(key)
        if url is None:
            if len(self._urls) > 65536:
                self._urls.clear()
            url = self._urls[key] = URL.build(scheme=scheme, authority=authority, path=path)
        return url

    def _timeout(self, timeout_s: float) -> aiohttp.ClientTimeout:
        t = self._timeouts.get(timeout_s)
        if t is None:
            t = self._timeouts[timeout_s] = aiohttp.ClientTimeout(total=timeout_s)
        return t
