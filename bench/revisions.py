"""A module of this repository as it was at a git revision, for benchmarks that compare the
checkout with an older version of itself (signals_scale/parse_cost.py, picker/kv_index_cost.py)."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def module_at(rev: str, path: str, name: str) -> types.ModuleType:
    """`path` (relative to the repository) at `rev`, loaded as a module named `name`."""
    text = subprocess.run(
        ["git", "show", f"{rev}:{path}"], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(text, f"{rev}:{path}", "exec"), module.__dict__)
    return module
