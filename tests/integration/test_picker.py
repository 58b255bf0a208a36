"""The per-request picker (issue 33) through a real Envoy: a model with `balancing: picker`
is served where the picker says; a picker killed, slow or confused costs no request, and
Envoy routes by the weights meanwhile (fail open)."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.integration.harness import (
    BIN,
    Client,
    EmulatedFleet,
    Emulator,
    Operator,
    Proc,
    http_get,
    wait_until,
)
from tests.integration.test_dashboard_metrics import dashboard_names, page_names
from tests.ports import free_port
from tests.unit.test_deploy_prometheus import ENVOY_PICKER_STATS

pytestmark = pytest.mark.envoy

MODEL = "chat"
CLUSTER = f"{MODEL}@v1"


class PickerProc:
    """One `controlplane picker` process, debug-logging each pick as JSON."""

    def __init__(
        self,
        name: str,
        control_plane: str,
        log_dir: Path,
        port: int | None = None,
        admin: tuple[str, Path] | None = None,
        peers: tuple[str, ...] = (),
        extra: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        self.peers = peers
        self.extra = extra  # more flags (TLS)
        self.admin = admin  # the operator API and a token file: picks follow the servers' pages
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.metrics_port = free_port()
        self.control_plane = control_plane
        self.log_dir = log_dir
        self.proc: Proc | None = None

    def start(self, ready: bool = True) -> PickerProc:
        """Start it; wait until it is ready (has the control plane's assignments), or with
        ready=False only until it answers health checks at all."""
        self.proc = Proc(
            self.name,
            [
                str(BIN / "controlplane"), "picker", "--control-plane", self.control_plane,
                "--listen", self.address, "--log-format", "json", "--log-level", "debug",
                "--metrics-listen", f"127.0.0.1:{self.metrics_port}",
                *(["--admin", self.admin[0], "--token-file", str(self.admin[1])] if self.admin else []),
                *(["--peers", ",".join(self.peers)] if self.peers else []),
                *(["--peer-token-file", str(self.peer_token_file())] if self.peers else []),
                *self.extra,
            ],
            self.log_dir,
        )  # fmt: skip
        if ready:
            wait_until(self.serving, 20, f"picker {self.name} to be ready")
        else:
            wait_until(lambda: self.health() is not None, 20, f"picker {self.name} to answer")
        return self

    def peer_token_file(self) -> Path:
        """The token the pickers of a test share for their peer reads (--peer-token-file)."""
        path = self.log_dir / "peer-token"
        if not path.exists():
            path.write_text("picker-peers-shared-token\n")
        return path

    def health(self) -> int | None:
        """Its gRPC health status, None while it does not answer."""
        assert self.proc is not None
        if not self.proc.alive():
            raise AssertionError(f"picker exited:\n{self.proc.log()[-3000:]}")
        with grpc.insecure_channel(self.address) as ch:
            try:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
            except grpc.RpcError:
                return None
            return int(r.status)

    def serving(self) -> bool:
        return self.health() == health_pb2.HealthCheckResponse.SERVING

    def picks(self) -> dict[str, str]:
        """request id -> the first server the picker named for it, from its log."""
        assert self.proc is not None
        out = {}
        for line in self.proc.log().splitlines():
            if '"request picked"' not in line:
                continue
            doc = json.loads(line)
            out[doc["request_id"]] = doc["picked"].split(",")[0]
        return out

    def metric(self, name: str) -> float:
        """One sample of the picker's /metrics, by its full name and labels."""
        _, page = http_get(f"http://127.0.0.1:{self.metrics_port}/metrics")
        for line in page.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        return 0.0

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


def fleet(addresses: list[str], pickers: list[str], timeout: str, affinity: str = "") -> str:
    """The rig's fleet file, its listener port left as %d."""
    lines = [
        "listener: {port: %d}",
        "signals: {interval: 300ms, timeout: 250ms}",
        f"picker: {{endpoints: {json.dumps(pickers)}, timeout: {timeout}}}",
        "tiers: {small: {timeout: 30s, balancing: picker}}",
        "models:",
        f"  {MODEL}:",
        "    params_b: 8",
        *([f"    affinity: {affinity}"] if affinity else []),
        "    stable: v1",
        "    versions:",
        "      v1:",
        "        endpoints:",
        *(f"          - {{address: '{a}'}}" for a in addresses),
    ]
    return "\n".join(lines) + "\n"


@dataclass
class Rig:
    fleet: EmulatedFleet
    picker: PickerProc

    @property
    def listener(self) -> int:
        return self.fleet.listener


@pytest.fixture
def rig(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Rig]:
    """Three emulated servers, a control plane, a picker and a real Envoy; the picker's budget
    is the test's `picker_timeout` mark (default 1000ms, the most allowed: the tests of where
    requests go must not see a pick fall back on a busy machine)."""
    mark = request.node.get_closest_marker("picker_timeout")
    timeout = mark.args[0] if mark else "1000ms"
    affinity = request.node.get_closest_marker("picker_affinity")
    rig = EmulatedFleet(tmp_path)
    picker: PickerProc | None = None
    try:
        for n in ("a", "b", "c"):
            rig.servers[n] = Emulator(n, tmp_path, MODEL, slots=8, decode_ms_per_token=2)
        picker_port = free_port()
        addresses = [s.address for s in rig.servers.values()]
        text = fleet(addresses, [f"127.0.0.1:{picker_port}"], timeout, affinity.args[0] if affinity else "")
        rig.serve(text % rig.listener)
        assert rig.cp is not None and rig.envoy is not None
        admin = (rig.cp.admin, rig.cp.state_dir / "admin-token")
        picker = PickerProc("picker", rig.cp.xds, tmp_path, picker_port, admin=admin).start()
        envoy = rig.envoy
        wait_until(
            lambda: [h for _, h in envoy.endpoints(CLUSTER).values()] == ["healthy"] * 3,
            20,
            "Envoy to have the three servers healthy",
        )
        yield Rig(rig, picker)
    finally:
        if picker is not None:
            picker.stop()
        rig.close()


def send(port: int, request_id: str, max_tokens: int = 2) -> tuple[int, str]:
    client = Client(port)
    try:
        body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": max_tokens}).encode()
        r = client.request(
            "POST", "/v1/completions", body, {"content-type": "application/json", "x-request-id": request_id}
        )
        return r.status, r.backend
    finally:
        client.close()


def test_requests_go_to_the_server_the_picker_names(rig: Rig) -> None:
    served: dict[str, str] = {}
    lock = threading.Lock()

    def worker(w: int) -> None:
        for i in range(15):
            rid = f"req-{w}-{i}"
            status, backend = send(rig.listener, rid, max_tokens=20)
            assert status == 200, status
            with lock:
                served[rid] = backend

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(served) == 60
    wait_until(lambda: set(rig.picker.picks()) >= set(served), 5, "the picker's log to name every request")
    picks = rig.picker.picks()
    mismatched = {rid: (picks[rid], b) for rid, b in served.items() if picks[rid] != b}
    assert not mismatched, mismatched
    assert len(Counter(served.values())) == 3, Counter(served.values())
    print(f"\n60 requests, each served where the picker said: {dict(Counter(served.values()))}")


@pytest.mark.picker_timeout("5ms")
def test_a_picker_killed_under_traffic_costs_no_request(rig: Rig) -> None:
    stop = threading.Event()
    results: list[tuple[float, int, str]] = []
    errors: list[str] = []

    def worker(w: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            try:
                status, backend = send(rig.listener, f"k-{w}-{i}")
            except Exception as e:
                errors.append(repr(e))
                continue
            results.append((time.monotonic(), status, backend))

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(4)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(results) >= 50, 20, "traffic through the picker")
        killed_at = time.monotonic()
        rig.picker.kill()
        wait_until(
            lambda: sum(t > killed_at + 1.0 for t, _, _ in results) >= 50, 20, "traffic on the weights"
        )
        assert rig.fleet.envoy is not None
        fell_back = rig.fleet.envoy.stat("http.inference.ext_proc.picker.failure_mode_allowed")
        # Back: the same port, a new process; picks resume.
        back = PickerProc(
            "picker-2", rig.picker.control_plane, rig.fleet.tmp, rig.picker.port, admin=rig.picker.admin
        ).start()
        try:
            wait_until(lambda: len(back.picks()) >= 20, 20, "the restarted picker to pick again")
        finally:
            stop.set()
            for t in threads:
                t.join(15)
            back.stop()
    finally:
        stop.set()
    assert errors == [], errors[:3]
    statuses = Counter(s for _, s, _ in results)
    assert set(statuses) == {200}, statuses
    assert fell_back > 0
    print(f"\npicker killed under traffic: {dict(statuses)}, {fell_back} requests routed by the weights")


def timed(port: int, rid: str) -> tuple[float, int]:
    t0 = time.monotonic()
    status, _ = send(port, rid)
    return time.monotonic() - t0, status


@pytest.mark.picker_timeout("5ms")
def test_a_hung_picker_costs_at_most_its_budget_never_a_failure(rig: Rig) -> None:
    """SIGSTOP: the picker's connection stays open and nothing answers, the worst case for a
    proxy. Each request waits out the 5 ms budget and goes by the weights."""
    import os
    import signal
    import statistics

    envoy = rig.fleet.envoy
    assert envoy is not None and rig.picker.proc is not None
    before = [timed(rig.listener, f"b-{i}") for i in range(30)]
    assert {s for _, s in before} == {200}
    # The picker answered those (most of them: on a busy machine a few miss the 5 ms budget).
    assert len(rig.picker.picks()) >= 20, len(rig.picker.picks())
    pid = rig.picker.proc.popen.pid
    earlier = envoy.stat("http.inference.ext_proc.picker.message_timeouts")
    os.kill(pid, signal.SIGSTOP)
    try:
        hung = [timed(rig.listener, f"h-{i}") for i in range(30)]
    finally:
        os.kill(pid, signal.SIGCONT)
    assert {s for _, s in hung} == {200}, hung
    timeouts = envoy.stat("http.inference.ext_proc.picker.message_timeouts") - earlier
    # One budget per request: once the pick timed out, Envoy does not ask about the response.
    assert timeouts == 30, timeouts
    p50_before, p50_hung = statistics.median(t for t, _ in before), statistics.median(t for t, _ in hung)
    # The budget is 5 ms; the rest of the margin is this shared machine's noise.
    assert p50_hung - p50_before < 0.05, (p50_before, p50_hung)
    print(f"\nhung picker: p50 {p50_before * 1000:.1f} ms -> {p50_hung * 1000:.1f} ms, {timeouts} timeouts")


def test_bad_input_takes_the_normal_path(rig: Rig) -> None:
    """What the picker never sees cannot fail because of it: bodies (a 200 KB prompt, one that
    is not JSON) and unknown models get what they get without a picker, and Envoy counts no
    picker failure."""
    envoy = rig.fleet.envoy
    assert envoy is not None
    server = next(iter(rig.fleet.servers.values()))
    client = Client(rig.listener)
    direct = Client(server.port)
    try:
        big = json.dumps({"model": MODEL, "prompt": "x" * 200_000, "max_tokens": 1}).encode()
        r = client.request("POST", "/v1/completions", big, {"content-type": "application/json"})
        assert r.status == 200, r
        junk = b"{not json"
        headers = {"content-type": "application/json", "x-model": MODEL}
        via, want = (
            client.request("POST", "/v1/completions", junk, headers),
            direct.request("POST", "/v1/completions", junk, headers),
        )
        assert via.status == want.status, (via, want)
        r = client.request(
            "POST", "/v1/completions", json.dumps({"model": "nope", "prompt": "x"}).encode(),
            {"content-type": "application/json"},
        )  # fmt: skip
        assert r.status == 404 and "model_not_found" in r.body, r
    finally:
        client.close()
        direct.close()
    assert envoy.stat("http.inference.ext_proc.picker.failure_mode_allowed") == 0
    assert envoy.stat("http.inference.ext_proc.picker.streams_failed") == 0
    assert envoy.stat("http.inference.ext_proc.picker.streams_started") >= 2
    # The names the scrape keeps (deploy/prometheus) are the ones this Envoy exports.
    _, page = http_get(f"http://127.0.0.1:{envoy.admin_port}/stats/prometheus")
    exported = {line.split("{")[0].split()[0] for line in page.splitlines() if line and line[0] != "#"}
    assert set(ENVOY_PICKER_STATS.values()) <= exported, sorted(set(ENVOY_PICKER_STATS.values()) - exported)


def test_the_picker_sees_each_request_start_and_end_and_where_it_went(rig: Rig) -> None:
    """Envoy sends the response's headers to the picker, with the upstream address: a request
    not streamed counts in flight on its server from the pick to its answer, and the picker
    learns where it really went (the served-endpoint readback). Three long requests: 3 in
    flight while they run, 0 after, each served where picked; equal servers take turns."""
    done: list[tuple[int, str]] = []

    def long_one(i: int) -> None:
        done.append(send(rig.listener, f"long-{i}", max_tokens=400))  # about 0.8 s each

    threads = [threading.Thread(target=long_one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    wait_until(
        lambda: rig.picker.metric('controlplane_picker_picks_total{reason="least_loaded"}') == 3, 5, "3 picks"
    )
    inflight = rig.picker.metric("controlplane_picker_inflight_requests")
    assert all(t.is_alive() for t in threads), "the requests ended before the look"
    assert inflight == 3
    for t in threads:
        t.join(30)
    assert [s for s, _ in done] == [200] * 3
    assert len({b for _, b in done}) == 3, done
    wait_until(
        lambda: rig.picker.metric("controlplane_picker_inflight_requests") == 0, 5, "the ends to be seen"
    )
    assert rig.picker.metric('controlplane_picker_served_total{where="picked"}') == 3
    for where in ("fallback_list", "elsewhere", "unknown"):
        assert rig.picker.metric(f'controlplane_picker_served_total{{where="{where}"}}') == 0

    # The dashboard reads a picker's own page: every name it uses there is on it.
    _, page = http_get(f"http://127.0.0.1:{rig.picker.metrics_port}/metrics")
    used, exported = dashboard_names("controlplane_picker_"), page_names(page)
    used = {n for n in used if not n.startswith("controlplane_picker_flow_")}  # test_flow_control.py
    assert len(used) >= 4 and used <= exported, sorted(used - exported)


@pytest.mark.picker_affinity("{prefix: {prompt_bytes: 16}}")
def test_a_prefix_goes_back_to_the_server_that_has_it(rig: Rig) -> None:
    """A model with prefix affinity and the picker: the gateway's Lua filter hashes the
    prompt's first 16 bytes, Envoy forwards the key, and the picker sends a prefix back to
    the server it went to (idle servers: always within the load bound); a new prefix goes to
    the least loaded, so eight prefixes spread over the three servers."""
    went: dict[str, set[str]] = {}
    for round_ in range(4):
        for k in range(8):
            client = Client(rig.listener)
            try:
                prompt = f"system-{k:02d}-----" + f" turn {round_}" * 20
                body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2}).encode()
                r = client.request(
                    "POST",
                    "/v1/completions",
                    body,
                    {"content-type": "application/json", "x-request-id": f"p{k}-{round_}"},
                )
            finally:
                client.close()
            assert r.status == 200, r.status
            went.setdefault(f"system-{k:02d}", set()).add(r.backend)
    assert all(len(servers) == 1 for servers in went.values()), went
    assert len(set().union(*went.values())) == 3, went
    assert rig.picker.metric('controlplane_picker_picks_total{reason="least_loaded"}') == 8
    assert rig.picker.metric('controlplane_picker_picks_total{reason="approximate"}') == 24
    print(f"\n8 prefixes x 4 requests, each prefix on one server: {sorted(went.items())}")


@pytest.mark.picker_timeout("100ms")
def test_a_picker_without_assignments_names_nothing_and_the_weights_route(rig: Rig) -> None:
    """A picker whose control plane is not there (a wrong address, started first) answers
    each request with no pick, at once: Envoy routes by the weights, no failure, no wait for
    the budget. Its health says NOT_SERVING meanwhile (readiness)."""
    rig.picker.stop()
    lost = PickerProc("picker-alone", f"127.0.0.1:{free_port()}", rig.fleet.tmp, rig.picker.port)
    lost.start(ready=False)
    try:
        assert lost.health() == health_pb2.HealthCheckResponse.NOT_SERVING
        results = [timed(rig.listener, f"n-{i}") for i in range(30)]
        assert [s for _, s in results] == [200] * 30
        assert lost.metric('controlplane_picker_picks_total{reason="not_ready"}') == 30
        assert lost.metric('controlplane_picker_picks_total{reason="least_loaded"}') == 0
        assert rig.fleet.envoy is not None
        assert rig.fleet.envoy.stat("http.inference.ext_proc.picker.failure_mode_allowed") == 0
        p50 = sorted(t for t, _ in results)[15]
        assert p50 < 0.1, p50  # an answer, not a budget spent waiting
        assert (
            len({b for b in (send(rig.listener, f"w-{i}")[1] for i in range(12))}) >= 2
        )  # the weights spread
    finally:
        lost.stop()


def test_the_control_plane_gone_the_picker_keeps_picking(rig: Rig) -> None:
    """The control plane stops under traffic: the picker keeps its last assignments and its
    own view of what is in flight, and goes on picking (its load readings age out); Envoy
    keeps its config. Nothing fails. Back, the picker reconnects."""
    assert rig.fleet.cp is not None
    picks = 'controlplane_picker_picks_total{reason="least_loaded"}'
    rig.fleet.cp.stop()
    wait_until(
        lambda: rig.picker.metric("controlplane_picker_control_plane_connected") == 0,
        10,
        "the picker to notice",
    )
    before = rig.picker.metric(picks)
    results = [send(rig.listener, f"o-{i}") for i in range(30)]
    assert [s for s, _ in results] == [200] * 30
    assert rig.picker.metric(picks) == before + 30
    assert len({b for _, b in results}) == 3
    rig.fleet.cp.start()
    wait_until(
        lambda: rig.picker.metric("controlplane_picker_control_plane_connected") == 1,
        20,
        "the picker to reconnect",
    )
    assert send(rig.listener, "after")[0] == 200


def test_two_pickers_count_each_others_requests(rig: Rig) -> None:
    """A second picker peered with the first (--peers both ways): Envoy spreads the picks
    over both, and each ranks by both's requests in flight. Three long requests, 150 ms
    apart, on three idle servers: one each, whichever picker took them. Unpeered, each
    picker's first pick is the same idle server (seen: two on one server, none on another)."""
    second_port = free_port()
    rig.picker.stop()
    first = PickerProc(
        "picker-p1", rig.picker.control_plane, rig.fleet.tmp, rig.picker.port, rig.picker.admin,
        peers=(f"127.0.0.1:{second_port}",),
    ).start()  # fmt: skip
    second = PickerProc(
        "picker-p2", rig.picker.control_plane, rig.fleet.tmp, second_port, rig.picker.admin,
        peers=(first.address,),
    ).start()  # fmt: skip
    assert rig.fleet.cp is not None
    try:
        # Envoy learns of the second picker from the fleet file, as an operator adds one.
        text = (rig.fleet.tmp / "fleet.yaml").read_text()
        (rig.fleet.tmp / "fleet.yaml").write_text(
            text.replace(f'["{first.address}"]', f'["{first.address}", "{second.address}"]')
        )
        assert rig.fleet.envoy is not None
        envoy = rig.fleet.envoy
        wait_until(lambda: len(envoy.endpoints("controlplane-picker")) == 2, 15, "Envoy to know both pickers")
        reads = 'controlplane_picker_peer_reads_total{result="ok"}'
        wait_until(
            lambda: min(first.metric(reads), second.metric(reads)) > 5, 10, "the pickers to read each other"
        )
        done: list[tuple[int, str]] = []

        def long_one(i: int) -> None:
            done.append(send(rig.listener, f"pair-{i}", max_tokens=600))

        picks = 'controlplane_picker_picks_total{reason="least_loaded"}'

        def picked() -> float:
            return first.metric(picks) + second.metric(picks)

        def read_by_both() -> tuple[float, float]:
            return first.metric(reads), second.metric(reads)

        def both_read_since(seen: tuple[float, float]) -> bool:
            """Each picker counted two reads of the other since `seen`: the second began after
            it (the one in flight then may have asked before)."""
            return all(now >= was + 2 for now, was in zip(read_by_both(), seen, strict=True))

        threads = []
        for i in range(3):
            before = picked()
            threads.append(threading.Thread(target=long_one, args=(i,)))
            threads[-1].start()
            # As requests arrive: the next comes once each picker has read the other's requests
            # in flight since this one was picked.
            wait_until(lambda n=before + 1: picked() >= n, 10, f"request {i} to be picked")  # type: ignore[misc]
            seen = read_by_both()
            wait_until(lambda s=seen: both_read_since(s), 10, "the pickers to read each other since")  # type: ignore[misc]
        for t in threads:
            t.join(30)
        assert [s for s, _ in done] == [200] * 3
        by_server = Counter(b for _, b in done)
        took = (first.metric(picks), second.metric(picks))
        assert min(took) >= 1, took  # both pickers picked
        assert sorted(by_server.values()) == [1, 1, 1], (by_server, took)
        print(f"\nthree requests over two peered pickers {took}: {dict(by_server)}")
    finally:
        first.stop()
        second.stop()


def test_picks_follow_the_servers_own_pages(rig: Rig) -> None:
    """A server whose page shows a queue (the emulator's backlog fault: phantom requests no
    proxy sent) gets no pick while the others are idle: the picker reads every server's
    running and waiting from the operator API and ranks by them, not by what it sent."""
    slow = rig.fleet.servers["a"]
    others = {s.address for n, s in rig.fleet.servers.items() if n != "a"}
    reads = 'controlplane_picker_load_reads_total{result="ok"}'
    wait_until(lambda: rig.picker.metric(reads) > 0, 10, "the picker to read the loads")
    slow.set_faults(backlog=16)
    try:
        wait_until(
            lambda: any(e.waiting > 0 for e in _endpoints(rig) if e.address == slow.address),
            15,
            "the control plane to read the backlog from the page",
        )
        # A loads read begun after the control plane had it: the second read counted from now
        # (the one in flight now may have asked before).
        so_far = rig.picker.metric(reads)
        wait_until(lambda: rig.picker.metric(reads) >= so_far + 2, 10, "the picker to read the loads since")
        served = [send(rig.listener, f"q-{i}")[1] for i in range(30)]
    finally:
        slow.set_faults(backlog=0)
    picks = rig.picker.picks()
    chosen = [picks[f"q-{i}"] for i in range(30)]
    assert chosen == served  # each went where the picker said
    assert slow.address not in chosen, Counter(chosen)
    assert set(chosen) == others, Counter(chosen)


def _endpoints(rig: Rig) -> list[Any]:
    assert rig.fleet.cp is not None
    op = Operator(rig.fleet.cp)
    try:
        from controlplane.v1 import endpoint_pb2

        return list(
            op.endpoints.List(endpoint_pb2.ListEndpointsRequest(), metadata=op.md, timeout=5).endpoints
        )
    finally:
        op.close()
