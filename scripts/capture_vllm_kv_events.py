"""Capture a real vLLM server's KV events as test fixtures (issue 43).

Runs with the Python of the venv that has vLLM's CPU build (see capture_vllm_pages.py):

    nice -n 19 /tmp/vllm-venv/bin/python scripts/capture_vllm_kv_events.py [--out DIR]

Makes the tests' tiny model (tests/real/vllm_model.py), starts vLLM's OpenAI server on
127.0.0.1 with `--kv-events-config` (publisher and replay socket on ipc:// paths: nothing
listens beyond this host), subscribes, and sends: a long chat, a chat sharing its system
prompt, a completion of token ids, then `POST /reset_prefix_cache` (VLLM_SERVER_DEV_MODE=1).
Saves into tests/fixtures/kv_events/vllm/:

- `events.msgpack`: every message as published, `[topic, seq, payload]` frames;
- `replay.msgpack`: what the replay socket answered to `(b"", 0)`, frames as received;
- `requests.json`: the requests sent (bodies), in order;
- `tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`: the model's tokenizer (the tests tokenize the
  same requests and match their blocks to the events');
- `capture.json`: the source (vLLM version, the command line).

Every process started is stopped, on failure too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from capture_vllm_pages import MODEL_NAME, STARTUP_S, free_port, get, make_model, stop  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "kv_events" / "vllm"
SYSTEM = "You are the assistant of the alpha team. " + " ".join(
    f"Rule {i}: answer briefly." for i in range(40)
)


def post(base: str, path: str, body: dict[str, Any] | None) -> int:
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(base + path, data, {"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()
        return int(r.status)


def capture(out: Path) -> dict[str, Any]:
    import msgspec
    import zmq

    with tempfile.TemporaryDirectory(prefix="capture-kv-") as tmp:
        model = Path(tmp) / MODEL_NAME
        described = make_model(model)
        port = free_port()
        events, replay = f"ipc://{tmp}/kv-events", f"ipc://{tmp}/kv-replay"
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": events,
            "replay_endpoint": replay,
        }
        args = [
            "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", "1024", "--max-num-seqs", "4", "--enforce-eager",
            "--kv-events-config", json.dumps(config),
        ]  # fmt: skip
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_SERVER_DEV_MODE": "1",
        }
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(events)
        with (Path(tmp) / "vllm.log").open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )
        frames: list[list[bytes]] = []
        requests: list[dict[str, Any]] = []
        try:
            base = f"http://127.0.0.1:{port}"
            t0 = time.monotonic()
            while not _up(base):
                if proc.poll() is not None or time.monotonic() - t0 > STARTUP_S:
                    raise RuntimeError((Path(tmp) / "vllm.log").read_text()[-3000:])
                time.sleep(0.5)
            time.sleep(1.0)  # the subscription joined (ZMQ drops what a PUB sends before)
            sends = [
                ("/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 2, "messages": [
                    {"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]}),
                ("/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 2, "messages": [
                    {"role": "system", "content": SYSTEM}, {"role": "user", "content": "second question"}]}),
                ("/v1/completions", {"model": MODEL_NAME, "max_tokens": 2, "prompt": list(range(3, 300))}),
            ]  # fmt: skip
            for path, body in sends:
                assert post(base, path, body) == 200
                requests.append({"path": path, "body": body})
            assert post(base, "/reset_prefix_cache", None) == 200
            requests.append({"path": "/reset_prefix_cache", "body": None})
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if sub.poll(500):
                    frames.append(sub.recv_multipart())
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(replay)
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            replayed: list[list[bytes]] = []
            while dealer.poll(5000):
                got = dealer.recv_multipart()
                replayed.append(got)
                if int.from_bytes(got[1], "big", signed=True) == -1:
                    break
            dealer.close(0)
        finally:
            stop(proc)
            sub.close(0)
            ctx.term()
        out.mkdir(parents=True, exist_ok=True)
        (out / "events.msgpack").write_bytes(msgspec.msgpack.encode(frames))
        (out / "replay.msgpack").write_bytes(msgspec.msgpack.encode(replayed))
        (out / "requests.json").write_text(json.dumps(requests, indent=1) + "\n")
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (model / name).exists():
                shutil.copy(model / name, out / name)
        import vllm

        meta = {
            "source": f"vLLM {vllm.__version__} (vllm-cpu), {described}",
            "command": "python " + " ".join(args).replace(tmp, "$TMP"),
            "messages": len(frames),
            "replayed": len(replayed),
        }
        (out / "capture.json").write_text(json.dumps(meta, indent=1) + "\n")
        return meta


def _up(base: str) -> bool:
    try:
        return get(base + "/health", timeout=2)[0] == 200
    except OSError:
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT)
    print(json.dumps(capture(p.parse_args().out), indent=1))


if __name__ == "__main__":
    main()
