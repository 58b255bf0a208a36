"""The README's first command: the demo runs to the end on loopback and exits 0."""

from __future__ import annotations

import subprocess

from tests.integration.harness import BIN


def test_demo_runs_to_the_end_with_no_failed_request() -> None:
    out = subprocess.run(
        [str(BIN / "controlplane"), "demo", "--duration", "12"],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert ", 0 failed" in out.stdout
    weights = [line for line in out.stdout.splitlines() if " weights " in line]
    assert "llama-cold=0" in weights[0]  # cold at first: held out
    assert "llama-b=35" in weights[-1]  # the L4 class's declared capacity
    assert "llama-cold=0" not in weights[-1]  # warm by the end, let in
