"""Envoy's Prometheus series per proxy at 40 model clusters, before and after cardinality control.

A real control plane serves a 40-model fleet (one version each: the 40 clusters that
controlplane/routing/translate.py makes of it, two endpoints each on loopback emulated servers)
to a real Envoy, twice: once bootstrapped with what `controlplane bootstrap` prints (its
stats_matcher keeps only the stats deploy/ uses) and once with the bootstrap's stats_config
removed (Envoy's default: every stat). Each Envoy gets the same requests to a few models, waits
for a stats flush, then its /stats/prometheus is read with and without `?usedonly`:

  before          no matcher, no usedonly (what Envoy rendered and Prometheus parsed)
  usedonly        no matcher, ?usedonly (stats never written since start are left out)
  matcher         the bootstrap's stats_matcher, no usedonly
  matcher+used    both (what deploy/ does now)

For each: samples (series) and bytes per scrape, the samples that deploy/prometheus keeps after its
metric_relabel keep-list (what Prometheus stores), samples per idle and per busy model cluster, the
time Envoy takes to render the page, and the ratios against `before` measured in the same run; then
the same extrapolated to 1,000 proxies. Everything listens on 127.0.0.1.

    .venv/bin/python bench/envoy_stats/series.py                        # about a minute
    .venv/bin/python bench/envoy_stats/series.py --clusters 40 --busy 4 --requests 100
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT))

from bench.ports import free_port, free_ports  # noqa: E402
from controlplane.fleet import parse_fleet  # noqa: E402
from controlplane.routing.translate import CLUSTER, translate  # noqa: E402
from controlplane.xds.bootstrap import envoy_bootstrap  # noqa: E402

ENDPOINTS_PER_MODEL = 2
SCRAPE_INTERVAL_S = 15  # deploy/prometheus/prometheus.yml
FLUSH_S = 5.5  # Envoy merges histograms at its stats flush (every 5 s); usedonly shows them after


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class Stack:
    """The processes of the run; stop() stops each one it started."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = (self.workdir / f"{name}.log").open("ab")
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def wait(self, check: object, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{what}: {p.args!r} exited (logs in {self.workdir})")
            try:
                if callable(check) and check():
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"timed out waiting for {what} (logs in {self.workdir})")

    def stop_one(self, p: subprocess.Popen[bytes]) -> None:
        if p in self.procs:
            self.procs.remove(p)
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)

    def stop(self) -> None:
        for p in reversed(list(self.procs)):
            self.stop_one(p)


def model_name(i: int) -> str:
    return f"m{i:02d}"


def fleet_yaml(listener: int, clusters: int, bases: list[int]) -> str:
    """`clusters` models, one version each, ENDPOINTS_PER_MODEL endpoints each; model i's
    servers are on ports bases[i], bases[i] + 1, ..."""
    lines = [
        f"listener: {{port: {listener}, address: 127.0.0.1}}",
        "tiers: {small: {max_params_b: 15, timeout: 60s}}",
        "signals: {interval: 2s, timeout: 1s}",
        "models:",
    ]
    for i in range(clusters):
        eps = ", ".join(f"'127.0.0.1:{bases[i] + k}'" for k in range(ENDPOINTS_PER_MODEL))
        lines.append(
            f"  {model_name(i)}: {{params_b: 8, stable: v1, versions: {{v1: {{endpoints: [{eps}]}}}}}}"
        )
    return "\n".join(lines) + "\n"


def start_servers(stack: Stack, clusters: int, busy: int) -> list[int]:
    """Emulated servers: one process per busy model (requests name their model), one for all
    the idle ones (never sent a request, only probed). Returns each model's base port."""
    bases: list[int] = []
    for i in range(busy):
        base = free_ports(ENDPOINTS_PER_MODEL)
        bases.append(base)
        emulate = [str(BIN / "controlplane"), "emulate", "--listen", f"127.0.0.1:{base}"]
        emulate += ["--model", model_name(i), "--count", str(ENDPOINTS_PER_MODEL), "--slots", "64"]
        emulate += ["--decode-ms-per-token", "1", "--prefill-ms-per-token", "0.01"]
        emulate += ["--metrics-page", "compact", "--log-level", "warning"]
        stack.spawn(f"emulate-{model_name(i)}", emulate)
    idle = clusters - busy
    if idle:
        base = free_ports(idle * ENDPOINTS_PER_MODEL)
        bases += [base + k * ENDPOINTS_PER_MODEL for k in range(idle)]
        emulate = [str(BIN / "controlplane"), "emulate", "--listen", f"127.0.0.1:{base}", "--model", "idle"]
        emulate += ["--count", str(idle * ENDPOINTS_PER_MODEL), "--metrics-page", "compact"]
        stack.spawn("emulate-idle", [*emulate, "--log-level", "warning"])
    for base in bases:
        for port in range(base, base + ENDPOINTS_PER_MODEL):
            stack.wait(lambda p=port: http_get(f"http://127.0.0.1:{p}/health")[0] == 200, 30, "servers")
    return bases


def without_stats_config(text: str) -> str:
    """The bootstrap with Envoy's default stats: every stat, no matcher."""
    boot = yaml.safe_load(text)
    boot.pop("stats_config")
    return yaml.safe_dump(boot)


def healthy_clusters(admin: int) -> set[str]:
    """Clusters that have a healthy endpoint in Envoy's own view (admin /clusters)."""
    _, body = http_get(f"http://127.0.0.1:{admin}/clusters")
    out = set()
    for line in body.decode().splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[2] == "health_flags" and parts[3] == "healthy":
            out.add(parts[0])
    return out


def send_traffic(listener: int, busy: int, requests: int) -> int:
    """`requests` completions to each busy model, and a few to a model nobody serves."""
    ok = 0
    conn = http.client.HTTPConnection("127.0.0.1", listener, timeout=30)
    try:
        for i in range(requests):
            for m in [*(model_name(k) for k in range(busy)), *(["unknown"] if i < 3 else [])]:
                body = json.dumps({"model": m, "prompt": "hi", "max_tokens": 4})
                conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
                r = conn.getresponse()
                r.read()
                ok += r.status == 200
    finally:
        conn.close()
    return ok


@dataclass(frozen=True)
class Page:
    samples: int
    bytes: int
    families: int
    stored: int  # samples that survive deploy/prometheus's keep-list
    per_cluster: dict[str, int]  # envoy_cluster_name -> samples
    render_ms: float


def keep_list() -> set[str]:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "envoy"]
    (keep,) = [r for r in job["metric_relabel_configs"] if r.get("action") == "keep"]
    return set(keep["regex"].strip().split("|"))


def read_page(admin: int, query: str, keep: set[str], fetches: int) -> Page:
    url = f"http://127.0.0.1:{admin}/stats/prometheus{query}"
    times = []
    body = b""
    for _ in range(fetches):
        start = time.perf_counter()
        status, body = http_get(url)
        times.append((time.perf_counter() - start) * 1000)
        assert status == 200, (url, status)
    samples = stored = families = 0
    per_cluster: dict[str, int] = {}
    for line in body.decode().splitlines():
        if line.startswith("# TYPE "):
            families += 1
        if not line or line.startswith("#"):
            continue
        samples += 1
        name = re.split(r"[{\s]", line, maxsplit=1)[0]
        stored += name in keep
        m = re.search(r'envoy_cluster_name="([^"]*)"', line)
        if m:
            per_cluster[m.group(1)] = per_cluster.get(m.group(1), 0) + 1
    return Page(samples, len(body), families, stored, per_cluster, statistics.median(times))


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def run_envoy(
    stack: Stack, workdir: Path, xds: str, listener: int, args: argparse.Namespace, matcher: bool
) -> tuple[dict[str, Page], float]:
    """One Envoy with or without the matcher: traffic, a stats flush, both pages; its RSS."""
    admin = free_port()
    node = "bench-matcher" if matcher else "bench-default"
    text = envoy_bootstrap(node, [xds], admin_port=admin)
    path = workdir / f"{node}.yaml"
    path.write_text(text if matcher else without_stats_config(text))
    envoy = shutil.which("envoy", path=str(BIN)) or "envoy"
    proc = stack.spawn(
        node, [envoy, "-c", str(path), "--disable-hot-restart", "-l", "warning", "--concurrency", "2"]
    )
    try:
        models = {f"{model_name(i)}@v1" for i in range(args.clusters)}
        stack.wait(
            lambda: models <= healthy_clusters(admin), 60, f"{node}: every cluster with a healthy endpoint"
        )
        stack.wait(
            lambda: http_get(f"http://127.0.0.1:{listener}/v1/models")[0] == 200, 30, f"{node}: the listener"
        )
        ok = send_traffic(listener, args.busy, args.requests)
        if ok < args.busy * args.requests:
            raise RuntimeError(f"{node}: {ok} of {args.busy * args.requests} requests answered 200")
        time.sleep(FLUSH_S)
        keep = keep_list()
        pages = {q: read_page(admin, q, keep, args.fetches) for q in ("", "?usedonly")}
        return pages, rss_mb(proc.pid)
    finally:
        stack.stop_one(proc)


def fmt_int(n: float) -> str:
    return f"{n:,.0f}"


def fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def report(rows: dict[str, Page], rss: dict[str, float], args: argparse.Namespace) -> None:
    base = rows["before"]
    busy = [model_name(i) + "_v1" for i in range(args.busy)]
    idle = [model_name(i) + "_v1" for i in range(args.busy, args.clusters)]

    def mean_of(p: Page, names: list[str]) -> float:
        return statistics.mean(p.per_cluster.get(n, 0) for n in names) if names else 0.0

    print(f"\n{args.clusters} model clusters, {args.busy} with traffic ({args.requests} requests each)")
    header = (
        f"{'config':<14}{'samples':>9}{'x before':>9}{'bytes':>10}{'x before':>9}{'stored':>8}"
        f"{'x before':>9}{'per idle':>9}{'per busy':>9}{'render ms':>10}{'x before':>9}"
    )
    print(header)
    print("-" * len(header))
    for name, p in rows.items():
        print(
            f"{name:<14}{fmt_int(p.samples):>9}{p.samples / base.samples:>9.3f}{fmt_bytes(p.bytes):>10}"
            f"{p.bytes / base.bytes:>9.3f}{fmt_int(p.stored):>8}{p.stored / max(base.stored, 1):>9.3f}"
            f"{mean_of(p, idle):>9.1f}{mean_of(p, busy):>9.1f}"
            f"{p.render_ms:>10.2f}{p.render_ms / base.render_ms:>9.3f}"
        )
    print("\nsamples: series Envoy renders and Prometheus parses; stored: those left after")
    print("deploy/prometheus's metric_relabel keep-list; per idle/busy: samples per model cluster.")
    print(
        f"Envoy RSS after traffic: {rss['default']:.1f} MB with every stat, "
        f"{rss['matcher']:.1f} MB with the matcher ({rss['matcher'] / rss['default']:.3f}x)"
    )
    n = args.proxies
    print(f"\nAt {n:,} proxies (x{n:,}), one scrape every {SCRAPE_INTERVAL_S} s:")
    header = f"{'config':<14}{'series parsed':>15}{'series stored':>15}{'bytes/scrape':>14}{'ingest/s':>11}"
    print(header)
    print("-" * len(header))
    for name, p in rows.items():
        print(
            f"{name:<14}{fmt_int(p.samples * n):>15}{fmt_int(p.stored * n):>15}"
            f"{fmt_bytes(p.bytes * n):>14}{fmt_bytes(p.bytes * n / SCRAPE_INTERVAL_S):>9}/s"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clusters", type=int, default=40, help="models, one cluster each (default: 40)")
    ap.add_argument("--busy", type=int, default=4, help="models that get traffic (default: 4)")
    ap.add_argument("--requests", type=int, default=50, help="requests to each busy model (default: 50)")
    ap.add_argument("--fetches", type=int, default=7, help="reads of each page; render time is the median")
    ap.add_argument("--proxies", type=int, default=1000, help="proxies to extrapolate to (default: 1000)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, bootstraps)")
    args = ap.parse_args()
    if not 0 < args.busy <= args.clusters:
        ap.error("--busy: between 1 and --clusters")

    workdir = Path(tempfile.mkdtemp(prefix="envoy-stats-"))
    stack = Stack(workdir)
    try:
        bases = start_servers(stack, args.clusters, args.busy)
        listener = free_port()
        config = workdir / "fleet.yaml"
        config.write_text(fleet_yaml(listener, args.clusters, bases))
        desired = translate(parse_fleet(config.read_text(), str(config)))
        print(f"translate: {len(desired.by_type[CLUSTER])} clusters for {args.clusters} models")
        xds, metrics = f"127.0.0.1:{free_port()}", free_port()
        serve = [str(BIN / "controlplane"), "serve", "--config", str(config), "--xds-listen", xds]
        serve += ["--metrics-listen", f"127.0.0.1:{metrics}", "--admin-listen", f"127.0.0.1:{free_port()}"]
        stack.spawn("controlplane", [*serve, "--state-dir", str(workdir / "state"), "--log-level", "warning"])
        stack.wait(lambda: http_get(f"http://127.0.0.1:{metrics}/healthz")[0] == 200, 30, "the control plane")

        default, rss_default = run_envoy(stack, workdir, xds, listener, args, matcher=False)
        matched, rss_matcher = run_envoy(stack, workdir, xds, listener, args, matcher=True)
        rows = {
            "before": default[""],
            "usedonly": default["?usedonly"],
            "matcher": matched[""],
            "matcher+used": matched["?usedonly"],
        }
        report(rows, {"default": rss_default, "matcher": rss_matcher}, args)
    finally:
        stack.stop()
        if args.keep:
            print(f"\nwork directory: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
