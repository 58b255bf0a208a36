"""The forecasts' history file (autoscaling/persist.py): written whole, read back, a damaged
one set aside so the control plane starts and learns afresh."""

from __future__ import annotations

import json
from pathlib import Path

from controlplane.autoscaling.forecast import Forecaster, Settings
from controlplane.autoscaling.persist import HISTORY_FILE, HistoryFile


def test_a_saved_history_is_read_back_by_a_new_process(tmp_path: Path) -> None:
    s = Settings(10.0, 400.0, "auto", 10.0)
    f = Forecaster()
    for i in range(30):
        f.record("m", s, i * 10.0, 1, 1, 10 + i)
    HistoryFile(tmp_path).write(f.dump())
    assert not list(tmp_path.glob("*.tmp"))
    g = Forecaster()
    assert g.restore(HistoryFile(tmp_path).read()) == 1
    g.record("m", s, 400.0, 1, 1, 10)
    assert g.histories["m"].buckets == f.histories["m"].buckets and len(g.histories["m"].buckets) > 20


def test_no_file_is_an_empty_history(tmp_path: Path) -> None:
    assert HistoryFile(tmp_path / "new").read() == {}


def test_a_damaged_file_is_set_aside_and_nothing_fails(tmp_path: Path) -> None:
    (tmp_path / HISTORY_FILE).write_text('{"models": {"m": ')
    assert HistoryFile(tmp_path).read() == {}
    assert (tmp_path / (HISTORY_FILE + ".bad")).exists() and not (tmp_path / HISTORY_FILE).exists()
    (tmp_path / HISTORY_FILE).write_text(json.dumps([1, 2]))
    assert HistoryFile(tmp_path).read() == {}
