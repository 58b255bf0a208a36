"""A llama-server's LoRA adapter as a signal (issue 45): the control plane reads what a real
llama-server started with `--lora` lists at GET /lora-adapters (signals/llamacpp_adapters.py)
and shows it as held on that endpoint in `cpctl endpoints list`, and none held on the server
started without it. The servers and the adapter are tests/real/test_llamacpp_lora.py's
(its `servers` fixture: a random adapter GGUF for the tests' tiny model); the control plane
here is one of its own, without Envoy, and its fleet file does not say where the adapter is
(no `endpoints:`): only the servers say.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import BIN, ControlPlane, wait_until
from tests.ports import free_port
from tests.real.test_llamacpp_lora import ADAPTER, MODEL, Servers, servers

pytestmark = [pytest.mark.real]

__all__ = ["servers"]  # the fixture, from the module whose servers these are

OTHER = "other-lora"  # in the fleet, on no server


@pytest.fixture
def cp(servers: Servers, tmp_path: Path) -> Iterator[ControlPlane]:
    """A control plane over both servers; the model's adapters are the one the first server was
    started with (its source the path it was given) and one no server has."""
    one, two = servers.with_adapter.address, servers.plain.address
    config = tmp_path / "fleet.yaml"
    config.write_text(
        f"listener: {{port: {free_port()}}}\n"
        "signals: {interval: 500ms, timeout: 500ms}\n"
        "tiers: {small: {}}\n"
        "models:\n"
        f"  {MODEL}:\n"
        "    params_b: 1\n"
        "    stable: v1\n"
        "    adapters:\n"
        f"      {ADAPTER}: {{source: '{servers.lora}'}}\n"
        f"      {OTHER}: {{source: '{servers.lora.parent / 'other-lora.gguf'}'}}\n"
        f"    versions: {{v1: {{endpoints: ['{one}', '{two}']}}}}\n"
    )
    control = ControlPlane(config, tmp_path)
    try:
        yield control.start()
    finally:
        control.stop()


def cpctl(cp: ControlPlane, *args: str) -> str:
    token = str(cp.state_dir / "admin-token")
    out = subprocess.run(
        [str(BIN / "cpctl"), "--server", cp.admin, "--token-file", token, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def rows(cp: ControlPlane) -> dict[str, dict[str, Any]]:
    """`cpctl endpoints list -o json`, by address."""
    return {e["address"]: e for e in json.loads(cpctl(cp, "endpoints", "list", "-o", "json"))["endpoints"]}


def test_the_adapter_a_llama_server_applies_is_shown_held_there_and_not_on_the_other(
    servers: Servers, cp: ControlPlane
) -> None:
    one, two = servers.with_adapter.address, servers.plain.address

    def held() -> bool:
        listed = rows(cp)
        return listed[one]["max_adapters"] is not None and listed[two]["max_adapters"] is not None

    wait_until(held, 30, "both servers' adapters to be read")
    listed = rows(cp)
    # The one listed at scale 1, named by the fleet's source; one slot: llama-server holds
    # every adapter it was started with.
    assert (
        listed[one]["running_adapters"],
        listed[one]["waiting_adapters"],
        listed[one]["max_adapters"],
    ) == (
        [ADAPTER],
        [],
        1,
    ), listed[one]
    # Known to hold none (an empty list at /lora-adapters), not unknown.
    assert (
        listed[two]["running_adapters"],
        listed[two]["waiting_adapters"],
        listed[two]["max_adapters"],
    ) == (
        [],
        [],
        0,
    ), listed[two]
    for row in listed.values():  # the rest of each page read as ever
        assert row["running"] is not None and row["scrape_error"] is None, row
    table = cpctl(cp, "endpoints", "list", "--model", MODEL).splitlines()
    column = table[0].index("ADAPTERS")
    adapters = {line.split()[2]: line[column:].strip() for line in table[1:3]}
    assert adapters == {one: f"{ADAPTER} (1 slot)", two: "none (0 slots)"}, table
