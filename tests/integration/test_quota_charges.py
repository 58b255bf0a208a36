"""Issue 41, finding 1, through a real Envoy 1.40: a response is charged what the server may
send. A stream with `max_tokens: 1` and `max_completion_tokens: 3000` gets 3,000 tokens from an
OpenAI-style server (the emulator lets max_completion_tokens win); it was charged 23. Now it is
charged its largest output limit (no usage in the stream), or its own usage event when the
server sends one (`stream_options.include_usage`, read as the stream passes by Envoy's Lua
filter, which holds nothing back: the first event reaches the client while the server is still
generating)."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.harness import EmulatedFleet, Emulator, http_get, wait_until
from tests.integration.quota_rig import QuotaService
from tests.ports import free_port

pytestmark = pytest.mark.envoy

MODEL = "chat"
USAGE = 'controlplane_quota_tokens_total{how="usage",model="chat",tenant="acme"}'
ESTIMATE = 'controlplane_quota_tokens_total{how="estimate",model="chat",tenant="acme"}'


@dataclass
class Rig:
    fleet: EmulatedFleet
    service: QuotaService
    server: Emulator


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    fleet = EmulatedFleet(tmp_path)
    service: QuotaService | None = None
    try:
        # 1 ms a token: 3,000 tokens take 3 s, long enough to see a stream pass unheld.
        server = fleet.servers["a"] = Emulator("a", tmp_path, MODEL, decode_ms_per_token=1)
        port = free_port()
        text = (
            f"listener: {{port: {fleet.listener}}}\n"
            "tiers: {small: {timeout: 60s}}\n"
            "quotas:\n"
            "  key: {header: x-api-key}\n"
            f"  service: {{endpoints: ['127.0.0.1:{port}'], timeout: 500ms}}\n"
            "  tenants: {acme: {requests_per_minute: 1000, tokens_per_minute: 1000000}}\n"
            "models:\n"
            f"  {MODEL}: {{params_b: 8, stable: v1, versions: {{v1: {{endpoints: ['{server.address}']}}}}}}\n"
        )
        (tmp_path / "fleet.yaml").write_text(text)
        service = QuotaService(tmp_path / "fleet.yaml", tmp_path)
        service.port = port
        service.start()
        fleet.serve(text)
        yield Rig(fleet, service, server)
    finally:
        if service is not None:
            service.stop()
        fleet.close()


def post(
    rig: Rig, body: dict[str, object]
) -> tuple[int, http.client.HTTPResponse, http.client.HTTPConnection]:
    conn = http.client.HTTPConnection("127.0.0.1", rig.fleet.listener, timeout=60)
    raw = json.dumps(body)
    conn.request(
        "POST", "/v1/completions", body=raw, headers={"content-type": "application/json", "x-api-key": "acme"}
    )
    r = conn.getresponse()
    return len(raw), r, conn


def events(r: http.client.HTTPResponse) -> Iterator[str]:
    """The data of each SSE event, as it arrives."""
    for line in r:
        text = line.decode().strip()
        if text.startswith("data: "):
            yield text[len("data: ") :]


def running(rig: Rig) -> int:
    _, text = http_get(f"http://{rig.server.address}/emulator/stats")
    return int(json.loads(text)["running"])


def test_a_stream_without_usage_is_charged_its_largest_output_limit(rig: Rig) -> None:
    body = {
        "model": MODEL,
        "prompt": "hi there",
        "max_tokens": 1,
        "max_completion_tokens": 3000,
        "stream": True,
    }
    size, r, conn = post(rig, body)
    try:
        assert r.status == 200, r.read()
        got = list(events(r))
    finally:
        conn.close()
    chunks = [e for e in got if e != "[DONE]"]
    assert len(chunks) == 3001, len(chunks)  # 3,000 tokens and the closing event: what the finding saw
    assert not any("usage" in json.loads(c) for c in chunks)  # nothing to read: estimated
    wait_until(lambda: rig.service.metric(ESTIMATE) > 0, 10, "the stream's charge")
    charged = rig.service.metric(ESTIMATE)
    assert 3000 <= charged <= 3000 + size // 4 + 1, charged  # was 23: bytes / 4 + max_tokens
    assert rig.service.metric(USAGE) == 0


def test_a_stream_with_a_usage_event_is_charged_its_usage_and_is_not_held(rig: Rig) -> None:
    body = {
        "model": MODEL,
        "prompt": "hi there",
        "max_tokens": 1,
        "max_completion_tokens": 3000,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    _, r, conn = post(rig, body)
    try:
        assert r.status == 200 and r.getheader("content-type", "").startswith("text/event-stream")
        stream = events(r)
        first = next(stream)
        # The first event is here while the server still generates: Envoy's filters (the
        # usage reader among them) let the stream pass as it comes, holding nothing back.
        assert running(rig) == 1, "the stream was held until the server finished"
        rest = list(stream)
    finally:
        conn.close()
    usage = json.loads([e for e in [first, *rest] if e != "[DONE]"][-1])["usage"]
    assert usage["completion_tokens"] == 3000, usage
    wait_until(
        lambda: rig.service.metric(USAGE) + rig.service.metric(ESTIMATE) > 0, 10, "the stream's charge"
    )
    assert rig.service.metric(ESTIMATE) == 0  # the usage event was read, not estimated around
    assert rig.service.metric(USAGE) == usage["total_tokens"]
    # A JSON answer with the same limits: charged its usage.total_tokens, as before.
    body = {"model": MODEL, "prompt": "hi there", "max_tokens": 1, "max_completion_tokens": 20}
    _, r, conn = post(rig, body)
    try:
        answer = json.loads(r.read())
    finally:
        conn.close()
    assert answer["usage"]["completion_tokens"] == 20
    total = usage["total_tokens"] + answer["usage"]["total_tokens"]
    wait_until(lambda: rig.service.metric(USAGE) == total, 10, "the JSON answer's charge")
