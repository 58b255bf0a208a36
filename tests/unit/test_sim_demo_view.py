"""The demo's events: what the live view's panel shows, `--no-live` prints as log lines, each
once, in order, none lost to the panel's short memory."""

from __future__ import annotations

import io

from rich.console import Console

from controlplane.sim.demo_view import DemoState, EndpointRow, plain_lines, render, rollout_line


def state_at(t: float) -> DemoState:
    state = DemoState(tiers={"m": "small"}, duration_s=60)
    state.started, state.now = 100.0, 100.0 + t
    return state


def text_of(renderable: object) -> str:
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def test_each_event_is_printed_once_with_its_time() -> None:
    state = state_at(6.0)
    state.event("fleet edit: add server llama-d to llama-3-8b v1")
    state.event("fleet edit refused (stable names a missing version); the last good config stays")
    assert state.take_unprinted() == [
        "t=  6.0s  fleet edit: add server llama-d to llama-3-8b v1",
        "t=  6.0s  fleet edit refused (stable names a missing version); the last good config stays",
    ]
    assert state.take_unprinted() == []
    state.now = 112.5
    state.event("$ cpctl rollout start llama-3-8b --to v2 --steps 20,50,100")
    assert state.take_unprinted() == ["t= 12.5s  $ cpctl rollout start llama-3-8b --to v2 --steps 20,50,100"]


def test_the_live_panel_and_the_log_lines_show_the_same_events() -> None:
    state = state_at(1.0)
    for event in ("fleet edit: add server llama-d", "surge: 6 clients on phi-3-mini", "rollout: m -> v2"):
        state.event(event)
    panel = text_of(render(state))
    for line in state.take_unprinted():
        assert line in panel


def test_no_event_is_lost_when_the_panel_forgets_old_ones() -> None:
    state = state_at(0.0)
    for i in range(20):
        state.event(f"event {i}")
    assert len(state.events) == 8  # the panel keeps the last few
    assert state.take_unprinted() == [f"t=  0.0s  event {i}" for i in range(20)]


def test_plain_progress_lines_name_the_rollout() -> None:
    state = state_at(5.0)
    rollout = {
        "model": "m",
        "canary_version": "v2",
        "phase": "Progressing",
        "step": 2,
        "steps": [20, 50, 100],
        "weights": {"v1": 50, "v2": 50},
    }
    state.rollout = rollout
    assert rollout_line(rollout) == "m -> v2: Progressing, step 2/3, v1 50%, v2 50%"
    assert plain_lines(state)[-1] == "demo: t=  5.0s  rollout m -> v2: Progressing, step 2/3, v1 50%, v2 50%"


def test_a_server_out_of_service_shows_out_not_never_read() -> None:
    state = state_at(5.0)
    state.endpoints = [
        EndpointRow("m", "v1", "old", "A100", "RETIRED", 0, None, None, None),
        EndpointRow("m", "v1", "gone", "A100", "DRAINED", 0, None, None, None),
        EndpointRow("m", "v2", "cold", "A100", "HELD_OUT", 0, None, None, None),
        EndpointRow("m", "v2", "new", "A100", "SERVING", 5, 2.0, 1.0, 0.25),
    ]
    line = next(x for x in plain_lines(state) if " load (" in x)
    assert line.endswith("never read) old=out, gone=out, cold=-+-, new=2+1"), line
    table = text_of(render(state))
    rows = [[c.strip() for c in row.split("│")] for row in table.splitlines() if row.count("│") > 10]
    cells = {r[3]: r[7:10] for r in rows if r[3] in ("old", "cold")}
    assert cells == {"old": ["out", "out", "out"], "cold": ["-", "-", "-"]}, cells
