from __future__ import annotations

from controlplane.ha.reports import PeerReports, decode, encode
from controlplane.signals.store import EndpointCounters, SignalStore

A = ("m", "127.0.0.1:8001")
B = ("m", "127.0.0.1:8002")


def test_a_source_counts_from_when_it_was_first_seen() -> None:
    peers = PeerReports()
    peers.fold({"r2-x": {A: (1000.0, 50.0, 7.0)}}, now=100.0)
    # Its history is not news: a step's analysis must not see 50 old failures arrive at once.
    assert peers.counters(A) == EndpointCounters()
    peers.fold({"r2-x": {A: (1010.0, 52.0, 8.0)}}, now=101.0)
    assert peers.counters(A) == EndpointCounters(lrs_ok=10.0, lrs_failed=2.0, lrs_reported_at=101.0)


def test_sums_over_sources_never_go_back() -> None:
    peers = PeerReports()
    peers.fold({"r2-x": {A: (0.0, 0.0, 1.0)}, "r3-y": {A: (0.0, 0.0, None)}}, now=10.0)
    peers.fold({"r2-x": {A: (5.0, 1.0, 2.0)}, "r3-y": {A: (3.0, 0.0, None)}}, now=11.0)
    assert (peers.counters(A).lrs_ok, peers.counters(A).lrs_failed) == (8.0, 1.0)
    peers.fold({"r3-y": {A: (4.0, 0.0, None)}}, now=12.0)  # r2's key went (its lease expired)
    assert peers.counters(A).lrs_ok == 9.0
    peers.fold({"r3-y": {A: (1.0, 0.0, None)}}, now=13.0)  # r3 forgot the endpoint and counts anew
    assert peers.counters(A).lrs_ok == 10.0
    assert peers.counters(B) == EndpointCounters()


def test_a_report_stamp_moves_only_forward() -> None:
    peers = PeerReports()
    peers.fold({"r2-x": {A: (0.0, 0.0, 5.0)}}, now=1.0)
    assert peers.counters(A).lrs_reported_at is None  # whether it is new cannot be told
    peers.fold({"r2-x": {A: (0.0, 0.0, 6.0)}}, now=2.0)  # a report of zeros still counts
    assert peers.counters(A).lrs_reported_at == 2.0
    peers.fold({"r2-x": {A: (0.0, 0.0, None)}}, now=3.0)  # its proxy's stream ended
    peers.fold({"r2-x": {A: (0.0, 0.0, 6.0)}}, now=4.0)
    assert peers.counters(A).lrs_reported_at == 2.0


def test_what_a_replica_publishes_reads_back() -> None:
    store = SignalStore()
    store.record_lrs(A, "envoy-1", in_progress=1, issued=3, succeeded=3, failed=1, now=42.0)
    store.record_lrs(B, "envoy-1", in_progress=0, issued=0, succeeded=0, failed=0, now=42.0)
    doc = encode(store, {A, B, ("m", "127.0.0.1:9")})  # one with no reports is left out
    assert decode(doc) == {A: (3.0, 1.0, 42.0), B: (0.0, 0.0, 42.0)}
    assert decode(b"not json") == {} and decode(b'{"endpoints": [[1]]}') == {}
