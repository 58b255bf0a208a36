"""Every HTTP client the package opens is built here (the seam to the network, as httpx's
transport is): the aiohttp sessions that scrape servers, query Prometheus, forward held
requests and generate load, and the Kubernetes API client.

Callers say what differs (connection limits, timeouts, headers, decompression); what is not
said is aiohttp's default, the same for every caller. The transports are two module-level
hooks, `connector` and `kubernetes_transport`: a test that cannot run a real peer assigns
its own (and puts the old one back), and every client built afterwards goes through it. The
product never changes them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

import aiohttp

if TYPE_CHECKING:
    import httpx2
    from lightkube import AsyncClient, KubeConfig

# aiohttp's own defaults, said once: a TCPConnector's pool, a session's timeout (5 minutes in
# all, 30 s to connect).
LIMIT = 100
LIMIT_PER_HOST = 0  # no limit
TIMEOUT = aiohttp.client.DEFAULT_TIMEOUT


class Connector(Protocol):
    """Makes the connection pool under a session (the aiohttp transport)."""

    def __call__(self, *, limit: int, limit_per_host: int, force_close: bool) -> aiohttp.BaseConnector: ...


def tcp_connector(*, limit: int, limit_per_host: int, force_close: bool) -> aiohttp.BaseConnector:
    """The real transport: TCP (and TLS) to wherever the URL says."""
    return aiohttp.TCPConnector(limit=limit, limit_per_host=limit_per_host, force_close=force_close)


# The hooks (see the module docstring): what sessions connect through, and the Kubernetes
# client's httpx2 transport (None: httpx2's own, with the kubeconfig's TLS settings).
connector: Connector = tcp_connector
kubernetes_transport: httpx2.AsyncBaseTransport | None = None


def client_session(
    *,
    limit: int = LIMIT,
    limit_per_host: int = LIMIT_PER_HOST,
    force_close: bool = False,
    timeout: aiohttp.ClientTimeout = TIMEOUT,
    headers: Mapping[str, str] | None = None,
    auto_decompress: bool = True,
    skip_auto_headers: Iterable[str] | None = None,
) -> aiohttp.ClientSession:
    """An aiohttp session over a pool of at most `limit` connections (0: no limit), at most
    `limit_per_host` to one host (0: no limit), not kept alive with `force_close`; `timeout`
    bounds each request unless the request says otherwise. Call it on the event loop that
    will use the session; the caller closes it."""
    pool = connector(limit=limit, limit_per_host=limit_per_host, force_close=force_close)
    return aiohttp.ClientSession(
        connector=pool,
        timeout=timeout,
        headers=headers,
        auto_decompress=auto_decompress,
        skip_auto_headers=skip_auto_headers,
    )


def kubernetes_client(config: KubeConfig, *, timeout_s: float, read_timeout_s: float) -> AsyncClient:
    """lightkube's async client for the API server `config` names, with its credentials and
    TLS: connecting, writing and waiting for a pooled connection take at most `timeout_s`,
    a read (a watch's next event) `read_timeout_s`."""
    # Imported here, not above: lightkube and httpx2 cost about 0.1 s, and most processes
    # that use this module (collectors, the holding service) never talk to Kubernetes.
    import httpx2
    from lightkube import AsyncClient

    return AsyncClient(
        config=config,
        timeout=httpx2.Timeout(timeout_s, read=read_timeout_s),
        transport=kubernetes_transport,
    )
