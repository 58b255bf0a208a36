"""Scale-up, the most common fleet edit, on the real Envoy: a server added while it still
loads its model is never picked before the probes have seen it ready (issue 30)."""

from __future__ import annotations

import time
from pathlib import Path

from tests.integration.harness import EmulatedFleet, Emulator, LoadLoop, wait_until

MODEL = "chat"
EDITS = 20
COLD_START_S = 1.5  # each added server answers 503 on /health and the API this long


def fleet(addresses: list[str]) -> str:
    eps = "\n".join(f"          - {{address: '{a}'}}" for a in addresses)
    return (
        "listener: {port: %d}\n"
        "signals: {interval: 300ms, timeout: 250ms}\n"
        "tiers: {small: {timeout: 30s}}\n"
        "models:\n"
        f"  {MODEL}:\n"
        "    params_b: 8\n"
        "    stable: v1\n"
        "    versions:\n"
        "      v1:\n"
        "        endpoints:\n"
        f"{eps}\n"
    )


def test_servers_added_while_loading_fail_no_request(tmp_path: Path) -> None:
    """20 edits in a row under steady traffic, each adding a server still loading: Envoy
    gets each new host held out (it used to get it healthy at weight 1 for about 0.5 s, and
    the loading server's 503 reached a client now and then), and no request fails."""
    rig = EmulatedFleet(tmp_path)
    try:
        for n in ("a", "b"):
            rig.servers[n] = Emulator(n, tmp_path, MODEL, slots=16, decode_ms_per_token=1)
        addresses = [s.address for s in rig.servers.values()]
        rig.serve(fleet(addresses) % rig.listener)
        assert rig.envoy is not None
        envoy = rig.envoy
        cluster = f"{MODEL}@v1"
        wait_until(lambda: len(envoy.endpoints(cluster)) == 2, 15, "Envoy to have both servers")
        first_seen: dict[str, str] = {}
        with LoadLoop(rig.listener, MODEL, threads=4, max_tokens=2) as load:
            wait_until(lambda: load.statuses()[200] >= 20, 15, "traffic through Envoy")
            for i in range(EDITS):
                name = f"new{i}"
                s = rig.servers[name] = Emulator(
                    name, tmp_path, MODEL, slots=16, decode_ms_per_token=1, cold_start=COLD_START_S
                )
                addresses.append(s.address)
                (tmp_path / "fleet.yaml.tmp").write_text(fleet(addresses) % rig.listener)
                (tmp_path / "fleet.yaml.tmp").replace(tmp_path / "fleet.yaml")

                def seen(address: str = s.address) -> bool:
                    view = envoy.endpoints(cluster)
                    if address in view:
                        first_seen[address] = view[address][1]
                        return True
                    return False

                wait_until(seen, 5, f"Envoy to get {name}", interval=0.01)
                # Held out from the first moment Envoy has it (EDS UNHEALTHY), not healthy.
                assert first_seen[s.address] != "healthy", (name, first_seen[s.address])
            # Servers that finished loading serve: the last ones added take requests too
            # (awaited: on a busy machine their warm-up and the signals that see it take longer).
            last = [rig.servers[f"new{i}"].address for i in (EDITS - 1, EDITS - 2)]
            wait_until(
                lambda: sum(load.share(time.monotonic() - 1.0)[a] for a in last) > 0,
                COLD_START_S + 30, "the last servers added to warm up and take requests",
            )  # fmt: skip
            assert load.failures == [], load.failures[:5]
            assert sum(load.statuses().values()) > 200
    finally:
        rig.close()
