"""The inference-server emulator: honest stand-ins for GPU model servers, on real HTTP.

Each `EmulatedServer` is one aiohttp site on its own port that answers the OpenAI API
(`/v1/completions`, `/v1/chat/completions`, `/v1/models`), `/health` and a vLLM-dialect
`/metrics` page. Latency comes from a continuous-batching model running in real time
(`emulator_engine`), with `ServerSpec`'s parameters. LoRA adapters are served as vLLM
serves them (`emulator_lora`): registered at start or at runtime, loaded into a bounded
number of GPU slots. Faults (slowness, errors, OOMs, crashes, a backlog, garbage metrics,
adapters that fail to load) are set at runtime over `/emulator/faults` or from Python. One
process can host many servers; `start_emulators` starts a set on free ports.
docs/emulator.md describes the behaviour, the HTTP API and the command.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any, Literal, TypeVar, get_args

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from controlplane.kvcache.prompt import Tokenizers, token_ids
from controlplane.sim.emulator_engine import LiveBatchingServer
from controlplane.sim.emulator_lora import (
    MAX_ADAPTERS,
    MAX_LORA_LOAD_S,
    MAX_LORAS,
    AdapterLoadFailed,
    AdapterSlots,
    LoraCounts,
    adapter_name_problem,
    lora_module,
)
from controlplane.sim.emulator_metrics import (
    GARBAGE_PAGE,
    MAX_MODEL_LEN,
    METRICS_PAGES,
    MetricsPage,
    TritonMetrics,
    VllmMetrics,
)
from controlplane.sim.emulator_protocol import (
    ApiError,
    Faults,
    FaultsInvalid,
    RequestKind,
    completion_body,
    parse_completion_request,
    sse,
    stream_chunk,
)
from controlplane.sim.kv_publisher import KvPublisher
from controlplane.sim.prefix_cache import BLOCK_TOKENS, PrefixCache, token_id
from controlplane.sim.service import ServerSpec

__all__ = [
    "EmulatedServer",
    "EmulatorConfig",
    "Emulators",
    "EmulatorsThread",
    "Faults",
    "FaultsInvalid",
    "start_emulators",
]

T = TypeVar("T")
SERVER_HEADER = "x-emulator-server"
log = structlog.get_logger("controlplane.emulate")
_GRACE_S = 0.5  # how long a graceful stop lets in-flight requests finish
_COMPLETION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_PROBE_PATHS_KEPT = 64  # distinct other paths counted per server; the rest count as "other"

# What the page's `vllm:lora_requests_info` labels list. "in_flight": both labels list every
# adapter with a request in flight, waiting or running, as vLLM 0.32 prints them
# (vllm/v1/metrics/stats.py, LoRARequestStates.update_scheduler_stats writes every adapter into
# both). "split": running lists adapters with running requests, waiting those with waiting
# ones, as vLLM v1 printed them when the metric came (vLLM PR 13504).
LoraInfoLabels = Literal["in_flight", "split"]
LORA_INFO_LABELS: tuple[LoraInfoLabels, ...] = get_args(LoraInfoLabels)


@dataclass(frozen=True)
class EmulatorConfig:
    """One emulated server. Token times are seconds at speed 1 (ServerSpec's defaults)."""

    model: str
    gpu: str | None = None  # GPU class, informational (stats, logs)
    speed: float = ServerSpec.speed  # relative GPU speed: 0.33 serves 3x slower
    slots: int = ServerSpec.slots  # sequences decoded at once (continuous batching)
    prefill_s_per_token: float = ServerSpec.prefill_s_per_token
    decode_s_per_token: float = ServerSpec.decode_s_per_token
    kv_capacity_tokens: int = ServerSpec.kv_capacity_tokens
    cold_start_s: float = 0.0  # /health and the API answer 503 this long after each start
    default_max_tokens: int = 16  # output tokens when a request sets no max_tokens
    max_tokens_limit: int = 4096  # a larger max_tokens is refused with 400
    phantom_prompt_tokens: int = 256  # size of each backlog phantom request
    phantom_output_tokens: int = 256
    faults: Faults = field(default_factory=Faults)  # in force from the start
    seed: int | None = None  # seeds the error/OOM draws, for repeatable runs
    metrics_page: MetricsPage = "full"  # "compact": only the families the control plane reads
    # KV events as vLLM publishes them (sim/kv_publisher.py): bound at this ZMQ endpoint, with
    # a replay socket; the prompt tokenized with this tokenizer directory (else a word a token).
    kv_events: str | None = None
    kv_replay: str | None = None
    tokenizer: str | None = None
    # LoRA adapters as vLLM serves them (emulator_lora.py, docs/emulator.md): those registered
    # at start (vLLM's --lora-modules: `name=path`, or `name`); the GPU's adapter slots
    # (--max-loras; None: 1 if lora_modules are given, else 0, LoRA disabled); the seconds a load
    # into a slot takes; whether POST /v1/load_lora_adapter and /v1/unload_lora_adapter exist
    # (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING); what the page's adapter labels list.
    lora_modules: tuple[str, ...] = ()
    max_loras: int | None = None
    lora_load_s: float = 0.5
    allow_runtime_lora: bool = True
    lora_info_labels: LoraInfoLabels = "in_flight"

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError(f"model: must be a non-empty string, got {self.model!r}")
        for name in ("speed", "decode_s_per_token"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: must be a finite number > 0, got {value!r}")
        for name in ("prefill_s_per_token", "cold_start_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
        for name in (
            "slots",
            "kv_capacity_tokens",
            "max_tokens_limit",
            "phantom_prompt_tokens",
            "phantom_output_tokens",
        ):
            value = getattr(self, name)
            minimum = 0 if name == "phantom_prompt_tokens" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name}: must be an integer >= {minimum}, got {value!r}")
        if not 1 <= self.default_max_tokens <= self.max_tokens_limit:
            raise ValueError(
                f"default_max_tokens: must be between 1 and max_tokens_limit ({self.max_tokens_limit}), "
                f"got {self.default_max_tokens!r}"
            )
        if self.faults.crash:
            raise ValueError("faults.crash: a server cannot start crashed")
        if self.metrics_page not in METRICS_PAGES:
            raise ValueError(
                f"metrics_page: must be one of {', '.join(METRICS_PAGES)}, got {self.metrics_page!r}"
            )
        self._check_lora()

    def _check_lora(self) -> None:
        modules = self.lora_modules
        if isinstance(modules, str) or not isinstance(modules, Sequence):
            raise ValueError(
                f"lora_modules: must be a list of 'name=path' (or 'name') entries, got {modules!r}"
            )
        if len(modules) > MAX_ADAPTERS:
            raise ValueError(f"lora_modules: at most {MAX_ADAPTERS} adapters, got {len(modules)}")
        object.__setattr__(self, "lora_modules", tuple(modules))  # a list given: frozen, hashable
        seen: set[str] = set()
        for i, entry in enumerate(modules):
            if not isinstance(entry, str):
                raise ValueError(f"lora_modules[{i}]: must be a string 'name=path' or 'name', got {entry!r}")
            name, path = lora_module(entry)
            problem = adapter_name_problem(name, self.model)
            if problem is not None:
                raise ValueError(f"lora_modules[{i}]: the adapter name {problem}")
            if not path:
                raise ValueError(f"lora_modules[{i}]: the path after '=' is empty in {entry!r}")
            if name in seen:
                raise ValueError(f"lora_modules[{i}]: adapter {name!r} is listed twice")
            seen.add(name)
        n = self.max_loras
        if n is not None:
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_LORAS:
                raise ValueError(f"max_loras: must be an integer between 0 and {MAX_LORAS}, got {n!r}")
            if n == 0 and modules:
                raise ValueError(
                    f"max_loras: 0 disables LoRA, but lora_modules registers {len(modules)} adapters"
                )
        load = self.lora_load_s
        if isinstance(load, bool) or not isinstance(load, int | float) or not 0 <= load <= MAX_LORA_LOAD_S:
            raise ValueError(f"lora_load_s: must be a number between 0 and {MAX_LORA_LOAD_S:g}, got {load!r}")
        if not isinstance(self.allow_runtime_lora, bool):
            raise ValueError(f"allow_runtime_lora: must be true or false, got {self.allow_runtime_lora!r}")
        if self.lora_info_labels not in LORA_INFO_LABELS:
            known = ", ".join(LORA_INFO_LABELS)
            raise ValueError(f"lora_info_labels: must be one of {known}, got {self.lora_info_labels!r}")

    @property
    def lora_slots(self) -> int:
        """The GPU's adapter slots: `max_loras`, else 1 if adapters are registered at start
        (vLLM's default --max-loras), else 0: LoRA disabled."""
        if self.max_loras is not None:
            return self.max_loras
        return 1 if self.lora_modules else 0

    @property
    def spec(self) -> ServerSpec:
        return ServerSpec(
            slots=self.slots,
            speed=self.speed,
            prefill_s_per_token=self.prefill_s_per_token,
            decode_s_per_token=self.decode_s_per_token,
            kv_capacity_tokens=self.kv_capacity_tokens,
        )


@dataclass
class _Life:
    """What an emulated server process holds between a start and a crash or stop."""

    runner: web.AppRunner
    engine: LiveBatchingServer
    metrics: VllmMetrics
    started_at: float  # event-loop time
    cache: PrefixCache  # a restart empties it, as a restarted vLLM's
    adapters: AdapterSlots | None  # the GPU's LoRA slots (None: LoRA disabled); a restart empties them


class EmulatedServer:
    """One emulated inference server on host:port (port 0: the OS picks one at start)."""

    def __init__(
        self, config: EmulatorConfig, host: str = "127.0.0.1", port: int = 0, metrics_port: int | None = None
    ) -> None:
        self.config = config
        self.host = host
        self.port = port
        # Triton-style: /metrics (and /health) on a port of their own; None: the serving port.
        self.metrics_port = metrics_port
        self._metrics_runner: web.AppRunner | None = None
        self.faults = config.faults
        # The emulator's own bookkeeping, kept across crashes (the /metrics page is not).
        self.requests_total = 0  # completion and chat requests received, whatever the answer
        self.responses_by_status: Counter[int] = Counter()
        self.aborted_total = 0  # requests whose client went away (or the server crashed) mid-way
        self.crashes = 0
        # Every other request (health and load probes, /metrics, paths it does not have), by
        # "METHOD /path": a router's probes are not requests served.
        self.probes_by_path: Counter[str] = Counter()
        # LoRA: loads, evictions and failed loads per adapter, and completion requests per
        # adapter (kept across crashes); the adapters registered (name -> path), which a start
        # resets to `lora_modules` (those registered at runtime die with the process, as on vLLM).
        self.lora_counts = LoraCounts()
        self.lora_requests: Counter[str] = Counter()
        self.adapters: dict[str, str] = {}
        self._registering: set[str] = set()  # adapters being loaded by POST /v1/load_lora_adapter
        self._rng = random.Random(config.seed)
        self._life: _Life | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.kv_publisher = KvPublisher(config.kv_events, config.kv_replay) if config.kv_events else None
        self._tokenizer = Tokenizers(max_chars=None).get(config.tokenizer) if config.tokenizer else None

    # --- state -------------------------------------------------------------------------

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def is_up(self) -> bool:
        return self._life is not None

    @property
    def is_warm(self) -> bool:
        return self._life is not None and self._cold_for(self._life) <= 0

    @property
    def running(self) -> int:
        return self._life.engine.num_running if self._life else 0

    @property
    def waiting(self) -> int:
        return self._life.engine.num_waiting if self._life else 0

    def stats(self) -> dict[str, Any]:
        """The emulator's counters and current load (also served at GET /emulator/stats)."""
        engine = self._life.engine if self._life else None
        return {
            "address": self.address,
            "model": self.config.model,
            "gpu": self.config.gpu,
            "speed": self.config.speed,
            "slots": self.config.slots,
            "up": self.is_up,
            "warm": self.is_warm,
            "requests_total": self.requests_total,
            "responses_by_status": {str(k): v for k, v in sorted(self.responses_by_status.items())},
            "aborted_total": self.aborted_total,
            "crashes": self.crashes,
            "probes_by_path": dict(sorted(self.probes_by_path.items())),
            "running": engine.num_running if engine else 0,
            "waiting": engine.num_waiting if engine else 0,
            "phantoms": engine.backlog if engine else 0,
            "kv_cache_usage": engine.kv_use if engine else 0.0,
            "metrics_port": self.metrics_port,
            "faults": self.faults.to_json(),
            "lora": self.lora_stats(),
        }

    def lora_stats(self) -> dict[str, Any] | None:
        """The LoRA adapters: registered, resident in GPU slots (least recently used first), with
        running and waiting requests; per adapter, completion requests, loads into a slot,
        evictions from one and failed loads (kept across crashes). None: LoRA disabled."""
        if not self.config.lora_slots:
            return None
        life = self._life
        _, running, waiting = life.engine.lora_adapters() if life else ([], [], [])
        c = self.lora_counts
        return {
            "max_loras": self.config.lora_slots,
            "load_s": self.config.lora_load_s,
            "registered": list(self.adapters),
            "resident": life.adapters.resident if life and life.adapters else [],
            "running": running,
            "waiting": waiting,
            "requests": dict(sorted(self.lora_requests.items())),
            "loads": dict(sorted(c.loads.items())),
            "loads_total": c.loads.total(),
            "evictions": dict(sorted(c.evictions.items())),
            "evictions_total": c.evictions.total(),
            "load_failures": dict(sorted(c.load_failures.items())),
        }

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self) -> EmulatedServer:
        """Listen and serve; cold for `cold_start_s` from now. Raise OSError if the port is taken."""
        if self._life is not None:
            raise RuntimeError(f"emulated server {self.address} is already running")
        slots = None
        if self.config.lora_slots:
            slots = AdapterSlots(
                self.config.lora_slots, self.config.lora_load_s, self.lora_counts, fails=self._lora_fails
            )
        engine = LiveBatchingServer(self.config.spec, slots)
        runner = web.AppRunner(
            self._app(), access_log=None, handler_cancellation=True, shutdown_timeout=_GRACE_S
        )
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self.port = int(runner.addresses[0][1])
        metrics: VllmMetrics
        if self.config.metrics_page == "triton":
            metrics = TritonMetrics(self.config.model, kv_capacity_tokens=self.config.kv_capacity_tokens)
        else:
            metrics = VllmMetrics(
                self.config.model,
                page=self.config.metrics_page,
                kv_capacity_tokens=self.config.kv_capacity_tokens,
                max_loras=self.config.lora_slots,
            )
        if self.metrics_port is not None:
            mapp = web.Application()
            mapp.router.add_get("/metrics", self._metrics)
            mapp.router.add_get("/health", self._health)
            self._metrics_runner = web.AppRunner(mapp, access_log=None, handler_cancellation=True)
            await self._metrics_runner.setup()
        if self.kv_publisher is not None:
            self.kv_publisher.start()  # a new stream: a restarted server's sequence starts at 0
        cache = PrefixCache(self.config.kv_capacity_tokens // BLOCK_TOKENS, self.kv_publisher)
        self.adapters = dict(lora_module(entry) for entry in self.config.lora_modules)
        self._registering.clear()
        if slots is not None:
            # vLLM loads its --lora-modules at start-up, in order, each into a GPU slot: the last
            # `max_loras` of them are resident when it starts serving (no load cost to a request).
            for name in self.adapters:
                with contextlib.suppress(AdapterLoadFailed):
                    slots.place(name, engine.now(), cost=False)
        life = self._life = _Life(runner, engine, metrics, engine.now(), cache, slots)
        if slots is not None:
            engine.on_change = lambda: self._observe_lora(life)
        self.faults = replace(self.faults, crash=False)
        await self._apply(self.faults)
        return self

    async def stop(self) -> None:
        """Stop listening, let in-flight requests finish for a moment, then close."""
        life, self._life = self._life, None
        if life is not None:
            await self._teardown(life, abrupt=False)
        await asyncio.gather(*self._tasks, return_exceptions=True)  # a crash being carried out

    async def crash(self, reason: str = "crash fault") -> None:
        """Die as a crashed process does: the port refuses connections, open ones are reset,
        queued and running requests are lost. It stays down until `restart()`. Logged, with
        `reason`, before the port closes."""
        life, self._life = self._life, None
        if life is None:
            return
        self.faults = replace(self.faults, crash=True)
        self.crashes += 1
        log.warning(
            "emulated server going down: port closes, requests in flight are lost",
            address=self.address,
            model=self.config.model,
            reason=reason,
            running=life.engine.num_running,
            waiting=life.engine.num_waiting,
            crashes=self.crashes,
        )
        await self._teardown(life, abrupt=True)

    async def restart(self) -> EmulatedServer:
        """Start again on the same port as a fresh process: new /metrics counters, cold start
        again. Faults other than `crash` stay as they were set. Logged, as a recovery after a
        crash."""
        life, self._life = self._life, None
        if life is not None:
            await self._teardown(life, abrupt=True)
        crashed = self.faults.crash
        self.faults = replace(self.faults, crash=False)
        await self.start()
        log.info(
            "emulated server restarted: recovered from its crash" if crashed else "emulated server restarted",
            address=self.address,
            model=self.config.model,
            cold_start_s=self.config.cold_start_s,
            faults=_in_force(self.faults),
        )
        return self

    async def _metrics_site(self, up: bool) -> None:
        """Open or close the separate metrics port (closed: connection refused)."""
        runner = self._metrics_runner
        if runner is None:
            return
        if up and not runner.sites:
            await web.TCPSite(runner, self.host, self.metrics_port or 0).start()
            self.metrics_port = int(runner.addresses[0][1])
        elif not up:
            for old in list(runner.sites):
                await old.stop()
            if runner.server is not None:  # kept-alive connections are cut too, as by a firewall
                for conn in runner.server.connections:
                    if conn.transport is not None:
                        conn.transport.abort()

    async def _teardown(self, life: _Life, *, abrupt: bool) -> None:
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
            self._metrics_runner = None
        for site in list(life.runner.sites):
            await site.stop()  # the listening socket closes: connection refused from here on
        if abrupt and life.runner.server is not None:
            for conn in life.runner.server.connections:
                if conn.transport is not None:
                    conn.transport.abort()
        await life.engine.close()
        await life.runner.cleanup()
        if self.kv_publisher is not None:
            await self.kv_publisher.stop()

    # --- faults ------------------------------------------------------------------------

    async def set_faults(
        self,
        *,
        slow: float | None = None,
        error_rate: float | None = None,
        oom_rate: float | None = None,
        crash: bool | None = None,
        backlog: int | None = None,
        garbage_metrics: bool | None = None,
        probes_hang: bool | None = None,
        metrics_port_down: bool | None = None,
        lora_load_fail: Sequence[str] | None = None,
    ) -> Faults:
        """Change the named faults (None leaves one as it is); raise FaultsInvalid naming a
        bad one. `crash=True` crashes the server (see `crash`). Returns the faults in force."""
        changes = {
            k: v
            for k, v in (
                ("slow", slow),
                ("error_rate", error_rate),
                ("oom_rate", oom_rate),
                ("crash", crash),
                ("backlog", backlog),
                ("garbage_metrics", garbage_metrics),
                ("probes_hang", probes_hang),
                ("metrics_port_down", metrics_port_down),
                ("lora_load_fail", lora_load_fail),
            )
            if v is not None
        }
        wanted = self.faults.updated(changes)
        await self._apply(wanted)
        self._log_faults(changes, wanted, via="python")
        if wanted.crash:
            await self.crash()
        return self.faults

    def _log_faults(self, changes: Mapping[str, Any], wanted: Faults, via: str) -> None:
        """One line per change of faults: the values set, and every fault then in force."""
        active = _in_force(wanted)
        event = "emulated server faults set" if active else "emulated server faults cleared"
        (log.warning if active else log.info)(
            event, address=self.address, model=self.config.model, via=via, **changes, in_force=active
        )

    async def _apply(self, wanted: Faults) -> None:
        """Put every fault but `crash` in force (or keep them for the next start if down)."""
        self.faults = replace(wanted, crash=self.faults.crash if self._life is None else False)
        if self._life is not None:
            engine = self._life.engine
            engine.slow = wanted.slow
            await engine.set_backlog(
                wanted.backlog, self.config.phantom_prompt_tokens, self.config.phantom_output_tokens
            )
            await self._metrics_site(up=not wanted.metrics_port_down)

    # --- HTTP --------------------------------------------------------------------------

    def _app(self) -> web.Application:
        app = web.Application(middlewares=[self._http_errors])
        app.on_response_prepare.append(self._stamp)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/health", self._health)
        if self.metrics_port is None:
            app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/get_load", self._get_load)
        if self.config.allow_runtime_lora:  # vLLM has them with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
            app.router.add_post("/v1/load_lora_adapter", self._load_lora_adapter)
            app.router.add_post("/v1/unload_lora_adapter", self._unload_lora_adapter)
        app.router.add_get("/emulator/faults", self._get_faults)
        app.router.add_post("/emulator/faults", self._post_faults)
        app.router.add_get("/emulator/stats", self._get_stats)
        return app

    async def _stamp(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers[SERVER_HEADER] = self.address
        if request.path not in _COMPLETION_PATHS or request.method != "POST":
            key = f"{request.method} {request.path}"
            if key not in self.probes_by_path and len(self.probes_by_path) >= _PROBE_PATHS_KEPT:
                key = "other"
            self.probes_by_path[key] += 1

    @web.middleware
    async def _http_errors(
        self, request: web.Request, handler: Any
    ) -> web.StreamResponse:  # unknown paths and methods answer in OpenAI's error shape too
        try:
            response: web.StreamResponse = await handler(request)
            return response
        except web.HTTPException as e:
            if e.status < 400:
                raise
            kind = "not_found" if e.status == 404 else "invalid_request"
            err = ApiError(e.status, f"{request.method} {request.path}: {e.reason}", code=kind)
            return web.json_response(err.body(), status=e.status)

    def _cold_for(self, life: _Life) -> float:
        return life.started_at + self.config.cold_start_s - life.engine.now()

    def _check_warm(self, life: _Life) -> None:
        left = self._cold_for(life)
        if left > 0:
            raise ApiError(
                503,
                f"model '{self.config.model}' is loading; ready in {left:.1f} s",
                type="server_error",
                code="model_loading",
            )

    def _error(self, e: ApiError) -> web.Response:
        headers = {"Retry-After": "1"} if e.status == 503 else None
        return web.json_response(e.body(), status=e.status, headers=headers)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "completion")

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "chat")

    def _draw_fault(self) -> None:
        f = self.faults
        if not (f.error_rate or f.oom_rate):
            return
        u = self._rng.random()
        if u < f.error_rate + f.oom_rate and self._life is not None:
            self._life.metrics.observe_failed()  # counted by dialects that count failures (Triton)
        if u < f.error_rate:
            raise ApiError(
                500, "internal server error (emulated fault)", type="server_error", code="internal_error"
            )
        if u < f.error_rate + f.oom_rate:
            raise ApiError(
                507,
                "CUDA out of memory: no free KV-cache blocks for this request (emulated fault)",
                type="server_error",
                code="out_of_memory",
            )

    async def _complete(self, request: web.Request, kind: RequestKind) -> web.StreamResponse:
        self.requests_total += 1
        life = self._life
        assert life is not None  # handlers run only while the server is up
        try:
            self._check_warm(life)
            body = await request.read()
            req = parse_completion_request(
                body,
                kind,
                served_model=self.config.model,
                default_max_tokens=self.config.default_max_tokens,
                max_tokens_limit=self.config.max_tokens_limit,
                adapters=self.adapters,
            )
            if req.adapter is not None:
                self.lora_requests[req.adapter] += 1
            if self._tokenizer is not None:  # the prompt as the model's tokenizer cuts it
                ids = token_ids(self._tokenizer, body)
                if ids:
                    req = replace(req, prompt=tuple(str(i) for i in ids), prompt_tokens=len(ids))
            self._draw_fault()
        except ApiError as e:
            self.responses_by_status[e.status] += 1
            return self._error(e)
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        engine = life.engine
        stream: web.StreamResponse | None = None
        if req.stream:
            stream = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await stream.prepare(request)
        self.responses_by_status[200] += 1
        try:
            cached = life.cache.admit(req.prompt, req.adapter)
            life.metrics.observe_prefix(len(req.prompt), cached)
            async with engine.admit(
                req.prompt_tokens, req.output_tokens, cached_tokens=cached, adapter=req.adapter
            ) as seq:
                if stream is not None:
                    for k in range(req.output_tokens):
                        await engine.wait_until(seq.token_time(k))
                        await stream.write(sse(stream_chunk(req, request_id, created, k)))
                await engine.wait_until(seq.finished)
            batch = min(engine.num_running + 1, engine.spec.slots)  # its slot is free already
            life.metrics.observe_finished(seq, req.finish_reason, batch_size=batch)
            if stream is None:
                return web.json_response(completion_body(req, request_id, created))
            await stream.write(sse(stream_chunk(req, request_id, created, None)))
            if req.include_usage:
                await stream.write(sse(stream_chunk(req, request_id, created, None, with_usage=True)))
            await stream.write(sse("[DONE]"))
            await stream.write_eof()
            return stream
        except AdapterLoadFailed as e:
            return await self._load_failed(e, stream)
        except (asyncio.CancelledError, ConnectionError):
            self.aborted_total += 1
            raise

    async def _load_failed(
        self, e: AdapterLoadFailed, stream: web.StreamResponse | None
    ) -> web.StreamResponse:
        """A request whose adapter failed to load into a GPU slot: 500, or for a stream (whose
        200 is out) an error event and the end, as vLLM ends a stream that fails."""
        err = ApiError(500, str(e), type="server_error", code="lora_load_failed")
        if stream is None:
            self.responses_by_status[200] -= 1  # counted when it was accepted
            self.responses_by_status[500] += 1
            return self._error(err)
        await stream.write(sse(err.body()))
        await stream.write(sse("[DONE]"))
        await stream.write_eof()
        return stream

    async def _models(self, request: web.Request) -> web.Response:
        life = self._life
        assert life is not None
        try:
            self._check_warm(life)
        except ApiError as e:
            return self._error(e)
        created = int(time.time())
        model = {
            "id": self.config.model,
            "object": "model",
            "created": created,
            "owned_by": "emulator",
            "root": self.config.model,
            "parent": None,
        }
        # vLLM lists each registered adapter as a model: its path as root, the base as parent.
        adapters = [
            {**model, "id": name, "root": path, "parent": self.config.model}
            for name, path in self.adapters.items()
        ]
        return web.json_response({"object": "list", "data": [model, *adapters]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's POST /tokenize: a completion's `prompt` or a chat's `messages` as the token ids
        the server caches them by (the ids its KV events carry), in vLLM's answer shape. A
        router that keys blocks by token ids (vllm-router's kv_aware) asks this."""
        life = self._life
        assert life is not None
        try:
            self._check_warm(life)
            body = await request.read()
            try:
                chat = "messages" in json.loads(body)
            except (ValueError, TypeError, RecursionError):  # the parse below names what is wrong
                chat = False
            req = parse_completion_request(
                body,
                "chat" if chat else "completion",
                served_model=self.config.model,
                default_max_tokens=self.config.default_max_tokens,
                max_tokens_limit=self.config.max_tokens_limit,
                adapters=self.adapters,
            )
        except ApiError as e:
            return self._error(e)
        ids = token_ids(self._tokenizer, body) if self._tokenizer is not None else None
        tokens = ids if ids else [token_id(t) for t in req.prompt]
        return web.json_response(
            {"count": len(tokens), "max_model_len": MAX_MODEL_LEN, "tokens": tokens, "token_strs": None}
        )

    async def _health(self, request: web.Request) -> web.Response:
        life = self._life
        assert life is not None
        if self.faults.probes_hang:
            await asyncio.Event().wait()  # until the client gives up (the handler is cancelled)
        left = self._cold_for(life)
        if left > 0:
            return web.json_response(
                {"status": "loading", "ready_in_s": round(left, 3)}, status=503, headers={"Retry-After": "1"}
            )
        return web.json_response({"status": "ok"})

    async def _metrics(self, request: web.Request) -> web.Response:
        life = self._life
        assert life is not None
        if self.faults.probes_hang:
            await asyncio.Event().wait()  # until the client gives up (the handler is cancelled)
        if self.faults.garbage_metrics:
            return web.Response(body=GARBAGE_PAGE, content_type="text/html")
        engine = life.engine
        if life.adapters is not None and (engine.num_running or engine.num_waiting):
            self._observe_lora(life)  # a busy vLLM sets its LoRA gauge every engine step
        page = life.metrics.render(engine.num_running, engine.num_waiting, engine.kv_use)
        return web.Response(body=page, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _get_load(self, request: web.Request) -> web.Response:
        """SGLang's load endpoint, which sglang-router's power_of_two polls: one entry per
        data-parallel rank (here one) with the requests running and waiting and the tokens
        they hold: KV tokens of the running ones plus the prompts of the waiting ones."""
        life = self._life
        assert life is not None
        engine = life.engine
        load = {
            "dp_rank": 0,
            "num_reqs": engine.num_running + engine.num_waiting,
            "num_waiting_reqs": engine.num_waiting,
            "num_tokens": round(engine.held_tokens) + engine.waiting_tokens,
        }
        return web.json_response([load])

    # --- LoRA ----------------------------------------------------------------------------

    def _lora_fails(self, adapter: str) -> bool:
        return adapter in self.faults.lora_load_fail

    def _observe_lora(self, life: _Life) -> None:
        """Set the page's LoRA label set of this moment (`lora_info_labels` says which lists)."""
        live, running, waiting = life.engine.lora_adapters()
        if self.config.lora_info_labels == "in_flight":
            running = waiting = live
        life.metrics.observe_lora(running, waiting)

    async def _lora_request(self, request: web.Request, life: _Life) -> dict[str, Any]:
        """The JSON object of a load or unload request; ApiError (vLLM's shape) if it is not one."""
        self._check_warm(life)
        try:
            body = json.loads(await request.read())  # aiohttp refuses bodies over 1 MiB (413)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise _lora_error(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise _lora_error(400, "request body must be a JSON object")
        return body

    async def _load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's POST /v1/load_lora_adapter: register an adapter. vLLM loads it at once (into a
        GPU slot, evicting the least recently used idle one), so the answer comes after the load
        time; if every slot runs requests it is registered without a slot, loaded on first use."""
        life = self._life
        assert life is not None
        try:
            body = await self._lora_request(request, life)
            name, path = body.get("lora_name"), body.get("lora_path")
            if not (isinstance(name, str) and name and isinstance(path, str) and path):
                raise _lora_error(
                    400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput"
                )
            problem = adapter_name_problem(name, self.config.model)
            if problem is not None:
                raise _lora_error(400, f"'lora_name' {problem}", "InvalidUserInput")
            if life.adapters is None:
                raise _lora_error(
                    400, "LoRA is not enabled on this server: max_loras is 0 (vLLM: --enable-lora)"
                )
            if name in self.adapters or name in self._registering:
                raise _lora_error(
                    400, f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput"
                )
            if len(self.adapters) + len(self._registering) >= MAX_ADAPTERS:
                raise _lora_error(400, f"this server holds {MAX_ADAPTERS} adapters, the most it registers")
            try:
                placed = life.adapters.place(name, life.engine.now(), cost=True)
            except AdapterLoadFailed as e:
                raise _lora_error(400, str(e)) from None
        except ApiError as e:
            return self._error(e)
        self._registering.add(name)
        try:
            ready = life.adapters.ready_at(name) if placed else None
            if ready is not None:
                await life.engine.wait_until(ready)
            self.adapters[name] = path
        finally:
            self._registering.discard(name)
        log.info(
            "emulated server registered a LoRA adapter",
            address=self.address,
            adapter=name,
            path=path,
            resident=placed,
        )
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def _unload_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's POST /v1/unload_lora_adapter: new requests naming it get 404; requests already
        in flight finish with it; its GPU slot is freed once none runs it."""
        life = self._life
        assert life is not None
        try:
            body = await self._lora_request(request, life)
            name = body.get("lora_name")
            if not (isinstance(name, str) and name):
                raise _lora_error(
                    400, "either 'lora_name' and 'lora_int_id' needs to be provided.", "InvalidUserInput"
                )
            if name not in self.adapters:
                raise _lora_error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        except ApiError as e:
            return self._error(e)
        del self.adapters[name]
        if life.adapters is not None:
            life.adapters.drop(name)
        log.info("emulated server unregistered a LoRA adapter", address=self.address, adapter=name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def _get_faults(self, request: web.Request) -> web.Response:
        return web.json_response(self.faults.to_json())

    async def _post_faults(self, request: web.Request) -> web.StreamResponse:
        try:
            changes = json.loads(await request.read())
            wanted = self.faults.updated(changes)
        except FaultsInvalid as e:
            return self._error(ApiError(400, str(e), param=e.field, code="invalid_value"))
        except (ValueError, UnicodeDecodeError) as e:
            return self._error(ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json"))
        await self._apply(wanted)
        self._log_faults(changes, wanted, via="http")
        if not wanted.crash:
            return web.json_response(self.faults.to_json())
        # Answer first, then crash: the caller learns it worked, then finds the port dead.
        response = web.json_response({**self.faults.to_json(), "crash": True})
        await response.prepare(request)
        await response.write_eof()
        self._spawn(self.crash())
        return response

    async def _get_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _lora_error(status: int, message: str, type: str = "BadRequestError") -> ApiError:
    """An error of vLLM's LoRA endpoints, in vLLM's shape: its error type, the status as code."""
    return ApiError(status, message, type=type, code=status)


def _in_force(faults: Faults) -> dict[str, Any]:
    """The faults that differ from none (an empty dict: a healthy server)."""
    healthy = Faults().to_json()
    return {k: v for k, v in faults.to_json().items() if v != healthy[k]}


class Emulators:
    """A set of emulated servers in this process; an async context manager that starts them
    (each on its own port, 0 = a free one) and stops them all on exit."""

    def __init__(
        self,
        configs: Sequence[EmulatorConfig],
        host: str = "127.0.0.1",
        ports: Sequence[int] | None = None,
        metrics_ports: Sequence[int | None] | None = None,
    ) -> None:
        if ports is not None and len(ports) != len(configs):
            raise ValueError(f"ports: {len(ports)} given for {len(configs)} servers")
        self.servers = [
            EmulatedServer(
                c,
                host,
                ports[i] if ports is not None else 0,
                metrics_ports[i] if metrics_ports is not None else None,
            )
            for i, c in enumerate(configs)
        ]

    async def start(self) -> Emulators:
        """Start every server not yet up; if one cannot listen, stop the rest and raise."""
        try:
            for server in self.servers:
                if not server.is_up:
                    await server.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def stop(self) -> None:
        await asyncio.gather(*(s.stop() for s in self.servers))

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.servers]

    def __getitem__(self, index: int) -> EmulatedServer:
        return self.servers[index]

    def __iter__(self) -> Iterator[EmulatedServer]:
        return iter(self.servers)

    def __len__(self) -> int:
        return len(self.servers)

    async def __aenter__(self) -> Emulators:
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


async def start_emulators(
    configs: Sequence[EmulatorConfig], host: str = "127.0.0.1", ports: Sequence[int] | None = None
) -> Emulators:
    """Start emulated servers (ports=None: free ports chosen by the OS). Stop them with
    `await emulators.stop()`, or use the result as `async with`."""
    return await Emulators(configs, host, ports).start()


class EmulatorsThread:
    """Emulators on their own event loop in a daemon thread, for synchronous callers (the
    demo, tests that drive Envoy). `call` runs a coroutine there: `t.call(t[0].crash())`."""

    def __init__(
        self,
        configs: Sequence[EmulatorConfig],
        host: str = "127.0.0.1",
        ports: Sequence[int] | None = None,
    ) -> None:
        self._configs, self._host, self._ports = list(configs), host, ports
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="emulators")
        self.emulators: Emulators | None = None

    def start(self, timeout: float = 10.0) -> EmulatorsThread:
        self._thread.start()
        try:
            self.emulators = self.call(start_emulators(self._configs, self._host, self._ports), timeout)
        except BaseException:
            self.stop(timeout)
            raise
        return self

    def call(self, coro: Awaitable[T], timeout: float = 10.0) -> T:
        """Run `coro` on the emulators' loop and return its result."""

        async def run() -> T:
            return await coro

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)

    @property
    def servers(self) -> list[EmulatedServer]:
        return self.emulators.servers if self.emulators else []

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.servers]

    def __getitem__(self, index: int) -> EmulatedServer:
        return self.servers[index]

    def stop(self, timeout: float = 10.0) -> None:
        if self.emulators is not None:
            self.call(self.emulators.stop(), timeout)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> EmulatorsThread:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
