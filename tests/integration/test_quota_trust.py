"""Issue 41, item 5: nobody is trusted by default on the rate-limit port. A real Envoy that gets
`quotas.service.tls` in the fleet reaches `controlplane ratelimit --tls-cert/--tls-key
/--tls-client-ca` over mutual TLS (a tenant over its limit gets 429: the decision came over
it); a client without a certificate, or without TLS, is refused; `cpctl quota status` works
with its --quota-tls-* flags and not without them."""

from __future__ import annotations

import http.client
import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from tests.certs import make_certs
from tests.integration.harness import BIN, EmulatedFleet, Emulator
from tests.integration.quota_rig import QuotaService, allowed, ask, descriptor
from tests.ports import free_port

pytestmark = pytest.mark.envoy

MODEL = "chat"
LIMIT = 3


@dataclass
class Rig:
    fleet: EmulatedFleet
    service: QuotaService
    certs: Path


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    certs = make_certs(tmp_path / "certs", ("ratelimit", "envoy", "operator"))
    fleet = EmulatedFleet(tmp_path)
    service: QuotaService | None = None
    try:
        server = fleet.servers["a"] = Emulator("a", tmp_path, MODEL)
        port = free_port()
        tls = (
            f"{{ca: '{certs / 'ca.pem'}', cert: '{certs / 'envoy.pem'}', key: '{certs / 'envoy.key'}', "
            "server_name: ratelimit}"
        )
        text = (
            f"listener: {{port: {fleet.listener}}}\n"
            "tiers: {small: {timeout: 30s}}\n"
            "quotas:\n"
            "  key: {header: x-api-key}\n"
            f"  service: {{endpoints: ['127.0.0.1:{port}'], timeout: 500ms, tls: {tls}}}\n"
            f"  tenants: {{acme: {{requests_per_minute: {LIMIT}}}}}\n"
            "models:\n"
            f"  {MODEL}: {{params_b: 8, stable: v1, versions: {{v1: {{endpoints: ['{server.address}']}}}}}}\n"
        )
        (tmp_path / "fleet.yaml").write_text(text)
        service = QuotaService(
            tmp_path / "fleet.yaml",
            tmp_path,
            "--tls-cert", str(certs / "ratelimit.pem"), "--tls-key", str(certs / "ratelimit.key"),
            "--tls-client-ca", str(certs / "ca.pem"),
        )  # fmt: skip
        service.port = port
        service.start()
        fleet.serve(text)
        yield Rig(fleet, service, certs)
    finally:
        if service is not None:
            service.stop()
        fleet.close()


def request(port: int, tenant: str) -> tuple[int, dict[str, str]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1})
        conn.request(
            "POST",
            "/v1/completions",
            body=body,
            headers={"content-type": "application/json", "x-api-key": tenant},
        )
        r = conn.getresponse()
        r.read()
        return r.status, {k.lower(): v for k, v in r.getheaders()}
    finally:
        conn.close()


def status(rig: Rig, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "cpctl"), "quota", "status", "-o", "json", "--quota-service", rig.service.address,
         "--token-file", str(rig.service.token_file), *flags],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_envoy_reaches_the_service_over_mutual_tls_and_strangers_are_refused(rig: Rig) -> None:
    port = rig.fleet.listener
    answers = [request(port, "acme") for _ in range(LIMIT + 1)]
    assert [s for s, _ in answers] == [200] * LIMIT + [429], answers  # decided over mutual TLS
    assert answers[0][1]["x-ratelimit-limit-requests"] == str(LIMIT)
    assert rig.fleet.envoy is not None
    assert rig.fleet.envoy.stat("cluster.chat_v1.ratelimit.quota.error") == 0
    certs = rig.certs
    ca = (certs / "ca.pem").read_bytes()
    strangers = {
        "plaintext": grpc.insecure_channel(rig.service.address),
        "TLS without a client certificate": grpc.secure_channel(
            rig.service.address,
            grpc.ssl_channel_credentials(root_certificates=ca),
            options=[("grpc.ssl_target_name_override", "ratelimit")],
        ),
    }
    for what, channel in strangers.items():
        with channel:
            with pytest.raises(grpc.RpcError) as refused:
                ask(channel, descriptor(MODEL, "acme"))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, what
    operator = grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=(certs / "operator.key").read_bytes(),
        certificate_chain=(certs / "operator.pem").read_bytes(),
    )
    with grpc.secure_channel(rig.service.address, operator) as channel:
        assert not allowed(ask(channel, descriptor(MODEL, "acme")))  # a client with a certificate: served
    # cpctl quota status over mutual TLS, with the service's token too.
    tls = ["--quota-tls-ca", str(certs / "ca.pem")]
    mine = ["--quota-tls-cert", str(certs / "operator.pem"), "--quota-tls-key", str(certs / "operator.key")]
    got = status(rig, *tls, *mine, "--quota-tls-server-name", "ratelimit")
    assert got.returncode == 0, got.stderr
    (row,) = json.loads(got.stdout)["buckets"]
    assert (row["tenant"], row["model"], row["remaining"]) == ("acme", MODEL, 0)
    assert status(rig, *tls, *mine).returncode == 0  # its certificate names 127.0.0.1 too
    for flags in ([], tls):  # plaintext; TLS without a client certificate
        refused = status(rig, *flags)
        assert refused.returncode == 1, refused
        assert "UNAVAILABLE" in refused.stderr and "--quota-tls-cert" in refused.stderr, refused.stderr
    half = status(rig, *tls, "--quota-tls-cert", str(certs / "operator.pem"))
    assert half.returncode == 2 and "--quota-tls-cert and --quota-tls-key go together" in half.stderr
