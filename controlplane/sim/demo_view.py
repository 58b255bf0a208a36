"""What the demo shows: the live terminal view (rich) and the final summary (pure rendering).

`DemoState` is what the scenario has measured so far; `render` turns it into one rich
renderable for `rich.live.Live`, `plain_lines` into lines for `--no-live`, and `summary`
into the closing table. Nothing here does I/O beyond returning text and renderables.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text


@dataclass
class EndpointRow:
    model: str
    version: str
    name: str
    gpu: str
    state: str
    weight: int
    running: float | None  # None: never read (the server's page not read yet)
    waiting: float | None
    latency_s: float | None


@dataclass
class DemoState:
    """Everything the view shows; the traffic threads and the scenario loop update it."""

    tiers: dict[str, str]  # model -> tier
    started: float = 0.0
    now: float = 0.0
    duration_s: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: Counter[str] = field(default_factory=Counter)  # by model
    errors: Counter[str] = field(default_factory=Counter)
    error_samples: list[str] = field(default_factory=list)
    latency: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    by_server: Counter[str] = field(default_factory=Counter)
    endpoints: list[EndpointRow] = field(default_factory=list)
    balance: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))  # model -> L samples
    rollout: dict[str, Any] | None = None
    events: deque[str] = field(default_factory=lambda: deque(maxlen=8))
    unprinted: list[str] = field(default_factory=list)

    def record(self, model: str, status: int, server: str, elapsed_s: float, error: str = "") -> None:
        with self.lock:
            self.requests[model] += 1
            if status == 200:
                self.latency[model].append(elapsed_s)
                self.by_server[server] += 1
            else:
                self.errors[model] += 1
                if len(self.error_samples) < 20:
                    when = f"t={time.monotonic() - self.started:5.1f}s"
                    self.error_samples.append(f"{when}  {model}: {status} {error}".strip())

    def event(self, text: str) -> None:
        with self.lock:
            line = f"t={self.now - self.started:5.1f}s  {text}"
            self.events.append(line)
            self.unprinted.append(line)

    def take_unprinted(self) -> list[str]:
        """Events not yet printed (the plain, no-terminal output prints each once)."""
        with self.lock:
            out, self.unprinted = self.unprinted, []
            return out

    def by_tier(self) -> dict[str, tuple[int, int, list[float]]]:
        """tier -> (requests, errors, latencies)."""
        out: dict[str, tuple[int, int, list[float]]] = {}
        with self.lock:
            for model, tier in self.tiers.items():
                r, e, lat = out.get(tier, (0, 0, []))
                out[tier] = (r + self.requests[model], e + self.errors[model], lat + self.latency[model])
        return out


def quantile_ms(values: list[float], q: float) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0] * 1000:.0f}"
    return f"{statistics.quantiles(values, n=100)[round(q * 100) - 1] * 1000:.0f}"


def _tier_table(state: DemoState, title: str) -> Table:
    t = Table(title=title, title_justify="left", expand=False)
    for col in ("tier", "models", "requests", "errors", "p50 ms", "p99 ms"):
        t.add_column(col, justify="right" if col not in ("tier", "models") else "left")
    models_of: dict[str, list[str]] = defaultdict(list)
    for m, tier in state.tiers.items():
        models_of[tier].append(m)
    for tier, (n, err, lat) in state.by_tier().items():
        t.add_row(
            tier,
            ", ".join(models_of[tier]),
            str(n),
            Text(str(err), style="bold red" if err else "green"),
            quantile_ms(lat, 0.5),
            quantile_ms(lat, 0.99),
        )
    return t


_STATE_STYLE = {"SERVING": "green", "HELD_OUT": "yellow", "DRAINING": "magenta", "RETIRED": "dim"}


def _endpoint_table(state: DemoState) -> Table:
    t = Table(title="endpoints (weights pushed over EDS)", title_justify="left")
    for col in (
        "model",
        "ver",
        "server",
        "gpu",
        "state",
        "weight",
        "running",
        "waiting",
        "latency",
        "served",
    ):
        t.add_column(col, justify="left" if col in ("model", "ver", "server", "gpu", "state") else "right")
    for e in state.endpoints:
        t.add_row(
            e.model,
            e.version,
            e.name,
            e.gpu,
            Text(e.state, style=_STATE_STYLE.get(e.state, "")),
            str(e.weight),
            _figure(e.running, e.state),
            _figure(e.waiting, e.state),
            _figure(e.latency_s, e.state) if e.latency_s is None else f"{e.latency_s * 1000:.0f} ms",
            str(state.by_server.get(e.name, 0)),
        )
    return t


def rollout_line(r: dict[str, Any] | None) -> str:
    if r is None:
        return "no rollout yet"
    weights = ", ".join(f"{v} {w}%" for v, w in sorted(r.get("weights", {}).items()))
    steps = r.get("steps", [])
    return (
        f"{r.get('model')} -> {r.get('canary_version')}: {r.get('phase')}, "
        f"step {r.get('step', 0)}/{len(steps)}, {weights}"
    )


def render(state: DemoState) -> Group:
    elapsed = state.now - state.started
    header = Text.assemble(
        ("inference control plane demo", "bold"),
        f"  t={elapsed:5.1f}s / {state.duration_s:.0f}s   ",
        ("rollout: ", "bold"),
        rollout_line(state.rollout),
    )
    events = Panel("\n".join(state.events) or "-", title="events", title_align="left")
    return Group(header, _endpoint_table(state), _tier_table(state, "traffic by tier"), events)


OUT_OF_SERVICE = ("RETIRED", "DRAINED")  # no longer read: their last figures are gone


def _figure(value: float | None, state: str = "") -> str:
    """A server's figure; "-" for one never read, "out" for a server out of service."""
    if value is None:
        return "out" if state in OUT_OF_SERVICE else "-"
    return f"{value:.0f}"


def _load(e: EndpointRow) -> str:
    if e.running is None and e.waiting is None and e.state in OUT_OF_SERVICE:
        return "out"
    return f"{_figure(e.running)}+{_figure(e.waiting)}"


def plain_lines(state: DemoState) -> list[str]:
    """A compact progress report for --no-live (CI logs)."""
    elapsed = state.now - state.started
    tiers = "  ".join(
        f"{tier}: {n} req {e} err p99 {quantile_ms(lat, 0.99)}ms"
        for tier, (n, e, lat) in state.by_tier().items()
    )
    weights = ", ".join(f"{e.name}={e.weight}" for e in state.endpoints)
    loads = ", ".join(f"{e.name}={_load(e)}" for e in state.endpoints)
    states = (
        ", ".join(f"{e.name}={e.state}" for e in state.endpoints if e.state != "SERVING") or "all serving"
    )
    return [
        f"demo: t={elapsed:5.1f}s  {tiers}",
        f"demo: t={elapsed:5.1f}s  weights {weights}",
        f"demo: t={elapsed:5.1f}s  load (running+waiting; out: retired or drained; - never read) {loads}",
        f"demo: t={elapsed:5.1f}s  states {states}",
        f"demo: t={elapsed:5.1f}s  rollout {rollout_line(state.rollout)}",
    ]


def summary(state: DemoState) -> Group:
    """The closing table: per tier requests, errors, p50/p99; per model L; the rollout."""
    lb = Table(
        title="load-balance degree L per model (std dev of endpoint utilisation; 0 is even)",
        title_justify="left",
    )
    lb.add_column("model")
    lb.add_column("tier")
    lb.add_column("mean L", justify="right")
    lb.add_column("max L", justify="right")
    for model, tier in state.tiers.items():
        samples = state.balance.get(model, [])
        lb.add_row(
            model,
            tier,
            f"{statistics.fmean(samples):.3f}" if samples else "-",
            f"{max(samples):.3f}" if samples else "-",
        )
    total = sum(state.requests.values())
    failed = sum(state.errors.values())
    lines = [
        f"total {total} requests, {failed} failed",
        f"rollout: {rollout_line(state.rollout)}",
        "requests per server: " + ", ".join(f"{s}={c}" for s, c in sorted(state.by_server.items())),
        *(f"  failed: {e}" for e in state.error_samples[:5]),
    ]
    return Group(_tier_table(state, "summary by tier"), lb, Text("\n".join(lines)))
