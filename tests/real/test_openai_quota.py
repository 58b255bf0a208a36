"""Token quotas as the `openai` SDK meets them (issue 34): a real llama.cpp server behind a
real control plane, a real Envoy and a real `controlplane ratelimit`; the tenant is the SDK's
API key (`key: {bearer: true}`). Each answer is charged the server's own `usage`; once the
key's tokens are spent, the SDK raises its own RateLimitError, with OpenAI's error code and
x-ratelimit headers, and another key is still served."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from controlplane.quota.service import bearer_tenant
from tests.fleets import fleet_yaml
from tests.integration.harness import BIN, ControlPlane, Envoy, Proc, http_get, wait_until
from tests.ports import free_port
from tests.real.conftest import LlamaFactory

pytestmark = [pytest.mark.real, pytest.mark.envoy]

KEY = "sk-tenant-acme"
TOKENS_PER_MINUTE = 120


def test_the_sdk_gets_its_own_rate_limit_error_once_its_keys_tokens_are_spent(
    llama_servers: LlamaFactory, tmp_path: Path, openai_sdk: ModuleType
) -> None:
    server = llama_servers("tiny")
    listener, rl_port, rl_metrics = free_port(), free_port(), free_port()
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        fleet_yaml({"tiny": {"v1": [server.address]}}, port=listener)
        + "quotas:\n"
        + "  key: {bearer: true}\n"
        + f"  service: {{endpoints: ['127.0.0.1:{rl_port}'], timeout: 500ms}}\n"
        + f"  tenants: {{{bearer_tenant('Bearer ' + KEY)}: {{tokens_per_minute: {TOKENS_PER_MINUTE}}}}}\n"
    )
    limiter = Proc(
        "ratelimit",
        [
            str(BIN / "controlplane"), "ratelimit", "--config", str(fleet),
            "--listen", f"127.0.0.1:{rl_port}", "--metrics-listen", f"127.0.0.1:{rl_metrics}",
        ],
        tmp_path,
    )  # fmt: skip
    cp = ControlPlane(fleet, tmp_path)
    envoy = Envoy("envoy-1", cp.xds, tmp_path, listener)
    try:
        cp.start()
        envoy.start()
        base = f"http://127.0.0.1:{listener}/v1"
        acme: Any = openai_sdk.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=60)
        other: Any = openai_sdk.OpenAI(base_url=base, api_key="sk-tenant-globex", max_retries=0, timeout=60)
        wait_until(
            lambda: http_get(f"http://127.0.0.1:{rl_metrics}/metrics")[0] == 200, 15, "the rate-limit service"
        )
        wait_until(
            lambda: other.completions.create(model="tiny", prompt="up?", max_tokens=1).model == "tiny",
            30,
            "the model to be served through the gateway",
            interval=0.2,
        )
        used = 0
        error = None
        for _ in range(20):
            try:
                raw = acme.completions.with_raw_response.create(
                    model="tiny", prompt="Once upon a time", max_tokens=32, extra_body={"ignore_eos": True}
                )
            except openai_sdk.RateLimitError as e:
                error = e
                break
            assert raw.headers["x-ratelimit-limit-tokens"] == str(TOKENS_PER_MINUTE)
            used += raw.parse().usage.total_tokens
        assert error is not None, f"never limited after {used} tokens"
        assert used >= TOKENS_PER_MINUTE, used  # no 429 before the key's tokens were spent
        assert error.status_code == 429
        assert error.code == "rate_limit_exceeded", error.body
        assert error.response.headers["x-ratelimit-remaining-tokens"] == "0"
        assert int(error.response.headers["retry-after"]) >= 1
        assert json.loads(error.response.text)["error"]["type"] == "tokens"
        # Every answer was charged the server's own usage, nothing estimated (a charge is sent
        # when a stream ends, so the last may still be on its way).
        tenant = bearer_tenant("Bearer " + KEY)

        def charged() -> dict[str, float]:
            _, page = http_get(f"http://127.0.0.1:{rl_metrics}/metrics")
            return {
                line.split('how="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                for line in page.splitlines()
                if line.startswith("controlplane_quota_tokens_total{") and f'tenant="{tenant}"' in line
            }

        wait_until(
            lambda: charged() == {"usage": used}, 5, f"{used} tokens charged as usage, not {charged()}"
        )
        assert other.completions.create(model="tiny", prompt="still?", max_tokens=1).model == "tiny"
    finally:
        envoy.stop()
        cp.stop()
        limiter.stop()
