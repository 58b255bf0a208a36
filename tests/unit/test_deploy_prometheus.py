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
    out = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60, cwd=cwd)
    assert out.returncode == 0, f"promtool {' '.join(args)}:\n{out.stdout}\n{out.stderr}"
    return out.stdout + out.stderr


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((PROM / "alerts.yml").read_text())["groups"]
    return [r for g in groups for r in g["rules"] if "alert" in r]


# ---- promtool ----------------------------------------------------------------------------


def test_promtool_accepts_the_scrape_config_and_its_rule_file(promtool: str) -> None:
    out = run(promtool, "check", "config", str(PROM / "prometheus.yml"))
    assert "SUCCESS" in out and "1 rule files found" in out


def test_promtool_accepts_the_alert_rules(promtool: str) -> None:
    out = run(promtool, "check", "rules", str(PROM / "alerts.yml"))
    assert f"SUCCESS: {len(alert_rules())} rules found" in out


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
    assert {"RolloutAborted", "ControlPlaneXdsNacks", "ControlPlaneProxiesNacked"} <= fired
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


def test_every_alert_has_a_severity_a_summary_a_description_and_a_runbook_in_the_docs() -> None:
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    deploy_doc = (ROOT / "docs" / "deploy.md").read_text()
    for r in rules:
        assert r["labels"]["severity"] in {"critical", "warning", "info"}, r["alert"]
        notes = r["annotations"]
        assert notes["summary"].strip() and len(notes["description"]) > 60, r["alert"]
        doc, _, anchor = notes["runbook_url"].partition("#")
        assert doc.startswith("docs/") and anchor, r["alert"]
        assert anchor in heading_anchors((ROOT / doc).read_text()), notes["runbook_url"]
        # docs/deploy.md says what each alert means and what to do.
        assert f"`{r['alert']}`" in deploy_doc, f"{r['alert']} is not explained in docs/deploy.md"


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
