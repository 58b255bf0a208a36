"""Every key the fleet loader accepts is described in docs/configuration.md."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import controlplane.fleet as fleet

ROOT = Path(__file__).resolve().parents[2]


def accepted_keys() -> set[str]:
    """String literals in the loader's key sets: *_KEYS constants and sets given to _mapping, in
    the schema modules (controlplane/fleet/schema*.py)."""
    schema = sorted(Path(fleet.__file__).parent.glob("schema*.py"))
    trees = [ast.parse(path.read_text()) for path in schema]
    keys: set[str] = set()

    def strings(node: ast.AST) -> set[str]:
        return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}

    for node in (child for tree in trees for child in ast.walk(tree)):
        names = [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
        if isinstance(node, ast.Assign) and any(
            n.endswith(("_KEYS", "_DURATIONS")) or n == "allowed" for n in names
        ):
            # A dict maps YAML keys to field names: only its keys are YAML.
            keys |= (
                set().union(*map(strings, node.value.keys))
                if isinstance(node.value, ast.Dict)
                else strings(node.value)
            )
        call = isinstance(node, ast.Call) and getattr(node.func, "id", "") == "_mapping"
        if call and len(node.args) >= 4 and isinstance(node.args[3], ast.Set):
            keys |= strings(node.args[3])
    return keys


def test_the_loader_accepts_a_known_set_of_keys() -> None:
    keys = accepted_keys()
    assert {
        "stable",
        "versions",
        "endpoints",
        "timeout",
        "max_params_b",
        "gpu_memory_gb",
        "slow_start",
    } <= keys
    assert "slow_start_s" not in keys  # field names are not YAML keys


def test_every_accepted_key_is_documented() -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text()
    documented = (
        set(re.findall(r"`([a-z_0-9]+)", doc))
        | set(re.findall(r"^\s*([a-z_0-9]+):", doc, re.M))
        | set(re.findall(r"[{,]\s*([a-z_0-9]+):", doc))
    )
    missing = sorted(accepted_keys() - documented)
    assert missing == [], f"keys the loader accepts but docs/configuration.md does not describe: {missing}"
