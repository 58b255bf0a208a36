"""docs/picker.md's snippets fit the README's example fleet (issue 41, item 15): the YAML it
shows, merged into deploy/fleet.yaml, keeps every tier's size limit and timeout and turns the
picker on for the small tier; the commands its walkthrough runs make exactly that file; the
Trust section's `picker.tls` is a valid fleet key. (tests/integration/test_docs_examples.py
runs the walkthrough itself, after the README's quick start.)"""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from controlplane.fleet import parse_fleet
from controlplane.fleet.model import Fleet

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "picker.md").read_text()
FLEET = (ROOT / "deploy" / "fleet.yaml").read_text()


def _blocks(lang: str) -> list[str]:
    fence = re.compile(r"^([ \t]*)```" + lang + r"\n(.*?)^\1```", re.S | re.M)
    return [
        "\n".join(line[len(m.group(1)) :] for line in m.group(2).splitlines()) for m in fence.finditer(DOC)
    ]


def _merged(snippet: str) -> Fleet:
    """deploy/fleet.yaml with `snippet`'s keys set over it (a tier's keys one by one)."""
    base: dict[str, Any] = yaml.safe_load(FLEET)
    for key, value in yaml.safe_load(snippet).items():
        if key == "tiers":
            for tier, keys in value.items():
                base["tiers"].setdefault(tier, {}).update(keys)
        else:
            base[key] = value
    return parse_fleet(yaml.safe_dump(base, sort_keys=False))


def _tiers(fleet: Fleet) -> dict[str, Any]:
    return {t.name: t for t in fleet.tiers}


def test_the_snippet_keeps_each_tiers_limits_and_turns_the_small_tier_to_the_picker() -> None:
    snippet = _blocks("yaml")[0]
    # Pasted over the example's line, the tier line is the example's, plus the picker.
    pasted = yaml.safe_load(snippet)["tiers"]["small"]
    assert pasted == {**yaml.safe_load(FLEET)["tiers"]["small"], "balancing": "picker"}
    before = parse_fleet(FLEET)
    after = _merged(snippet)
    assert [f"{h}:{p}" for h, p in after.picker.endpoints] == ["127.0.0.1:18090", "127.0.0.1:18092"]
    old, new = _tiers(before), _tiers(after)
    assert new["small"].policy.balancing == "picker"
    assert (
        dataclasses.replace(new["small"].policy, balancing=old["small"].policy.balancing)
        == old["small"].policy
    )
    assert new["small"].max_params_b == old["small"].max_params_b == 15
    assert {n: t for n, t in new.items() if n != "small"} == {n: t for n, t in old.items() if n != "small"}
    assert after.picked(next(m for m in after.models if m.name == "llama-3-8b"))


def test_the_walkthroughs_commands_make_the_snippets_fleet(tmp_path: Path) -> None:
    (sh,) = [b for b in _blocks("sh") if "controlplane picker" in b]
    edits = [line for line in sh.splitlines() if line.startswith(("printf ", "sed "))]
    assert len(edits) == 2
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(FLEET)
    for line in edits:
        subprocess.run(["bash", "-c", line.replace("deploy/fleet.yaml", str(fleet))], check=True)
    assert parse_fleet(fleet.read_text()) == _merged(_blocks("yaml")[0])


def test_the_trust_sections_picker_tls_is_a_valid_fleet() -> None:
    (snippet,) = [b for b in _blocks("yaml") if "tls:" in b]
    fleet = _merged(snippet)
    assert fleet.picker.tls is not None and fleet.picker.tls.server_name == "picker"
    assert fleet.picker.tls.cert and fleet.picker.tls.key
