"""The picker under hostile and careless input (issue 41): its ext_proc and peer port as a
stranger would use them, its peers lying, local replies it must not be asked about, TLS, and
the first minutes of running it. Each test is a finding's reproduction: a real
`controlplane picker` fed by a real control plane, spoken to on its real port, or through a
real Envoy where the path goes through one."""

from __future__ import annotations

import asyncio
import json
import queue
import socket
import subprocess
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from controlplane import limits
from controlplane.v1 import picker_pb2, picker_pb2_grpc
from tests.certs import make_certs
from tests.integration.harness import BIN, Client, ControlPlane, EmulatedFleet, Emulator, wait_until
from tests.integration.quota_rig import QuotaService
from tests.integration.test_picker import CLUSTER, MODEL, PickerProc, send
from tests.integration.test_quotas import ask
from tests.ports import free_port
from tests.unit.test_picker_request import message

pytestmark = pytest.mark.envoy

TOKEN = "picker-peers-shared-token"  # what PickerProc writes for --peer-token-file


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def picked(resp: ep.ProcessingResponse) -> str:
    """The first server a request-headers answer names, "" if none."""
    for h in resp.request_headers.response.header_mutation.set_headers:
        return h.header.raw_value.decode().split(",")[0]
    return ""


class OpenStream:
    """One ext_proc stream, kept open: each request-headers message sent gets its answer."""

    def __init__(self, stub: ep_grpc.ExternalProcessorStub) -> None:
        self._out: queue.Queue[ep.ProcessingRequest | None] = queue.Queue()
        self.call = stub.Process(iter(self._out.get, None))

    def send(self, req: ep.ProcessingRequest) -> ep.ProcessingResponse:
        self._out.put(req)
        return next(self.call)  # type: ignore[no-any-return]

    def close(self) -> None:
        self._out.put(None)
        for _ in self.call:  # the server ends the stream once the client has
            pass


def ask_once(stub: ep_grpc.ExternalProcessorStub, req: ep.ProcessingRequest) -> str:
    """One request on a stream of its own, closed at once: the server named, "" for none."""
    stream = OpenStream(stub)
    try:
        return picked(stream.send(req))
    finally:
        stream.close()


@dataclass
class Direct:
    """Two emulated servers, a control plane and a picker, and an ext_proc client on the
    picker's own port (no Envoy: what a stranger on the port sends)."""

    tmp: Path
    servers: list[Emulator]
    cp: ControlPlane
    picker: PickerProc
    channel: grpc.Channel
    stub: ep_grpc.ExternalProcessorStub = field(init=False)

    def __post_init__(self) -> None:
        self.stub = ep_grpc.ExternalProcessorStub(self.channel)

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.servers]


def start_direct(tmp: Path, *picker_flags: str, peers: tuple[str, ...] = ()) -> Direct:
    servers = [Emulator(n, tmp, MODEL, slots=8) for n in ("a", "b")]
    port = free_port()
    text = (
        f"listener: {{port: {free_port()}}}\n"
        "signals: {interval: 300ms, timeout: 250ms}\n"
        f"picker: {{endpoints: ['127.0.0.1:{port}']}}\n"
        "tiers: {small: {timeout: 30s, balancing: picker}}\n"
        "models:\n"
        f"  {MODEL}: {{params_b: 8, stable: v1, versions: {{v1: {{endpoints: "
        f"{json.dumps([s.address for s in servers])}}}}}}}\n"
    )
    (tmp / "fleet.yaml").write_text(text)
    cp = ControlPlane(tmp / "fleet.yaml", tmp).start()
    picker = PickerProc("picker", cp.xds, tmp, port, peers=peers, extra=picker_flags).start()
    channel = grpc.insecure_channel(picker.address, options=[("grpc.max_send_message_length", 8 << 20)])
    rig = Direct(tmp, servers, cp, picker, channel)
    for address in rig.addresses:  # both ready: each picked when it is the only one allowed
        wait_until(
            lambda a=address: ask_once(rig.stub, message(CLUSTER, subset_list=[a])) == a,  # type: ignore[misc]
            20,
            f"the control plane to find {address} ready",
        )
    wait_until(
        lambda: rig.picker.metric("controlplane_picker_inflight_requests") == 0, 5, "the probes to end"
    )
    return rig


@pytest.fixture
def direct(tmp_path: Path) -> Iterator[Direct]:
    rig = start_direct(tmp_path)
    try:
        yield rig
    finally:
        stop_direct(rig)


def stop_direct(rig: Direct) -> None:
    rig.channel.close()
    rig.picker.stop()
    rig.cp.stop()
    for s in rig.servers:
        s.stop()


def spread(rig: Direct, n: int = 10) -> Counter[str]:
    """Where `n` requests held open at once go (then all end)."""
    streams = [OpenStream(rig.stub) for _ in range(n)]
    try:
        return Counter(picked(s.send(message(CLUSTER))) for s in streams)
    finally:
        for s in streams:
            s.close()


# ---- finding 5: the prefix index bounded in bytes ------------------------------------------------


def test_prefix_keys_of_a_megabyte_do_not_grow_the_picker(direct: Direct) -> None:
    """Finding 5: 400 picks with 1 MB prefix keys took the picker from 55 to 460 MB. The index
    now keeps a 16-byte digest per key; a key past the bound (the fleet's own largest, 1 MiB)
    gets no pick, counted."""
    assert direct.picker.proc is not None
    pid = direct.picker.proc.popen.pid

    def key(i: int) -> str:
        return f"{i:08d}" + "k" * (1_000_000 - 8)

    for i in range(20):  # gRPC's buffers for messages of this size, allocated once
        assert ask_once(direct.stub, message(CLUSTER, prefix=key(i)))
    before = rss_bytes(pid)
    for i in range(20, 420):
        assert ask_once(direct.stub, message(CLUSTER, prefix=key(i))) in direct.addresses
    grown = rss_bytes(pid) - before
    assert grown < 48 << 20, f"RSS grew {grown >> 20} MB over 400 picks with 1 MB prefix keys"
    # Still a prefix index: a key seen goes back to its server.
    again = ask_once(direct.stub, message(CLUSTER, prefix=key(419)))
    assert direct.picker.metric('controlplane_picker_picks_total{reason="approximate"}') >= 1, again
    # One byte past the bound: no pick, counted; the next request is picked as usual.
    too_long = "x" * (limits.PICKER_PREFIX_KEY_MAX_BYTES + 1)
    assert ask_once(direct.stub, message(CLUSTER, prefix=too_long)) == ""
    assert direct.picker.metric('controlplane_picker_inputs_refused_total{input="prefix_key"}') == 1
    assert direct.picker.metric('controlplane_picker_picks_total{reason="input_refused"}') == 1
    assert ask_once(direct.stub, message(CLUSTER)) in direct.addresses
    print(f"\n400 picks with 1 MB prefix keys: RSS {before >> 20} MB -> {(before + grown) >> 20} MB")


# ---- finding 6: one stream, one pick --------------------------------------------------------------


def test_two_thousand_request_headers_on_one_stream_leave_nothing_in_flight(direct: Direct) -> None:
    """Finding 6: one stream carrying 2,000 request-header messages, each with a subset hint
    naming one server, then closed, left that server at 1,999 in flight for good, and every
    later request went to the other. The second message now ends the stream, and its pick."""
    a = direct.addresses[0]
    sequence = [message(CLUSTER, subset_list=[a]) for _ in range(2000)]
    answers: list[ep.ProcessingResponse] = []
    with pytest.raises(grpc.RpcError) as e:
        for resp in direct.stub.Process(iter(sequence)):
            answers.append(resp)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert "second request_headers" in (e.value.details() or "")
    assert [picked(r) for r in answers] == [a]  # the first was answered, and only the first
    wait_until(
        lambda: direct.picker.metric("controlplane_picker_inflight_requests") == 0, 5, "nothing in flight"
    )
    assert (
        direct.picker.metric('controlplane_picker_inputs_refused_total{input="second_request_headers"}') == 1
    )
    where = spread(direct)
    assert sorted(where.values()) == [5, 5], where  # later requests spread
    wait_until(
        lambda: direct.picker.metric("controlplane_picker_inflight_requests") == 0, 5, "nothing in flight"
    )


def test_what_held_up_still_holds(direct: Direct) -> None:
    """The issue's "what held up": empty messages, 3 MB headers, 10,000 headers, unknown
    clusters, a 10,000-address subset hint (now past its bound: no pick, counted), body
    messages and response headers without a request, 3,000 streams cancelled mid-way, 2,000
    idle streams (under 48 MB): each answered, nothing left in flight, a real pick answered
    after. And without a peer
    credential (no token, no mutual TLS) the peer read answers nobody."""
    stub = direct.stub
    stream = OpenStream(stub)
    try:
        assert stream.send(ep.ProcessingRequest()) == ep.ProcessingResponse()
        for req in (
            ep.ProcessingRequest(request_body=ep.HttpBody(body=b"x" * 1000)),
            ep.ProcessingRequest(response_headers=ep.HttpHeaders()),
            ep.ProcessingRequest(response_body=ep.HttpBody(body=b"y")),
            ep.ProcessingRequest(request_trailers=ep.HttpTrailers()),
        ):
            assert stream.send(req).WhichOneof("response") == req.WhichOneof("request")
    finally:
        stream.close()
    big = message(CLUSTER, headers={"x-big": b"h" * (3 << 20)})
    assert ask_once(stub, big) in direct.addresses
    many = message(CLUSTER, headers={f"x-h-{i}": b"v" for i in range(10_000)})
    assert ask_once(stub, many) in direct.addresses
    assert ask_once(stub, message("nope@v9")) == ""
    hint = [f"127.0.0.{i % 250}:{i}" for i in range(10_000)]
    assert ask_once(stub, message(CLUSTER, subset_list=hint)) == ""
    assert direct.picker.metric('controlplane_picker_inputs_refused_total{input="subset_hint"}') == 1
    # 3,000 streams picked and cancelled before any response, 100 at a time.
    answers = asyncio.run(_batches(direct.picker.address, 30, message(CLUSTER)))
    assert len(answers) == 3000 and {picked(r) for r in answers} == set(direct.addresses)
    wait_until(
        lambda: direct.picker.metric("controlplane_picker_inflight_requests") == 0, 10, "nothing in flight"
    )
    assert direct.picker.metric('controlplane_picker_served_total{where="unknown"}') >= 3000
    assert sorted(spread(direct).values()) == [5, 5]
    # 2,000 idle streams (each opened with an empty message, then left) cost little.
    assert direct.picker.proc is not None
    pid = direct.picker.proc.popen.pid
    before = rss_bytes(pid)
    grown = asyncio.run(
        _streams(direct.picker.address, 2000, ep.ProcessingRequest(), lambda: rss_bytes(pid) - before)
    )[1]
    assert grown < 64 << 20, f"2,000 idle streams took {grown >> 20} MB"  # about 45 MB, as before
    print(f"\n2,000 idle streams: RSS {before >> 20} MB -> {(before + grown) >> 20} MB")
    wait_until(
        lambda: direct.picker.metric("controlplane_picker_inflight_requests") == 0, 5, "nothing in flight"
    )
    # A picker with neither a peer token nor mutual TLS answers no peer read.
    with pytest.raises(grpc.RpcError) as e:
        picker_pb2_grpc.PickerPeersStub(direct.channel).InFlight(
            picker_pb2.InFlightRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),)
        )
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "--peer-token-file" in (e.value.details() or "")


async def _streams(
    address: str, n: int, first: ep.ProcessingRequest, measure: Callable[[], int]
) -> tuple[list[ep.ProcessingResponse], int]:
    """Open `n` ext_proc streams, 100 to a connection (as Envoy spreads its streams over
    connections; 500 on one made the client's own writes fail now and then), send `first` on
    each and read its answer; then, with all of them open, take `measure()`; then cancel them
    all (no response ever comes back). The answers and the measure."""
    channels = [
        grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1), ("x-conn", i)])
        for i in range((n + 99) // 100)
    ]
    calls = []
    try:
        for i in range(n):
            call = ep_grpc.ExternalProcessorStub(channels[i // 100]).Process()
            await call.write(first)
            calls.append(call)
        answers = [await call.read() for call in calls]
        return answers, measure()  # type: ignore[return-value]
    finally:
        for call in calls:
            call.cancel()
        for channel in channels:
            await channel.close()


async def _batches(address: str, n: int, first: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
    """`n` times: 100 streams opened, each sent `first` and answered, then all cancelled."""
    answers = []
    for _ in range(n):
        answers += (await _streams(address, 100, first, lambda: 0))[0]
    return answers


# ---- finding 7: peers ------------------------------------------------------------------------------


class FakePeer:
    """A gRPC server answering PickerPeers.InFlight with whatever bytes `answer` holds (and,
    for the code before issue 41, the same on its JSON method), recording what callers sent."""

    METHODS = ("/controlplane.v1.PickerPeers/InFlight", "/controlplane.picker.v1.Peers/InFlight")

    def __init__(self) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.answer = b""
        self.json = b"{}"
        self.calls = 0
        self.metadata: list[dict[str, str]] = []
        self.server = grpc.server(
            futures.ThreadPoolExecutor(4), options=[("grpc.max_send_message_length", 8 << 20)]
        )
        self.server.add_generic_rpc_handlers((self,))  # type: ignore[arg-type]
        self.server.add_insecure_port(self.address)
        self.server.start()

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if details.method not in self.METHODS:  # type: ignore[attr-defined]
            return None
        is_json = details.method.endswith("Peers/InFlight") and "picker.v1" in details.method  # type: ignore[attr-defined]

        def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
            self.calls += 1
            self.metadata.append(dict(context.invocation_metadata()))  # type: ignore[arg-type]
            return self.json if is_json else self.answer

        return grpc.unary_unary_rpc_method_handler(handle)

    def stop(self) -> None:
        self.server.stop(0)


def entries(*pairs: tuple[str, int]) -> bytes:
    return picker_pb2.InFlightResponse(
        servers=[picker_pb2.ServerInFlight(address=a, requests=n) for a, n in pairs]
    ).SerializeToString()


def test_a_peer_answering_nonsense_is_refused_and_never_steers_or_stops_a_pick(tmp_path: Path) -> None:
    """Finding 7: a fake peer's 1,000,000 in flight on one server steered 8 of 8 requests away
    from it; 10^400 made every pick raise OverflowError. Now a peer's answer past its bounds
    (a count above the server's slots times 16, more than 10,000 servers, a server twice, bytes
    that are not the message) is refused whole and counted, and one over 1 MiB is not read
    (an error); picks go on, spread. The picker sent its peer token."""
    fake = FakePeer()
    rig: Direct | None = None
    try:
        rig = start_direct(tmp_path, peers=(fake.address,))
        a, b = rig.addresses
        refused = 'controlplane_picker_peer_reads_total{result="refused"}'
        errors = 'controlplane_picker_peer_reads_total{result="error"}'
        for answer, counter in (
            (entries((a, 1_000_000)), refused),
            (entries((a, 4_294_967_295)), refused),
            (entries(*((f"127.0.0.{i % 250}:{i}", 1) for i in range(10_001))), refused),
            (entries((a, 1), (a, 1)), refused),
            (b"\xff\xff\xff\xff", refused),  # not the message
            (entries((a, 1)) * ((limits.PICKER_PEER_MAX_BYTES // 20) + 1), errors),  # over 1 MiB
        ):
            fake.answer = answer
            fake.json = json.dumps({a: 10**400}).encode()  # what the JSON protocol allowed
            seen = rig.picker.metric(counter)
            wait_until(lambda c=counter, s=seen: rig.picker.metric(c) >= s + 2, 10, f"a {counter}")  # type: ignore[misc]
            where = spread(rig, 8)
            assert sorted(where.values()) == [4, 4], (answer[:40], where)
        assert all(m.get("authorization") == f"Bearer {TOKEN}" for m in fake.metadata), fake.metadata[:2]
        # A sensible answer counts again: 6 in flight on a by the peer's word.
        fake.answer = entries((a, 6), ("10.9.9.9:1", 3))
        ok = rig.picker.metric('controlplane_picker_peer_reads_total{result="ok"}')
        wait_until(
            lambda: rig.picker.metric('controlplane_picker_peer_reads_total{result="ok"}') >= ok + 2,
            10,
            "ok reads",
        )
        assert spread(rig, 6) == Counter({b: 6})
        assert rig.picker.proc is not None
        logged = [
            json.loads(x) for x in rig.picker.proc.log().splitlines() if "requests in flight refused" in x
        ]
        assert logged and all(len(d["error"]) < 120 for d in logged), logged[:2]
    finally:
        if rig is not None:
            stop_direct(rig)
        fake.stop()


def test_the_peer_read_needs_the_token_and_an_unknown_caller_is_refused(tmp_path: Path) -> None:
    """Whoever reaches --listen may not read a picker's counts: without the shared token (or a
    client certificate) the read is UNAUTHENTICATED, counted; with it, the counts come back
    as controlplane.v1.PickerPeers says."""
    peer = f"127.0.0.1:{free_port()}"  # listed, never started
    rig = start_direct(tmp_path, peers=(peer,))
    try:
        stub = picker_pb2_grpc.PickerPeersStub(rig.channel)
        for md in ((), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
            with pytest.raises(grpc.RpcError) as e:
                stub.InFlight(picker_pb2.InFlightRequest(), metadata=md, timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
        assert rig.picker.metric('controlplane_picker_inputs_refused_total{input="peer_credentials"}') == 3
        stream = OpenStream(rig.stub)
        try:
            server = picked(stream.send(message(CLUSTER)))
            got = stub.InFlight(
                picker_pb2.InFlightRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),)
            )
            assert [(s.address, s.requests) for s in got.servers] == [(server, 1)]
        finally:
            stream.close()
        # Item 14: the peer not up yet is logged once, its gRPC error whole, never cut mid-word.
        assert rig.picker.proc is not None
        log = rig.picker.proc.log()
        (line,) = [json.loads(x) for x in log.splitlines() if "a peer's requests in flight unread" in x]
        assert line["peer"] == peer and line["error"].startswith("UNAVAILABLE: "), line
        assert "Connection refused" in line["error"] or line["error"].endswith(" ..."), line
    finally:
        stop_direct(rig)


# ---- item 13: a port in use ------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["--listen", "--metrics-listen"])
def test_a_port_in_use_is_one_clean_line_and_exit_2(which: str) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = f"127.0.0.1:{held.getsockname()[1]}"
        listen = busy if which == "--listen" else f"127.0.0.1:{free_port()}"
        metrics = busy if which == "--metrics-listen" else f"127.0.0.1:{free_port()}"
        out = subprocess.run(
            [str(BIN / "controlplane"), "picker", "--control-plane", f"127.0.0.1:{free_port()}",
             "--listen", listen, "--metrics-listen", metrics],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    assert out.returncode == 2, out
    assert out.stderr.splitlines() == [
        f"controlplane picker: {which} {busy}: cannot listen (Address already in use)"
    ]


# ---- finding 11: only requests that go to a server ask the picker ----------------------------------


def test_requests_refused_locally_never_reach_the_picker(tmp_path: Path) -> None:
    """Finding 11: 29 quota 429s and one 200 started 30 picker streams (Envoy sent each local
    reply's response headers to the picker), while picks rose by one. Now only the request
    that goes to a server asks: one stream, one pick, its end seen. Unknown models (404) and
    bodies over the limit (413) never ask either."""
    fleet = EmulatedFleet(tmp_path)
    limiter: QuotaService | None = None
    picker: PickerProc | None = None
    try:
        fleet.servers["a"] = Emulator("a", tmp_path, MODEL, slots=8)
        rl_port, picker_port = free_port(), free_port()
        text = (
            "listener: {port: %d}\n"
            f"picker: {{endpoints: ['127.0.0.1:{picker_port}'], timeout: 1000ms}}\n"
            "tiers: {small: {timeout: 30s, balancing: picker, max_body_bytes: 65536}}\n"
            "quotas:\n"
            "  key: {header: x-api-key}\n"
            f"  service: {{endpoints: ['127.0.0.1:{rl_port}'], timeout: 500ms}}\n"
            "  default: {requests_per_minute: 1000}\n"
            "  tenants: {acme: {requests_per_minute: 1}}\n"
            "models:\n"
            f"  {MODEL}: {{params_b: 8, stable: v1, versions: {{v1: {{endpoints: "
            f"['{fleet.servers['a'].address}']}}}}}}\n"
        )
        (tmp_path / "fleet.yaml").write_text(text % fleet.listener)
        limiter = QuotaService(tmp_path / "fleet.yaml", tmp_path, port=rl_port).start()
        fleet.serve(text % fleet.listener)
        assert fleet.cp is not None and fleet.envoy is not None
        picker = PickerProc("picker", fleet.cp.xds, tmp_path, picker_port).start()
        envoy = fleet.envoy
        wait_until(lambda: envoy.endpoints(CLUSTER) != {}, 20, "Envoy to have the server")
        started = "http.inference.ext_proc.picker.streams_started"
        before = envoy.stat(started)
        statuses = [ask(fleet.listener, "acme").status for _ in range(30)]
        assert statuses == [200] + [429] * 29, statuses
        client = Client(fleet.listener)
        try:
            for _ in range(3):
                r = client.request(
                    "POST", "/v1/completions", json.dumps({"model": "nope", "prompt": "x"}).encode(),
                    {"content-type": "application/json", "x-api-key": "globex"},
                )  # fmt: skip
                assert r.status == 404, r
            big = json.dumps({"model": MODEL, "prompt": "x" * 100_000}).encode()
            r = client.request(
                "POST", "/v1/completions", big, {"content-type": "application/json", "x-api-key": "globex"}
            )
            assert r.status == 413, r
        finally:
            client.close()
        assert envoy.stat(started) - before == 1
        assert picker.metric('controlplane_picker_picks_total{reason="least_loaded"}') == 1
        assert (
            sum(
                picker.metric(f'controlplane_picker_picks_total{{reason="{r}"}}')
                for r in ("not_ready", "no_cluster", "unknown_cluster", "no_eligible_server", "input_refused")
            )
            == 0
        )
        # The one picked request's end was seen (its response's headers, asked for by the pick).
        wait_until(
            lambda: picker.metric('controlplane_picker_served_total{where="picked"}') == 1, 5, "its end"
        )
        assert picker.metric("controlplane_picker_inflight_requests") == 0
        assert envoy.stat("http.inference.ext_proc.picker.failure_mode_allowed") == 0
    finally:
        if picker is not None:
            picker.stop()
        if limiter is not None:
            limiter.stop()
        fleet.close()


# ---- trust: mutual TLS through a real Envoy ---------------------------------------------------------


class TlsPickerProc(PickerProc):
    """A picker on mutual TLS: its health is asked with a client certificate."""

    def __init__(self, *args: Any, certs: Path, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.certs = certs

    def credentials(self, cert: str | None = "client") -> grpc.ChannelCredentials:
        c = self.certs
        if cert is None:
            return grpc.ssl_channel_credentials(root_certificates=(c / "ca.pem").read_bytes())
        return grpc.ssl_channel_credentials(
            root_certificates=(c / "ca.pem").read_bytes(),
            private_key=(c / f"{cert}.key").read_bytes(),
            certificate_chain=(c / f"{cert}.pem").read_bytes(),
        )

    def health(self) -> int | None:
        assert self.proc is not None
        if not self.proc.alive():
            raise AssertionError(f"picker exited:\n{self.proc.log()[-3000:]}")
        with grpc.secure_channel(self.address, self.credentials()) as ch:
            try:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
            except grpc.RpcError:
                return None
            return int(r.status)


def test_picks_over_mutual_tls_and_a_client_without_a_certificate_is_refused(tmp_path: Path) -> None:
    """The fleet's picker.tls (a CA, the proxy's certificate, the name the pickers' carry) and
    two pickers on --tls-cert/--tls-key/--tls-client-ca, peered over the same mutual TLS:
    Envoy's picks travel over TLS and every request is served where a picker said; a client
    without a certificate, or in plaintext, gets nothing from the port."""
    certs = make_certs(tmp_path / "certs", ("picker", "envoy", "client"))
    tls_flags = (
        "--tls-cert", str(certs / "picker.pem"), "--tls-key", str(certs / "picker.key"),
        "--tls-client-ca", str(certs / "ca.pem"), "--peer-server-name", "picker",
    )  # fmt: skip
    fleet = EmulatedFleet(tmp_path)
    pickers: list[TlsPickerProc] = []
    try:
        for n in ("a", "b"):
            fleet.servers[n] = Emulator(n, tmp_path, MODEL, slots=8)
        ports = [free_port(), free_port()]
        addresses = [f"127.0.0.1:{p}" for p in ports]
        tls = (
            f"{{ca: '{certs}/ca.pem', cert: '{certs}/envoy.pem', key: '{certs}/envoy.key', "
            "server_name: picker}"
        )
        text = (
            "listener: {port: %d}\n"
            f"picker: {{endpoints: {json.dumps(addresses)}, timeout: 1000ms, tls: {tls}}}\n"
            "tiers: {small: {timeout: 30s, balancing: picker}}\n"
            "models:\n"
            f"  {MODEL}: {{params_b: 8, stable: v1, versions: {{v1: {{endpoints: "
            f"{json.dumps([s.address for s in fleet.servers.values()])}}}}}}}\n"
        )
        fleet.serve(text % fleet.listener)
        assert fleet.cp is not None and fleet.envoy is not None
        for i, port in enumerate(ports):
            other = (addresses[1 - i],)
            pickers.append(
                TlsPickerProc(
                    f"picker-{i}",
                    fleet.cp.xds,
                    tmp_path,
                    port,
                    certs=certs,
                    extra=(*tls_flags, "--peers", other[0]),
                ).start()
            )
        envoy = fleet.envoy
        wait_until(lambda: len(envoy.endpoints(CLUSTER)) == 2, 20, "Envoy to have both servers")
        served = {f"tls-{i}": send(fleet.listener, f"tls-{i}")[1] for i in range(12)}
        picks = {**pickers[0].picks(), **pickers[1].picks()}
        assert {rid: picks.get(rid) for rid in served} == served  # each went where a picker said
        assert envoy.stat("http.inference.ext_proc.picker.failure_mode_allowed") == 0
        assert envoy.stat("http.inference.ext_proc.picker.streams_started") >= 12
        reads = 'controlplane_picker_peer_reads_total{result="ok"}'
        wait_until(
            lambda: min(p.metric(reads) for p in pickers) > 3, 10, "the pickers to read each other over TLS"
        )
        # Strangers: no certificate, or plaintext, get nothing.
        for credentials in (pickers[0].credentials(None), None):
            channel = (
                grpc.secure_channel(pickers[0].address, credentials)
                if credentials is not None
                else grpc.insecure_channel(pickers[0].address)
            )
            with channel:
                with pytest.raises(grpc.RpcError) as e:
                    ask_once(ep_grpc.ExternalProcessorStub(channel), message(CLUSTER))
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
                with pytest.raises(grpc.RpcError):
                    picker_pb2_grpc.PickerPeersStub(channel).InFlight(picker_pb2.InFlightRequest(), timeout=5)
        print(f"\n12 requests picked over mutual TLS: {dict(Counter(served.values()))}")
    finally:
        for p in pickers:
            p.stop()
        fleet.close()
