"""Minutes of seeded random input against a real `controlplane picker` (issue 41), fed by a
real control plane: ext_proc streams of random messages (request headers with random headers,
clusters, prefix keys and subset hints of any size up to megabytes, bodies, response headers,
trailers, empty messages, in any order), closed every way a client can (half-closed, cancelled
mid-way, held open then cancelled, the whole connection dropped), random peer reads with and
without the token, and a peer that answers at random: sense, nonsense, garbage, megabytes.

Meanwhile a probe asks for a real pick every PROBE_EVERY_S and must get a right answer (one of
the two servers; the one a subset hint allows), and the picker's RSS must stay under
RSS_BOUND_BYTES. At the end every stream is closed, and nothing may be left in flight.

    .venv/bin/pytest -m fuzz tests/fuzz/test_fuzz_picker.py -s   # FUZZ_SECONDS, FUZZ_SEED
"""

from __future__ import annotations

import os
import queue
import random
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2

from controlplane import limits
from controlplane.picker.request import CLUSTER_ATTRIBUTE, PREFIX_KEY, SERVED_ATTRIBUTE, SUBSET_HEADER
from controlplane.resources.names import METADATA_NS, SUBSET_METADATA_NS
from controlplane.v1 import picker_pb2, picker_pb2_grpc
from tests.integration.harness import http_get
from tests.integration.test_picker import CLUSTER
from tests.integration.test_picker_hostile import (
    TOKEN,
    FakePeer,
    entries,
    picked,
    rss_bytes,
    start_direct,
    stop_direct,
)

SECONDS = float(os.environ.get("FUZZ_SECONDS", "180"))
SEED = int(os.environ.get("FUZZ_SEED", str(random.SystemRandom().randrange(1 << 32))))
pytestmark = [pytest.mark.fuzz, pytest.mark.envoy, pytest.mark.timeout(int(SECONDS) + 300)]
WORKERS = 6
PROBE_EVERY_S = 0.25
# The picker's memory: its baseline (about 60 MB), the prefix index at its most (65,536
# digests, 16 MB), and the messages in flight at once (WORKERS streams of up to 4 MiB each,
# as gRPC buffers them twice), with room for the allocator's slack.
RSS_BOUND_BYTES = 320 << 20
FILTER = "envoy.filters.http.ext_proc"
POOL = random.Random(0).randbytes(5 << 20)  # bytes to slice random values from


def size(rng: random.Random) -> int:
    """Mostly small, sometimes large, now and then megabytes (past every bound)."""
    r = rng.random()
    if r < 0.7:
        return rng.randrange(0, 200)
    if r < 0.93:
        return rng.randrange(200, 70_000)
    return rng.randrange(70_000, int(4.5 * (1 << 20)))


def text(rng: random.Random, n: int) -> str:
    start = rng.randrange(0, len(POOL) - n) if n < len(POOL) else 0
    chunk = POOL[start : start + n // 2 + 1].hex()[:n]
    return chunk if rng.random() < 0.9 else chunk[: n // 2] + "\u20ac\x00é" * 3


def addresses(rng: random.Random, servers: list[str], n: int) -> list[str]:
    return [rng.choice(servers) if rng.random() < 0.3 else f"10.{i % 250}.0.1:{i}" for i in range(n)]


def request_headers(rng: random.Random, servers: list[str]) -> ep.ProcessingRequest:
    req = ep.ProcessingRequest(request_headers=ep.HttpHeaders(end_of_stream=rng.random() < 0.5))
    r = rng.random()
    if r < 0.6:
        req.attributes[FILTER].fields[CLUSTER_ATTRIBUTE].string_value = CLUSTER
    elif r < 0.8:
        req.attributes[FILTER].fields[CLUSTER_ATTRIBUTE].string_value = text(rng, size(rng))
    if rng.random() < 0.5:
        req.metadata_context.filter_metadata[METADATA_NS].fields[PREFIX_KEY].string_value = text(
            rng, size(rng)
        )
    r = rng.random()
    if r < 0.15:
        value = req.metadata_context.filter_metadata[SUBSET_METADATA_NS].fields[SUBSET_HEADER]
        n = rng.choice([1, 2, 5, 50, 1024, 1025, 3000])
        value.list_value.CopyFrom(
            struct_pb2.ListValue(
                values=[struct_pb2.Value(string_value=a) for a in addresses(rng, servers, n)]
            )
        )
    elif r < 0.25:
        n = rng.choice([1, 3, 1000, 5000])
        hint = ",".join(addresses(rng, servers, n)).encode()
        req.request_headers.headers.headers.add(key=SUBSET_HEADER, raw_value=hint)
    for _ in range(rng.choice([0, 1, 5, 30, 300])):
        req.request_headers.headers.headers.add(
            key=text(rng, rng.randrange(1, 40)), raw_value=POOL[: size(rng) // 8]
        )
    return req


def any_message(rng: random.Random, servers: list[str]) -> ep.ProcessingRequest:
    r = rng.random()
    if r < 0.45:
        return request_headers(rng, servers)
    if r < 0.65:
        resp = ep.ProcessingRequest(response_headers=ep.HttpHeaders())
        if rng.random() < 0.7:
            served = rng.choice([*servers, "10.1.1.1:1", text(rng, size(rng))])
            resp.attributes[FILTER].fields[SERVED_ATTRIBUTE].string_value = served
        return resp
    if r < 0.75:
        return ep.ProcessingRequest(
            request_body=ep.HttpBody(body=POOL[: size(rng)], end_of_stream=rng.random() < 0.5)
        )
    if r < 0.82:
        return ep.ProcessingRequest(response_body=ep.HttpBody(body=POOL[: size(rng)]))
    if r < 0.88:
        return ep.ProcessingRequest(request_trailers=ep.HttpTrailers())
    if r < 0.93:
        return ep.ProcessingRequest(response_trailers=ep.HttpTrailers())
    return ep.ProcessingRequest()


class Figures:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.sent_bytes = 0

    def add(self, what: str, n: int = 1) -> None:
        with self.lock:
            self.counts[what] += n


def one_stream(rng: random.Random, channel: grpc.Channel, servers: list[str], figures: Figures) -> None:
    """A random script of messages on one stream, ended one of the ways a client can."""
    stub = ep_grpc.ExternalProcessorStub(channel)
    n = rng.choice([1, 1, 1, 2, 3, 5, 20, 200])
    msgs = [
        request_headers(rng, servers) if i == 0 and rng.random() < 0.8 else any_message(rng, servers)
        for i in range(n)
    ]
    ending = rng.choice(["drain", "drain", "cancel", "cancel-early", "hold"])
    figures.add(f"streams:{ending}")
    figures.add("messages", len(msgs))
    with figures.lock:
        figures.sent_bytes += sum(m.ByteSize() for m in msgs)
    try:
        if ending == "hold":
            out: queue.Queue[ep.ProcessingRequest | None] = queue.Queue()
            call = stub.Process(iter(out.get, None))
            for m in msgs:
                out.put(m)
            for read, _ in enumerate(call, 1):
                if read >= len(msgs):
                    break
            time.sleep(rng.random() * 2)
            call.cancel()
            out.put(None)
            return
        call = stub.Process(iter(msgs))
        if ending == "cancel-early":
            call.cancel()
            return
        for i, _ in enumerate(call):
            if ending == "cancel" and i >= rng.randrange(0, n):
                call.cancel()
                return
    except grpc.RpcError as e:
        with figures.lock:
            figures.errors[e.code().name if e.code() else "?"] += 1


def worker(seed: int, address: str, servers: list[str], stop: threading.Event, figures: Figures) -> None:
    rng = random.Random(seed)
    options = [("grpc.max_send_message_length", 8 << 20), ("grpc.max_receive_message_length", 8 << 20)]
    channel = grpc.insecure_channel(address, options=options)
    try:
        while not stop.is_set():
            r = rng.random()
            if r < 0.9:
                one_stream(rng, channel, servers, figures)
            elif r < 0.95:
                md = rng.choice(
                    [(), (("authorization", f"Bearer {TOKEN}"),), (("authorization", text(rng, 50)),)]
                )
                try:
                    picker_pb2_grpc.PickerPeersStub(channel).InFlight(
                        picker_pb2.InFlightRequest(), metadata=md, timeout=5
                    )
                    figures.add("peer calls answered")
                except grpc.RpcError:
                    figures.add("peer calls refused")
            else:  # the connection dropped with streams on it
                calls = [
                    ep_grpc.ExternalProcessorStub(channel).Process(iter([request_headers(rng, servers)] * 2))
                    for _ in range(rng.randrange(1, 20))
                ]
                time.sleep(rng.random() * 0.05)
                channel.close()
                figures.add("connections dropped")
                figures.add("streams:dropped", len(calls))
                channel = grpc.insecure_channel(address, options=options)
    finally:
        channel.close()


class LyingPeer(FakePeer):
    """A peer whose every answer is drawn at random: sense, nonsense, garbage, megabytes."""

    def __init__(self, seed: int, servers: list[str]) -> None:
        self.rng = random.Random(seed)
        self.servers = servers
        self.lock = threading.Lock()
        super().__init__()

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if details.method != self.METHODS[0]:  # type: ignore[attr-defined]
            return None

        def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
            with self.lock:
                r, rng = self.rng.random(), self.rng
                a, b = self.servers
                self.calls += 1
                if r < 0.4:
                    return entries((a, rng.randrange(0, 20)), (b, rng.randrange(0, 20)))
                if r < 0.55:
                    return entries((a, rng.choice([1025, 10**6, 2**32 - 1])))
                if r < 0.65:
                    return entries(
                        *((f"10.0.{i % 250}.1:{i}", 1) for i in range(limits.PICKER_PEER_MAX_SERVERS + 1))
                    )
                if r < 0.75:
                    return POOL[: rng.randrange(1, 5000)]
                if r < 0.8:
                    return POOL[: (limits.PICKER_PEER_MAX_BYTES + rng.randrange(1, 1 << 20))]
                if r < 0.9:
                    return entries((a, 1), (a, 2))
                return b""

        return grpc.unary_unary_rpc_method_handler(handle)


def metric(port: int, name: str) -> float:
    _, page = http_get(f"http://127.0.0.1:{port}/metrics", timeout=5)
    return sum(float(line.split()[-1]) for line in page.splitlines() if line.rsplit(" ", 1)[0] == name)


@pytest.fixture
def peer() -> Iterator[LyingPeer]:
    p = LyingPeer(SEED + 1, ["127.0.0.1:1", "127.0.0.1:2"])
    try:
        yield p
    finally:
        p.stop()


def test_fuzz_the_pickers_ports(tmp_path: Path, peer: LyingPeer) -> None:
    print(f"\nfuzz: FUZZ_SEED={SEED} FUZZ_SECONDS={SECONDS:g}, {WORKERS} workers")
    rig = start_direct(tmp_path, peers=(peer.address,))
    try:
        peer.servers = list(rig.addresses)
        assert rig.picker.proc is not None
        pid = rig.picker.proc.popen.pid
        baseline = rss_bytes(pid)
        stop = threading.Event()
        figures = Figures()
        threads = [
            threading.Thread(
                target=worker, args=(SEED + 10 + i, rig.picker.address, rig.addresses, stop, figures)
            )
            for i in range(WORKERS)
        ]
        for t in threads:
            t.start()
        rss: list[int] = []
        probes: list[float] = []
        wrong: list[Any] = []
        a = rig.addresses[0]
        end = time.monotonic() + SECONDS
        try:
            while time.monotonic() < end:
                assert rig.picker.proc.alive(), rig.picker.proc.log()[-3000:]
                rss.append(rss_bytes(pid))
                assert rss[-1] < RSS_BOUND_BYTES, f"RSS {rss[-1] >> 20} MB after {len(rss)} samples"
                t0 = time.monotonic()
                hinted = len(probes) % 2 == 1
                req = ep.ProcessingRequest(request_headers=ep.HttpHeaders())
                req.attributes[FILTER].fields[CLUSTER_ATTRIBUTE].string_value = CLUSTER
                if hinted:
                    req.request_headers.headers.headers.add(key=SUBSET_HEADER, raw_value=a.encode())
                call = rig.stub.Process(iter([req]), timeout=5)
                got = picked(next(call))
                call.cancel()
                probes.append(time.monotonic() - t0)
                if (hinted and got != a) or got not in rig.addresses:
                    wrong.append((hinted, got))
                time.sleep(PROBE_EVERY_S)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert not wrong, wrong[:5]
        port = rig.picker.metrics_port
        inflight = "controlplane_picker_inflight_requests"
        deadline = time.monotonic() + 15
        while metric(port, inflight) != 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        left = metric(port, inflight)
        counts = picker_pb2_grpc.PickerPeersStub(rig.channel).InFlight(
            picker_pb2.InFlightRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),)
        )
        reasons = {
            r: metric(port, f'controlplane_picker_picks_total{{reason="{r}"}}')
            for r in (
                "least_loaded",
                "approximate",
                "unknown_cluster",
                "no_cluster",
                "no_eligible_server",
                "input_refused",
            )
        }
        refused = {
            i: metric(port, f'controlplane_picker_inputs_refused_total{{input="{i}"}}')
            for i in ("cluster", "prefix_key", "subset_hint", "second_request_headers", "peer_credentials")
        }
        reads = {
            r: metric(port, f'controlplane_picker_peer_reads_total{{result="{r}"}}')
            for r in ("ok", "error", "refused")
        }
        p = sorted(probes)
        streams = {k.split(":", 1)[1]: v for k, v in figures.counts.items() if k.startswith("streams:")}
        c = figures.counts
        print(
            f"fuzz: {SECONDS:g} s, {sum(streams.values())} streams {streams} scripted with "
            f"{c['messages']} messages ({figures.sent_bytes / (1 << 20):.0f} MB; a stream refused or "
            f"cancelled sends only part of its script), {c['connections dropped']} connections "
            f"dropped, stream errors {dict(figures.errors)}, peer calls "
            f"{c['peer calls answered']} answered / {c['peer calls refused']} refused"
        )
        print(
            f"fuzz: RSS {baseline >> 20} MB at start, by quarters "
            f"{[rss[len(rss) * q // 4 - 1] >> 20 for q in (1, 2, 3, 4)]} MB, max {max(rss) >> 20} MB "
            f"(bound {RSS_BOUND_BYTES >> 20} MB); {len(probes)} probes all right, "
            f"p50 {statistics.median(p) * 1000:.1f} ms, p99 {p[int(len(p) * 0.99)] * 1000:.1f} ms; "
            f"in flight at the end {left:g}"
        )
        print(f"fuzz: picks {reasons}; inputs refused {refused}; peer reads {reads}; peer read {peer.calls}x")
        assert left == 0 and list(counts.servers) == []
        assert reads["refused"] > 0 and reads["ok"] > 0
        assert (
            refused["prefix_key"] > 0 and refused["subset_hint"] > 0 and refused["second_request_headers"] > 0
        )
    finally:
        stop_direct(rig)
