"""deploy/prometheus: promtool accepts the scrape config and the alerts, the alerts' unit tests
pass, the dashboard's queries parse, and every alert says what to do.

promtool comes from Debian's `prometheus` package (.ci/run installs it). Without it the
promtool tests are skipped, unless CONTROLPLANE_REQUIRE_PROMTOOL=1 (CI), where they fail.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)

from controlplane.fleet import parse_fleet
from controlplane.resources.names import stat_name
from controlplane.routing.translate import CLUSTER, LISTENER, RoutingOverlay, translate
from controlplane.xds.bootstrap import envoy_bootstrap
from tests.fleets import BASIC
from tests.peers import required

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "deploy" / "prometheus"
K8S = ROOT / "deploy" / "kubernetes" / "base"


@pytest.fixture(scope="module")
def promtool() -> str:
    return required(
        shutil.which("promtool"),
        missing="promtool is missing: install Debian's prometheus package "
        "(apt-get install --no-install-recommends prometheus), as .ci/run does",
        env="CONTROLPLANE_REQUIRE_PROMTOOL",
    )


def run(promtool: str, *args: str, cwd: Path = PROM) -> str:
    # `test rules alerts_test.yml` takes about 35 s on an idle 2-core machine: room for a busy one
    out = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=180, cwd=cwd)
    assert out.returncode == 0, f"promtool {' '.join(args)}:\n{out.stdout}\n{out.stderr}"
    return out.stdout + out.stderr


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((PROM / "alerts.yml").read_text())["groups"]
    return [r for g in groups for r in g["rules"] if "alert" in r]


# ---- promtool ----------------------------------------------------------------------------


def test_promtool_accepts_the_scrape_config_and_its_rule_file(promtool: str) -> None:
    out = run(promtool, "check", "config", str(PROM / "prometheus.yml"))
    rule_files = yaml.safe_load((PROM / "prometheus.yml").read_text())["rule_files"]
    assert "SUCCESS" in out and f"{len(rule_files)} rule files found" in out


def test_promtool_accepts_the_alert_rules(promtool: str) -> None:
    out = run(promtool, "check", "rules", str(PROM / "alerts.yml"), str(PROM / "slo-rules.yml"))
    recorded = [r for g in yaml.safe_load((PROM / "slo-rules.yml").read_text())["groups"] for r in g["rules"]]
    assert all("record" in r for r in recorded)
    assert f"SUCCESS: {len(alert_rules())} rules found" in out
    assert f"SUCCESS: {len(recorded)} rules found" in out


def test_the_alerts_fire_as_their_unit_tests_expect(promtool: str) -> None:
    out = run(promtool, "test", "rules", "alerts_test.yml")
    assert "SUCCESS" in out
    tested = yaml.safe_load((PROM / "alerts_test.yml").read_text())
    fired = {
        case["alertname"]
        for test in tested["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    # The pages, and the cases of several replicas (every alert: the test at the end of the file).
    assert {
        "ModelAvailabilityBudgetBurn",
        "ModelLatencyBudgetBurn",
        "GatewayAvailabilityBudgetBurn",
        "ModelVersionNoReadyEndpoints",
        "ControlPlaneProxiesNacked",
    } <= fired
    assert fired <= {r["alert"] for r in alert_rules()}


def test_every_dashboard_query_is_valid_promql(promtool: str, tmp_path: Path) -> None:
    rules = []
    for path in sorted((ROOT / "deploy" / "grafana").glob("*.json")):
        dash = json.loads(path.read_text())
        for p in dash["panels"]:
            for t in p.get("targets", []):
                expr = t["expr"].replace("$__rate_interval", "5m")
                expr = re.sub(r"\$\{?\w+\}?", ".*", expr)  # $model, $cluster: regex matchers
                rules.append({"record": f"dashboard:panel_{p['id']}:{t['refId']}", "expr": expr})
    assert len(rules) > 40
    file = tmp_path / "dashboard-rules.yml"
    file.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    assert f"SUCCESS: {len(rules)} rules found" in run(promtool, "check", "rules", str(file))


# ---- what promtool does not check --------------------------------------------------------


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file."""
    anchors = set()
    for title in re.findall(r"^#+\s+(.+?)\s*$", markdown, re.M):
        anchors.add(re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-"))
    return anchors


def test_every_alert_has_a_severity_a_summary_and_a_description() -> None:
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for r in rules:
        assert r["labels"]["severity"] in {"critical", "warning", "info"}, r["alert"]
        notes = r["annotations"]
        assert notes["summary"].strip() and len(notes["description"]) > 60, r["alert"]
    # Their runbooks: test_every_runbook_url_is_a_section_of_docs_alerts_md.


def test_the_alerts_select_the_jobs_the_scrape_config_defines() -> None:
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    jobs = {j["job_name"] for j in config["scrape_configs"]}
    assert jobs == {"controlplane", "envoy"}
    for r in alert_rules():
        for job in re.findall(r'job\s*=~?\s*"([^"]*)"', r["expr"]):
            assert job in jobs, (r["alert"], job)
    # The PodMonitors (Prometheus Operator) give the same job names and keep the same metrics.
    monitors = [d for d in yaml.safe_load_all((PROM / "podmonitors.yaml").read_text()) if d]
    keep = {
        j["job_name"]: j["metric_relabel_configs"][0]["regex"]
        for j in config["scrape_configs"]
        if j.get("metric_relabel_configs")
    }
    for m in monitors:
        (endpoint,) = m["spec"]["podMetricsEndpoints"]
        (job,) = [r["replacement"] for r in endpoint["relabelings"] if r.get("targetLabel") == "job"]
        assert job in jobs
        if job in keep:
            assert endpoint["metricRelabelings"][0]["regex"] == keep[job]


def test_the_dns_names_prometheus_resolves_are_headless_services_of_the_manifests() -> None:
    services = {
        d["metadata"]["name"]: d
        for p in K8S.glob("*.yaml")
        for d in yaml.safe_load_all(p.read_text())
        if d and d.get("kind") == "Service"
    }
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    seen = 0
    for job in config["scrape_configs"]:
        for sd in job["dns_sd_configs"]:
            assert sd["type"] == "SRV"
            for name in sd["names"]:
                m = re.fullmatch(r"_([\w-]+)\._tcp\.([\w-]+)\.([\w-]+)\.svc\.cluster\.local", name)
                assert m, name
                port_name, service, namespace = m.groups()
                svc = services[service]
                assert namespace == "inference-system" and svc["spec"]["clusterIP"] == "None", name
                assert port_name in {p["name"] for p in svc["spec"]["ports"]}, name
                # The relabelling gives the labels the alerts and the dashboard use.
                labels = {}
                for rule in job["relabel_configs"]:
                    rm = re.fullmatch(rule["regex"], name)
                    if rule["source_labels"] == ["__meta_dns_name"] and rm:
                        labels[rule["target_label"]] = rm.expand(
                            rule.get("replacement", "$1").replace("$", "\\")
                        )
                assert labels.get("namespace") == "inference-system", (name, labels)
                if job["job_name"] == "envoy":
                    assert labels["app"] == svc["metadata"]["labels"]["app.kubernetes.io/name"], name
                seen += 1
    assert seen == 3


# ---- Envoy's stats: the bootstrap's stats_matcher and the scrape's keep-list -------------

# One Envoy stat (dotted, as the matcher sees it) for each kind the bootstrap's stats_matcher
# keeps, and the Prometheus name Envoy gives it at /stats/prometheus, where its tags (cluster,
# status class, connection manager prefix...) become labels.
# tests/integration/test_dashboard_metrics.py checks these names against the real Envoy.
ENVOY_STATS = {
    "cluster.llama-3-8b_v1.upstream_rq_total": "envoy_cluster_upstream_rq_total",
    "cluster.llama-3-8b_v1.upstream_rq_5xx": "envoy_cluster_upstream_rq_xx",
    "cluster.llama-3-8b_v1.upstream_rq_503": "envoy_cluster_upstream_rq",
    "cluster.llama-3-8b_v1.upstream_rq_active": "envoy_cluster_upstream_rq_active",
    "cluster.llama-3-8b_v1.upstream_rq_time": "envoy_cluster_upstream_rq_time",
    "cluster.llama-3-8b_v1.upstream_rq_retry": "envoy_cluster_upstream_rq_retry",
    "cluster.llama-3-8b_v1.upstream_rq_retry_success": "envoy_cluster_upstream_rq_retry_success",
    "cluster.llama-3-8b_v1.upstream_rq_timeout": "envoy_cluster_upstream_rq_timeout",
    "cluster.llama-3-8b_v1.upstream_rq_per_try_timeout": "envoy_cluster_upstream_rq_per_try_timeout",
    "cluster.llama-3-8b_v1.upstream_rq_pending_overflow": "envoy_cluster_upstream_rq_pending_overflow",
    "cluster.llama-3-8b_v1.upstream_rq_active_overflow": "envoy_cluster_upstream_rq_active_overflow",
    "cluster.llama-3-8b_v1.upstream_rq_rx_reset": "envoy_cluster_upstream_rq_rx_reset",
    "cluster.llama-3-8b_v1.upstream_rq_maintenance_mode": "envoy_cluster_upstream_rq_maintenance_mode",
    "cluster.llama-3-8b_v1.upstream_cx_none_healthy": "envoy_cluster_upstream_cx_none_healthy",
    "cluster.llama-3-8b_v1.upstream_cx_connect_fail": "envoy_cluster_upstream_cx_connect_fail",
    "cluster.llama-3-8b_v1.upstream_cx_destroy_local_with_active_rq": (
        "envoy_cluster_upstream_cx_destroy_local_with_active_rq"
    ),
    "cluster.llama-3-8b_v1.upstream_cx_destroy_remote_with_active_rq": (
        "envoy_cluster_upstream_cx_destroy_remote_with_active_rq"
    ),
    "cluster.llama-3-8b_v1.membership_healthy": "envoy_cluster_membership_healthy",
    "cluster.llama-3-8b_v1.membership_total": "envoy_cluster_membership_total",
    "cluster.llama-3-8b_v1.update_rejected": "envoy_cluster_update_rejected",
    "cluster.llama-3-8b_v1.update_empty": "envoy_cluster_update_empty",
    "cluster.llama-3-8b_v1.outlier_detection.ejections_active": (
        "envoy_cluster_outlier_detection_ejections_active"
    ),
    "cluster.llama-3-8b_v1.outlier_detection.ejections_enforced_total": (
        "envoy_cluster_outlier_detection_ejections_enforced_total"
    ),
    "cluster.llama-3-8b_v1.outlier_detection.ejections_enforced_consecutive_5xx": (
        "envoy_cluster_outlier_detection_ejections_enforced_consecutive_5xx"
    ),
    "http.inference.downstream_rq_total": "envoy_http_downstream_rq_total",
    "http.inference.downstream_rq_2xx": "envoy_http_downstream_rq_xx",
    "http.inference.downstream_rq_active": "envoy_http_downstream_rq_active",
    "http.inference.downstream_rq_completed": "envoy_http_downstream_rq_completed",
    "http.inference.downstream_rq_time": "envoy_http_downstream_rq_time",
    "http.inference.downstream_rq_tx_reset": "envoy_http_downstream_rq_tx_reset",
    "http.inference.downstream_rq_rx_reset": "envoy_http_downstream_rq_rx_reset",
    "http.inference.downstream_rq_idle_timeout": "envoy_http_downstream_rq_idle_timeout",
    "http.inference.no_route": "envoy_http_no_route",
    "http.inference.no_cluster": "envoy_http_no_cluster",
    "http.inference.rq_direct_response": "envoy_http_rq_direct_response",
    "http.inference.rq_reset_after_downstream_response_started": (
        "envoy_http_rq_reset_after_downstream_response_started"
    ),
    "cluster_manager.cds.update_time": "envoy_cluster_manager_cds_update_time",
    "cluster_manager.cds.update_success": "envoy_cluster_manager_cds_update_success",
    "cluster_manager.cds.update_rejected": "envoy_cluster_manager_cds_update_rejected",
    "cluster_manager.cds.version": "envoy_cluster_manager_cds_version",
    "listener_manager.lds.update_time": "envoy_listener_manager_lds_update_time",
    "listener_manager.lds.update_success": "envoy_listener_manager_lds_update_success",
    "listener_manager.lds.update_rejected": "envoy_listener_manager_lds_update_rejected",
    "listener_manager.lds.version": "envoy_listener_manager_lds_version",
    "http.inference.rds.inference.update_time": "envoy_http_rds_update_time",
    "http.inference.rds.inference.update_success": "envoy_http_rds_update_success",
    "http.inference.rds.inference.update_rejected": "envoy_http_rds_update_rejected",
    "http.inference.rds.inference.version": "envoy_http_rds_version",
    "cluster_manager.warming_clusters": "envoy_cluster_manager_warming_clusters",
    "cluster_manager.cluster_modified": "envoy_cluster_manager_cluster_modified",
    "listener_manager.total_listeners_active": "envoy_listener_manager_total_listeners_active",
    "listener_manager.listener_stopped": "envoy_listener_manager_listener_stopped",
    "control_plane.connected_state": "envoy_control_plane_connected_state",
    "server.live": "envoy_server_live",
    "server.uptime": "envoy_server_uptime",
    "server.memory_allocated": "envoy_server_memory_allocated",
    "server.concurrency": "envoy_server_concurrency",
}
ENVOY_HISTOGRAMS = {"envoy_cluster_upstream_rq_time", "envoy_http_downstream_rq_time"}
# Kept by Envoy for its admin API only (the tests, the gateway's preStop hook, an operator's
# curl) and not scraped: per-status-code counters (one series per code per cluster) and a few
# diagnostics no panel or alert reads.
# The picker filter's stats (ext_proc, stat_prefix picker): Envoy has them only where a model
# has `balancing: picker` (tests/integration/test_picker.py reads them on the real Envoy).
ENVOY_PICKER_STATS = {
    "http.inference.ext_proc.picker.streams_started": "envoy_http_ext_proc_picker_streams_started",
    "http.inference.ext_proc.picker.streams_failed": "envoy_http_ext_proc_picker_streams_failed",
    "http.inference.ext_proc.picker.failure_mode_allowed": "envoy_http_ext_proc_picker_failure_mode_allowed",
    "http.inference.ext_proc.picker.message_timeouts": "envoy_http_ext_proc_picker_message_timeouts",
}
# The quota filter's stats (ratelimit, stat_prefix quota, per model cluster): Envoy has them
# only where the fleet has `quotas:` (tests/integration/test_quotas.py reads them).
ENVOY_QUOTA_STATS = {
    "cluster.chat_v1.ratelimit.quota.ok": "envoy_cluster_ratelimit_quota_ok",
    "cluster.chat_v1.ratelimit.quota.over_limit": "envoy_cluster_ratelimit_quota_over_limit",
    "cluster.chat_v1.ratelimit.quota.error": "envoy_cluster_ratelimit_quota_error",
    "cluster.chat_v1.ratelimit.quota.failure_mode_allowed": (
        "envoy_cluster_ratelimit_quota_failure_mode_allowed"
    ),
}
ENVOY_ADMIN_ONLY = {
    "envoy_cluster_upstream_rq",
    "envoy_cluster_upstream_rq_retry_success",
    "envoy_cluster_upstream_rq_maintenance_mode",
    "envoy_cluster_upstream_cx_connect_fail",
    "envoy_cluster_update_empty",
    "envoy_cluster_outlier_detection_ejections_enforced_consecutive_5xx",
    "envoy_http_downstream_rq_completed",
    "envoy_http_downstream_rq_idle_timeout",
    "envoy_http_rq_direct_response",
    "envoy_cluster_manager_cluster_modified",
    "envoy_listener_manager_total_listeners_active",
    "envoy_listener_manager_listener_stopped",
}
# Stats the matcher drops: Envoy's other ~280 per cluster, other scopes, near misses.
ENVOY_DROPPED = [
    "cluster.llama-3-8b_v1.upstream_cx_total",
    "cluster.llama-3-8b_v1.upstream_rq_completed",
    "cluster.llama-3-8b_v1.upstream_rq_pending_total",
    "cluster.llama-3-8b_v1.external.upstream_rq_2xx",
    "cluster.llama-3-8b_v1.external.upstream_rq_time",
    "cluster.llama-3-8b_v1.canary.upstream_rq_503",
    "cluster.llama-3-8b_v1.circuit_breakers.default.rq_open",
    "cluster.llama-3-8b_v1.outlier_detection.ejections_detected_consecutive_5xx",
    "cluster.llama-3-8b_v1.update_success",
    "cluster.llama-3-8b_v1.lb_healthy_panic",
    "cluster_manager.cds.update_attempt",
    "cluster_manager.active_clusters",
    "http.admin.downstream_rq_2xx",
    "http.envoy_stats.downstream_rq_total",
    "http.inference.downstream_cx_total",
    "http.inference.rds.inference.update_attempt",
    "listener.0.0.0.0_10000.http.inference.downstream_rq_2xx",
    "listener_manager.lds.update_duration",
    "control_plane.pending_requests",
    "server.memory_heap_size",
    "runtime.load_success",
]


def prometheus_names(name: str) -> set[str]:
    """The series names of one Prometheus family (a histogram has three)."""
    if name in ENVOY_HISTOGRAMS:
        return {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return {name}


def envoy_scraped_names() -> set[str]:
    """The Prometheus names of the stats the matcher keeps and the scrape keeps too."""
    every = {**ENVOY_STATS, **ENVOY_PICKER_STATS, **ENVOY_QUOTA_STATS}
    return {n for v in every.values() for n in prometheus_names(v)} - ENVOY_ADMIN_ONLY


def envoy_matcher_patterns() -> list[dict[str, Any]]:
    boot = yaml.safe_load(envoy_bootstrap("envoy", ["127.0.0.1:18000"]))
    patterns: list[dict[str, Any]] = boot["stats_config"]["stats_matcher"]["inclusion_list"]["patterns"]
    return patterns


def envoy_matches(pattern: dict[str, Any], name: str) -> bool:
    """Envoy's StringMatcher, for the kinds a stats matcher uses (safe_regex: RE2, whole name)."""
    ((kind, value),) = pattern.items()
    if kind == "exact":
        return name == str(value)
    if kind == "prefix":
        return name.startswith(str(value))
    if kind == "suffix":
        return name.endswith(str(value))
    if kind == "safe_regex":
        return re.fullmatch(str(value["regex"]), name) is not None
    raise AssertionError(f"unexpected stats matcher {pattern}")


def envoy_kept(name: str) -> bool:
    return any(envoy_matches(p, name) for p in envoy_matcher_patterns())


def test_the_bootstrap_keeps_exactly_the_envoy_stats_listed_here() -> None:
    patterns = envoy_matcher_patterns()
    listed = {**ENVOY_STATS, **ENVOY_PICKER_STATS, **ENVOY_QUOTA_STATS}
    assert [n for n in listed if not envoy_kept(n)] == []
    # Each pattern is there for a stat listed above, and the rest of Envoy's are dropped.
    for p in patterns:
        assert any(envoy_matches(p, n) for n in listed), f"{p} keeps no stat listed here"
    assert [n for n in ENVOY_DROPPED if envoy_kept(n)] == []
    # Whatever the cluster is called: generated names, the holding cluster, xds_cluster.
    for cluster in (stat_name("qwen-2.5-72b@v2"), "controlplane-hold", "xds_cluster", "envoy_admin"):
        assert envoy_kept(f"cluster.{cluster}.upstream_rq_2xx")
        assert envoy_kept(f"cluster.{cluster}.upstream_rq_time")
    # The ConfigMap's bootstrap (tests/unit/test_deploy_manifests.py checks the rest of it).
    (cm,) = [
        d
        for d in yaml.safe_load_all((K8S / "envoy-bootstrap-configmap.yaml").read_text())
        if d and d.get("kind") == "ConfigMap"
    ]
    boot = yaml.safe_load(cm["data"]["bootstrap.yaml"])
    assert boot["stats_config"]["stats_matcher"]["inclusion_list"]["patterns"] == patterns


def test_the_matcher_knows_the_stat_names_our_resources_give_envoy() -> None:
    """Clusters' stat names, the model listener's prefix and its route configuration are the
    translation's: a rename there would make the matcher drop the dashboard's stats."""
    desired = translate(parse_fleet(BASIC), overlay=RoutingOverlay(hold_address="127.0.0.1:18002"))
    clusters = desired.by_type[CLUSTER].values()
    assert len(clusters) == 3
    for c in clusters:
        stat = c.alt_stat_name or c.name
        assert envoy_kept(f"cluster.{stat}.upstream_rq_5xx"), stat
        assert envoy_kept(f"cluster.{stat}.outlier_detection.ejections_active"), stat
    (listener,) = [desired.by_type[LISTENER][n] for n in desired.wildcard[LISTENER]]
    hcm = hcm_pb2.HttpConnectionManager()
    assert listener.filter_chains[0].filters[0].typed_config.Unpack(hcm)
    assert envoy_kept(f"http.{hcm.stat_prefix}.downstream_rq_5xx")
    assert envoy_kept(f"http.{hcm.stat_prefix}.rds.{hcm.rds.route_config_name}.update_rejected")


def test_the_scrape_keeps_what_envoy_keeps_less_the_admin_only_stats() -> None:
    assert set(ENVOY_STATS.values()) >= ENVOY_ADMIN_ONLY
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "envoy"]
    (keep,) = [r for r in job["metric_relabel_configs"] if r.get("action") == "keep"]
    names = keep["regex"].strip().split("|")
    assert len(names) == len(set(names))
    assert set(names) == envoy_scraped_names()
    # podmonitors.yaml keeps the same (test_the_alerts_select_the_jobs_the_scrape_config_defines).


# Envoy's tags that become labels: named in the rules, but not metrics.
ENVOY_LABELS = {"envoy_cluster_name", "envoy_response_code_class", "envoy_http_conn_manager_prefix"}


def rule_expressions() -> list[str]:
    """Every expression of alerts.yml and slo-rules.yml."""
    return [
        r["expr"]
        for name in ("alerts.yml", "slo-rules.yml")
        for g in yaml.safe_load((PROM / name).read_text())["groups"]
        for r in g["rules"]
    ]


def test_every_envoy_stat_the_rules_read_is_kept_by_the_bootstrap_and_the_scrape() -> None:
    # A stat the matcher or the keep-list drops has no series: an alert on it never fires.
    used = {n for e in rule_expressions() for n in re.findall(r"(?<![\w:])envoy_\w+", e)} - ENVOY_LABELS
    # The gateways' own errors read the model listener's downstream responses.
    assert {"envoy_http_downstream_rq_xx", "envoy_cluster_upstream_rq_xx", "envoy_server_live"} <= used
    assert sorted(used - envoy_scraped_names()) == []
    assert envoy_kept("http.inference.downstream_rq_5xx") and envoy_kept("server.live")


def test_the_gateway_objective_falls_back_to_the_fleet_files_default() -> None:
    import importlib.util

    from controlplane.fleet.model import Slo

    spec = importlib.util.spec_from_file_location("slo_rules", PROM / "slo_rules.py")
    assert spec is not None and spec.loader is not None
    slo_rules = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(slo_rules)
    assert Slo().availability == slo_rules.DEFAULT_AVAILABILITY


def test_both_scrapes_ask_envoy_for_the_stats_in_use_only() -> None:
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "envoy"]
    assert (job["metrics_path"], job["params"]) == ("/stats/prometheus", {"usedonly": [""]})
    monitors = [d for d in yaml.safe_load_all((PROM / "podmonitors.yaml").read_text()) if d]
    (envoy,) = [m for m in monitors if m["metadata"]["name"] == "inference-envoy"]
    (endpoint,) = envoy["spec"]["podMetricsEndpoints"]
    assert (endpoint["path"], endpoint["params"]) == ("/stats/prometheus", {"usedonly": [""]})


# ---- the alerts: every one tested, documented, and paging only on symptoms ---------------

RUNBOOK_BASE = "https://github.com/inference-controlplane/inference-controlplane/blob/main/docs/alerts.md"
# Symptoms users feel page; causes (the control plane, signals, rollouts) are tickets.
PAGES = {
    "ModelAvailabilityBudgetBurn",
    "ModelLatencyBudgetBurn",
    "GatewayAvailabilityBudgetBurn",
    "ModelVersionNoReadyEndpoints",
}


def promtool_cases() -> list[dict[str, Any]]:
    tests = yaml.safe_load((PROM / "alerts_test.yml").read_text())["tests"]
    return [case for test in tests for case in test.get("alert_rule_test", [])]


def test_every_alert_has_a_promtool_case_that_fires_it_and_one_that_does_not() -> None:
    names = {r["alert"] for r in alert_rules()}
    cases = promtool_cases()
    fired = {c["alertname"] for c in cases if c.get("exp_alerts")}
    quiet = {c["alertname"] for c in cases if not c.get("exp_alerts")}
    assert sorted(names - fired) == [], "alerts no case of alerts_test.yml expects to fire"
    assert sorted(names - quiet) == [], "alerts no case of alerts_test.yml expects to stay quiet"
    assert {c["alertname"] for c in cases} <= names
    # Both rule files, the recording groups evaluated before the alerts that read them.
    tested = yaml.safe_load((PROM / "alerts_test.yml").read_text())
    assert tested["rule_files"] == ["alerts.yml", "slo-rules.yml"]
    recording = [g["name"] for g in yaml.safe_load((PROM / "slo-rules.yml").read_text())["groups"]]
    alerting = [g["name"] for g in yaml.safe_load((PROM / "alerts.yml").read_text())["groups"]]
    assert tested["group_eval_order"] == recording + alerting


def test_every_runbook_url_is_a_section_of_docs_alerts_md() -> None:
    # docs/alerts.md is what the absolute URLs point at, on the project's main branch.
    anchors = heading_anchors((ROOT / "docs" / "alerts.md").read_text())
    for r in alert_rules():
        url = r["annotations"]["runbook_url"]
        base, _, anchor = url.partition("#")
        assert base == RUNBOOK_BASE, url
        # Each alert its own section, named after it.
        assert anchor == r["alert"].lower(), url
        assert anchor in anchors, f"{url}: no heading of docs/alerts.md has that anchor"


def test_the_slo_recording_rules_are_generated_from_slo_rules_py() -> None:
    import sys

    out = subprocess.run(
        [sys.executable, str(PROM / "slo_rules.py"), "--check"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr


def test_only_what_users_feel_pages() -> None:
    severities = {r["alert"]: r["labels"]["severity"] for r in alert_rules()}
    assert set(severities.values()) <= {"critical", "warning", "info"}
    assert {a for a, s in severities.items() if s == "critical"} == PAGES
