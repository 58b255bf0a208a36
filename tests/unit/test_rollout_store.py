"""The rollout store on a real SQLite file: state and audit survive a process that dies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from controlplane.rollout.machine import Abort, Effect, RolloutSpec, Tick, Transition, apply, start
from controlplane.rollout.store import RolloutStore


def audit_of(effects: list[Effect]) -> list[Transition]:
    return [e for e in effects if isinstance(e, Transition)]


SPEC = RolloutSpec(model="chat", stable="v1", canary="v2", steps=(10, 100), interval_s=None)


def test_state_and_audit_round_trip(tmp_path: Path) -> None:
    store = RolloutStore(tmp_path)
    r, eff = start(SPEC, now=0.0)
    store.save(r, audit_of(eff), who="alice")
    r, eff = apply(r, Tick(1.0))
    store.save(r, audit_of(eff), who="controller")
    assert store.get("chat") == r
    assert store.get("other") is None
    assert [a.who for a in store.audit("chat")] == ["alice", "controller"]
    assert [a.weight for a in store.audit("chat")] == [0, 10]
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    store.close_now()
    again = RolloutStore(tmp_path)
    assert again.all() == [r]


def test_a_committed_transition_survives_kill_9(tmp_path: Path) -> None:
    # A child process saves a transition, then kills itself without closing anything.
    code = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from controlplane.rollout.machine import RolloutSpec, Tick, apply, start\n"
        "from controlplane.rollout.store import RolloutStore\n"
        "s = RolloutStore(Path(sys.argv[1]))\n"
        "spec = RolloutSpec(model='chat', stable='v1', canary='v2', steps=(10, 100), interval_s=None)\n"
        "r, _ = start(spec, 0.0)\n"
        "r, eff = apply(r, Tick(1.0))\n"
        "s.save(r, [e for e in eff if hasattr(e, 'phase')], who='controller')\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=False)
    assert proc.returncode == -9
    r = RolloutStore(tmp_path).get("chat")
    assert r is not None and (r.phase, r.step, r.weight) == ("Progressing", 0, 10)


def test_an_aborted_rollout_is_stored_with_its_reason(tmp_path: Path) -> None:
    store = RolloutStore(tmp_path)
    r, _ = start(SPEC, now=0.0)
    r, eff = apply(r, Abort("bad canary"))
    store.save(r, audit_of(eff), who="bob")
    got = store.get("chat")
    assert got is not None and got.phase == "Aborted" and got.reason == "bad canary"
    assert store.audit("chat")[-1].reason == "bad canary"
