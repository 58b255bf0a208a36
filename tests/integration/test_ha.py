"""Several control-plane replicas on a real etcd (Debian's etcd-server), real Envoys, real load.

The issue's "done when":
- two replicas, two Envoys, steady load through both; the leader is killed (-9) mid-rollout:
  the other replica takes over within the lease TTL, the rollout completes, zero failures;
- etcd stopped for 12 s (30 s under -m soak): traffic unaffected, writes fail clearly,
  afterwards a new rollout works;
plus: a change through any replica is served by all within 1 s, and losing one member of a
3-member etcd cluster loses nothing.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from controlplane.v1 import endpoint_pb2, rollout_pb2
from tests.integration.harness import (
    BIN,
    OUTAGES,
    ControlPlane,
    Emulator,
    Envoy,
    EtcdCluster,
    Operator,
    Traffic,
    free_port,
    import_fleet,
    wait_until,
)

pytestmark = pytest.mark.envoy

MODEL = "llama"
FAST = {"slots": 32, "decode_ms_per_token": 2, "prefill_ms_per_token": 0.01}
TTL_S = 3  # the harness starts replicas with --leader-ttl 3


class HaRig:
    """etcd, emulated servers (v1: a1 a2, v2: b1 b2), replicas r1 r2, Envoys e1 e2, traffic."""

    def __init__(self, tmp: Path, etcd_members: int = 1) -> None:
        self.tmp = tmp
        self.etcd = EtcdCluster(tmp, etcd_members)
        self.servers: dict[str, Emulator] = {}
        self.replicas: dict[str, ControlPlane] = {}
        self.ops: dict[str, Operator] = {}
        self.envoys: list[Envoy] = []
        self.traffic: list[Traffic] = []
        self.listener = free_port()
        self.token = tmp / "admin-token"
        self.token.write_text("ha-test-token\n")

    def fleet(self, listener: int, extra_v1: list[str] = ()) -> str:  # type: ignore[assignment]
        a = [self.servers[n].address for n in ("a1", "a2", *extra_v1)]
        b = [self.servers[n].address for n in ("b1", "b2")]
        return (
            f"listener: {{port: {listener}}}\n"
            "tiers: {small: {max_params_b: 15}}\n"
            "signals: {interval: 500ms, timeout: 400ms}\n"
            f"models: {{{MODEL}: {{params_b: 8, stable: v1, versions: {{\n"
            f"  v1: {{endpoints: [{', '.join(f'{{address: {x!r}}}' for x in a)}]}},\n"
            f"  v2: {{endpoints: [{', '.join(f'{{address: {x!r}}}' for x in b)}]}}}}}}}}\n"
        )

    def import_fleet(self, text: str) -> None:
        path = self.tmp / "fleet.yaml"
        path.write_text(text)
        import_fleet(path, self.etcd.url)

    def replica(self, name: str) -> ControlPlane:
        cp = ControlPlane(
            self.tmp / "unused.yaml",
            self.tmp,
            store=self.etcd.url,
            replica_id=name,
            extra_args=["--admin-token-file", str(self.token)],
        )
        self.replicas[name] = cp
        return cp

    def start(self, envoys: int = 2, servers: tuple[str, ...] = ("a1", "a2", "b1", "b2")) -> None:
        self.etcd.start()
        for n in servers:
            self.servers[n] = Emulator(n, self.tmp, MODEL, **FAST)
        # Both Envoys serve the fleet's one listener port: Envoy binds listeners with
        # SO_REUSEPORT, so the kernel spreads the load generator's connections over both.
        self.import_fleet(self.fleet(self.listener))
        for name in ("r1", "r2"):
            self.replica(name).start()
            self.ops[name] = Operator(self.replicas[name], token="ha-test-token")
        xds = ",".join(self.replicas[n].xds for n in ("r1", "r2"))
        for i in range(envoys):
            self.envoys.append(Envoy(f"envoy-{i + 1}", xds, self.tmp, self.listener).start())

    def leader(self) -> str | None:
        leaders = [
            n
            for n, cp in self.replicas.items()
            if cp.proc and cp.proc.alive() and cp.metric("controlplane_leader") == 1
        ]
        return leaders[0] if len(leaders) == 1 else None

    def rollout(self, replica: str) -> rollout_pb2.Rollout:
        op = self.ops[replica]
        return op.rollouts.Get(rollout_pb2.GetRolloutRequest(model=MODEL), metadata=op.md, timeout=5)

    def close(self) -> None:
        for t in self.traffic:
            t.proc.stop()
        for op in self.ops.values():
            op.close()
        for p in (*self.envoys, *self.replicas.values(), *self.servers.values()):
            p.stop()
        self.etcd.stop()


@pytest.fixture
def ha(tmp_path: Path) -> Iterator[HaRig]:
    rig = HaRig(tmp_path)
    try:
        yield rig
    finally:
        rig.close()


def _failures(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if not 200 <= r["status"] < 300]


def cpctl(rig: HaRig, replica: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "cpctl"), "--server", rig.replicas[replica].admin, "--token-file", str(rig.token), *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


def _served_by_each_envoy(rig: HaRig) -> list[int]:
    return [e.stat("http.inference.downstream_rq_completed") for e in rig.envoys]


def test_a_change_through_any_replica_is_served_by_all_within_a_second(ha: HaRig) -> None:
    ha.start(envoys=0, servers=("a1", "a2", "b1", "b2", "a3"))
    wait_until(lambda: ha.leader() is not None, 10, "a leader")
    follower = next(n for n in ha.replicas if n != ha.leader())
    other = next(n for n in ha.replicas if n != follower)
    # A rollout started through the follower is stored in etcd and seen by the leader.
    started = time.monotonic()
    op = ha.ops[follower]
    op.rollouts.Start(
        rollout_pb2.StartRolloutRequest(model=MODEL, to_version="v2", manual=True), metadata=op.md, timeout=5
    )
    wait_until(lambda: ha.rollout(other).phase == "Progressing", 1.0, "the other replica to see it")
    # The leader drives it: step 1 shows on both.
    wait_until(lambda: all(ha.rollout(n).step == 1 for n in ha.replicas), 5, "step 1 everywhere")
    assert time.monotonic() - started < 6
    # A new fleet imported into etcd is served by every replica within a second.
    ha.import_fleet(ha.fleet(ha.listener, extra_v1=["a3"]))
    added = time.monotonic()
    a3 = ha.servers["a3"].address

    def everywhere() -> bool:
        for name in ha.replicas:
            o = ha.ops[name]
            eps = o.endpoints.List(endpoint_pb2.ListEndpointsRequest(model=MODEL), metadata=o.md, timeout=2)
            if a3 not in {e.address for e in eps.endpoints}:
                return False
        return True

    wait_until(everywhere, 1.0, "the new endpoint on every replica")
    assert time.monotonic() - added < 1.0
    # History shows who did it, through which replica.
    h = op.rollouts.History(rollout_pb2.GetRolloutRequest(model=MODEL), metadata=op.md, timeout=5)
    assert h.records[0].phase == "Progressing" and "admin token" in h.records[0].who


def test_leader_killed_mid_rollout_another_takes_over_and_nothing_fails(ha: HaRig) -> None:
    ha.start()
    for i in range(2):
        # A new connection per request: kept-alive connections would all stick to whichever
        # Envoy the kernel picked first, and "load through both" would be a coin toss.
        ha.traffic.append(
            Traffic(ha.listener, MODEL, ha.tmp, rate=50, name=f"traffic-{i}", fresh_connections=True)
        )
    wait_until(lambda: all(n > 50 for n in _served_by_each_envoy(ha)), 20, "load through both Envoys")
    wait_until(lambda: ha.leader() is not None, 10, "a leader")
    leader = ha.leader()
    assert leader is not None
    survivor = next(n for n in ha.replicas if n != leader)
    out = cpctl(ha, survivor, "rollout", "start", MODEL, "--to", "v2", "--steps", "5,25,50,100",
                "--interval", "3s", "--min-requests", "10")  # fmt: skip
    assert out.returncode == 0, out.stderr
    wait_until(lambda: ha.rollout(survivor).step >= 2, 20, "step 2")
    step_before = ha.rollout(survivor).step
    ha.replicas[leader].proc.kill()  # type: ignore[union-attr]
    killed = time.monotonic()
    wait_until(lambda: ha.replicas[survivor].metric("controlplane_leader") == 1, TTL_S + 3, "the takeover")
    took_over = time.monotonic() - killed
    assert took_over <= TTL_S + 1.5, took_over
    assert ha.rollout(survivor).step >= step_before  # continued from the stored step, not restarted
    wait_until(lambda: ha.rollout(survivor).phase == "Completed", 30, "the rollout to complete")
    # Both Envoys are on the survivor now, and kept serving throughout.
    wait_until(lambda: len(ha.replicas[survivor].proxies()) == 2, 10, "both Envoys on the survivor")
    served = _served_by_each_envoy(ha)
    time.sleep(2)
    assert all(after > before for after, before in zip(_served_by_each_envoy(ha), served, strict=True))
    records = [r for t in ha.traffic for r in t.stop()]
    assert len(records) > 1000
    assert _failures(records) == []
    op = ha.ops[survivor]
    history = op.rollouts.History(rollout_pb2.GetRolloutRequest(model=MODEL), metadata=op.md, timeout=5)
    phases = [h.phase for h in history.records]
    assert phases.count("Completed") == 1
    # The controller's own moves name the replica that made them: the completion, the survivor.
    completed = next(h for h in history.records if h.phase == "Completed")
    assert completed.who == f"controller@{survivor}", completed.who


@pytest.mark.parametrize("outage_s", OUTAGES)
def test_etcd_down_traffic_flows_writes_fail_clearly_then_work_again(ha: HaRig, outage_s: int) -> None:
    ha.start(envoys=1)
    ha.traffic.append(Traffic(ha.listener, MODEL, ha.tmp, rate=50))
    wait_until(lambda: len(ha.traffic[0].records()) > 50, 15, "traffic")
    wait_until(lambda: ha.leader() is not None, 10, "a leader")
    ha.etcd.stop()
    down_at = time.time()
    time.sleep(2)
    out = cpctl(ha, "r1", "rollout", "start", MODEL, "--to", "v2", "--manual")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "UNAVAILABLE" in out.stderr and "state store is unreachable" in out.stderr
    assert "nothing was changed" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    reads = cpctl(ha, "r2", "endpoints", "list")  # reads are served from memory
    assert reads.returncode == 0, reads.stderr
    time.sleep(max(0.0, down_at + outage_s - time.time()))
    ha.etcd.start()
    up_at = time.time()
    # Once etcd is back (and a leader elected again), a new rollout works end to end.
    wait_until(lambda: ha.leader() is not None, 15, "a leader again")
    op = ha.ops["r2"]
    wait_until(
        lambda: op.rollouts.Start(
            rollout_pb2.StartRolloutRequest(model=MODEL, to_version="v2", steps=[50, 100], interval_seconds=1,
                                            min_requests=5),
            metadata=op.md, timeout=5,
        ).phase == "Progressing",
        10,
        "a rollout to start",
    )  # fmt: skip
    wait_until(lambda: ha.rollout("r1").phase == "Completed", 20, "the rollout to complete")
    records = ha.traffic[0].stop()
    during = [r for r in records if down_at <= r["t"] <= up_at]
    assert len(during) > 33 * outage_s  # 50 req/s
    assert _failures(records) == []
    # The refused command was not half-applied: the only rollout is the one after.
    h = op.rollouts.History(rollout_pb2.GetRolloutRequest(model=MODEL), metadata=op.md, timeout=5)
    assert [r.phase for r in h.records].count("Completed") == 1


def test_losing_one_member_of_three_loses_nothing(tmp_path: Path) -> None:
    rig = HaRig(tmp_path, etcd_members=3)
    try:
        rig.start(envoys=0)
        wait_until(lambda: rig.leader() is not None, 10, "a leader")
        first = rig.etcd.names[0]  # every replica talks to the first member until it fails
        rig.etcd.kill(first)
        op = rig.ops["r1"]
        r = op.rollouts.Start(
            rollout_pb2.StartRolloutRequest(model=MODEL, to_version="v2", steps=[50, 100], interval_seconds=1,
                                            min_requests=0),
            metadata=op.md, timeout=20,
        )  # fmt: skip
        assert r.phase == "Progressing"
        wait_until(lambda: rig.rollout("r2").phase == "Completed", 20, "the rollout to complete")
        with pytest.raises(grpc.RpcError) as e:
            op.rollouts.Start(rollout_pb2.StartRolloutRequest(model="nope", to_version="v2"), metadata=op.md)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        rig.close()


def test_import_checks_the_file_and_export_gives_it_back(tmp_path: Path) -> None:
    etcd = EtcdCluster(tmp_path).start()
    try:
        good = tmp_path / "fleet.yaml"
        good.write_text(
            "listener: {port: 10000}\ntiers: {small: {}}\n"
            "models: {m: {params_b: 8, stable: v1,\n"
            "             versions: {v1: {endpoints: [{address: '127.0.0.1:9'}]}}}}\n"
        )
        bad = tmp_path / "bad.yaml"
        bad.write_text(good.read_text().replace("stable: v1", "stable: v9"))
        cp = str(BIN / "controlplane")
        out = subprocess.run(
            [cp, "import", "--from", str(bad), "--to", etcd.url], capture_output=True, text=True
        )
        assert out.returncode == 1 and "stable" in out.stderr and "nothing was written" in out.stderr
        missing = subprocess.run(
            [cp, "export", "--from", etcd.url, "--to", "-"], capture_output=True, text=True
        )
        assert missing.returncode == 1 and "import one first" in missing.stderr
        ok = subprocess.run(
            [cp, "import", "--from", str(good), "--to", etcd.url], capture_output=True, text=True
        )
        assert ok.returncode == 0 and "1 models, 1 endpoints" in ok.stdout, ok.stderr
        back = subprocess.run([cp, "export", "--from", etcd.url, "--to", "-"], capture_output=True, text=True)
        assert back.returncode == 0 and back.stdout == good.read_text()
    finally:
        etcd.stop()
    down = subprocess.run([cp, "export", "--from", etcd.url, "--to", "-"], capture_output=True, text=True)
    assert down.returncode == 1 and "unreachable" in down.stderr


def test_a_change_made_before_a_replicas_first_poll_is_not_missed(tmp_path: Path) -> None:
    """CI, once: the rollout started through r1 while r2 was losing its etcd member; r2's first
    poll of etcd's revision came after the write and took it for the baseline, so r2 never
    reloaded (it answered "no rollout" for the whole 20 s). A replica now compares its first
    poll with the revision its state was loaded at."""
    import asyncio

    from controlplane.ha.etcd import Etcd, parse_store_url
    from controlplane.ha.state import EtcdStateStore
    from controlplane.rollout.overlay import EndpointDrain
    from controlplane.rollout.store import StateChange

    etcd = EtcdCluster(tmp_path).start()

    async def scenario() -> None:
        url = parse_store_url(etcd.url + "/controlplane")
        mine, theirs = EtcdStateStore(Etcd(url), "r2"), EtcdStateStore(Etcd(url), "r1")
        try:
            assert (await mine.load()).drains == {}
            drain = EndpointDrain("127.0.0.1:9", "draining", 0.0, 30.0, "test", "the race")
            await theirs.write("test", [], StateChange(drains=(drain,)))
            changes = mine.changes().__aiter__()
            await asyncio.wait_for(changes.__anext__(), 10)  # without the fix: never
            assert set((await mine.load()).drains) == {"127.0.0.1:9"}
        finally:
            await mine.close()
            await theirs.close()

    try:
        asyncio.run(scenario())
    finally:
        etcd.stop()
