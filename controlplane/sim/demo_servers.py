"""The demo's inference servers: emulated (the default) or real llama.cpp servers.

Both give the scenario the same things: each server's address by name, which server
answered a request, the warming-up server, a few lines to close with, and a stop that ends
every process. The story differs where the emulator fakes what a real server does not do
on its own, and the real fleet does it for real instead:

- an L4 is about 3x slower: an emulator is told so (speed 0.35); a real L4 server serves a
  model with 3x the layers of an A100 server's (6 instead of 2, hidden 256), so each token
  takes about 3x the compute on the same CPU;
- llama-cold loads its model for a while from the moment the traffic starts (however long
  the control plane and Envoy took to start): an emulator answers 503 model_loading; a real
  llama-server loads the tiny model in milliseconds, so its process starts only after that
  while, and until then its port is held closed (bound, not listening: connections are
  refused), as a loading vLLM's is.
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from controlplane.sim.emulator import SERVER_HEADER, EmulatedServer, EmulatorConfig, EmulatorsThread
from controlplane.sim.llamacpp import LlamaServer, write_tiny_llama

COLD = "llama-cold"  # the server that warms up


LOADING_UNTIL_TRAFFIC_S = 3600.0  # llama-cold's cold start until tick() starts its real one


async def _load_for(server: EmulatedServer, cold_s: float) -> None:
    """Start `server` loading again, for `cold_s` from now."""
    server.config = replace(server.config, cold_start_s=cold_s)
    await server.restart()


class EmulatedServers:
    """Emulated GPU servers on one event loop in a thread (controlplane/sim/emulator.py)."""

    kind = "emulated"

    def __init__(self, servers: Mapping[str, tuple[str, str]], cold_s: float) -> None:
        """`servers`: name -> (model, GPU class); the L4s serve at 0.35 the speed."""
        self.names = list(servers)
        self.configs = [
            EmulatorConfig(
                model=model,
                gpu=gpu,
                speed=0.35 if gpu == "L4" else 1.0,
                slots=4,
                decode_s_per_token=0.004,
                prefill_s_per_token=0.0001,
                # llama-cold loads until the traffic starts, then for cold_s (tick): however long
                # the control plane and Envoy take to start, it is still loading at the first look.
                cold_start_s=LOADING_UNTIL_TRAFFIC_S if name == COLD else 0.0,
                seed=i,
            )
            for i, (name, (model, gpu)) in enumerate(servers.items())
        ]
        self.cold_s = cold_s
        self.loading_from_traffic = False
        self.thread: EmulatorsThread | None = None
        self.addresses: dict[str, str] = {}
        self.by_address: dict[str, str] = {}

    def start(self) -> None:
        self.thread = EmulatorsThread(self.configs).start()
        self.addresses = dict(zip(self.names, self.thread.addresses, strict=True))
        self.by_address = {a: n for n, a in self.addresses.items()}

    def describe(self) -> str:
        return (
            f"{len(self.names) - 1} emulated GPU servers (A100 and 3x slower L4; "
            f"{COLD} is loading its model for {self.cold_s:.0f}s)"
        )

    def served_by(self, response: http.client.HTTPResponse, body: bytes) -> str:
        """The server that answered (the emulator names itself in a header)."""
        return self.by_address.get(response.getheader(SERVER_HEADER) or "", "?")

    def tick(self, since_start_s: float) -> list[str]:
        """At the traffic's start, llama-cold starts loading for cold_s (the emulator then warms
        up by itself)."""
        if not self.loading_from_traffic and self.thread is not None:
            self.loading_from_traffic = True
            cold = self.thread[self.names.index(COLD)]
            self.thread.call(_load_for(cold, self.cold_s))
        return []

    def report(self) -> list[str]:
        return []

    def stop(self) -> None:
        if self.thread is not None:
            self.thread.stop()


# The real servers' GGUFs: the same architecture, an "L4" one with 3x the layers (measured
# here: 11.6 ms against 3.8 ms for 8 tokens, one thread each).
A100_MODEL = {"n_embd": 256, "n_layer": 2}
L4_MODEL = {"n_embd": 256, "n_layer": 6}


class LlamaCppServers:
    """Real `llama-server` processes (controlplane/sim/llamacpp.py), one per server name, each
    with the server's name as its alias: every answer's `model` field says who served it."""

    kind = "llama.cpp"

    def __init__(
        self, servers: Mapping[str, tuple[str, str]], cold_s: float, binary: str, work: Path
    ) -> None:
        self.gpus = {name: gpu for name, (_, gpu) in servers.items()}
        self.cold_s, self.binary, self.work = cold_s, binary, work
        self.servers: dict[str, LlamaServer] = {}
        self.addresses: dict[str, str] = {}
        self.hold: socket.socket | None = None  # llama-cold's port, closed until it starts
        self.models = {"A100": work / "a100-2-layers.gguf", "L4": work / "l4-6-layers.gguf"}

    def start(self) -> None:
        models = self.models
        write_tiny_llama(models["A100"], **A100_MODEL)
        write_tiny_llama(models["L4"], **L4_MODEL)
        for name, gpu in self.gpus.items():
            port = None
            if name == COLD:
                self.hold = socket.socket()
                self.hold.bind(("127.0.0.1", 0))  # bound, never listening: connections refused
                port = int(self.hold.getsockname()[1])
            server = LlamaServer(
                self.binary, models[gpu], self.work, alias=name, port=port, slots=4, ctx_per_slot=256
            )
            self.servers[name] = server  # before start(): one that fails to start is stopped too
            self.addresses[name] = server.address
            if name != COLD:
                server.start()

    def describe(self) -> str:
        return (
            f"{len(self.servers) - 1} real llama.cpp servers (llama-server, a tiny random GGUF each, "
            "no download; an A100 server runs a 2-layer model, an L4 one a 6-layer one, about 3x "
            f"slower per token; {COLD}'s server starts after {self.cold_s:.0f}s, its port closed until then)"
        )

    def pids(self) -> str:
        return ", ".join(f"{n}={s.proc.pid}" for n, s in self.servers.items() if s.proc is not None)

    def served_by(self, response: http.client.HTTPResponse, body: bytes) -> str:
        """The server that answered: the alias llama-server puts in its answer's `model`."""
        try:
            return str(json.loads(body)["model"])
        except (ValueError, KeyError, TypeError):
            return "?"

    def tick(self, since_start_s: float) -> list[str]:
        """Start llama-cold once its loading time is over."""
        cold = self.servers.get(COLD)
        if cold is None or cold.proc is not None or since_start_s < self.cold_s:
            return []
        if self.hold is not None:
            self.hold.close()
            self.hold = None
        cold.start()
        return [
            f"{COLD}: its llama-server started (pid {cold.proc.pid if cold.proc else '?'}), /health 200; "
            "the control plane lets it in and ramps it up"
        ]

    def report(self) -> list[str]:
        """Each server's own counters, read from its /metrics page."""
        lines = []
        for name, server in self.servers.items():
            if not server.running:
                lines.append(f"{name}: llama-server not running")
                continue
            try:
                page = server.metrics()
            except OSError as e:
                lines.append(f"{name}: /metrics unreadable: {e!r}")
                continue
            figures = {}
            for line in page.splitlines():
                if line.startswith("llamacpp:") and " " in line:
                    key, _, value = line.partition(" ")
                    figures[key] = value
            lines.append(
                f"{name}: llama-server pid {server.proc.pid if server.proc else '?'} on {server.address}: "
                f"llamacpp:tokens_predicted_total {figures.get('llamacpp:tokens_predicted_total', '?')}, "
                f"llamacpp:prompt_tokens_total {figures.get('llamacpp:prompt_tokens_total', '?')}"
            )
        return lines

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()
        if self.hold is not None:
            self.hold.close()
            self.hold = None
        for path in self.models.values():  # 35 MB, made again in a second: not kept with the logs
            path.unlink(missing_ok=True)
