"""The HTTP seam (net/http.py): sessions get the settings asked for and aiohttp's defaults
otherwise; the transport hooks carry every client built while they are set (shown with real
servers on Unix sockets); and no other module of the package builds an HTTP client."""

from __future__ import annotations

import ast
import asyncio
import json
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import httpx2
import pytest
from aiohttp import web
from lightkube import KubeConfig
from lightkube.resources.core_v1 import Pod

from controlplane.net import http

PACKAGE = Path(__file__).resolve().parents[2] / "controlplane"
SEAM = PACKAGE / "net" / "http.py"


@pytest.fixture
def socket_path() -> Iterator[str]:
    # Short, under /tmp: a Unix socket's path has a limit of about 100 bytes.
    with tempfile.TemporaryDirectory(prefix="net-", dir="/tmp") as d:
        yield str(Path(d) / "s")


@asynccontextmanager
async def serving(path: str, seen: list[str], body: object) -> AsyncIterator[None]:
    """A real HTTP server on a Unix socket that answers every GET with `body` as JSON."""

    async def answer(request: web.Request) -> web.Response:
        seen.append(request.path_qs)
        return web.json_response(body)

    app = web.Application()
    app.router.add_get("/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.UnixSite(runner, path).start()
    try:
        yield
    finally:
        await runner.cleanup()


def test_a_session_has_the_settings_asked_for_and_aiohttps_defaults_otherwise() -> None:
    async def check() -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=2)
        async with http.client_session(
            limit=256, limit_per_host=2, force_close=True, timeout=timeout, headers={"User-Agent": "ua"},
            auto_decompress=False, skip_auto_headers=("Accept-Encoding",),
        ) as s:  # fmt: skip
            c = s.connector
            assert c is not None and (c.limit, c.limit_per_host, c.force_close) == (256, 2, True)
            assert (s.timeout, s.headers["User-Agent"], s.auto_decompress) == (timeout, "ua", False)
            assert "Accept-Encoding" in s.skip_auto_headers
        async with http.client_session() as ours, aiohttp.ClientSession() as plain:
            a, b = ours.connector, plain.connector
            assert a is not None and b is not None
            assert (a.limit, a.limit_per_host, a.force_close) == (b.limit, b.limit_per_host, b.force_close)
            assert (ours.timeout, ours.auto_decompress) == (plain.timeout, plain.auto_decompress)
            assert (dict(ours.headers), ours.skip_auto_headers) == (
                dict(plain.headers),
                plain.skip_auto_headers,
            )

    asyncio.run(check())


def test_a_session_goes_through_the_connector_hook(socket_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[int, int, bool]] = []

    def over_the_socket(*, limit: int, limit_per_host: int, force_close: bool) -> aiohttp.BaseConnector:
        asked.append((limit, limit_per_host, force_close))
        return aiohttp.UnixConnector(
            socket_path, limit=limit, limit_per_host=limit_per_host, force_close=force_close
        )

    monkeypatch.setattr(http, "connector", over_the_socket)
    seen: list[str] = []

    async def get() -> object:
        async with (
            serving(socket_path, seen, {"ok": True}),
            http.client_session(limit=16) as s,
            s.get("http://nowhere.invalid/metrics") as resp,
        ):
            return await resp.json()

    assert asyncio.run(get()) == {"ok": True}
    assert (asked, seen) == ([(16, 0, False)], ["/metrics"])


KUBECONFIG = KubeConfig.from_dict(
    {
        "clusters": [{"name": "c", "cluster": {"server": "http://kube.invalid"}}],
        "users": [{"name": "u", "user": {"token": "t0ken"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
)


def test_the_kubernetes_client_goes_through_the_transport_hook(
    socket_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http, "kubernetes_transport", httpx2.AsyncHTTPTransport(uds=socket_path))
    pods = {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "7"}, "items": []}
    seen: list[str] = []

    async def listed() -> list[Pod]:
        client = http.kubernetes_client(KUBECONFIG, timeout_s=10.0, read_timeout_s=330.0)
        # The timeouts reach the httpx2 client lightkube wraps (no public accessor).
        assert client._client._client.timeout == httpx2.Timeout(10.0, read=330.0)
        try:
            async with serving(socket_path, seen, pods):
                return [p async for p in client.list(Pod, namespace="models")]
        finally:
            await client.close()

    assert asyncio.run(listed()) == []
    assert seen == ["/api/v1/namespaces/models/pods"]


# ---- the seam stays the only one -----------------------------------------------------------------

# Calls that build an HTTP client or its transport: (package, names under it).
BUILDERS = {
    "aiohttp": {"ClientSession", "TCPConnector", "UnixConnector", "NamedPipeConnector"},
    "lightkube": {"AsyncClient", "Client"},
    "httpx2": {"AsyncClient", "Client", "AsyncHTTPTransport", "HTTPTransport"},
    "httpx": {"AsyncClient", "Client", "AsyncHTTPTransport", "HTTPTransport"},
}


def client_builds(source: str) -> list[str]:
    """The calls in `source` that build an HTTP client, by their full dotted name, however
    the name was imported (`import aiohttp as a`, `from lightkube import AsyncClient as K`)."""
    tree = ast.parse(source)
    names: dict[str, str] = {}  # local name -> what it was imported as
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                local = alias.asname or alias.name.split(".")[0]
                names[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        parts: list[str] = []
        f: ast.expr = node.func
        while isinstance(f, ast.Attribute):
            parts.append(f.attr)
            f = f.value
        if not isinstance(f, ast.Name):
            continue
        dotted = ".".join([names.get(f.id, f.id), *reversed(parts)])
        top, last = dotted.split(".")[0], dotted.rsplit(".", 1)[-1]
        if last in BUILDERS.get(top, ()):
            found.append(f"line {node.lineno}: {dotted}")
    return found


def test_no_module_but_the_seam_builds_an_http_client() -> None:
    sources = {p: p.read_text() for p in sorted(PACKAGE.rglob("*.py")) if p != SEAM}
    named = {p: text for p, text in sources.items() if any(n in text for ns in BUILDERS.values() for n in ns)}
    builds = {
        str(p.relative_to(PACKAGE.parent)): found
        for p, text in named.items()
        if (found := client_builds(text))
    }
    assert not builds, "HTTP clients built outside controlplane/net/http.py:\n" + json.dumps(builds, indent=2)
    assert client_builds(SEAM.read_text()), "the seam itself not read"


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("import aiohttp\ns = aiohttp.ClientSession()\n", ["line 2: aiohttp.ClientSession"]),
        ("import aiohttp as a\nc = a.TCPConnector(limit=1)\n", ["line 2: aiohttp.TCPConnector"]),
        ("from aiohttp import ClientSession as S\nS()\n", ["line 2: aiohttp.ClientSession"]),
        (
            "from aiohttp.client import ClientSession\nClientSession()\n",
            ["line 2: aiohttp.client.ClientSession"],
        ),
        ("import lightkube\nlightkube.AsyncClient(config=c)\n", ["line 2: lightkube.AsyncClient"]),
        ("from lightkube import AsyncClient\nAsyncClient(config=c)\n", ["line 2: lightkube.AsyncClient"]),
        ("import httpx2\nhttpx2.AsyncClient()\n", ["line 2: httpx2.AsyncClient"]),
        # naming the types (annotations, isinstance) builds nothing; nor does the seam's own call
        (
            "import aiohttp\ndef f(s: aiohttp.ClientSession) -> None: isinstance(s, aiohttp.TCPConnector)\n",
            [],
        ),
        ("from controlplane.net.http import client_session\nclient_session(limit=1)\n", []),
        ("from lightkube import Client as KubeClient\nimport os\nos.Client()\n", []),
    ],
)
def test_the_check_finds_a_client_however_it_is_named(source: str, found: list[str]) -> None:
    assert client_builds(source) == found
