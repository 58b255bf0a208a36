"""Session and prompt-cache affinity with bounded load, through a real Envoy.

`chat` hashes on the x-session-id header, `code` on the JSON body's prompt_cache_key (no
extra hop: json_to_metadata -> set_filter_state as envoy.hashable_string -> hash policy).
A session sticks to one server while that server is under its bound; a burst of one
session's requests above the bound spreads to other servers.
"""

from __future__ import annotations

import http.client
import json
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import ControlPlane, Emulator, Envoy, free_port

FLAGS = {"slots": 8, "decode_ms_per_token": 10, "prefill_ms_per_token": 0.1}


class Rig:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.listener = free_port()
        self.servers: dict[str, list[Emulator]] = {}
        self.cp: ControlPlane | None = None
        self.envoy: Envoy | None = None

    def close(self) -> None:
        for p in (self.envoy, self.cp, *(s for ss in self.servers.values() for s in ss)):
            if p is not None:
                p.stop()


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    tmp = tmp_path_factory.mktemp("affinity")
    r = Rig(tmp)
    try:
        r.servers = {m: [Emulator(f"{m}{i}", tmp, m, **FLAGS) for i in range(3)] for m in ("chat", "code")}

        def eps(m: str) -> str:
            return ", ".join(f"'{s.address}'" for s in r.servers[m])

        (tmp / "fleet.yaml").write_text(
            f"listener: {{port: {r.listener}}}\n"
            "tiers: {small: {max_params_b: 15}}\n"
            "models:\n"
            "  chat: {params_b: 8, stable: v1, affinity: {header: x-session-id},\n"
            f"         versions: {{v1: {{endpoints: [{eps('chat')}]}}}}}}\n"
            "  code: {params_b: 8, stable: v1,\n"
            "         affinity: {body: prompt_cache_key, hash_balance_factor: 125},\n"
            f"         versions: {{v1: {{endpoints: [{eps('code')}]}}}}}}\n"
        )
        r.cp = ControlPlane(tmp / "fleet.yaml", tmp).start()
        r.envoy = Envoy("envoy-1", r.cp.xds, tmp, r.listener).start()
        yield r
    finally:
        r.close()


def send(port: int, model: str, session: str, tokens: int = 2) -> str:
    """One request of a session; returns the server that answered."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
    body: dict[str, object] = {"model": model, "prompt": "hi", "max_tokens": tokens}
    headers = {"content-type": "application/json"}
    if model == "chat":
        headers["x-session-id"] = session
    else:
        body["prompt_cache_key"] = session
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
        r = conn.getresponse()
        r.read()
        assert r.status == 200, r.status
        return r.getheader("x-emulator-server") or ""
    finally:
        conn.close()


@pytest.mark.parametrize("model", ["chat", "code"])
def test_a_session_sticks_to_one_server_under_its_bound(rig: Rig, model: str) -> None:
    homes: dict[str, Counter[str]] = {}
    for _round in range(8):
        for s in range(12):
            session = f"{model}-session-{s}"
            homes.setdefault(session, Counter())[send(rig.listener, model, session)] += 1
    for session, seen in homes.items():
        assert seen.most_common(1)[0][1] / sum(seen.values()) >= 0.95, (session, seen)
    # ...and different sessions do not all share one server.
    assert len({seen.most_common(1)[0][0] for seen in homes.values()}) >= 2, homes


@pytest.mark.parametrize("model", ["chat", "code"])
def test_a_burst_above_the_bound_spreads(rig: Rig, model: str) -> None:
    served: Counter[str] = Counter()
    lock = threading.Lock()

    def one() -> None:
        server = send(rig.listener, model, f"{model}-hot", tokens=40)  # 0.4 s each, all at once
        with lock:
            served[server] += 1

    threads = [threading.Thread(target=one) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sum(served.values()) == 12
    assert len(served) >= 2, served  # over the bound: the next servers take the rest
