"""xDS corners on real Envoy (SotW and delta). Under steady load (~30 requests/s):

a. a model's version replaced in one edit, the old version removed from the file;
b. a cluster-level edit: Envoy must not sit with a warming cluster (and a held CDS ACK);
c. a version replaced next to a model whose cluster Envoy rejects (NACK).

Under closed-loop load (their blackholes last milliseconds):

d. the control plane killed (-9), a version replaced in the file while it is down, restarted;
e. the xDS connection cut (through a relay, same control-plane process) while a CDS NACK is
   outstanding.

A failure is any non-200, connection error or misrouted answer.

    .venv/bin/pytest tests/integration/test_xds_corners.py -s
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.churn import BAD_OVERRIDE, ChurnRig, describe_failures
from tests.integration.harness import wait_until

pytestmark = pytest.mark.envoy

NACK_MESSAGE = "Expected positive duration"


def _rig(request: pytest.FixtureRequest, tmp_path: Path, relay: bool) -> Iterator[ChurnRig]:
    r = ChurnRig(tmp_path, delta=request.param == "delta", relay=relay)
    try:
        yield r
    finally:
        r.close()


@pytest.fixture(params=["sotw", "delta"])
def rig(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ChurnRig]:
    yield from _rig(request, tmp_path, relay=False)


@pytest.fixture(params=["delta", "sotw"])
def long_rig(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ChurnRig]:
    """For the longest corners (20-30 s each), on both transports."""
    yield from _rig(request, tmp_path, relay=False)


def on_backends(rig: ChurnRig, model: str, backends: set[str], n: int = 10) -> bool:
    """The last `n` answers to `model` all came from `backends`."""
    assert rig.load is not None
    last = rig.load.last(n, model)
    return len(last) == n and all(o.backend in backends and not o.failed for o in last)


def test_version_replaced_in_one_edit_with_the_old_one_removed(long_rig: ChurnRig) -> None:
    rig = long_rig
    rig.add_model("m1", backends=2)
    rig.start(load_models=["m1"])
    assert rig.load is not None
    sides = {"v1": ["m1-v1-0", "m1-v1-1"], "v2": ["m1-v2-0", "m1-v2-1"]}
    timings: list[str] = []
    missed: list[str] = []
    for i in range(6):  # v1 -> v2 -> v1 -> ... three times back and forth
        version = "v2" if i % 2 == 0 else "v1"
        detail = rig.switch_to("m1", version, sides[version])
        t = rig.write()
        rig.record("replace", detail, t)
        try:
            took = wait_until(
                lambda v=version: on_backends(rig, "m1", set(sides[v])),  # type: ignore[misc]
                5.0,
                f"traffic to move to {version}",
                interval=0.02,
            )
            first = rig.load.first_from(sides[version], t, "m1")
            timings.append(
                f"{detail}: first answer from {version} +{(first or t) - t:.2f}s, "
                f"only {version} (last 10 answers) +{took:.2f}s"
            )
        except AssertionError:
            missed.append(f"{detail}: traffic not on {version} 5 s after the edit")
        time.sleep(1.5)
    rig.load.stop()
    failures = rig.load.failures()
    print("\n" + "\n".join(timings + missed))
    print(f"requests: {rig.load.total()}; {describe_failures(rig, failures)}")
    failed = len(failures)
    assert failed == 0, describe_failures(rig, failures)
    assert not missed, missed
    rig.wait_converged(5)


def cluster_edits(rig: ChurnRig) -> list[tuple[str, Callable[[], None]]]:
    """Cluster-level edits, each applied to rig.fleet by its callable (not written yet)."""
    small = rig.fleet.tiers["small"]
    m1 = rig.fleet.models["m1"].keys
    bad = rig.fleet.models["bad"].keys

    def nack_beside() -> None:
        small["outlier_detection"] = {"consecutive_5xx": 4, "interval": "6s"}
        bad["cluster_overrides"] = dict(BAD_OVERRIDE)

    def fix() -> None:
        bad.pop("cluster_overrides")
        small["outlier_detection"] = {"consecutive_5xx": 9}

    return [
        (
            "tier small outlier_detection",
            lambda: small.update(outlier_detection={"consecutive_5xx": 7, "interval": "3s"}),
        ),
        (
            "tier small circuit_breakers",
            lambda: small.update(circuit_breakers={"default": {"max_requests": 900}}),
        ),
        (
            "m1 cluster_overrides connect_timeout 2s",
            lambda: m1.update(cluster_overrides={"connect_timeout": "2s"}),
        ),
        ("m1 balancing round_robin", lambda: m1.update(balancing="round_robin")),
        ("tier small outlier_detection + NACKed override on model bad, one edit", nack_beside),
        ("bad override removed + tier small outlier_detection", fix),
    ]


def test_cluster_level_edit_leaves_no_cluster_warming_and_no_held_cds_ack(rig: ChurnRig) -> None:
    rig.add_model("m1", backends=2)
    rig.add_model("m2", backends=1)
    rig.add_model("bad", backends=1)  # no traffic; carries the NACKed override in one case
    rig.start(load_models=["m1", "m2"])
    assert rig.envoy is not None and rig.load is not None
    envoy = rig.envoy
    rows: list[str] = []
    problems: list[str] = []
    for i, (label, edit) in enumerate(cluster_edits(rig)):
        edit()
        modified = envoy.stat("cluster_manager.cluster_modified")
        t_write = rig.write()
        rig.record("cluster", label, t_write)
        # The moment Envoy takes the changed cluster (it warms from here until its assignment).
        deadline = t_write + 5.0
        t_applied = None
        while time.monotonic() < deadline:
            if envoy.stat("cluster_manager.cluster_modified") > modified:
                t_applied = time.monotonic()
                break
            time.sleep(0.01)
        if t_applied is None:
            problems.append(f"{label}: Envoy never got the changed cluster (cluster_modified unchanged)")
            continue
        # Right away, a CDS change (a new model): it must not wait behind a held CDS ACK.
        added = f"n{i}"
        rig.add_model(added, backends=1)
        t_add = rig.write()
        rig.record("add", f"add {added}", t_add)
        t_cold = t_live = None
        peak = 0
        while time.monotonic() - t_applied < 20.0 and (t_cold is None or t_live is None):
            now = time.monotonic()
            warming = envoy.stat("cluster_manager.warming_clusters")
            peak = max(peak, warming)
            if t_cold is None and warming == 0:
                t_cold = now
            if t_live is None and rig.probe(added)[0] == 200:
                t_live = now
            time.sleep(0.02)
        warm = f"{t_cold - t_applied:.2f}s" if t_cold is not None else ">20s"
        live = f"{t_live - t_add:.2f}s" if t_live is not None else ">20s"
        rows.append(
            f"{label}: in Envoy {t_applied - t_write:.2f}s after the write; warming_clusters "
            f"(peak {peak}) 0 after {warm}; model {added} (written {t_add - t_applied:.2f}s later) "
            f"live after {live}"
        )
        if t_cold is None or t_cold - t_applied > 1.0:
            problems.append(f"{label}: warming_clusters back to 0 only after {warm} (limit 1 s)")
        if t_live is None or t_live - t_add > 2.0:
            problems.append(f"{label}: the next CDS change (add {added}) live only after {live} (limit 2 s)")
        time.sleep(1.0)
    rig.load.stop()
    failures = rig.load.failures()
    print("\n" + "\n".join(rows))
    print(f"requests: {rig.load.total()}; {describe_failures(rig, failures)}")
    assert not problems, "\n".join(problems + rows)
    failed = len(failures)
    assert failed == 0, describe_failures(rig, failures)
    rig.wait_converged(5)


def cluster_nack(rig: ChurnRig) -> str:
    assert rig.cp is not None
    for p in rig.cp.proxies():
        if p["node_id"] == rig.node_id:
            return str(p["types"].get("cluster", {}).get("last_nack") or "")
    return ""


@pytest.mark.parametrize("order", ["nack_first", "same_edit", "new_model"])
def test_replacement_next_to_a_nacked_model(rig: ChurnRig, order: str) -> None:
    """`good` replaces v1 by v2 (v1 removed) while `bad`'s cluster is refused by Envoy: first
    an edit of an existing model's cluster (Envoy keeps its previous one), before or in the
    same edit; or (`new_model`) a new model whose cluster Envoy refuses, in the same edit."""
    rig.add_model("good", backends=2)
    if order != "new_model":
        rig.add_model("bad", backends=1)
    rig.start(load_models=["good"])
    assert rig.load is not None and rig.cp is not None
    load = rig.load
    v1, v2 = {"good-v1-0", "good-v1-1"}, {"good-v2-0", "good-v2-1"}

    if order == "new_model":
        rig.add_model("bad", backends=1, cluster_overrides=dict(BAD_OVERRIDE))
    rig.fleet.models["bad"].keys["cluster_overrides"] = dict(BAD_OVERRIDE)
    if order == "nack_first":
        rig.record("nack", "bad cluster_overrides={connect_timeout: -1s}", rig.write())
        wait_until(lambda: NACK_MESSAGE in cluster_nack(rig), 5, "the CDS NACK at /debug/proxies")
        time.sleep(0.5)
    detail = rig.switch_to("good", "v2", sorted(v2))
    t_edit = rig.write()
    rig.record("replace", detail + (" + bad override" if order == "same_edit" else ""), t_edit)

    time.sleep(5.0)
    window = t_edit + 2.0
    answered = [o for o in load.snapshot() if o.t >= t_edit and not o.failed]
    late = load.failures(since=window)
    on_v1 = on_backends(rig, "good", v1)
    on_v2 = on_backends(rig, "good", v2)
    nack = cluster_nack(rig)
    status = rig.proxy_status()
    first_v2 = load.first_from(v2, t_edit, "good")
    print(
        f"\n{order}: 5 s after the edit traffic is on "
        + ("v1 (route held)" if on_v1 else "v2" if on_v2 else "a mix / failing")
        + (f" (first answer from v2 +{first_v2 - t_edit:.2f}s)" if first_v2 is not None else "")
        + f"; statuses {status}; cluster last_nack {nack[:200]!r}"
    )
    print(describe_failures(rig, load.failures()))

    assert answered and answered[0].t <= window, "good gave no 200 within 2 s of the edit"
    failed_late = len(late)
    assert failed_late == 0, "failures after the 2 s window:\n" + describe_failures(rig, late)
    assert NACK_MESSAGE in nack, f"the cluster NACK is not shown at /debug/proxies: {nack!r}"
    assert on_v2, "good is not on v2 five seconds after the edit"
    types = rig.proxy_types()
    assert types["cluster"]["status"] == "NACKED" and "bad@v1" in types["cluster"]["reason"], types
    if order == "new_model":
        # The gateway's one route configuration: every entry went out but bad's, held back.
        assert types["route"]["status"] == "STALE", types
        assert "bad@v1 was rejected by the proxy" in types["route"]["reason"], types
        assert rig.probe("bad")[0] == 404  # not routed to a cluster the proxy does not have
    else:
        # Nothing is held back: bad's routes name its cluster, which the proxy keeps as it was.
        assert types["route"]["status"] == "SYNCED", types

    # Fix the bad model: traffic reaches v2 and everything converges, still with no failure.
    rig.fleet.models["bad"].keys.pop("cluster_overrides")
    t_fix = rig.write()
    rig.record("unnack", "bad override removed", t_fix)
    took = wait_until(lambda: on_backends(rig, "good", v2), 3.0, "traffic on v2 after the fix", interval=0.02)
    print(f"traffic on v2 {took:.2f}s after the fix")
    rig.wait_converged(5)
    load.stop()
    failures = load.failures()
    failed = len(failures)
    assert failed == 0, describe_failures(rig, failures)


# The corners below open windows of a few milliseconds: they run under closed-loop load
# (thousands of requests per second) so that a window that opens is seen.
BURST = 2000.0


@pytest.fixture(params=["sotw", "delta"])
def relayed_rig(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ChurnRig]:
    yield from _rig(request, tmp_path, relay=True)


def test_restart_with_the_version_replaced_while_the_control_plane_was_down(long_rig: ChurnRig) -> None:
    """kill -9, replace m1's version in the file (old removed), start again: the proxy must get
    the new route before losing the old cluster."""
    rig = long_rig
    rig.add_model("m1", backends=2)
    rig.add_model("m2", backends=2)
    rig.start(load_models=["m1", "m2"], rate=BURST)
    assert rig.load is not None
    load = rig.load
    sides = {"v1": ["m1-v1-0", "m1-v1-1"], "v2": ["m1-v2-0", "m1-v2-1"]}
    rows: list[str] = []
    for i in range(4):
        version = "v2" if i % 2 == 0 else "v1"
        t_kill = rig.kill_control_plane()
        time.sleep(0.5)
        detail = rig.switch_to("m1", version, sides[version])
        rig.write()
        time.sleep(0.5)
        t_up = rig.start_control_plane()
        rig.record("restart", f"edited while down: {detail}", t_kill)
        wait_until(
            lambda v=version: on_backends(rig, "m1", set(sides[v])),  # type: ignore[misc]
            10,
            f"traffic to move to {version}",
        )
        first = load.first_from(sides[version], t_up, "m1")
        rows.append(
            f"restart {i + 1} ({detail}): control plane up {t_up - t_kill:.2f}s after the kill, "
            f"first answer from {version} +{(first or t_up) - t_up:.2f}s after that; "
            f"failures so far {len(load.failures())} of {load.total()}"
        )
        time.sleep(1.0)
    load.stop()
    print("\n" + "\n".join(rows))
    print(describe_failures(rig, load.failures()))
    failures = load.failures()
    failed = len(failures)
    assert failed == 0, describe_failures(rig, failures)
    rig.wait_converged(5)


def test_reconnect_while_a_cds_nack_is_outstanding(relayed_rig: ChurnRig) -> None:
    """The xDS connection is cut (same control-plane process) while the proxy's last cluster
    response was NACKed: on the new stream no cluster in use may go missing, even briefly."""
    rig = relayed_rig
    rig.add_model("m1", backends=2)
    rig.add_model("m2", backends=2)
    rig.add_model("bad", backends=1)
    rig.start(load_models=["m1", "m2"], rate=BURST)
    assert rig.load is not None
    load = rig.load
    rig.fleet.models["bad"].keys["cluster_overrides"] = dict(BAD_OVERRIDE)
    rig.record("nack", "bad cluster_overrides={connect_timeout: -1s}", rig.write())
    wait_until(lambda: NACK_MESSAGE in cluster_nack(rig), 5, "the CDS NACK at /debug/proxies")
    time.sleep(0.5)
    rows: list[str] = []
    for i in range(3):
        before = len(load.failures())
        rig.record("reconnect", f"relay cut {rig.cut_xds()} connection(s)")
        time.sleep(2.0)
        rows.append(
            f"cut {i + 1}: {len(load.failures()) - before} failures; statuses {rig.proxy_status()}; "
            f"envoy clusters {sorted(rig.envoy_clusters())}"
        )
    rig.fleet.models["bad"].keys.pop("cluster_overrides")
    rig.record("unnack", "bad override removed", rig.write())
    converged = rig.wait_converged(5)
    load.stop()
    print("\n" + "\n".join(rows) + f"\nconverged {converged:.2f}s after the fix")
    print(describe_failures(rig, load.failures()))
    failures = load.failures()
    failed = len(failures)
    assert failed == 0, describe_failures(rig, failures)
