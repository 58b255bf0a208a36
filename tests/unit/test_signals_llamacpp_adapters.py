"""llama.cpp's LoRA adapters from its GET /lora-adapters (signals/llamacpp_adapters.py): what an
answer says (pure, with hostile answers), how a listed path is matched to the fleet's
`source:`, and the fetch beside a scrape, against real HTTP servers on 127.0.0.1 through both
scrape paths (a collector process's `_one` and the in-process Scraper): asked only for a
llama.cpp page of a model with adapters, and whatever it answers (an error, garbage, too much,
nothing in time) the rest of the endpoint's signals stand."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from controlplane import limits
from controlplane.fleet import parse_fleet
from controlplane.net.http import client_session
from controlplane.signals import collector_worker
from controlplane.signals.llamacpp_adapters import PATH_MAX_CHARS, UNKNOWN, fleet_names, resident
from controlplane.signals.parse import ServerSample
from controlplane.signals.probe import Probe, Prober, probes_of
from controlplane.signals.scrape import Scraper
from controlplane.signals.store import EndpointKey, ScrapeResult, SignalStore
from tests.unit.test_signals_parse import VLLM, lora

PAGES = Path(__file__).resolve().parents[1] / "fixtures" / "pages" / "llamacpp"
LLAMACPP = (PAGES / "metrics-busy.txt").read_text()  # a real llama-server's page: 2 running, 4 deferred
FLEET_ADAPTERS = (("sql", "/models/sql.gguf"), ("chat", "/models/chat.gguf"), ("bare", ""))


def entry(path: str, scale: object = 1.0, index: object = 0, **more: object) -> dict[str, object]:
    """One /lora-adapters entry, as llama-server prints it."""
    return {"id": index, "path": path, "scale": scale, "task_name": "", "prompt_prefix": "", **more}


def answer(*entries: object) -> bytes:
    return json.dumps(list(entries)).encode()


# ---- what an answer says ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "want"),
    [
        # llama-server's own shape: one adapter, applied at 1.0 (--lora FILE)
        (answer(entry("/models/sql.gguf")), (("sql",), (), 1)),
        # scale 0 (--lora-scaled FILE:0): loaded, counted, not applied
        (answer(entry("/models/sql.gguf", 0.0)), ((), (), 1)),
        (answer(entry("/models/sql.gguf", 0)), ((), (), 1)),
        # a negative scale subtracts the adapter: not it
        (answer(entry("/models/sql.gguf", -1.0)), ((), (), 1)),
        # any positive scale, a JSON integer too
        (answer(entry("/models/sql.gguf", 1)), (("sql",), (), 1)),
        (answer(entry("/models/sql.gguf", 0.25)), (("sql",), (), 1)),
        # none loaded: known, none held, no slots
        (b"[]", ((), (), 0)),
        (b" [ ]\n", ((), (), 0)),
        # in the server's order, each slot counted, a path not the fleet's counted but unnamed
        (
            answer(
                entry("/models/chat.gguf", index=0), entry("/tmp/x.gguf", index=1), entry("/models/sql.gguf")
            ),
            (("chat", "sql"), (), 3),
        ),
        # the same adapter listed twice: named once, both counted
        (answer(entry("/models/sql.gguf"), entry("/models/sql.gguf", index=1)), (("sql",), (), 2)),
        # by file name when the path is not a source (a server started with a relative path)
        (answer(entry("sql.gguf")), (("sql",), (), 1)),
        (answer(entry("/mnt/other/chat.gguf")), (("chat",), (), 1)),
        # a fleet adapter without a source matches nothing, an empty path neither
        (answer(entry("")), ((), (), 1)),
        (answer(entry("/")), ((), (), 1)),
        # fields llama-server may add later, or leave out (id), do not matter
        (answer(entry("/models/sql.gguf", alora_invocation_tokens=[1, 2])), (("sql",), (), 1)),
        (answer({"path": "/models/sql.gguf", "scale": 1.0}), (("sql",), (), 1)),
        # the bounds themselves are within them
        (
            answer(*(entry(f"/a/{i}.gguf", index=i) for i in range(limits.METRICS_LORA_MAX_ADAPTERS))),
            ((), (), 64),
        ),
        (answer(entry("/" + "p" * (PATH_MAX_CHARS - 1))), ((), (), 1)),
        # a huge integer scale is a positive number
        (b'[{"id": 0, "path": "/models/sql.gguf", "scale": ' + b"9" * 4000 + b"}]", (("sql",), (), 1)),
    ],
)
def test_an_answer_names_the_fleets_adapters_it_applies(body: bytes, want: object) -> None:
    assert resident(body, FLEET_ADAPTERS) == want


HOSTILE = [
    b"",  # no body
    b"not json",
    b"<html>404</html>",
    b"\xff\xfe\x00garbage",  # not text
    b'[{"id": 0, "path": "/models/sql.gguf", "scale": 1.0}',  # cut short
    b"{}",  # an object, not a list
    b'{"adapters": []}',
    b'"/models/sql.gguf"',
    b"1",
    b"null",
    b"true",
    answer("/models/sql.gguf"),  # entries not objects
    answer(["/models/sql.gguf", 1.0]),
    answer(None),
    answer(entry("/models/sql.gguf"), 7),  # one good, one not
    answer({"id": 0, "scale": 1.0}),  # no path
    answer(entry(None)),  # type: ignore[arg-type]
    answer(entry(0)),  # type: ignore[arg-type]
    answer(entry(["/models/sql.gguf"])),  # type: ignore[arg-type]
    answer({"id": 0, "path": "/models/sql.gguf"}),  # no scale
    answer(entry("/models/sql.gguf", "1.0")),
    answer(entry("/models/sql.gguf", None)),
    answer(entry("/models/sql.gguf", True)),  # a bool is not a number here
    answer(entry("/models/sql.gguf", [1.0])),
    answer(entry("/models/sql.gguf", index="0")),
    answer(entry("/models/sql.gguf", index=0.5)),
    answer(entry("/models/sql.gguf", index=False)),
    answer(entry("/models/sql.gguf", index=None)),
    b'[{"id": 0, "path": "/models/sql.gguf", "scale": NaN}]',  # Python's reader takes these
    b'[{"id": 0, "path": "/models/sql.gguf", "scale": Infinity}]',
    b'[{"id": 0, "path": "/models/sql.gguf", "scale": -Infinity}]',
    b'[{"id": 0, "path": "/models/sql.gguf", "scale": 1e999}]',  # read as inf
    # over the bounds: one entry too many, a path one character too long, a body too big
    answer(*(entry(f"/a/{i}.gguf", index=i) for i in range(limits.METRICS_LORA_MAX_ADAPTERS + 1))),
    answer(*(entry("/models/sql.gguf", index=i) for i in range(1000))),
    answer(entry("/" + "p" * PATH_MAX_CHARS)),
    answer(entry("/models/sql.gguf", prompt_prefix="x" * limits.LLAMACPP_LORA_MAX_BYTES)),
    # nested past the JSON reader's depth (a RecursionError, not a ValueError)
    b"[" * 200_000 + b"]" * 200_000,
    b'[{"path": ' * 50_000,
]


@pytest.mark.parametrize("body", HOSTILE, ids=range(len(HOSTILE)))
def test_an_answer_that_is_not_a_list_of_adapters_within_bounds_leaves_them_unknown(body: bytes) -> None:
    assert resident(body, FLEET_ADAPTERS) == UNKNOWN


@pytest.mark.parametrize(
    ("path", "fleet", "want"),
    [
        ("/models/sql.gguf", FLEET_ADAPTERS, ("sql",)),
        # exact wins over a file name shared with another source
        ("/m/a.gguf", (("one", "/m/a.gguf"), ("two", "/n/a.gguf")), ("one",)),
        # two fleet adapters of one source: both are what the server holds
        ("/m/a.gguf", (("one", "/m/a.gguf"), ("two", "/m/a.gguf")), ("one", "two")),
        ("a.gguf", (("one", "/m/a.gguf"), ("two", "/m/a.gguf")), ("one", "two")),
        # by file name only when that names one source: two different files of that name
        ("/z/a.gguf", (("one", "/m/a.gguf"), ("two", "/n/a.gguf")), ()),
        ("/z/a.gguf", (("one", "/m/a.gguf"),), ("one",)),
        # a source that is a directory (vLLM's kind), trailing '/' and all
        ("/srv/lora-x/", (("x", "/models/lora-x"),), ("x",)),
        ("/models/lora-x", (("x", "/models/lora-x/"),), ("x",)),
        # a URI source's last part is its file name too
        ("/cache/sql.gguf", (("sql", "s3://bucket/loras/sql.gguf"),), ("sql",)),
        # names are compared whole, case and all
        ("/m/SQL.gguf", FLEET_ADAPTERS, ()),
        ("/m/sql.gguf.bak", FLEET_ADAPTERS, ()),
        ("/m/sql", FLEET_ADAPTERS, ()),
        # nothing to match: no path, a path of slashes, a fleet adapter without a source
        ("", FLEET_ADAPTERS, ()),
        ("///", FLEET_ADAPTERS, ()),
        ("bare", FLEET_ADAPTERS, ()),
        ("/models/sql.gguf", (), ()),
    ],
)
def test_a_listed_path_is_the_fleet_adapter_of_that_source_else_of_that_file_name(
    path: str, fleet: tuple[tuple[str, str], ...], want: tuple[str, ...]
) -> None:
    assert fleet_names(path, fleet) == want


# ---- the fetch beside a scrape, against real servers --------------------------------------


@dataclass
class Server:
    """A fake inference server on 127.0.0.1: its /metrics page, and /lora-adapters answered by
    `adapters` (a request in, a response out); every path asked is kept."""

    page: str = LLAMACPP
    adapters: Callable[[web.Request], Awaitable[web.StreamResponse]] | None = None
    asked: list[str] = field(default_factory=list)
    port: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def json_body(body: bytes, status: int = 200) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def answer(_: web.Request) -> web.StreamResponse:
        return web.Response(body=body, status=status, content_type="application/json")

    return answer


def adapters_of(*entries: object) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    return json_body(answer(*entries))


@asynccontextmanager
async def serving(*servers: Server) -> AsyncIterator[None]:
    runners = []
    try:
        for s in servers:

            async def handle(request: web.Request, s: Server = s) -> web.StreamResponse:
                s.asked.append(request.path)
                if request.path == "/metrics":
                    return web.Response(text=s.page)
                if request.path == "/health":
                    return web.Response(text="ok")
                if request.path == "/lora-adapters" and s.adapters is not None:
                    return await s.adapters(request)
                return web.Response(status=404, text="File Not Found")

            app = web.Application()
            app.router.add_get("/{tail:.*}", handle)
            runner = web.AppRunner(app, handler_cancellation=True)  # a hung answer ends with its client
            await runner.setup()
            runners.append(runner)
            site = web.TCPSite(runner, "127.0.0.1", s.port)
            await site.start()
            s.port = runner.addresses[0][1]
        yield
    finally:
        for r in runners:
            await r.cleanup()


def fleet_yaml(*servers: Server, adapters: str | None = "adapters: {sql: {source: /models/sql.gguf}}") -> str:
    endpoints = ", ".join(f"'{s.address}'" for s in servers)
    return (
        "listener: {port: 10000}\ntiers: {small: {}}\nmodels:\n"
        f"  tiny: {{params_b: 1, stable: v1, {adapters + ', ' if adapters else ''}"
        f"versions: {{v1: {{endpoints: [{endpoints}]}}}}}}\n"
    )


Scrape = Callable[[dict[EndpointKey, Probe], float], Awaitable[dict[EndpointKey, ScrapeResult]]]


async def by_collector(probes: dict[EndpointKey, Probe], timeout_s: float) -> dict[EndpointKey, ScrapeResult]:
    """One scrape of each target by a collector process's `_one`, with a real Prober."""
    w = collector_worker._Worker.__new__(collector_worker._Worker)
    collector_worker._Worker.__init__(w, None, 0)  # type: ignore[arg-type]  # never sends
    w.settings = collector_worker.Settings(timeout_s=timeout_s)
    w.probes = probes
    session = client_session(limit=0, limit_per_host=2)
    w.prober = Prober(session)
    try:
        await asyncio.gather(*(w._one(key, time.monotonic()) for key in probes))
    finally:
        await w.prober.close()
        await session.close()
    return dict(w.outbox)


async def by_scraper(probes: dict[EndpointKey, Probe], timeout_s: float) -> dict[EndpointKey, ScrapeResult]:
    """One round of the in-process Scraper."""
    scraper = Scraper(timeout_s)
    try:
        return await scraper.scrape_round(probes, probes)
    finally:
        await scraper.close()


SCRAPES = [pytest.param(by_collector, id="collector"), pytest.param(by_scraper, id="inline")]


def scraped(
    scrape: Scrape, server: Server, adapters: str | None = None, timeout_s: float = 1.0
) -> tuple[Any, Any, float]:
    """(load, signals, the scrape's seconds) of one server scraped once, in a fleet whose
    model has `adapters` (default: sql from /models/sql.gguf)."""
    took = 0.0

    async def run() -> dict[EndpointKey, ScrapeResult]:
        nonlocal took
        async with serving(server):
            text = fleet_yaml(server) if adapters is None else fleet_yaml(server, adapters=adapters or None)
            t0 = time.monotonic()
            results = await scrape(probes_of(parse_fleet(text)), timeout_s)
            took = time.monotonic() - t0
            return results

    results = asyncio.run(run())
    store = SignalStore()
    [(key, result)] = results.items()
    store.record_scrape(key, result, now=1.0)
    return store.load(key, 1.0, 1.0), store.endpoints[key], took


def adapters(load: Any) -> tuple[object, object, object]:
    return load.lora_running, load.lora_waiting, load.max_lora


def page_read(load: Any, sig: Any) -> None:
    """The rest of the llama.cpp page read as ever, and no scrape error."""
    assert (load.running, load.waiting, load.age_s) == (2.0, 4.0, 0.0)
    assert sig.scrape_error is None and sig.scrape_errors == 0 and sig.last_error is None


@pytest.mark.parametrize("scrape", SCRAPES)
def test_a_llamacpp_server_of_a_model_with_adapters_shows_the_ones_it_applies(scrape: Scrape) -> None:
    server = Server(adapters=adapters_of(entry("/models/sql.gguf"), entry("/models/other.gguf", 0.0, 1)))
    load, sig, _ = scraped(scrape, server)
    assert adapters(load) == (("sql",), (), 2)
    page_read(load, sig)
    assert server.asked.count("/lora-adapters") == 1 and server.asked.count("/metrics") == 1


@pytest.mark.parametrize("scrape", SCRAPES)
def test_a_server_started_without_lora_holds_none(scrape: Scrape) -> None:
    load, sig, _ = scraped(scrape, Server(adapters=json_body(b"[]")))
    assert adapters(load) == ((), (), 0)
    page_read(load, sig)


@pytest.mark.parametrize("scrape", SCRAPES)
def test_adapters_are_asked_for_only_of_a_model_with_adapters(scrape: Scrape) -> None:
    server = Server(adapters=adapters_of(entry("/models/sql.gguf")))
    load, sig, _ = scraped(scrape, server, adapters="")
    assert adapters(load) == UNKNOWN  # as before: nothing on the page
    page_read(load, sig)
    assert "/lora-adapters" not in server.asked


@pytest.mark.parametrize("scrape", SCRAPES)
def test_adapters_are_asked_for_only_of_a_llamacpp_page(scrape: Scrape) -> None:
    """A vLLM of a model with adapters: its page's gauge, no /lora-adapters asked."""
    server = Server(page=VLLM + lora("sql", at="2"), adapters=adapters_of(entry("/models/other.gguf")))

    async def run() -> dict[EndpointKey, ScrapeResult]:
        async with serving(server):
            text = fleet_yaml(server).replace("tiny:", "llama-3-8b:")
            return await scrape(probes_of(parse_fleet(text)), 1.0)

    [(_, result)] = asyncio.run(run()).items()
    store = SignalStore()
    store.record_scrape(("llama-3-8b", server.address), result, now=1.0)
    load = store.load(("llama-3-8b", server.address), 1.0, 1.0)
    assert adapters(load) == (("sql",), (), 2) and load.running == 3.0
    assert "/lora-adapters" not in server.asked


async def _hang(_: web.Request) -> web.StreamResponse:
    await asyncio.sleep(3)
    return web.Response(text="[]")


async def _huge_streamed(request: web.Request) -> web.StreamResponse:
    """A body past the limit with no Content-Length: refused as it arrives."""
    resp = web.StreamResponse()
    resp.content_type = "application/json"
    await resp.prepare(request)
    await resp.write(b'[{"id": 0, "path": "/models/sql.gguf", "scale": 1.0, "prompt_prefix": "')
    chunk = b"x" * 65536
    for _ in range(limits.LLAMACPP_LORA_MAX_BYTES // len(chunk) + 2):
        await resp.write(chunk)
    await resp.write(b'"}]')
    return resp


async def _broken(request: web.Request) -> web.StreamResponse:
    """Headers, then the connection dropped mid-body."""
    resp = web.StreamResponse(headers={"Content-Length": "1000"})
    await resp.prepare(request)
    await resp.write(b'[{"id": 0, "path": "/mo')
    assert request.transport is not None
    request.transport.close()
    return resp


BAD_ANSWERS = {
    "404": None,  # a llama-server too old to have the endpoint
    "500": json_body(answer(entry("/models/sql.gguf")), 500),
    "503": json_body(b'{"error": {"code": 503, "message": "Loading model"}}', 503),
    "not json": json_body(b"<html>hi</html>"),
    "an object": json_body(b'{"id": 0, "path": "/models/sql.gguf", "scale": 1.0}'),
    "a wrong type": adapters_of(entry("/models/sql.gguf", "1")),
    "too many": adapters_of(*(entry("/models/sql.gguf", index=i) for i in range(65))),
    "a path too long": adapters_of(entry("/" + "p" * PATH_MAX_CHARS)),
    "too big, said": json_body(answer(entry("/models/sql.gguf", prompt_prefix="x" * (2 << 20)))),
    "too big, streamed": _huge_streamed,
    "dropped": _broken,
    "no answer in time": _hang,
}


@pytest.mark.parametrize("scrape", SCRAPES)
@pytest.mark.parametrize("bad", list(BAD_ANSWERS))
def test_an_answer_not_usable_leaves_the_adapters_unknown_and_the_rest_read(scrape: Scrape, bad: str) -> None:
    load, sig, took = scraped(scrape, Server(adapters=BAD_ANSWERS[bad]), timeout_s=0.3)
    assert adapters(load) == UNKNOWN
    page_read(load, sig)
    assert took < 2.0  # a hung /lora-adapters costs its timeout (0.3 s), not its 3 s


@pytest.mark.parametrize("scrape", SCRAPES)
def test_a_page_refused_is_still_a_scrape_error_and_adapters_are_not_asked(scrape: Scrape) -> None:
    server = Server(page="<html>not metrics</html>", adapters=adapters_of(entry("/models/sql.gguf")))
    load, sig, _ = scraped(scrape, server)
    assert adapters(load) == UNKNOWN and load.running is None
    assert sig.scrape_error_reason == "unreadable" and sig.scrape_errors == 1
    assert "/lora-adapters" not in server.asked


@pytest.mark.parametrize("scrape", SCRAPES)
def test_each_server_shows_its_own_adapters(scrape: Scrape) -> None:
    """Two servers of one model: the one started with the adapter holds it, the other none;
    the adapter's `endpoints:` restriction does not change what a server says it holds."""
    one = Server(adapters=adapters_of(entry("/models/sql.gguf"), entry("chat.gguf", index=1)))
    two = Server(adapters=json_body(b"[]"))

    async def run() -> dict[EndpointKey, ScrapeResult]:
        async with serving(one, two):
            text = fleet_yaml(
                one,
                two,
                adapters=(
                    f"adapters: {{sql: {{source: /models/sql.gguf, endpoints: ['{two.address}']}}, "
                    "chat: {source: /srv/chat.gguf}, bare: {}}"
                ),
            )
            return await scrape(probes_of(parse_fleet(text)), 1.0)

    results = asyncio.run(run())
    store = SignalStore()
    for key, result in results.items():
        store.record_scrape(key, result, now=1.0)
    assert adapters(store.load(("tiny", one.address), 1.0, 1.0)) == (("sql", "chat"), (), 2)
    assert adapters(store.load(("tiny", two.address), 1.0, 1.0)) == ((), (), 0)


@pytest.mark.parametrize("scrape", SCRAPES)
def test_adapters_are_asked_of_the_server_whose_page_was_read(scrape: Scrape) -> None:
    """A metrics port of its own (`metrics: {port: N}`): /lora-adapters on that port too, as
    the page (llama-server serves both on one); the serving port is never asked."""
    metrics = Server(adapters=adapters_of(entry("/models/sql.gguf")))
    serving_port = Server(adapters=json_body(b"[]"))

    async def run() -> dict[EndpointKey, ScrapeResult]:
        async with serving(metrics, serving_port):
            text = fleet_yaml(serving_port).replace(
                "stable: v1,", f"stable: v1, health: none, metrics: {{port: {metrics.port}}},"
            )
            return await scrape(probes_of(parse_fleet(text)), 1.0)

    [(key, result)] = asyncio.run(run()).items()
    assert result.sample is not None or result.metrics_text is not None
    store = SignalStore()
    store.record_scrape(key, result, now=1.0)
    assert adapters(store.load(key, 1.0, 1.0)) == (("sql",), (), 1)
    assert serving_port.asked == [] and metrics.asked == ["/metrics", "/lora-adapters"]


def test_probes_carry_the_models_adapters_and_only_theirs() -> None:
    fleet = parse_fleet(
        "listener: {port: 10000}\ntiers: {small: {}}\nmodels:\n"
        "  a: {params_b: 1, stable: v1, adapters: {x: {source: /m/x.gguf}, y: {}},\n"
        "      versions: {v1: {endpoints: ['127.0.0.1:8000']}}}\n"
        "  b: {params_b: 1, stable: v1, versions: {v1: {endpoints: ['127.0.0.1:8001']}}}\n"
    )
    p = probes_of(fleet)
    assert p[("a", "127.0.0.1:8000")].adapters == (("x", "/m/x.gguf"), ("y", ""))
    assert p[("b", "127.0.0.1:8001")] == Probe()  # the default: a collector is not sent it


def test_a_record_with_llamacpp_adapters_crosses_the_process_boundary() -> None:
    import pickle

    server = Server(adapters=adapters_of(entry("/models/sql.gguf")))

    async def run() -> dict[EndpointKey, ScrapeResult]:
        async with serving(server):
            text = fleet_yaml(server)
            return await by_collector(probes_of(parse_fleet(text)), 1.0)

    [(_, result)] = asyncio.run(run()).items()
    sample = pickle.loads(pickle.dumps(result)).sample
    assert isinstance(sample, ServerSample) and sample.dialect == "llamacpp"
    assert (sample.lora_running, sample.lora_waiting, sample.max_lora) == (("sql",), (), 1)
