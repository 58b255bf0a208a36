"""cpctl's rollout views agree on which version is stable and which is the canary: the table
people read and the json/yaml scripts read come from the same `roles`."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from controlplane.cli import cpctl_output as out
from controlplane.v1 import rollout_pb2


def _rollout(phase: str, weights: dict[str, int], step: int) -> rollout_pb2.Rollout:
    # As the server sends it: stable_version is where the rollout started, canary_version
    # where it goes, whatever the phase.
    return rollout_pb2.Rollout(
        model="llama",
        stable_version="v1",
        canary_version="v2",
        phase=phase,
        step=step,
        steps=[5, 25, 50, 100],
        weights=weights,
        reason="",
        interval_seconds=60,
    )


# (phase, weights, step) -> (stable, canary, replaced): what an operator should read.
CASES = [
    pytest.param("Progressing", {"v1": 75, "v2": 25}, 2, ("v1", "v2", None), id="running"),
    pytest.param("Paused", {"v1": 95, "v2": 5}, 1, ("v1", "v2", None), id="paused"),
    pytest.param("Completed", {"v1": 0, "v2": 100}, 4, ("v2", None, "v1"), id="completed"),
    # The aborted canary is still named: the version the rollout gave up on, at 0%.
    pytest.param("Aborted", {"v1": 100, "v2": 0}, 2, ("v1", "v2", None), id="aborted"),
]


def _table_roles(text: str) -> tuple[str, str | None, str | None]:
    fields = dict(line.split(":", 1) for line in text.splitlines() if not line.startswith(" "))
    stable, _, rest = fields["Stable"].strip().partition("  ")
    replaced = rest.removeprefix("(replaced ").removesuffix(")") if rest else None
    canary = fields["Canary"].strip()
    return stable, None if canary == "-" else canary, replaced


def _doc_roles(doc: dict[str, Any]) -> tuple[str, str | None, str | None]:
    # .get: the old form had no previous_version, and must fail only where the parts disagree.
    return doc["stable_version"], doc["canary_version"], doc.get("previous_version")


@pytest.mark.parametrize(("phase", "weights", "step", "expected"), CASES)
def test_the_table_json_and_yaml_name_the_same_roles(
    phase: str, weights: dict[str, int], step: int, expected: tuple[str, str | None, str | None]
) -> None:
    r = _rollout(phase, weights, step)
    assert _table_roles(out.rollout_table(r)) == expected
    as_json = json.loads(out.dump(out.rollout_to_dict(r), "json"))
    as_yaml = yaml.safe_load(out.dump(out.rollout_to_dict(r), "yaml"))
    assert _doc_roles(as_json) == expected
    assert _doc_roles(as_yaml) == expected
    # One line per watch event (-w -o json) says the same.
    assert _doc_roles(json.loads(out.dump(out.rollout_to_dict(r), "json", one_line=True))) == expected

    # The list view's STABLE and CANARY columns, and `rollout list -o json`.
    head, row = out.rollouts_table([r]).splitlines()[:2]
    at = head.index("STABLE")
    stable, canary = row[at:].split()[:2]
    assert (stable, None if canary == "-" else canary) == expected[:2]
    listed = json.loads(out.dump({"rollouts": [out.rollout_to_dict(r)]}, "json"))
    assert _doc_roles(listed["rollouts"][0]) == expected


@pytest.mark.parametrize(("phase", "weights", "step", "expected"), CASES)
def test_weights_list_the_stable_version_first(
    phase: str, weights: dict[str, int], step: int, expected: tuple[str, str | None, str | None]
) -> None:
    r = _rollout(phase, weights, step)
    order = [v for v in expected if v is not None]
    assert list(out.rollout_to_dict(r)["weights"]) == order
    assert out.weights_text(r) == ", ".join(f"{v} {weights[v]}%" for v in order)


def test_roles_is_the_one_place_the_parts_are_worked_out() -> None:
    done = _rollout("Completed", {"v1": 0, "v2": 100}, 4)
    assert out.roles(done) == out.Roles(stable="v2", canary=None, previous="v1")
    running = _rollout("Progressing", {"v1": 75, "v2": 25}, 2)
    assert out.roles(running) == out.Roles(stable="v1", canary="v2", previous=None)
