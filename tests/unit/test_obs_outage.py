"""The once-per-outage log (obs/outage.py), through structlog's real logger; capture_logs reads
the lines."""

from __future__ import annotations

import structlog
from structlog.testing import capture_logs

from controlplane.obs.outage import Outage

log = structlog.get_logger("tests.outage")


def test_an_outage_is_logged_at_its_first_failure_and_its_recovery_once_each() -> None:
    outage = Outage(log, "store.unreachable", "store.reachable_again")
    with capture_logs() as logs:
        assert outage.ok(store="s") is False  # no outage yet: nothing to end
        assert outage.failed(ConnectionError("refused"), store="s") is True
        assert outage.failed(ConnectionError("refused again"), store="s") is False
        assert outage.failed(TimeoutError("timed out"), store="s") is False
        assert outage.ok(store="s") is True
        assert outage.ok(store="s") is False
    assert logs == [
        {"event": "store.unreachable", "log_level": "warning", "store": "s", "error": "refused"},
        {"event": "store.reachable_again", "log_level": "info", "store": "s"},
    ]


def test_a_second_outage_is_logged_again() -> None:
    outage = Outage(log, "down", "up")
    with capture_logs() as logs:
        outage.failed("first")
        outage.ok()
        outage.failed("second")
        outage.failed("second, again")
    events = [(e["event"], e.get("error")) for e in logs]
    assert events == [("down", "first"), ("up", None), ("down", "second")]


def test_without_an_up_event_recovery_is_silent_and_still_re_arms() -> None:
    outage = Outage(log, "cannot share: etcd unreachable")
    with capture_logs() as logs:
        outage.failed(OSError("a"))
        assert outage.ok() is True
        outage.failed(OSError("b"))
    assert [(e["event"], e["error"]) for e in logs] == [
        ("cannot share: etcd unreachable", "a"),
        ("cannot share: etcd unreachable", "b"),
    ]


def test_the_error_text_is_cut_where_the_site_says_and_whole_otherwise() -> None:
    long = "x" * 1000
    with capture_logs() as logs:
        Outage(log, "cut", error_chars=300).failed(ValueError(long), peer="p")
        Outage(log, "whole").failed(ValueError(long))
    assert logs[0] == {"event": "cut", "log_level": "warning", "peer": "p", "error": "x" * 300}
    assert logs[1]["error"] == long
