"""Per-proxy capabilities against the real Envoy: a proxy that reports an older version gets
resources without the features that version lacks, and the real binary must accept them.

Only Envoy 1.40 runs here, so it is told (in its bootstrap's node) to report an older
version; the control plane adapts to the report, and the real Envoy then proves the
fallbacks are valid configuration that serves traffic."""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import Stack
from tests.integration.harness import Envoy, http_get, wait_until

pytestmark = pytest.mark.envoy

MODELS = {"llama": {"v1": ["l1", "l2"]}}


@pytest.mark.parametrize(
    ("claim", "lacks"),
    [
        ((1, 27, 0), ["the json_to_metadata filter", "least request FULL_SCAN", "hashable filter state"]),
        ((1, 25, 0), ["typed load_balancing_policy", "the json_to_metadata filter"]),
    ],
)
def test_an_older_envoy_gets_fallbacks_it_applies(
    stack: Stack, claim: tuple[int, int, int], lacks: list[str]
) -> None:
    stack.write(MODELS)
    stack.start()
    assert stack.cp is not None
    # The same listener port (Envoy binds it with SO_REUSEPORT), its own admin port.
    old = Envoy(
        "envoy-old", stack.cp.xds, stack.tmp, stack.listener_port, delta=stack.delta, claim_version=claim
    )
    try:
        old.start()

        def proxy() -> dict[str, object]:
            return next(p for p in stack.cp.proxies() if p["node_id"] == "envoy-old")  # type: ignore[union-attr]

        wait_until(
            lambda: {t["status"] for t in proxy()["types"].values()} == {"SYNCED"},  # type: ignore[attr-defined]
            10,
            "the older Envoy to ACK everything it was sent",
        )
        p = proxy()
        assert p["version"] == ".".join(map(str, claim))
        notes = " | ".join(p["notes"])  # type: ignore[arg-type]
        assert all(f in notes for f in lacks), notes
        # Its own config, as it holds it: the fallbacks, accepted.
        _, dump = http_get(f"http://127.0.0.1:{old.admin_port}/config_dump?resource=dynamic_active_clusters")
        [cluster] = [c["cluster"] for c in json.loads(dump)["configs"] if c["cluster"]["name"] == "llama@v1"]
        if claim < (1, 26, 0):
            assert cluster["lb_policy"] == "LEAST_REQUEST" and "load_balancing_policy" not in cluster
        else:
            assert "FULL_SCAN" not in json.dumps(cluster["load_balancing_policy"])
        _, listeners = http_get(f"http://127.0.0.1:{old.admin_port}/config_dump?resource=dynamic_listeners")
        assert "json_to_metadata" not in listeners
        # The gateway's own Envoy (1.40) still gets everything.
        assert stack.envoy is not None
        _, new_listeners = http_get(
            f"http://127.0.0.1:{stack.envoy.admin_port}/config_dump?resource=dynamic_listeners"
        )
        assert "json_to_metadata" in new_listeners
        # With only the older Envoy on the listener: x-model is served; a model named only in
        # the JSON body is not seen (no json_to_metadata), which is the documented fallback.
        stack.envoy.stop()
        before = old.stat("http.inference.downstream_rq_completed")
        client = stack.client()
        assert [client.post(header="llama").status for _ in range(10)] == [200] * 10
        assert client.post("llama").status == 400
        client.close()
        assert old.stat("http.inference.downstream_rq_completed") - before == 11
    finally:
        old.stop()
