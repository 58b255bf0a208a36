"""A real `controlplane ratelimit` process for the quota tests: started on a free loopback
port with any flags, its metrics read from its own page, its memory from /proc, and Envoy's
rate-limit calls made straight to its port (as a stranger on the port would)."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import grpc
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

from tests.integration.harness import BIN, Proc, http_get, wait_until
from tests.ports import free_port

TOKEN = "quota-status-token"


class QuotaService:
    """One `controlplane ratelimit` on 127.0.0.1, with `--token-file` holding TOKEN."""

    def __init__(
        self, config: Path, log_dir: Path, *flags: str, name: str = "ratelimit", port: int | None = None
    ) -> None:
        self.config, self.log_dir, self.flags, self.name = config, log_dir, flags, name
        self.port = port or free_port()  # a fleet file's quotas.service.endpoints names it
        self.metrics_port = free_port()
        self.token_file = log_dir / f"{name}-token"
        self.token_file.write_text(TOKEN + "\n")
        self.proc: Proc | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> QuotaService:
        self.proc = Proc(
            self.name,
            [
                str(BIN / "controlplane"), "ratelimit", "--config", str(self.config),
                "--listen", self.address, "--metrics-listen", f"127.0.0.1:{self.metrics_port}",
                "--token-file", str(self.token_file), *self.flags,
            ],
            self.log_dir,
        )  # fmt: skip
        wait_until(self._up, 15, "the rate-limit service to serve")
        return self

    def _up(self) -> bool:
        assert self.proc is not None
        if not self.proc.alive():
            raise AssertionError(f"ratelimit exited:\n{self.proc.log()[-3000:]}")
        try:
            return http_get(f"http://127.0.0.1:{self.metrics_port}/metrics")[0] == 200
        except OSError:
            return False

    def page(self, most: int = 4 << 20) -> bytes:
        """Its /metrics page; AssertionError if it is longer than `most` bytes (read no further)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=30) as r:
            body = r.read(most + 1)
        assert len(body) <= most, f"the /metrics page is over {most} bytes"
        return body

    def metric(self, name: str) -> float:
        """One sample, by its name and labels as the page prints them; 0 if absent."""
        page = self.page().decode()
        return sum(float(line.split()[-1]) for line in page.splitlines() if line.rsplit(" ", 1)[0] == name)

    def rss_mb(self) -> float:
        """The process's resident memory now (VmRSS), in MB."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.popen.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def log(self) -> str:
        assert self.proc is not None
        return self.proc.log()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


def descriptor(model: str | None, tenant: str | None, **entries: str) -> ratelimit_pb2.RateLimitDescriptor:
    d = ratelimit_pb2.RateLimitDescriptor()
    if model is not None:
        d.entries.add(key="model", value=model)
    if tenant is not None:
        d.entries.add(key="tenant", value=tenant)
    for key, value in entries.items():
        d.entries.add(key=key, value=value)
    return d


def ask(
    channel: grpc.Channel, *descriptors: ratelimit_pb2.RateLimitDescriptor, domain: str = "inference"
) -> rls_pb2.RateLimitResponse:
    """One ShouldRateLimit call, as Envoy makes it."""
    stub = rls_pb2_grpc.RateLimitServiceStub(channel)
    request = rls_pb2.RateLimitRequest(domain=domain, descriptors=list(descriptors))
    return stub.ShouldRateLimit(request, timeout=30)


def allowed(response: rls_pb2.RateLimitResponse) -> bool:
    return bool(response.overall_code == rls_pb2.RateLimitResponse.OK)


def headers(response: rls_pb2.RateLimitResponse) -> dict[str, str]:
    return {h.key: h.value for h in response.response_headers_to_add}
