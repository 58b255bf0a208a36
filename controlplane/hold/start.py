"""Starting the holding service for a running control plane (I/O shell): its view of the
fleet, and the port it keeps across restarts so the proxies' holding cluster stays put."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

from controlplane.fleet.model import Fleet, Model
from controlplane.hold.service import HoldingService, Ready
from controlplane.obs.http import split_host_port
from controlplane.obs.metrics import HoldMetrics

HOLD_PORT_FILE = "hold-port"  # in the state directory: the holding service's last free port
DEFAULT_TIMEOUT_S = 60.0  # a model the fleet no longer has: what a held request may wait
DEFAULT_MAX_BODY = 8 << 20


def start_holding(
    listen: str,
    address: str | None,
    state_dir: Path,
    fleet: Callable[[], Fleet | None],
    ready: Callable[[], Ready],
    candidates: Callable[[], Ready],
    on_held: Callable[[str], object],
    metrics: HoldMetrics,
) -> tuple[HoldingService, str, int]:
    """Start the holding service on its own thread, listening on `listen` (port 0: the port
    of the last run if it is free, else any), and return it with the address proxies dial
    (`address`, else the bound one) and the bound port. `fleet` is read from the service's
    thread: it must return a value replaced whole, never mutated. OSError if it cannot listen,
    or if it listens on a wildcard without an `address`."""
    host, port = split_host_port(listen)

    def named(model: str) -> tuple[Fleet, Model] | None:
        f = fleet()
        m = next((x for x in f.models if x.name == model), None) if f else None
        return (f, m) if f is not None and m is not None else None

    def hold_max(model: str) -> int | None:
        found = named(model)
        return found[0].scaling_of(found[1]).hold_max if found else None

    def timeout_s(model: str) -> float:
        found = named(model)
        return found[0].traffic_of(found[1]).timeout_s if found else DEFAULT_TIMEOUT_S

    def max_body(model: str) -> int:
        found = named(model)
        return found[0].traffic_of(found[1]).max_body_bytes if found else DEFAULT_MAX_BODY

    hold = HoldingService(
        ready,
        hold_max,
        timeout_s,
        metrics,
        candidates=candidates,
        on_held=on_held,
        max_body=max_body,
    )
    remembered = state_dir / HOLD_PORT_FILE
    bound = 0
    if port == 0 and remembered.is_file():
        # The port of the last run, if free: the proxies' holding cluster stays as it was
        # across a restart instead of changing address every time.
        with contextlib.suppress(OSError, ValueError):
            bound = hold.start(host, int(remembered.read_text().strip()))
    if not bound:
        bound = hold.start(host, port)
    if port == 0:
        with contextlib.suppress(OSError):
            remembered.parent.mkdir(parents=True, exist_ok=True)
            remembered.write_text(f"{bound}\n")
    if address is None:
        if host in ("0.0.0.0", "::", ""):
            hold.stop()
            raise OSError(
                f"--hold-listen {listen}: give --hold-address HOST:PORT, the address proxies dial to reach it"
            )
        address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
    return hold, address, bound
