"""The fleet file watcher acts on a half-written file only once it has held still (issue 16,
F7): an edit that removes something, or does not load, waits FILE_SETTLE_S; an edit that
only adds or changes goes out at once. A fake clock; the file is real."""

from __future__ import annotations

from pathlib import Path

import pytest

from controlplane import limits
from controlplane.fleet import parse_fleet
from controlplane.fleet.errors import FleetConfigInvalid
from controlplane.fleet.model import Fleet
from controlplane.fleet.watch import FleetFileWatcher, removals
from tests.fleets import fleet_yaml

THREE = {
    "a": {"v1": ["127.0.0.1:8001", "127.0.0.1:8002"]},
    "b": {"v1": ["127.0.0.1:8003"]},
    "c": {"v1": ["127.0.0.1:8004"], "v2": ["127.0.0.1:8005"]},
}


class Rig:
    def __init__(self, tmp_path: Path) -> None:
        self.path = tmp_path / "fleet.yaml"
        self.now = 0.0
        self.served: list[Fleet] = []
        self.refused: list[FleetConfigInvalid] = []
        self.watcher = FleetFileWatcher(
            self.path, self.served.append, self.refused.append, clock=lambda: self.now
        )

    def write(self, text: str) -> None:
        self.path.write_text(text)

    def poll(self, after_s: float = 0.25) -> None:
        self.now += after_s
        self.watcher.check()

    def models(self) -> set[str]:
        return {m.name for m in self.served[-1].models}


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    r = Rig(tmp_path)
    r.write(fleet_yaml(THREE))  # type: ignore[arg-type]
    r.poll()
    assert r.models() == {"a", "b", "c"}  # the first load is never held
    return r


def test_a_half_written_file_is_not_served_while_the_writer_pauses(rig: Rig) -> None:
    text = fleet_yaml({**THREE, "d": {"v1": ["127.0.0.1:8006"]}})  # type: ignore[arg-type]
    cut = text.index("  b:")  # a truncation that is still a valid 1-model fleet
    rig.write(text[:cut])
    assert {m.name for m in parse_fleet(text[:cut]).models} == {"a"}
    for _ in range(int((limits.FILE_SETTLE_S - 0.3) / 0.25)):  # a pause of 1.7 s
        rig.poll()
    assert len(rig.served) == 1 and "removes model b" in rig.watcher.held
    rig.write(text)  # the writer finishes: only adds, served at once
    rig.poll()
    assert len(rig.served) == 2 and rig.models() == {"a", "b", "c", "d"} and not rig.refused


def test_a_removal_is_served_once_the_file_holds_still(rig: Rig) -> None:
    rig.write(fleet_yaml({"a": THREE["a"], "c": {"v2": THREE["c"]["v2"]}}))  # type: ignore[arg-type]
    rig.poll()
    assert len(rig.served) == 1
    assert "model b" in rig.watcher.held and "version c@v1" in rig.watcher.held
    rig.poll(limits.FILE_SETTLE_S)
    assert rig.models() == {"a", "c"} and rig.watcher.held == ""


def test_an_edit_that_only_adds_or_changes_goes_out_at_once(rig: Rig) -> None:
    more = {**THREE, "a": {"v1": [*THREE["a"]["v1"], "127.0.0.1:8009"]}}
    rig.write(fleet_yaml(more))  # type: ignore[arg-type]
    rig.poll()
    assert len(rig.served) == 2


def test_a_file_that_does_not_load_is_refused_at_once_and_a_removal_after_it_still_waits(rig: Rig) -> None:
    rig.write(fleet_yaml(THREE)[:-7] + "  [")  # type: ignore[arg-type]
    rig.poll()
    assert len(rig.refused) == 1 and len(rig.served) == 1  # refusing changes nothing served
    rig.write(fleet_yaml({"a": THREE["a"]}))  # type: ignore[arg-type]
    rig.poll()
    assert len(rig.served) == 1  # measured against what is served, not the refused file
    rig.poll(limits.FILE_SETTLE_S)
    assert rig.models() == {"a"}


def test_a_held_edit_undone_is_dropped(rig: Rig) -> None:
    rig.write(fleet_yaml({"a": THREE["a"]}))  # type: ignore[arg-type]
    rig.poll()
    rig.write(fleet_yaml(THREE))  # type: ignore[arg-type]
    rig.poll()
    rig.poll(limits.FILE_SETTLE_S)
    assert len(rig.served) == 1 and not rig.refused and rig.watcher.held == ""


def test_each_new_change_restarts_the_wait(rig: Rig) -> None:
    rig.write(fleet_yaml({"a": THREE["a"]}))  # type: ignore[arg-type]
    rig.poll()
    rig.poll(limits.FILE_SETTLE_S - 0.5)
    rig.write(fleet_yaml({"a": THREE["a"], "b": THREE["b"]}))  # type: ignore[arg-type]
    rig.poll()
    rig.poll(limits.FILE_SETTLE_S - 0.5)
    assert len(rig.served) == 1  # the file never held still for the whole settle time
    rig.poll(0.5)
    assert rig.models() == {"a", "b"}


def test_removals_names_what_goes() -> None:
    old = parse_fleet(fleet_yaml(THREE))  # type: ignore[arg-type]
    assert removals(old, old) == ""
    fewer = parse_fleet(fleet_yaml({**THREE, "a": {"v1": ["127.0.0.1:8001"]}}))  # type: ignore[arg-type]
    assert removals(old, fewer) == "it removes 1 endpoint(s) of a@v1"
    assert removals(fewer, old) == ""


def test_a_file_that_never_holds_still_is_served_after_the_longest_wait(rig: Rig) -> None:
    """A tool rewriting the file every second (each edit keeping a removal) must not keep every
    edit out forever: a churn run held 14 s of edits until a restart read them all at once."""
    texts = [
        fleet_yaml({"a": THREE["a"], "d": {"v1": [f"127.0.0.1:{9000 + i}"]}})  # type: ignore[arg-type]
        for i in range(20)
    ]
    held_for = 0.0
    for text in texts:
        rig.write(text)
        rig.poll()
        rig.poll(0.75)
        held_for += 1.0
        if len(rig.served) > 1:
            break
    assert len(rig.served) == 2, "held past the longest wait"
    assert limits.FILE_SETTLE_MAX_S <= held_for <= limits.FILE_SETTLE_MAX_S + 1.0
    assert rig.models() == {"a", "d"}
    assert rig.watcher.held == ""


def test_after_the_longest_wait_content_read_once_still_waits_for_a_second_read(rig: Rig) -> None:
    rig.write(fleet_yaml({"a": THREE["a"]}))  # type: ignore[arg-type]
    rig.poll()
    rig.poll(limits.FILE_SETTLE_S - 0.5)
    rig.write(fleet_yaml({"a": THREE["a"], "b": THREE["b"]}))  # type: ignore[arg-type]
    rig.poll(limits.FILE_SETTLE_MAX_S)  # first read of this content, long after the first hold
    assert len(rig.served) == 1  # one read could be a torn write
    rig.poll()
    assert rig.models() == {"a", "b"}
