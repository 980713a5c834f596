"""deploy/kubernetes: rendered the way Kustomize does for the features it uses, validated against the
Kubernetes schemas (kubernetes-validate, offline), and compared with the code they must agree with:
the settings' environment variables and ports, the probe paths, the shutdown timings."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from core import health
from core.config import FILE_SUFFIX, Settings, variables

ROOT = Path(__file__).resolve().parent.parent
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.33.0"
CLUSTER_SCOPED = {"Namespace"}
ENV_READ = re.compile(
    r"""(?:environ\.get\(|environ\[|env\.get\(|env\[|getenv\(|_from_env\()\s*["']([A-Z][A-Z0-9_]+)["']"""
)


def render() -> list[dict[str, Any]]:
    """The documents `kustomize build` would print: the resources with the namespace, the labels and
    the image tag applied (the only transformations kustomization.yaml uses; checked below)."""
    kustomization = yaml.safe_load((KUSTOMIZE / "kustomization.yaml").read_text())
    assert set(kustomization) <= {"apiVersion", "kind", "namespace", "labels", "resources", "images"}
    labels: dict[str, str] = {}
    for entry in kustomization.get("labels", []):
        labels |= entry["pairs"]
    images = {i["name"]: f"{i['name']}:{i['newTag']}" for i in kustomization.get("images", [])}
    docs = []
    for resource in kustomization["resources"]:
        for doc in yaml.safe_load_all((KUSTOMIZE / resource).read_text()):
            meta = doc["metadata"]
            if doc["kind"] not in CLUSTER_SCOPED:
                meta["namespace"] = kustomization["namespace"]
            meta["labels"] = meta.get("labels", {}) | labels
            for container in pod_spec(doc).get("containers", []):
                container["image"] = images.get(container["image"], container["image"])
            docs.append(doc)
    return docs


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    spec = doc.get("spec", {})
    return dict(spec.get("template", {}).get("spec", {}))


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return render()


def env_names_the_code_reads() -> set[str]:
    """The settings tree's variables (and each secret's _FILE form), and any read directly."""
    sources = [ROOT / "worker.py", ROOT / "starter.py"]
    for package in ("core", "cleanup", "ledger", "outbox", "activities", "workflows"):
        sources += (ROOT / package).glob("*.py")
    tree = {v.name for v in variables()} | {v.name + FILE_SUFFIX for v in variables() if v.secret}
    return tree | {name for path in sources for name in ENV_READ.findall(path.read_text())}


def test_every_manifest_validates_against_the_kubernetes_schemas(docs: list[dict[str, Any]]) -> None:
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "PodDisruptionBudget", "Job", "ConfigMap", "Secret", "NetworkPolicy"} <= kinds
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {err.message} at {list(err.path)}")


def test_a_wrong_manifest_is_refused() -> None:
    """The validator is live: an unknown field (strict) and a wrong type are errors."""
    bad = render()
    deployment = one(bad, "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    deployment["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=False)


def test_settings_come_from_variables_the_code_reads(
    docs: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = one(docs, "ConfigMap")["data"]
    secret = one(docs, "Secret")["stringData"]
    read = env_names_the_code_reads()
    assert {"DATABASE_URL", "METRICS_PORT", "HEALTH_PORT", "MAIL_PROVIDER_URL"} <= read, "the scan finds them"
    for doc in docs:
        for container in pod_spec(doc).get("containers", []):
            names = set(config) | {e["name"] for e in container.get("env", [])}
            assert names <= read, f"{doc['metadata']['name']}: no code reads {names - read}"
            for e in container.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == one(docs, "Secret")["metadata"]["name"] and ref["key"] in secret
            refs = [r["configMapRef"]["name"] for r in container.get("envFrom", []) if "configMapRef" in r]
            assert refs == [one(docs, "ConfigMap")["metadata"]["name"]]
    for name, value in (config | {"DATABASE_URL": secret["DATABASE_URL"]}).items():
        monkeypatch.setenv(name, value)
    settings = Settings.from_env()
    assert settings.metrics_port == int(config["METRICS_PORT"]) and settings.health_port == int(config["HEALTH_PORT"])
    assert settings.worker_graceful_shutdown_seconds == float(config["WORKER_GRACEFUL_SHUTDOWN_SECONDS"])


def test_ports_probes_and_scrape_annotations_match_the_settings(docs: list[dict[str, Any]]) -> None:
    config = one(docs, "ConfigMap")["data"]
    deployment = one(docs, "Deployment")
    template = deployment["spec"]["template"]
    (container,) = template["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": int(config["METRICS_PORT"]), "health": int(config["HEALTH_PORT"])}
    assert template["metadata"]["annotations"]["prometheus.io/port"] == config["METRICS_PORT"]
    assert container["livenessProbe"]["httpGet"] == {"path": health.HEALTH_PATH, "port": "health"}
    assert container["startupProbe"]["httpGet"] == {"path": health.HEALTH_PATH, "port": "health"}
    assert container["readinessProbe"]["httpGet"] == {"path": health.READY_PATH, "port": "health"}
    assert container["readinessProbe"]["timeoutSeconds"] > health.CHECK_TIMEOUT_SECONDS * 2, "two checks in a row"
    dockerfile_cmd = re.search(r"^CMD (\[.*\])$", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert dockerfile_cmd and container["command"] == yaml.safe_load(dockerfile_cmd[1])
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert container["image"] == f"deadline-cleanup:{version}"
    assert template["spec"]["securityContext"]["runAsNonRoot"] is True
    assert re.search(r"USER cleanup", (ROOT / "Dockerfile").read_text())


def test_grace_period_covers_prestop_and_the_sigterm_hand_back(docs: list[dict[str, Any]]) -> None:
    config = one(docs, "ConfigMap")["data"]
    spec = one(docs, "Deployment")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    graceful = float(config["WORKER_GRACEFUL_SHUTDOWN_SECONDS"])
    needed = pre_stop + graceful + 5  # 5 s: closing pools and the client
    assert spec["terminationGracePeriodSeconds"] >= needed, (spec["terminationGracePeriodSeconds"], needed)


def test_pdb_and_network_policies_select_the_pods(docs: list[dict[str, Any]]) -> None:
    deployment = one(docs, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pdb["spec"]["maxUnavailable"] < deployment["spec"]["replicas"]
    job_labels = one(docs, "Job")["spec"]["template"]["metadata"]["labels"]
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "NetworkPolicy"}
    (container,) = pod_spec(deployment)["containers"]
    port_names = {p["name"] for p in container["ports"]}
    selected = []
    for policy in policies.values():
        selector = policy["spec"]["podSelector"]["matchLabels"]
        selected += [
            name for name, labels in (("worker", pod_labels), ("job", job_labels)) if selector.items() <= labels.items()
        ]
        for rule in policy["spec"].get("ingress", []):
            assert {p["port"] for p in rule["ports"]} <= port_names
    assert sorted(selected) == ["job", "worker"], "each pod kind has exactly one policy"
    migrate = one(docs, "Job")
    (job_container,) = pod_spec(migrate)["containers"]
    assert job_container["command"][:2] == [container["command"][0], "migrate"], "the same entry point as the worker"
