"""Real llama.cpp servers as test peers: the product's runner (controlplane/sim/llamacpp.py,
which the demo uses too), on ports from tests/ports.py (safe when tests run in parallel)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from controlplane.sim import llamacpp
from controlplane.sim.llamacpp import LONG_MAX_TOKENS, SLOTS, health, llama_server_binary
from tests.ports import free_port

__all__ = ["LONG_MAX_TOKENS", "SLOTS", "LlamaServer", "health", "llama_server_binary"]


class LlamaServer(llamacpp.LlamaServer):
    """`controlplane.sim.llamacpp.LlamaServer`, its port (unless given) from tests/ports.py."""

    def __init__(
        self, binary: str, model: Path, log_dir: Path, *, port: int | None = None, **kw: Any
    ) -> None:
        super().__init__(binary, model, log_dir, port=free_port() if port is None else port, **kw)
