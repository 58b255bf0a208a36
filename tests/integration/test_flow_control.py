"""Flow control (issue 44) through a real Envoy: while every server of a model is full, its
requests wait in the picker, premium first, then fair share between tenants, then arrival;
past its class's longest wait a request gets 429 with OpenAI's body; a picker that dies or
hangs with requests queued costs none of them (fail open)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.integration.harness import EmulatedFleet, Emulator, http_get, wait_until
from tests.integration.test_dashboard_metrics import dashboard_names, page_names
from tests.integration.test_picker import PickerProc, Rig
from tests.ports import free_port

pytestmark = pytest.mark.envoy

MODEL = "chat"
CLUSTER = f"{MODEL}@v1"
DECODE_MS = 100  # per output token: a request of TOKENS tokens holds its server's one slot ~1 s
TOKENS = 10
STANDARD_WAIT_S = 8.0


def fleet(addresses: list[str], picker: str, adapter: bool = False) -> str:
    """`adapter`: the model has an adapter, `tuned`, on the first server only."""
    return (
        "\n".join(
            [
                "listener: {port: %d}",
                "signals: {interval: 300ms, timeout: 250ms}",
                f"picker: {{endpoints: ['{picker}'], timeout: 1000ms}}",
                "priority_classes: {premium: {routing_priority: high}, standard: {}, batch: {}}",
                "default_priority_class: standard",
                "tiers:",
                "  small:",
                "    timeout: 60s",
                "    balancing: picker",
                "    flow_control:",
                f"      max_wait: {{premium: 20s, standard: {STANDARD_WAIT_S:g}s, batch: 1500ms}}",
                "      max_requests: 40",
                # the tenants named (the picker's metrics label them); no rate-limit service runs
                # there: Envoy serves without a decision (fail open), as docs/quotas.md says
                f"quotas: {{key: {{header: x-api-key}}, service: {{endpoints: ['127.0.0.1:{free_port()}']}}, "
                "tenants: {acme: {}, globex: {}}}",
                "models:",
                f"  {MODEL}:",
                "    params_b: 8",
                "    stable: v1",
                *([f"    adapters: {{tuned: {{endpoints: ['{addresses[0]}']}}}}"] if adapter else []),
                "    versions:",
                "      v1:",
                "        endpoints:",
                *(f"          - {{address: '{a}'}}" for a in addresses),
            ]
        )
        + "\n"
    )


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    yield from _rig(tmp_path)


@pytest.fixture
def adapter_rig(tmp_path: Path) -> Iterator[Rig]:
    yield from _rig(tmp_path, adapter=True)


def _rig(tmp_path: Path, adapter: bool = False) -> Iterator[Rig]:
    """Two emulated servers of one slot each, a control plane, a picker with the servers'
    pages, and a real Envoy; `adapter`: the first server has adapter `tuned`, in the fleet
    file as on its first server only."""
    fl = EmulatedFleet(tmp_path)
    picker: PickerProc | None = None
    try:
        for n in ("a", "b"):
            lora = {"lora_modules": ["tuned=/adapters/tuned"], "max_loras": 1} if adapter and n == "a" else {}
            fl.servers[n] = Emulator(n, tmp_path, MODEL, slots=1, decode_ms_per_token=DECODE_MS, **lora)
        picker_port = free_port()
        text = fleet([s.address for s in fl.servers.values()], f"127.0.0.1:{picker_port}", adapter)
        fl.serve(text % fl.listener)
        assert fl.cp is not None and fl.envoy is not None
        admin = (fl.cp.admin, fl.cp.state_dir / "admin-token")
        picker = PickerProc("picker", fl.cp.xds, tmp_path, picker_port, admin=admin).start()
        envoy = fl.envoy
        wait_until(
            lambda: [h for _, h in envoy.endpoints(CLUSTER).values()] == ["healthy"] * 2,
            20,
            "Envoy to have both servers healthy",
        )
        rig = Rig(fl, picker)
        learn_slots(rig)
        yield rig
    finally:
        if picker is not None:
            picker.stop()
        fl.close()


def learn_slots(rig: Rig) -> None:
    """Until the picker knows both servers' one slot: it learns a server's slots from its page
    when requests wait there, and until then counts it free (the queue does not engage)."""
    slots = [f'controlplane_picker_server_slots{{server="{s.address}"}}' for s in rig.fleet.servers.values()]
    deadline = time.monotonic() + 60
    while not all(rig.picker.metric(s) == 1 for s in slots):
        assert time.monotonic() < deadline, "the picker never learned the servers' slots"
        burst = Sent()
        for i in range(6):  # three for each one-slot server: two wait there
            burst.send(rig.listener, f"learn-{i}")
        burst.join()


@dataclass
class Sent:
    """Requests sent in threads: each one's (id, status, seconds, body)."""

    results: dict[str, tuple[int, float, str]] = field(default_factory=dict)
    threads: list[threading.Thread] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def send(self, port: int, rid: str, headers: dict[str, str] | None = None, model: str = MODEL) -> None:
        def run() -> None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            body = json.dumps({"model": model, "prompt": "hello", "max_tokens": TOKENS}).encode()
            t0 = time.monotonic()
            try:
                conn.request(
                    "POST",
                    "/v1/completions",
                    body,
                    {"content-type": "application/json", "x-request-id": rid, **(headers or {})},
                )
                r = conn.getresponse()
                data = r.read().decode()
                self.results[rid] = (r.status, time.monotonic() - t0, data)
            except Exception as e:
                self.errors.append(f"{rid}: {e!r}")
            finally:
                conn.close()

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.threads.append(t)

    def join(self, timeout: float = 60.0) -> None:
        for t in self.threads:
            t.join(timeout)


def waiting(rig: Rig) -> float:
    """Requests waiting in the picker's queue, every class and tenant."""
    _, page = http_get(f"http://127.0.0.1:{rig.picker.metrics_port}/metrics")
    return sum(
        float(line.split()[-1])
        for line in page.splitlines()
        if line.startswith("controlplane_picker_flow_waiting{")
    )


def demand(rig: Rig) -> float:
    """The model's demand as the control plane's autoscaler counts it."""
    assert rig.fleet.cp is not None
    _, page = http_get(f"http://127.0.0.1:{rig.fleet.cp.metrics_port}/metrics")
    for line in page.splitlines():
        if line.startswith(f'controlplane_model_demand{{model="{MODEL}"}}'):
            return float(line.split()[-1])
    return 0.0


def picked_order(rig: Rig) -> list[str]:
    """Request ids in the order the picker named their servers (its debug log)."""
    assert rig.picker.proc is not None
    out = []
    for line in rig.picker.proc.log().splitlines():
        if '"request picked"' in line:
            out.append(json.loads(line)["request_id"])
    return out


def test_while_every_server_is_full_premium_goes_first_then_tenants_take_turns(rig: Rig) -> None:
    sent = Sent()
    n0 = len(picked_order(rig))
    for i in range(2):  # both servers busy
        sent.send(rig.listener, f"busy-{i}")
    wait_until(lambda: len(picked_order(rig)) >= n0 + 2, 20, "both servers busy")
    for i in range(6):  # acme's burst queues first...
        sent.send(rig.listener, f"acme-{i}", {"x-api-key": "acme"})
    wait_until(lambda: waiting(rig) >= 6, 20, "acme's requests queued")
    for i in range(2):  # ...then globex's two, then a premium request
        sent.send(rig.listener, f"globex-{i}", {"x-api-key": "globex"})
    wait_until(lambda: waiting(rig) >= 8, 20, "globex's requests queued")
    sent.send(rig.listener, "premium-0", {"x-priority": "premium", "x-api-key": "acme"})
    sent.join()
    assert sent.errors == [], sent.errors
    assert {s for s, _, _ in sent.results.values()} == {200}, sent.results
    order = [r for r in picked_order(rig) if not r.startswith(("busy", "learn"))]
    assert order[0] == "premium-0", order  # it came last and went first
    # globex waited behind acme's burst only as long as the tokens both were served make fair:
    # both its requests went within the first five of the standard class, not after all six.
    standard = [r for r in order if r != "premium-0"]
    assert max(standard.index(g) for g in ("globex-0", "globex-1")) < 5, standard
    assert (
        rig.picker.metric(
            'controlplane_picker_flow_dispatched_total{class="premium",model="chat",tenant="acme"}'
        )
        == 1
    )


def test_an_adapter_on_one_server_waits_for_that_one_and_lets_others_pass(adapter_rig: Rig) -> None:
    """While server a (the only one with `tuned`) is busy, a request for `tuned` waits in the
    queue, and the base model's requests behind it take b's slot as it frees; `tuned` goes
    to a once a frees, and is served there."""
    rig = adapter_rig
    sent = Sent()
    n0 = len(picked_order(rig))
    for i in range(2):  # both servers busy
        sent.send(rig.listener, f"busy-{i}")
    wait_until(lambda: len(picked_order(rig)) >= n0 + 2, 20, "both servers busy")
    sent.send(rig.listener, "tuned-0", model="tuned")
    wait_until(lambda: waiting(rig) >= 1, 20, "the adapter's request queued")
    for i in range(2):
        sent.send(rig.listener, f"base-{i}")
    wait_until(lambda: waiting(rig) >= 3, 20, "the base model's requests queued behind it")
    sent.join()
    assert sent.errors == [], sent.errors
    assert {s for s, _, _ in sent.results.values()} == {200}, sent.results
    assert json.loads(sent.results["tuned-0"][2])["model"] == "tuned"
    _, stats = http_get(f"http://{rig.fleet.servers['a'].address}/emulator/stats")
    assert json.loads(stats)["lora"]["requests"] == {"tuned": 1}
    order = [r for r in picked_order(rig) if not r.startswith(("busy", "learn"))]
    assert sorted(order) == ["base-0", "base-1", "tuned-0"], order


def test_past_its_class_wait_a_request_gets_429_with_openais_body(rig: Rig) -> None:
    sent = Sent()
    for i in range(4):
        sent.send(rig.listener, f"busy-{i}")
    wait_until(lambda: waiting(rig) >= 2, 20, "two requests queued")
    t0 = time.monotonic()
    sent.send(rig.listener, "batch-0", {"x-priority": "batch", "x-api-key": "acme"})
    sent.join()
    status, seconds, body = sent.results["batch-0"]
    assert status == 429, sent.results
    assert 1.2 <= seconds < 5.0, seconds  # its class's 1.5 s (answered 0.25 s before), not 8 s
    error = json.loads(body)["error"]
    assert error["code"] == "rate_limit_exceeded" and "1.5s" in error["message"], error
    assert time.monotonic() - t0 < 30
    assert {sent.results[f"busy-{i}"][0] for i in range(4)} == {200}
    shed = 'controlplane_picker_flow_shed_total{class="batch",model="chat",reason="timeout",tenant="acme"}'
    assert rig.picker.metric(shed) == 1
    # The dashboard's Flow control row reads the picker's page: every name it uses is on it.
    _, page = http_get(f"http://127.0.0.1:{rig.picker.metrics_port}/metrics")
    used, exported = dashboard_names("controlplane_picker_flow_"), page_names(page)
    assert len(used) >= 4 and used <= exported, sorted(used - exported)


def _queue_then(rig: Rig, act: str) -> tuple[Sent, float]:
    """Both servers busy and 12 requests queued; then the picker is killed (SIGKILL) or hung
    (SIGSTOP). Returns the requests and when it happened."""
    sent = Sent()
    for i in range(14):
        sent.send(rig.listener, f"r-{i}")
    wait_until(lambda: waiting(rig) >= 12, 20, "12 requests queued")
    # The picker reports its queue to the control plane: demand for the autoscaler, beside
    # the two requests the servers run.
    wait_until(lambda: demand(rig) >= 14, 20, "the queued requests counted as the model's demand")
    assert rig.picker.proc is not None
    at = time.monotonic()
    if act == "kill":
        rig.picker.kill()
    else:
        os.kill(rig.picker.proc.popen.pid, signal.SIGSTOP)
    return sent, at


def test_a_picker_killed_with_requests_queued_releases_them_all_to_the_weights(rig: Rig) -> None:
    sent, killed_at = _queue_then(rig, "kill")
    sent.join()
    assert sent.errors == [], sent.errors
    assert {s for s, _, _ in sent.results.values()} == {200}, sent.results  # fail open: none failed
    assert len(sent.results) == 14
    envoy = rig.fleet.envoy
    assert envoy is not None
    assert envoy.stat("http.inference.ext_proc.picker.failure_mode_allowed") >= 12
    # Released at once, not after their wait: the 14 take their turns on the two servers.
    assert time.monotonic() - killed_at < STANDARD_WAIT_S + 4, time.monotonic() - killed_at


def test_a_hung_picker_holds_a_queued_request_at_most_its_class_wait(rig: Rig) -> None:
    assert rig.picker.proc is not None
    pid = rig.picker.proc.popen.pid
    try:
        sent, stopped_at = _queue_then(rig, "stop")
        sent.join(90)
        took = time.monotonic() - stopped_at
    finally:
        os.kill(pid, signal.SIGCONT)
    assert sent.errors == [], sent.errors
    assert {s for s, _, _ in sent.results.values()} == {200}, sent.results
    envoy = rig.fleet.envoy
    assert envoy is not None
    assert envoy.stat("http.inference.ext_proc.picker.message_timeouts") >= 12
    # Each waited its class's 8 s, then went by the weights, into the servers' own queues:
    # two slots, ~1 s a request.
    longest = max(s for _, s, _ in sent.results.values())
    assert longest >= STANDARD_WAIT_S, longest
    assert took < STANDARD_WAIT_S + 14 / 2 * DECODE_MS * TOKENS / 1000 + 4, took


def test_a_streamed_request_holds_its_slot_in_the_pickers_view_until_it_ends(rig: Rig) -> None:
    """A stream's headers come before its first token: the picker must count it in flight
    until its end (its trailers), or it would send the next request to a busy server."""
    done, streaming = threading.Event(), threading.Event()

    def stream() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", rig.listener, timeout=60)
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 30, "stream": True}
        try:
            conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
            resp = conn.getresponse()
            chunks = 0
            while resp.read1(65536):
                chunks += 1
                if chunks == 5:  # tokens flowing: its headers long sent, most of it to come
                    streaming.set()
        finally:
            conn.close()
            done.set()

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    inflight = "controlplane_picker_inflight_requests"
    wait_until(lambda: rig.picker.metric(inflight) == 1, 10, "the stream picked")
    wait_until(streaming.is_set, 10, "the stream's tokens to flow")
    assert rig.picker.metric(inflight) == 1 and not done.is_set()
    wait_until(done.is_set, 30, "the stream to end")
    wait_until(lambda: rig.picker.metric(inflight) == 0, 10, "the picker to see it end")
    t.join(5)


def test_bad_input_while_queued_gets_the_default_or_a_precise_error_and_loses_nothing(rig: Rig) -> None:
    dispatched = "controlplane_picker_flow_dispatched_total"
    other = f'{dispatched}{{class="standard",model="chat",tenant="other"}}'
    anonymous = f'{dispatched}{{class="standard",model="chat",tenant=""}}'
    sent = Sent()
    n0 = len(picked_order(rig))
    for i in range(2):
        sent.send(rig.listener, f"busy-{i}")
    wait_until(lambda: len(picked_order(rig)) >= n0 + 2, 20, "both servers busy")
    # Counted from here: a busy request may itself have waited (and been counted dispatched)
    # when the picker had not yet seen the last request before it end.
    before = rig.picker.metric(other), rig.picker.metric(anonymous)
    sent.send(rig.listener, "nonsense", {"x-priority": "platinum"})  # unknown: the default class
    sent.send(rig.listener, "no-tenant")  # no x-api-key: the tenant ""
    sent.send(rig.listener, "big-tenant", {"x-api-key": "k" * 4000})  # over 256 bytes: its digest
    wait_until(lambda: waiting(rig) >= 3, 20, "three requests queued")
    # A client that goes away while queued: removed at once, counted, nothing else lost.
    gone = socket.create_connection(("127.0.0.1", rig.listener))
    body = json.dumps({"model": MODEL, "prompt": "bye", "max_tokens": TOKENS}).encode()
    gone.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    wait_until(lambda: waiting(rig) >= 4, 20, "the fourth request queued")
    gone.close()
    shed_gone = 'controlplane_picker_flow_shed_total{class="standard",model="chat",reason="gone",tenant=""}'
    wait_until(lambda: rig.picker.metric(shed_gone) == 1, 20, "the vanished client's request removed")
    # A 10 MB key never reaches the picker: Envoy refuses the headers (431), nothing queued changes.
    huge = http.client.HTTPConnection("127.0.0.1", rig.listener, timeout=30)
    try:
        huge.request(
            "POST",
            "/v1/completions",
            body,
            {"content-type": "application/json", "x-api-key": "k" * (10 << 20)},
        )
        status = huge.getresponse().status
    except (ConnectionError, http.client.HTTPException):
        status = 0  # reset before a status: refused all the same
    finally:
        huge.close()
    assert status in (431, 0), status
    sent.join()
    assert sent.errors == [], sent.errors
    assert {r: s for r, (s, _, b) in sent.results.items() if s != 200} == {}, {
        r: b for r, (s, _, b) in sent.results.items() if s != 200
    }  # the other three served
    assert rig.picker.metric(other) - before[0] == 1  # the 4 KB key, as its digest
    assert rig.picker.metric(anonymous) - before[1] == 2  # no key, and the unknown class
