"""The dashboard and the alerts in deploy/ only use metrics that really exist.

A real control plane, a real Envoy started the way deploy/kubernetes starts it (the bootstrap
from its ConfigMap, the gateway Deployment's command-line flags) and emulated servers serve a
model with v1 and v2 under steady traffic. A rollout is aborted, a second one completes, an
endpoint is drained and a proxy NACKs, so that every family has samples. Then every metric
name used by deploy/grafana/*.json and deploy/prometheus/alerts.yml must be in the control
plane's /metrics or in Envoy's /stats/prometheus (scraped through the stats listener that
Prometheus scrapes in Kubernetes), and the Envoy metrics kept by prometheus.yml must exist.
Envoy creates exactly the stats its bootstrap's stats_matcher keeps, and the page Prometheus
scrapes (?usedonly) has those that traffic and config wrote; every one it leaves out is zero.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import grpc
import pytest
import yaml

from controlplane.v1 import endpoint_pb2, rollout_pb2
from tests.integration.harness import (
    ControlPlane,
    EmulatedFleet,
    Emulator,
    Envoy,
    Operator,
    Proc,
    Traffic,
    envoy_binary,
    free_port,
    http_get,
    wait_until,
)
from tests.unit.test_deploy_prometheus import (
    ENVOY_ADMIN_ONLY,
    ENVOY_PICKER_STATS,
    ENVOY_QUOTA_STATS,
    ENVOY_STATS,
    prometheus_names,
)

pytestmark = pytest.mark.envoy

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
MODEL = "llama"
FAST = {"slots": 32, "decode_ms_per_token": 2, "prefill_ms_per_token": 0.01}

# PromQL words that are not metric names: aggregations, keywords, and functions (an
# identifier followed by "(" is taken for a function call anyway).
PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
    "count_values", "group", "by", "without", "on", "ignoring", "group_left", "group_right",
    "offset", "bool", "and", "or", "unless", "inf", "nan", "le", "atan2",
    "rate", "irate", "increase", "delta", "idelta", "deriv", "histogram_quantile", "absent",
    "absent_over_time", "changes", "resets", "label_replace", "label_join", "vector", "scalar",
    "clamp", "clamp_min", "clamp_max", "abs", "ceil", "floor", "round", "sqrt", "exp", "ln",
    "time", "timestamp", "sort", "sort_desc", "avg_over_time", "max_over_time",
    "min_over_time", "sum_over_time", "count_over_time", "last_over_time",
    "quantile_over_time", "predict_linear", "label_values",
}  # fmt: skip
# Series that Prometheus makes itself, per scrape target.
PROMETHEUS_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names an expression reads (Grafana variables allowed)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"'(?:[^'\\]|\\.)*'", "''", e)
    e = re.sub(r"\$\{?\w+(?::\w+)?\}?", "", e)  # $__rate_interval, ${model}...
    e = re.sub(r"\{[^}]*\}", " ", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", " ", e)  # ranges and subqueries
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"\boffset\s+-?\w+", " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w:.])([a-zA-Z_:][\w:]*)(\s*\()?", e):
        if m.group(2) is None and m.group(1).lower() not in PROMQL_WORDS:
            names.add(m.group(1))
    return names


def dashboard_names(prefix: str) -> set[str]:
    """The metric names starting with `prefix` that the dashboards' queries read."""
    return {
        name
        for path in sorted((DEPLOY / "grafana").glob("*.json"))
        for expr in dashboard_expressions(path)
        for name in promql_metric_names(expr)
        if name.startswith(prefix)
    }


def page_names(page: str) -> set[str]:
    """The names a Prometheus page has samples of, or declares (a labelled counter has no
    sample before its first count, only its # TYPE line)."""
    names = {line.split("{")[0].split()[0] for line in page.splitlines() if line and line[0] != "#"}
    for line in page.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split()
            names.add(family if family.endswith("_total") or kind != "counter" else family + "_total")
    return names


def dashboard_expressions(path: Path) -> list[str]:
    """Every PromQL expression of a dashboard: panel targets and template queries."""
    dash = json.loads(path.read_text())
    out: list[str] = []

    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for p in items:
            yield p
            yield from panels(p.get("panels", []))

    for p in panels(dash["panels"]):
        out += [t["expr"] for t in p.get("targets", []) if t.get("expr")]
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", q)
            out.append(m.group(1) if m else q)
    return out


def alert_expressions(path: Path) -> list[str]:
    groups = yaml.safe_load(path.read_text())["groups"]
    return [r["expr"] for g in groups for r in g["rules"]]


def exposition(text: str) -> tuple[set[str], set[str]]:
    """(sample names, names declared by # TYPE) of a Prometheus text page."""
    samples, declared = set(), set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            declared.add(line.split()[2])
        elif line and not line.startswith("#"):
            samples.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return samples, declared


def envoy_keep_list() -> list[str]:
    """The Envoy metric names prometheus.yml keeps (its `__name__` keep rule)."""
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "envoy"]
    (keep,) = [
        r
        for r in job["metric_relabel_configs"]
        if r.get("action") == "keep" and r["source_labels"] == ["__name__"]
    ]
    names: list[str] = keep["regex"].strip().split("|")
    assert all(re.fullmatch(r"[a-zA-Z_:][\w:]*", n) for n in names), "keep a flat list of names"
    return names


@dataclass
class DeployedEnvoy(Envoy):
    """Envoy started as deploy/kubernetes starts a gateway: the ConfigMap's bootstrap (with
    loopback addresses and free ports) and the Deployment's command-line flags."""

    stats_port: int = field(default_factory=free_port)

    def start(self) -> DeployedEnvoy:
        docs = yaml.safe_load_all(
            (DEPLOY / "kubernetes" / "base" / "envoy-bootstrap-configmap.yaml").read_text()
        )
        (cm,) = [d for d in docs if d and d["kind"] == "ConfigMap"]
        boot = yaml.safe_load(cm["data"]["bootstrap.yaml"])
        boot["admin"]["address"]["socket_address"]["port_value"] = self.admin_port
        host, _, port = self.xds.rpartition(":")
        for listener in boot["static_resources"]["listeners"]:
            assert listener["name"] == "envoy_stats"
            listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": self.stats_port}
        for cluster in boot["static_resources"]["clusters"]:
            (ep,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
            addr = ep["endpoint"]["address"]["socket_address"]
            if cluster["name"] == "xds_cluster":
                addr.update(address=host, port_value=int(port))
            else:
                assert addr == {"address": "127.0.0.1", "port_value": 9901}
                addr["port_value"] = self.admin_port
        path = self.log_dir / f"{self.node_id}-k8s-bootstrap.yaml"
        path.write_text(yaml.safe_dump(boot))
        self.proc = Proc(self.node_id, [envoy_binary(), *self.gateway_args(path)], self.log_dir)
        wait_until(self._ready, 20, f"envoy {self.node_id} to serve the listener")
        return self

    def gateway_args(self, bootstrap: Path) -> list[str]:
        docs = yaml.safe_load_all((DEPLOY / "kubernetes" / "base" / "envoy-gateway.yaml").read_text())
        (dep,) = [d for d in docs if d and d["kind"] == "Deployment"]
        (container,) = dep["spec"]["template"]["spec"]["containers"]
        assert container["command"] == ["envoy"]
        args = [
            {"$(POD_NAME)": self.node_id, "/etc/envoy/bootstrap.yaml": str(bootstrap)}.get(a, a)
            for a in container["args"]
        ]
        args[args.index("--drain-time-s") + 1] = "1"  # the preStop hook's drain, shortened
        return args

    def prestop_command(self) -> list[str]:
        docs = yaml.safe_load_all((DEPLOY / "kubernetes" / "base" / "envoy-gateway.yaml").read_text())
        (dep,) = [d for d in docs if d and d["kind"] == "Deployment"]
        (container,) = dep["spec"]["template"]["spec"]["containers"]
        command: list[str] = container["lifecycle"]["preStop"]["exec"]["command"]
        return [c.replace("/127.0.0.1/9901", f"/127.0.0.1/{self.admin_port}") for c in command]


class Rig(EmulatedFleet):
    op: Operator | None = None
    traffic: Traffic | None = None
    envoy: DeployedEnvoy | None = None

    def start(self) -> None:
        for name in ("a1", "a2", "b1", "b2"):
            self.servers[name] = Emulator(name, self.tmp, MODEL, **FAST)
        a1, a2, b1, b2 = (self.servers[n].address for n in ("a1", "a2", "b1", "b2"))
        (self.tmp / "fleet.yaml").write_text(
            f"listener: {{port: {self.listener}}}\n"
            "tiers: {small: {max_params_b: 15}}\n"
            "signals: {interval: 500ms, timeout: 400ms}\n"
            f"models: {{{MODEL}: {{params_b: 8, stable: v1, versions: {{\n"
            f"  v1: {{endpoints: [{{address: '{a1}'}}, {{address: '{a2}'}}]}},\n"
            f"  v2: {{endpoints: [{{address: '{b1}'}}, {{address: '{b2}'}}]}}}}}}}}\n"
        )
        self.cp = ControlPlane(self.tmp / "fleet.yaml", self.tmp).start()
        self.envoy = DeployedEnvoy("inference-gateway-7d9f-x2x", self.cp.xds, self.tmp, self.listener)
        self.envoy.start()
        self.op = Operator(self.cp)
        self.traffic = Traffic(self.listener, MODEL, self.tmp)

    def rollout(self) -> rollout_pb2.Rollout:
        assert self.op is not None
        return self.op.rollouts.Get(rollout_pb2.GetRolloutRequest(model=MODEL), metadata=self.op.md)

    def command(self, method: str, **kw: Any) -> rollout_pb2.Rollout:
        assert self.op is not None
        rpc = getattr(self.op.rollouts, method)
        return rpc(rollout_pb2.RolloutCommand(model=MODEL, **kw), metadata=self.op.md)  # type: ignore[no-any-return]

    def start_rollout(self) -> None:
        assert self.op is not None
        self.op.rollouts.Start(
            rollout_pb2.StartRolloutRequest(model=MODEL, to_version="v2", manual=True, min_requests=5),
            metadata=self.op.md,
        )
        wait_until(lambda: self.rollout().step >= 1, 10, "rollout step 1")

    def endpoint_state(self, address: str) -> str:
        assert self.op is not None
        eps = self.op.endpoints.List(endpoint_pb2.ListEndpointsRequest(model=MODEL), metadata=self.op.md)
        return {e.address: e.state for e in eps.endpoints}[address]

    def close(self) -> None:
        if self.traffic is not None:
            self.traffic.proc.stop()
        if self.op is not None:
            self.op.close()
        super().close()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    try:
        r.start()
        yield r
    finally:
        r.close()


def nack_once(cp: ControlPlane) -> None:
    """A gRPC ADS client that rejects the clusters it is sent, then goes away."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
    from google.rpc import status_pb2

    cds = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
    nack: list[discovery_pb2.DiscoveryRequest] = []
    done = threading.Event()

    def requests() -> Iterator[discovery_pb2.DiscoveryRequest]:
        yield discovery_pb2.DiscoveryRequest(node=base_pb2.Node(id="nacking-proxy"), type_url=cds)
        wait_until(lambda: bool(nack), 5, "the clusters")
        yield nack[0]
        done.wait(10)

    with grpc.insecure_channel(cp.xds) as channel:
        stream = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources(requests())
        try:
            response = next(stream)
            status = status_pb2.Status(code=3, message="test: rejected on purpose")
            nack.append(
                discovery_pb2.DiscoveryRequest(
                    type_url=cds, response_nonce=response.nonce, error_detail=status
                )
            )
            wait_until(lambda: cp.metric("controlplane_xds_nacks_total", type="cluster") >= 1, 5, "the NACK")
        finally:
            done.set()
            stream.cancel()


def test_every_metric_of_the_dashboard_and_alerts_is_exported(rig: Rig) -> None:
    assert rig.cp is not None and rig.envoy is not None and rig.traffic is not None
    cp, envoy = rig.cp, rig.envoy
    # The pod name given on Envoy's command line is its node id at the control plane.
    assert [p["node_id"] for p in cp.proxies()] == [envoy.node_id]
    wait_until(lambda: len(rig.traffic.records()) > 100, 15, "traffic through Envoy")  # type: ignore[union-attr]

    # A rollout aborted by the operator, then one that completes (v1 then drains).
    rig.start_rollout()
    assert rig.command("Abort").phase == "Aborted"
    rig.start_rollout()
    wait_until(
        lambda: "controlplane_rollout_analysis_error_ratio{" in cp.metrics_text(), 10, "the step's analysis"
    )
    rig.command("Promote", full=True)
    wait_until(lambda: rig.rollout().phase == "Completed", 10, "the rollout to complete")
    # An endpoint drained by hand, and a proxy that rejects config.
    b1 = rig.servers["b1"].address
    assert rig.op is not None
    rig.op.endpoints.Drain(endpoint_pb2.DrainRequest(address=b1, reason="test"), metadata=rig.op.md)
    nack_once(cp)
    wait_until(lambda: rig.endpoint_state(b1) == "DRAINED", 15, "the drain to finish")
    # The traffic feeds the metrics; whether a change drops requests is test_rollouts.py's job.
    assert sum(r["status"] == 200 for r in rig.traffic.stop()) > 300

    cp_samples, cp_declared = exposition(cp.metrics_text())
    status, page = http_get(f"http://127.0.0.1:{envoy.stats_port}/stats/prometheus")
    assert status == 200
    envoy_samples, _ = exposition(page)
    assert http_get(f"http://127.0.0.1:{envoy.stats_port}/ready")[0] == 200
    assert http_get(f"http://127.0.0.1:{envoy.stats_port}/quitquitquit")[0] == 404  # admin stays private

    used: dict[str, set[str]] = {}
    sources = [(p, dashboard_expressions(p)) for p in sorted((DEPLOY / "grafana").glob("*.json"))]
    for rules in ("alerts.yml", "slo-rules.yml"):
        sources.append((DEPLOY / "prometheus" / rules, alert_expressions(DEPLOY / "prometheus" / rules)))
    # The recording rules' own names (model:inference_*) are made by Prometheus from the
    # slo-rules.yml expressions, whose metrics are checked like the others.
    slo_groups = yaml.safe_load((DEPLOY / "prometheus" / "slo-rules.yml").read_text())["groups"]
    recorded = {r["record"] for g in slo_groups for r in g["rules"]}
    for path, exprs in sources:
        assert exprs, path
        for expr in exprs:
            for name in promql_metric_names(expr):
                used.setdefault(name, set()).add(path.name)
    assert len(used) > 40, sorted(used)

    missing = []
    picker_only = set(ENVOY_PICKER_STATS.values())  # only where a model picks: test_picker.py
    picker_only |= set(ENVOY_QUOTA_STATS.values())  # only where the fleet has quotas: test_quotas.py
    for name, where in sorted(used.items()):
        if name in PROMETHEUS_SERIES or name in recorded or name in picker_only:
            continue
        if name.startswith(("controlplane_picker_", "controlplane_quota_")):
            continue  # a picker's or rate-limit service's own page: test_picker.py, test_quotas.py
        if name.startswith("envoy_"):
            ok = name in envoy_samples
        elif re.search(r"_(bucket|count|sum)$", name):
            ok = name in cp_samples  # a histogram's series must be there, not just its family
        else:
            ok = name in cp_declared or name in cp_samples
        if not ok:
            missing.append(f"{name} (used in {', '.join(sorted(where))})")
    assert missing == [], "metrics used but not exported:\n" + "\n".join(missing)

    # Histograms of the control plane used through their buckets are histograms indeed.
    for name in used:
        if (
            name.startswith("controlplane_")
            and name.endswith("_bucket")
            and "_picker_" not in name
            and "_quota_" not in name
        ):
            assert f"{name[: -len('_bucket')]}_count" in cp_samples

    # prometheus.yml keeps only some Envoy metrics: each exists, and every one used is kept.
    keep = envoy_keep_list()
    assert [n for n in keep if n not in envoy_samples and n not in picker_only] == []
    assert sorted(n for n in used if n.startswith("envoy_") and n not in keep) == []
    check_envoy_stats_as_scraped(envoy, rig.listener, envoy_samples, keep)

    # The gateway's preStop hook drains through the admin API (drain time 1 s here), and
    # returns once the listeners have stopped and nothing is in flight.
    started = time.monotonic()
    hook = subprocess.run(envoy.prestop_command(), capture_output=True, text=True, timeout=20)
    assert hook.returncode == 0, hook.stderr
    assert time.monotonic() - started >= 1.0
    assert envoy.stat("listener_manager.listener_stopped") >= 1
    with pytest.raises(OSError):
        http_get(f"http://127.0.0.1:{rig.listener}/v1/models")


def envoy_scrape_path() -> str:
    """The path and query prometheus.yml scrapes Envoys on (/stats/prometheus?usedonly=)."""
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "envoy"]
    return f"{job['metrics_path']}?{urlencode(job.get('params', {}), doseq=True)}"


def reset_mid_request(listener: int) -> None:
    """A client that sends a long completion and hangs up before the answer: Envoy counts a
    downstream reset and closes the upstream connection under its request."""
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2000}).encode()
    with socket.create_connection(("127.0.0.1", listener), timeout=5) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        time.sleep(0.3)


def check_envoy_stats_as_scraped(
    envoy: DeployedEnvoy, listener: int, envoy_samples: set[str], keep: list[str]
) -> None:
    """The bootstrap's stats_matcher and the scrape's usedonly, on the Envoy after traffic.
    `envoy_samples`: the names at /stats/prometheus without usedonly."""
    # Envoy creates the stats the matcher keeps (each has its Prometheus name, as listed in
    # tests/unit/test_deploy_prometheus.py) and no others.
    listed = {n for v in ENVOY_STATS.values() for n in prometheus_names(v)}
    assert sorted(listed - envoy_samples) == []
    assert sorted(envoy_samples - listed) == []
    assert sorted(envoy_samples - set(keep)) == sorted(ENVOY_ADMIN_ONLY)

    reset_mid_request(listener)
    stats = f"http://127.0.0.1:{envoy.stats_port}"

    def scraped() -> tuple[str, set[str]]:
        status, page = http_get(stats + envoy_scrape_path())
        assert status == 200
        return page, exposition(page)[0]

    # Histograms count as used once merged (Envoy's stats flush, every 5 s).
    wait_until(
        lambda: (
            {"envoy_cluster_upstream_rq_time_bucket", "envoy_http_downstream_rq_rx_reset"} <= scraped()[1]
        ),
        10,
        "the histograms and the reset in the usedonly page",
    )
    full = http_get(stats + "/stats/prometheus")[1]  # first: a stat written later shows in both
    page, names = scraped()
    assert names <= envoy_samples and len(page) < len(full)
    # What traffic, config and a client's reset write is there; every stat left out by
    # usedonly is all zeros on the full page (nothing has written it yet).
    written = {
        "envoy_cluster_upstream_rq_total", "envoy_cluster_upstream_rq_xx", "envoy_cluster_upstream_rq_active",
        "envoy_cluster_upstream_rq_time_bucket", "envoy_cluster_upstream_rq_time_sum",
        "envoy_cluster_upstream_rq_time_count", "envoy_cluster_membership_healthy",
        "envoy_cluster_membership_total", "envoy_cluster_upstream_cx_destroy_local_with_active_rq",
        "envoy_http_downstream_rq_total", "envoy_http_downstream_rq_xx", "envoy_http_downstream_rq_active",
        "envoy_http_downstream_rq_time_bucket", "envoy_http_downstream_rq_time_sum",
        "envoy_http_downstream_rq_time_count", "envoy_http_downstream_rq_rx_reset",
        "envoy_cluster_manager_cds_update_time", "envoy_cluster_manager_cds_update_success",
        "envoy_cluster_manager_cds_version", "envoy_listener_manager_lds_update_time",
        "envoy_listener_manager_lds_update_success", "envoy_listener_manager_lds_version",
        "envoy_http_rds_update_time", "envoy_http_rds_update_success", "envoy_http_rds_version",
        "envoy_cluster_manager_warming_clusters", "envoy_control_plane_connected_state",
        "envoy_server_live", "envoy_server_uptime", "envoy_server_memory_allocated",
        "envoy_server_concurrency",
    }  # fmt: skip
    assert written <= set(keep)
    assert sorted(written - names) == []
    for line in full.splitlines():
        name, _, value = line.rpartition(" ")
        if line and not line.startswith("#") and re.split(r"[{\s]", name)[0] not in names:
            assert float(value) == 0, f"{line}: written, yet not in the usedonly page"


def test_promql_metric_names_reads_names_not_functions_labels_or_variables() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, type) (rate(a_bucket{type=~"$t", x="y z"}[$__rate_interval])))'
        " / on (model) group_left sum without (pod) (b offset 5m) > bool 1e3"
        " or absent(up{job='c'} == 1) unless c:recorded and max(d)"
    )
    assert promql_metric_names(expr) == {"a_bucket", "b", "up", "c:recorded", "d"}
