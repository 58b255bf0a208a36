"""Fuzz runs against the side services' ports: minutes each, so they run only when selected
(`-m fuzz`), never in the README's suite. FUZZ_SECONDS sets each run's length, FUZZ_SEED its
seed (printed, so a failure can be replayed)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "fuzz" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="fuzz run (minutes): select with -m fuzz")
    for item in items:
        if item.get_closest_marker("fuzz") is not None:
            item.add_marker(skip)
