"""How each server is asked about readiness and load, and the asking itself (I/O shell).

The fleet says per model or version (`health:` and `metrics:`, fleet/model.py) how its
servers are probed: HTTP GET of a health path, a grpc.health.v1 Check, or nothing; and
where the Prometheus page is (path, port, scheme), or that there is none. `probes_of`
turns that into one picklable `Probe` per scrape target, which the collector processes
receive with their share of the targets; `Prober` runs one probe.

A gRPC health answer is mapped to the HTTP status the signal store understands: SERVING
200, UNIMPLEMENTED (the server has no health service) 404, any other answer 503. No answer
(refused, timeout, UNAVAILABLE) is an error, as for HTTP: the server is out of sight, not
unready. One refusal is told apart (`ProbeResult.serving_refused`): a connection refused
on the port requests go to, which the proxies' connections would get too (a vLLM keeps its
port closed while it loads); the store reads it as "not ready yet" for a server never seen
ready.
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
from controlplane.signals.stalls import MAX_EXTRA_S, LoopStalls, ScrapeTimeout

EndpointKey = tuple[str, str]  # (model, address), as in signals.store
MAX_PAGE_BYTES = 4 << 20  # a metrics page larger than this is refused, not buffered


class Refusal(str):
    """An error text that says the connection was refused: nothing listens on the port."""


def _refused(e: BaseException) -> bool:
    """Whether a connection attempt's error is a refusal (RST: the host is there, the port
    closed), not a timeout or an unreachable network."""
    seen: BaseException | None = e
    for _ in range(4):  # aiohttp wraps the OSError; look a few causes down
        if seen is None:
            return False
        if isinstance(seen, ConnectionRefusedError):
            return True
        os_error = getattr(seen, "os_error", None)
        if isinstance(seen, aiohttp.ClientConnectorError) and isinstance(os_error, ConnectionRefusedError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


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
    # The model's LoRA adapters as (name, source; "" without one): a llama.cpp page read from
    # this target has its adapters read from /lora-adapters (signals/llamacpp_adapters.py).
    adapters: tuple[tuple[str, str], ...] = ()


def probes_of(fleet: Fleet) -> dict[EndpointKey, Probe]:
    """Every scrape target's probe (the first version listing an address decides)."""
    out: dict[EndpointKey, Probe] = {}
    for m in fleet.models:
        adapters = tuple((a.name, a.source or "") for a in m.adapters)
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
                adapters=adapters,
            )
            for ep in v.endpoints:
                out.setdefault((m.name, ep.address), probe)
    return out


def _on_serving_port(p: Probe, health_error: str | None, metrics_error: str | None) -> bool:
    """Whether the probe that goes to the serving port was refused: health if probed there,
    else the metrics page if it is served there."""
    if p.health != "none":
        return p.health_port is None and isinstance(health_error, Refusal)
    return p.metrics and p.metrics_port is None and isinstance(metrics_error, Refusal)


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
    stalls: LoopStalls | None = None,
    timeout_s: float | None = None,
    max_bytes: int = MAX_PAGE_BYTES,
) -> tuple[int | None, bytes | None, str | None]:
    """One GET: (status, body, error); error is set when no usable HTTP answer came in time.
    A body over `max_bytes` is refused, not buffered. With `stalls`, the GET has
    `timeout_s` of the time its event loop could run (`timeout` is then the outer bound)."""
    limit_s = timeout.total if timeout_s is None else timeout_s
    try:
        if stalls is None:
            return await _get(session, url, timeout, want_body, max_bytes)
        result, _ = await stalls.within(_get(session, url, timeout, want_body, max_bytes), limit_s or 0.0)
        return result
    except ScrapeTimeout as e:
        more = f" (and {e.extra_s:.1f}s more while the collector stood still)" if e.extra_s >= 0.05 else ""
        return None, None, f"GET {path} timed out after {limit_s:g}s{more}"
    except TimeoutError:
        return None, None, f"GET {path} timed out after {limit_s:g}s"
    except aiohttp.ClientError as e:
        text = f"GET {path} failed: {e.__class__.__name__}: {e}"
        return None, None, Refusal(text) if _refused(e) else text
    except OSError as e:
        text = f"GET {path} failed: {e}"
        return None, None, Refusal(text) if _refused(e) else text


async def _get(
    session: aiohttp.ClientSession,
    url: URL | str,
    timeout: aiohttp.ClientTimeout,
    want_body: bool,
    max_bytes: int = MAX_PAGE_BYTES,
) -> tuple[int | None, bytes | None, str | None]:
    async with session.get(url, timeout=timeout, ssl=False) as resp:  # https: not verified
        if not want_body:
            return resp.status, None, None
        if resp.content_length is not None and resp.content_length > max_bytes:
            return resp.status, None, f"page of {resp.content_length} bytes is over the limit"
        body = await read_page(resp.content, max_bytes)
        if body is None:
            return resp.status, None, f"page is over the {max_bytes} byte limit"
        return resp.status, body, None


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
    # The probe of the serving port (health, else metrics, when on that port) was refused.
    serving_refused: bool = False

    @property
    def reached(self) -> bool:
        """Some probe got an answer (or nothing was probed, so nothing went unanswered)."""
        probed = (self.health_status, self.health_error, self.metrics_status, self.metrics_error)
        return self.health_status is not None or self.metrics_status is not None or probed == (None,) * 4


class Prober:
    """Runs probes over one HTTP session and one gRPC channel per health target. With
    `stalls` (a collector's), an HTTP probe's timeout counts only the time the loop ran."""

    def __init__(self, session: aiohttp.ClientSession, stalls: LoopStalls | None = None) -> None:
        self.session = session
        self.stalls = stalls
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
                refused = _on_serving_port(p, h_err, None)
                return ProbeResult(None, h_err, None, None, h_err if p.metrics else None, refused)
            m_status, body, m_err = await self.metrics(address, p, timeout_s)
            return ProbeResult(h_status, None, m_status, body, m_err)
        (h_status, h_err), (m_status, body, m_err) = await asyncio.gather(
            self.health(address, p, timeout_s), self.metrics(address, p, timeout_s)
        )
        refused = h_status is None and m_status is None and _on_serving_port(p, h_err, m_err)
        return ProbeResult(h_status, h_err, m_status, body, m_err, refused)

    async def health(self, address: str, p: Probe, timeout_s: float) -> tuple[int | None, str | None]:
        if p.health == "none":
            return None, None
        target = at_port(address, p.health_port)
        if p.health == "grpc":
            return await self._grpc_health(target, p.grpc_service, timeout_s)
        status, _, error = await fetch(
            self.session, self._url("http", target, p.health_path), p.health_path, self._timeout(timeout_s),
            want_body=False, stalls=self.stalls, timeout_s=timeout_s,
        )  # fmt: skip
        return status, error

    async def metrics(
        self, address: str, p: Probe, timeout_s: float
    ) -> tuple[int | None, bytes | None, str | None]:
        if not p.metrics:
            return None, None, None
        target = at_port(address, p.metrics_port)
        url = self._url(p.metrics_scheme, target, p.metrics_path)
        return await fetch(
            self.session, url, p.metrics_path, self._timeout(timeout_s), want_body=True,
            stalls=self.stalls, timeout_s=timeout_s,
        )  # fmt: skip

    async def get(
        self, address: str, p: Probe, path: str, timeout_s: float, max_bytes: int
    ) -> tuple[int | None, bytes | None, str | None]:
        """GET `path` of the server whose metrics page `p` reads (its port and scheme), bounded
        as that page is: (status, body, error)."""
        url = self._url(p.metrics_scheme, at_port(address, p.metrics_port), path)
        return await fetch(
            self.session, url, path, self._timeout(timeout_s), want_body=True, stalls=self.stalls,
            timeout_s=timeout_s, max_bytes=max_bytes,
        )  # fmt: skip

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
                text = f"gRPC health Check failed: {e.code().name}: {e.details()}"
                refused = e.code() == grpc.StatusCode.UNAVAILABLE and "connection refused" in text.lower()
                return None, Refusal(text) if refused else text
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
            # With stalls, the running-time timeout is kept by `stalls.within`; this is its cap.
            total = timeout_s + MAX_EXTRA_S if self.stalls is not None else timeout_s
            t = self._timeouts[timeout_s] = aiohttp.ClientTimeout(total=total)
        return t
