"""A real Prometheus server for the integration tests (Debian's `prometheus` package, which
`.ci/run` installs; without it the tests that need it skip, or fail when
CONTROLPLANE_REQUIRE_PROMTOOL is set)."""

from __future__ import annotations

import json
import shutil
import urllib.parse
from pathlib import Path
from typing import Any

from tests.integration.harness import EmulatedFleet, Proc, free_port, http_get
from tests.peers import required


def prometheus_binary() -> str:
    return required(
        shutil.which("prometheus"),
        missing="the prometheus server is missing: install Debian's prometheus package "
        "(apt-get install --no-install-recommends prometheus), as .ci/run does",
        env="CONTROLPLANE_REQUIRE_PROMTOOL",
    )


class Prometheus:
    """A real Prometheus on a free loopback port, running `config` (YAML text)."""

    def __init__(self, binary: str, tmp: Path, config: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        path = tmp / "prometheus.yml"
        path.write_text(config)
        self.proc = Proc(
            "prometheus",
            [
                binary,
                f"--config.file={path}",
                f"--storage.tsdb.path={tmp / 'prometheus-data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            tmp,
        )

    @classmethod
    def scraping(cls, binary: str, tmp: Path, targets: list[str]) -> Prometheus:
        """One job (`vllm`) scraping `targets` every second."""
        return cls(
            binary,
            tmp,
            "global: {scrape_interval: 1s, scrape_timeout: 900ms, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            f"  - {{job_name: vllm, static_configs: [{{targets: {json.dumps(targets)}}}]}}\n",
        )

    def query(self, promql: str) -> list[dict[str, Any]]:
        status, body = http_get(f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}")
        assert status == 200, body
        return json.loads(body)["data"]["result"]  # type: ignore[no-any-return]

    def alerts(self) -> list[dict[str, Any]]:
        """Every alert pending or firing now: labels, state, value."""
        status, body = http_get(f"{self.url}/api/v1/alerts")
        assert status == 200, body
        return json.loads(body)["data"]["alerts"]  # type: ignore[no-any-return]

    def ready(self) -> bool:
        """Up and answering (its /-/ready); raises if the process exited."""
        self.alive()
        try:
            return http_get(f"{self.url}/-/ready")[0] == 200
        except OSError:
            return False

    def alive(self) -> bool:
        if not self.proc.alive():
            raise AssertionError(f"prometheus exited:\n{self.proc.log()[-3000:]}")
        return True

    def stop(self) -> None:
        self.proc.stop()


class PrometheusFleet(EmulatedFleet):
    """Emulated servers, a control plane, an Envoy and a Prometheus; close() stops them all."""

    prometheus: Prometheus | None = None

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.prometheus is not None:
                self.prometheus.stop()
