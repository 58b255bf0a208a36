"""Per-version TTFT/TPOT histograms merged from the servers' own (signals/model_latency.py)."""

from __future__ import annotations

import math
import random
import threading
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.fleet import parse_fleet
from controlplane.fleet.model import Fleet
from controlplane.signals.collector_worker import SentHistograms
from controlplane.signals.model_latency import FOLD_AFTER_S, ModelLatency
from controlplane.signals.parse import ServerHistogram, ServerSample, continues
from tests.fleets import fleet_yaml

A, B, C = "127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"
BOUNDS = (0.1, 0.5, 1.0)
TTFT = "controlplane_model_time_to_first_token_seconds"
TPOT = "controlplane_model_time_per_output_token_seconds"


def fleet(versions: dict[str, list[str]], model: str = "m") -> Fleet:
    return parse_fleet(fleet_yaml({model: versions}))


def hist(
    counts: tuple[float, ...], count: float, total: float | None = 0.0, bounds: tuple[float, ...] = BOUNDS
) -> ServerHistogram:
    return ServerHistogram(bounds, counts, count, total)


def sample(ttft: ServerHistogram | None = None, tpot: ServerHistogram | None = None) -> ServerSample:
    return ServerSample("vllm", running=0.0, ttft=ttft, tpot=tpot)


def rendered(latency: ModelLatency) -> dict[tuple[str, str, str, str], float]:
    """(sample name, model, version, le) -> value, as Prometheus reads /metrics."""
    reg = CollectorRegistry()
    reg.register(latency)
    out = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            out[s.name, s.labels["model"], s.labels["version"], s.labels.get("le", "")] = s.value
    return out


def test_first_sight_is_a_baseline_then_increases_add_and_a_restart_counts_whole() -> None:
    f = fleet({"v1": [A, B]})
    lat = ModelLatency()
    lat.observe(
        f, [(("m", A), sample(hist((5, 8, 9), 10, 4.0))), (("m", B), sample(hist((1, 1, 1), 1, 0.1)))]
    )
    r = rendered(lat)
    # Before the control plane saw them: not counted (as rate() ignores a first sample).
    assert r[f"{TTFT}_count", "m", "v1", ""] == 0
    assert r[f"{TTFT}_bucket", "m", "v1", "+Inf"] == 0
    lat.observe(f, [(("m", A), sample(hist((6, 10, 11), 12, 5.0)))])
    lat.observe(f, [(("m", A), sample(hist((7, 11, 12), 13, 5.5)))])
    r = rendered(lat)
    assert r[f"{TTFT}_bucket", "m", "v1", "0.1"] == 2
    assert r[f"{TTFT}_bucket", "m", "v1", "0.5"] == 3
    assert r[f"{TTFT}_bucket", "m", "v1", "1.0"] == 3
    assert r[f"{TTFT}_bucket", "m", "v1", "+Inf"] == 3
    assert r[f"{TTFT}_count", "m", "v1", ""] == 3
    assert r[f"{TTFT}_sum", "m", "v1", ""] == pytest.approx(1.5)
    # A restarted server: its counts start again; the new value is all since the restart.
    lat.observe(f, [(("m", A), sample(hist((1, 1, 2), 2, 0.7)))])
    r = rendered(lat)
    assert r[f"{TTFT}_count", "m", "v1", ""] == 5
    assert r[f"{TTFT}_bucket", "m", "v1", "0.1"] == 3
    assert r[f"{TTFT}_sum", "m", "v1", ""] == pytest.approx(2.2)


def test_a_restart_between_two_reads_is_seen_even_when_the_count_regrows_past_the_old_one() -> None:
    """Queued histograms collapse into the newest only within one lifetime: a bucket that went
    down is a reset even if the count went up."""
    f = fleet({"v1": [A]})
    lat = ModelLatency()
    for h in (
        hist((3, 3, 3), 3, 0.3),
        hist((4, 4, 4), 4, 0.4),
        hist((5, 5, 5), 5, 0.5),
        hist((0, 6, 6), 6, 3.0),
    ):
        lat.observe(f, [(("m", A), sample(h))])
    r = rendered(lat)
    assert r[f"{TTFT}_count", "m", "v1", ""] == 2 + 6
    assert r[f"{TTFT}_bucket", "m", "v1", "0.1"] == 2 + 0


def test_a_server_that_leaves_keeps_its_counts_and_one_that_returns_is_a_new_baseline() -> None:
    both, only_a = fleet({"v1": [A, B]}), fleet({"v1": [A]})
    lat = ModelLatency()
    lat.observe(both, [(("m", A), sample(hist((0, 0, 0), 0))), (("m", B), sample(hist((0, 0, 0), 0)))])
    lat.observe(both, [(("m", A), sample(hist((1, 1, 1), 1))), (("m", B), sample(hist((2, 2, 2), 2)))])
    assert rendered(lat)[f"{TTFT}_count", "m", "v1", ""] == 3
    lat.retain(only_a)
    assert rendered(lat)[f"{TTFT}_count", "m", "v1", ""] == 3  # B's past stays
    # B back, far ahead (it went on serving elsewhere): its first histogram is a baseline.
    lat.observe(both, [(("m", B), sample(hist((50, 50, 50), 50)))])
    lat.observe(both, [(("m", B), sample(hist((51, 51, 51), 51)))])
    assert rendered(lat)[f"{TTFT}_count", "m", "v1", ""] == 4


def test_servers_of_a_version_are_summed_and_versions_kept_apart() -> None:
    f = fleet({"v1": [A, B], "v2": [C]})
    lat = ModelLatency()
    zero = sample(hist((0, 0, 0), 0), hist((0, 0, 0), 0))
    lat.observe(f, [(("m", a), zero) for a in (A, B, C)])
    lat.observe(
        f,
        [
            (("m", A), sample(hist((1, 2, 3), 3, 1.0), hist((10, 10, 10), 10, 0.5))),
            (("m", B), sample(hist((0, 1, 1), 1, 0.3))),  # its TPOT unchanged (None)
            (("m", C), sample(hist((4, 4, 4), 4, 0.2))),
        ],
    )
    r = rendered(lat)
    assert r[f"{TTFT}_bucket", "m", "v1", "0.1"] == 1
    assert r[f"{TTFT}_bucket", "m", "v1", "0.5"] == 3
    assert r[f"{TTFT}_count", "m", "v1", ""] == 4
    assert r[f"{TTFT}_count", "m", "v2", ""] == 4
    assert r[f"{TPOT}_count", "m", "v1", ""] == 10
    assert r[f"{TPOT}_count", "m", "v2", ""] == 0


def test_disagreeing_bounds_keep_the_common_ones_for_good() -> None:
    f = fleet({"v1": [A, B]})
    lat = ModelLatency()
    lat.observe(f, [(("m", A), sample(hist((0, 0, 0), 0)))])
    lat.observe(f, [(("m", A), sample(hist((1, 2, 3), 3, 1.0)))])
    assert {k[3] for k in rendered(lat) if k[0].endswith("_bucket")} == {"0.1", "0.5", "1.0", "+Inf"}
    other = (0.1, 0.25, 1.0, 2.0)
    lat.observe(f, [(("m", B), sample(hist((0, 0, 0, 0), 0, bounds=other)))])
    lat.observe(f, [(("m", B), sample(hist((1, 1, 2, 2), 2, 0.5, bounds=other)))])
    r = rendered(lat)
    assert {k[3] for k in r if k[0] == f"{TTFT}_bucket"} == {"0.1", "1.0", "+Inf"}
    assert r[f"{TTFT}_bucket", "m", "v1", "0.1"] == 2
    assert r[f"{TTFT}_bucket", "m", "v1", "1.0"] == 5
    assert r[f"{TTFT}_count", "m", "v1", ""] == 5
    # B gone: 0.5 does not come back (it never counted B's requests).
    lat.retain(fleet({"v1": [A]}))
    lat.observe(fleet({"v1": [A]}), [(("m", A), sample(hist((1, 3, 4), 4, 1.5)))])
    assert {k[3] for k in rendered(lat) if k[0] == f"{TTFT}_bucket"} == {"0.1", "1.0", "+Inf"}


def test_a_server_without_a_sum_drops_the_sum_but_keeps_the_count() -> None:
    f = fleet({"v1": [A, B]})
    lat = ModelLatency()
    lat.observe(f, [(("m", A), sample(hist((0, 0, 0), 0))), (("m", B), sample(hist((0, 0, 0), 0, None)))])
    lat.observe(
        f, [(("m", A), sample(hist((1, 1, 1), 1, 0.05))), (("m", B), sample(hist((1, 1, 1), 1, None)))]
    )
    r = rendered(lat)
    assert (f"{TTFT}_sum", "m", "v1", "") not in r
    assert r[f"{TTFT}_count", "m", "v1", ""] == 2


def test_a_moved_server_counts_for_its_new_version_from_then_on() -> None:
    before, after = fleet({"v1": [A], "v2": [B]}), fleet({"v1": [], "v2": [A, B]})
    lat = ModelLatency()
    lat.observe(before, [(("m", A), sample(hist((0, 0, 0), 0)))])
    lat.observe(before, [(("m", A), sample(hist((1, 1, 1), 1)))])
    lat.observe(after, [(("m", A), sample(hist((3, 3, 3), 3)))])
    r = rendered(lat)
    assert r[f"{TTFT}_count", "m", "v1", ""] == 1
    assert r[f"{TTFT}_count", "m", "v2", ""] == 2


def test_series_of_removed_versions_and_models_disappear() -> None:
    f = parse_fleet(fleet_yaml({"m": {"v1": [A], "v2": [B]}, "n": {"v1": [C]}}))
    lat = ModelLatency()
    for key in (("m", A), ("m", B), ("n", C)):
        lat.observe(f, [(key, sample(hist((0, 0, 0), 0)))])
    assert {(k[1], k[2]) for k in rendered(lat)} == {("m", "v1"), ("m", "v2"), ("n", "v1")}
    lat.retain(fleet({"v1": [A]}))
    assert {(k[1], k[2]) for k in rendered(lat)} == {("m", "v1")}
    # A late record of a removed version does not bring it back.
    lat.observe(fleet({"v1": [A]}), [(("m", B), sample(hist((5, 5, 5), 5)))])
    assert {(k[1], k[2]) for k in rendered(lat)} == {("m", "v1")}


def test_unchanged_histograms_and_unknown_endpoints_change_nothing() -> None:
    f = fleet({"v1": [A]})
    lat = ModelLatency()
    lat.observe(f, [(("m", A), sample(hist((0, 0, 0), 0)))])
    lat.observe(f, [(("m", A), sample(hist((1, 1, 1), 1)))])
    lat.observe(f, [(("m", A), sample()), (("m", A), None), (("other", A), sample(hist((9, 9, 9), 9)))])
    lat.observe(f, [(("m", A), sample(hist((1, 1, 1), 1)))])  # the same again: no increase
    assert rendered(lat)[f"{TTFT}_count", "m", "v1", ""] == 1
    assert {k[1] for k in rendered(lat)} == {"m"}


def test_the_weight_loop_folds_when_nobody_reads() -> None:
    now = [0.0]
    lat = ModelLatency(clock=lambda: now[0])
    f = fleet({"v1": [A]})
    for i in range(5):
        lat.observe(f, [(("m", A), sample(hist((i, i, i), i)))])
        lat.observe(f, [(("m", A), sample(hist((0, 0, 0), 0)))])  # a crash loop: every one a reset
    assert sum(len(q) for q in lat._pending.values()) == 9  # each reset kept, and its successor
    now[0] = FOLD_AFTER_S + 1
    lat.observe(f, [])
    assert not lat._pending
    assert lat.merged()["ttft", "m", "v1"].count == sum(range(5))


def test_le_is_written_as_prometheus_client_writes_it() -> None:
    f = fleet({"v1": [A]})
    lat = ModelLatency()
    bounds = (0.001, 1.0, 2.5, 1e-05, 1234567.0)
    lat.observe(f, [(("m", A), sample(hist((0,) * 5, 0, bounds=tuple(sorted(bounds)))))])
    les = {k[3] for k in rendered(lat) if k[0].endswith("_bucket")}
    assert les == {"1e-05", "0.001", "1.0", "2.5", "1.234567e+06", "+Inf"}


# ---- against a direct fold of every histogram, in order ------------------------------------


@dataclass
class Reference:
    """What the merged series must be: every histogram folded in turn as it arrives."""

    accounted: dict[tuple[tuple[str, str], str], tuple[str, ServerHistogram]] = field(default_factory=dict)
    merged: dict[tuple[str, str, str], tuple[dict[float, float], float, float | None]] = field(
        default_factory=dict
    )
    bounds: dict[tuple[str, str, str], set[float]] = field(default_factory=dict)

    def leave(self, key: tuple[str, str]) -> None:
        for f in ("ttft", "tpot"):
            self.accounted.pop((key, f), None)

    def add(self, key: tuple[str, str], f: str, version: str, h: ServerHistogram) -> None:
        series = (f, key[0], version)
        self.bounds[series] = self.bounds.get(series, set(h.bounds)) & set(h.bounds)
        counts, count, total = self.merged.get(series, ({}, 0.0, 0.0))
        if series not in self.merged and h.sum is None:
            total = None
        prev = self.accounted.get((key, f))
        self.accounted[key, f] = (version, h)
        if prev is None:
            self.merged[series] = (counts, count, None if h.sum is None else total)
            return
        p = prev[1]
        reset = not continues(p, h)
        base = dict.fromkeys(h.bounds, 0.0) if reset else dict(zip(p.bounds, p.counts, strict=True))
        for b, c in zip(h.bounds, h.counts, strict=True):
            counts[b] = counts.get(b, 0.0) + c - base[b]
        count += h.count - (0.0 if reset else p.count)
        if total is not None and h.sum is not None and (reset or p.sum is not None):
            total += h.sum - (0.0 if reset else (p.sum or 0.0))
        else:
            total = None
        self.merged[series] = (counts, count, total)


@dataclass
class Server:
    bounds: tuple[float, ...]
    counts: list[float]
    count: float = 0.0
    total: float = 0.0

    def serve(self, bucket: int, n: int) -> None:
        for i in range(bucket, len(self.counts)):
            self.counts[i] += n
        self.count += n
        self.total += n * (self.bounds[bucket] if bucket < len(self.bounds) else 5.0)

    def histogram(self) -> ServerHistogram:
        return ServerHistogram(self.bounds, tuple(self.counts), self.count, self.total)


FLEETS = [
    {"v1": [A, B], "v2": [C]},
    {"v1": [A], "v2": [C]},
    {"v1": [A, B, C]},
    {"v2": [A, B]},
]

_serve = st.tuples(st.just("serve"), st.sampled_from([A, B, C]), st.integers(0, 3), st.integers(1, 5))
_round = st.tuples(
    st.just("round"),
    st.lists(st.sampled_from([A, B, C]), min_size=1, max_size=3),
    st.booleans(),  # the pages have a TPOT histogram
    st.sampled_from([False] * 5 + [True]),  # the batch is lost on the way
    st.sampled_from([0.1, 1.0, 1.0, 11.0]),  # seconds since the previous round
)
# Weighted as a fleet lives: serving and rounds mostly, now and then a restart or a read,
# rarely a fleet change or a collector started again (each would end a run of rounds).
_op = st.sampled_from(["serve"] * 4 + ["round"] * 4 + ["restart", "restart", "read", "rare"]).flatmap(
    lambda kind: {
        "serve": _serve,
        "round": _round,
        "restart": st.tuples(st.just("restart"), st.sampled_from([A, B, C]), st.sampled_from([0, 0, 1])),
        "read": st.tuples(st.just("read")),
        "rare": st.one_of(
            st.tuples(st.just("collector restarted")),
            st.tuples(st.just("fleet"), st.integers(0, len(FLEETS) - 1)),
        ),
    }[kind]
)
OTHER_BOUNDS = (0.1, 0.25, 1.0)


@settings(max_examples=250, deadline=None)
@given(ops=st.lists(_op, min_size=20, max_size=80), collector=st.booleans())
def test_merged_series_equal_a_direct_fold_and_only_grow(
    ops: list[tuple[object, ...]], collector: bool
) -> None:
    """With `collector`, the pages go through a collector's `SentHistograms` first (left out
    when unchanged, stamped with lifetime ids), and some batches are lost on the way; the
    reference folds what arrived."""
    fleets = [fleet(v) for v in FLEETS]
    lat, ref = ModelLatency(), Reference()
    sent, now = SentHistograms(), 0.0
    servers = {a: Server(BOUNDS, [0.0] * 3) for a in (A, B, C)}
    current = fleets[0]
    last: dict[tuple[str, str, str, str], float] = {}
    last_bounds: dict[tuple[str, str], set[str]] = {}

    def versions(f: Fleet) -> dict[tuple[str, str], str]:
        out: dict[tuple[str, str], str] = {}
        for m in f.models:
            for v in m.versions:
                for ep in v.endpoints:
                    out.setdefault((m.name, ep.address), v.name)
        return out

    def check() -> None:
        got = lat.merged()
        # Series of versions not in the fleet when read are gone (a version removed and back
        # between two reads never went).
        live = {(m.name, v.name) for m in current.models for v in m.versions}
        ref.merged = want = {k: v for k, v in ref.merged.items() if (k[1], k[2]) in live}
        ref.bounds = {k: v for k, v in ref.bounds.items() if k in want}
        assert set(got) == set(want)
        for key, m in got.items():
            counts, count, total = want[key]
            assert m.count == count
            assert set(m.bounds) == ref.bounds[key]
            for b, c in zip(m.bounds, m.counts, strict=True):
                assert c == counts.get(b, 0.0)
            assert (m.sum is None) == (total is None)
            if total is not None and m.sum is not None:
                assert m.sum == pytest.approx(total)
        # Prometheus' view: every series only grows, buckets are cumulative, and a bucket
        # that went away never comes back.
        now = rendered(lat)
        for k, v in now.items():
            if k in last and not k[0].endswith("_sum"):
                assert v >= last[k], k
        for (name, model, version, le), v in now.items():
            if name.endswith("_bucket") and le != "+Inf":
                assert v <= now[name, model, version, "+Inf"]
        for name, model, version, le in now:
            if name.endswith("_bucket") and (name, model, version) in last_bounds:
                assert le in last_bounds[name, model, version], (le, last_bounds)
        last_bounds.clear()
        for name, model, version, le in now:
            if name.endswith("_bucket"):
                last_bounds.setdefault((name, model, version), set()).add(le)
        last.clear()
        last.update(now)

    for op in ops:
        if op[0] == "serve":
            servers[op[1]].serve(op[2], op[3])  # type: ignore[index, arg-type]
        elif op[0] == "restart":
            bounds = BOUNDS if op[2] == 0 else OTHER_BOUNDS
            servers[op[1]] = Server(bounds, [0.0] * 3)  # type: ignore[index]
        elif op[0] == "round":
            vs = versions(current)
            batch = []
            now += op[4]  # type: ignore[operator]
            for addr in op[1]:  # type: ignore[union-attr]
                key = ("m", addr)
                h = servers[addr].histogram()
                page = sample(h, h if op[2] else None)
                got = sent.changed_only(key, page, now) if collector else page
                batch.append((key, got))
                if key in vs and not (collector and op[3]):
                    for f, delivered in (("ttft", got.ttft), ("tpot", got.tpot)):
                        if delivered is not None:
                            ref.add(key, f, vs[key], delivered)
            if not (collector and op[3]):
                lat.observe(current, batch)
        elif op[0] == "collector restarted":
            sent = SentHistograms()
        elif op[0] == "read":
            check()
        else:
            new = fleets[op[1]]  # type: ignore[index]
            for key in versions(current).keys() - versions(new).keys():
                ref.leave(key)
            current = new
            lat.retain(current)
    check()


def test_reading_while_the_loop_observes_loses_nothing() -> None:
    """Readers (the /metrics thread) fold while the weight loop queues: the end result is the
    same as with no reader at all."""
    f = fleet({"v1": [A, B, C]})
    lat, quiet = ModelLatency(), ModelLatency()
    rng = random.Random(7)
    servers = {a: Server(BOUNDS, [0.0] * 3) for a in (A, B, C)}
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            rendered(lat)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(3000):
            addr = rng.choice((A, B, C))
            if i % 97 == 0:
                servers[addr] = Server(BOUNDS, [0.0] * 3)
            servers[addr].serve(rng.randrange(4), rng.randrange(1, 4))
            batch = [(("m", addr), sample(servers[addr].histogram()))]
            lat.observe(f, batch)
            quiet.observe(f, batch)
    finally:
        stop.set()
        reader.join()
    got, want = lat.merged()["ttft", "m", "v1"], quiet.merged()["ttft", "m", "v1"]
    assert (got.counts, got.count) == (want.counts, want.count)
    assert got.sum == pytest.approx(want.sum)
    assert not math.isnan(got.count) and got.count > 0


def test_a_restart_that_counted_past_the_old_counts_is_still_a_restart() -> None:
    """Found by the property test: 1 slow request, restarted, 5 fast ones by the next scrape.
    The counts all rose, but the fast bucket by more than the count: a new lifetime."""
    f = fleet({"v1": [A]})
    lat = ModelLatency()
    lat.observe(f, [(("m", A), sample(hist((0, 1, 1), 1, 0.5)))])
    lat.observe(f, [(("m", A), sample(hist((5, 5, 5), 5, 0.5)))])
    r = rendered(lat)
    assert r[f"{TTFT}_count", "m", "v1", ""] == 5
    assert r[f"{TTFT}_bucket", "m", "v1", "0.1"] == 5
