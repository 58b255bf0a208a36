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
    lines = [line.split(" weights ", 1)[1] for line in out.stdout.splitlines() if " weights " in line]
    first, last = (dict(kv.strip().split("=") for kv in line.split(",")) for line in (lines[0], lines[-1]))
    assert first["llama-cold"] == "0"  # cold at first: held out
    assert int(last["llama-b"]) < int(last["llama-a"]) / 2  # the 3x slower L4 gets less
    assert int(last["llama-cold"]) > 0  # warm by the end, let in
