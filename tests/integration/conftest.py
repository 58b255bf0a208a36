from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from controlplane.sim.backend import EchoBackend
from tests.fleets import fleet_yaml
from tests.integration.harness import Client, ControlPlane, Envoy, free_port


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`soak` tests run only when selected (-m soak): the README's suite keeps to its budget."""
    if "soak" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="soak variant (30 s outages): select with -m soak")
    for item in items:
        if item.get_closest_marker("soak") is not None:
            item.add_marker(skip)


@dataclass
class Stack:
    """A control plane, one real Envoy and echo backends, all on loopback."""

    tmp: Path
    delta: bool
    backends: dict[str, EchoBackend] = field(default_factory=dict)
    cp: ControlPlane | None = None
    envoy: Envoy | None = None
    listener_port: int = field(default_factory=free_port)

    @property
    def config(self) -> Path:
        return self.tmp / "fleet.yaml"

    def backend(self, name: str, model: str) -> EchoBackend:
        if name not in self.backends:
            self.backends[name] = EchoBackend(name, model).start()
        return self.backends[name]

    def write(self, models: dict[str, dict[str, list[str]]], **kw: object) -> None:
        """Write the fleet; endpoints are backend names, started on demand."""
        resolved = {
            m: {v: [self.backend(b, m).address for b in names] for v, names in versions.items()}
            for m, versions in models.items()
        }
        text = fleet_yaml(resolved, port=self.listener_port, **kw)  # type: ignore[arg-type]
        tmp = self.config.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(self.config)  # atomic, as a ConfigMap update or an editor's save is

    def write_text(self, text: str) -> None:
        tmp = self.config.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(self.config)

    def start(self) -> Stack:
        self.cp = ControlPlane(self.config, self.tmp).start()
        self.envoy = Envoy("envoy-1", self.cp.xds, self.tmp, self.listener_port, delta=self.delta).start()
        return self

    def client(self) -> Client:
        return Client(self.listener_port)

    def close(self) -> None:
        for p in (self.envoy, self.cp):
            if p is not None:
                p.stop()
        for b in self.backends.values():
            b.stop()


@pytest.fixture(params=["sotw", "delta"])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Stack]:
    s = Stack(tmp_path, delta=request.param == "delta")
    try:
        yield s
    finally:
        s.close()
