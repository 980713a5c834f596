"""deploy/kubernetes: rendered the way Kustomize does for the features it uses, validated against the
Kubernetes schemas (kubernetes-validate, offline), and compared with the code they must agree with:
the settings' environment variables and ports, the probe paths, the shutdown timings; secrets only as
files from Secrets the operator creates, payload encryption enforced, no service account token, and
egress only to named destinations."""

from __future__ import annotations

import base64
import ipaddress
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from core import health
from core.codec import new_key
from core.config import FILE_SUFFIX, PROJECT_ROOT, Settings, variables
from devstack.embedded import free_port

ROOT = Path(__file__).resolve().parent.parent
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.33.0"
CLUSTER_SCOPED = {"Namespace"}
SECRETS_DIR = "/run/secrets/deadline-cleanup"
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
    for package in ("core", "budget", "cleanup", "ledger", "outbox", "activities", "workflows", "deadline_cleanup"):
        sources += (ROOT / package).glob("*.py")
    tree = {v.name for v in variables()} | {v.name + FILE_SUFFIX for v in variables() if v.secret}
    return tree | {name for path in sources for name in ENV_READ.findall(path.read_text())}


def test_every_manifest_validates_against_the_kubernetes_schemas(docs: list[dict[str, Any]]) -> None:
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "PodDisruptionBudget", "Job", "ConfigMap", "NetworkPolicy"} <= kinds
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


def documented_secrets() -> dict[str, set[str]]:
    """The Secrets kustomization.yaml's header tells the operator to create: name -> its keys."""
    text = (KUSTOMIZE / "kustomization.yaml").read_text()
    commands = re.split(r"create secret generic ", text)[1:]
    return {c.split()[0]: set(re.findall(r"--from-file=([\w.-]+)=", c)) for c in commands}


def mounted_files(doc: dict[str, Any], container: dict[str, Any]) -> set[str]:
    """The paths of the secret files `container` sees (each key of each mounted Secret)."""
    secrets = documented_secrets()
    volumes = {v["name"]: v["secret"]["secretName"] for v in pod_spec(doc).get("volumes", []) if "secret" in v}
    return {
        f"{m['mountPath']}/{key}"
        for m in container.get("volumeMounts", [])
        if m["name"] in volumes
        for key in secrets[volumes[m["name"]]]
    }


def containers(docs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(doc, c) for doc in docs for c in pod_spec(doc).get("containers", [])]


def process_env(docs: list[dict[str, Any]], container: dict[str, Any], secrets_dir: Path) -> dict[str, str]:
    """What `container`'s process sees: the ConfigMap and its own variables, its secret files under
    `secrets_dir` instead of SECRETS_DIR."""
    env = dict(one(docs, "ConfigMap")["data"])
    env |= {e["name"]: e["value"].replace(SECRETS_DIR, str(secrets_dir)) for e in container["env"]}
    return env


def test_settings_come_from_variables_the_code_reads(
    docs: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = one(docs, "ConfigMap")["data"]
    read = env_names_the_code_reads()
    assert {"DATABASE_URL", "METRICS_PORT", "HEALTH_PORT", "MAIL_PROVIDER_URL"} <= read, "the scan finds them"
    for doc, container in containers(docs):
        names = set(config) | {e["name"] for e in container.get("env", [])}
        assert names <= read, f"{doc['metadata']['name']}: no code reads {names - read}"
        refs = [r["configMapRef"]["name"] for r in container.get("envFrom", []) if "configMapRef" in r]
        assert refs == [one(docs, "ConfigMap")["metadata"]["name"]]
    worker = one(docs, "Deployment")
    files = {"database-url": "postgresql://cleanup_worker_app:pw@db:5432/x", "mail-provider-token": "tok-123"}
    files["payload-encryption-key"] = key = new_key()
    for name, value in files.items():
        (tmp_path / name).write_text(value + "\n")
    for name, value in process_env(docs, pod_spec(worker)["containers"][0], tmp_path).items():
        monkeypatch.setenv(name, value)
    settings = Settings.from_env()
    assert settings.database_url == files["database-url"] and settings.payload_encryption_key
    assert settings.payload_encryption_key.get_secret_value() == key
    assert settings.outbox.provider_token and settings.outbox.provider_token.get_secret_value() == "tok-123"
    assert settings.metrics_port == int(config["METRICS_PORT"]) and settings.health_port == int(config["HEALTH_PORT"])
    assert settings.worker_graceful_shutdown_seconds == float(config["WORKER_GRACEFUL_SHUTDOWN_SECONDS"])


def test_secrets_are_files_from_secrets_the_operator_creates(docs: list[dict[str, Any]]) -> None:
    """No Secret (and no placeholder) is shipped; no variable holds a secret: each pod mounts a Secret
    the kustomization's header documents, and every `*_FILE` variable names one of its files."""
    assert not [d for d in docs if d["kind"] == "Secret"]
    assert "CHANGE-ME" not in yaml.safe_dump_all(docs)
    secret_names = {v.name for v in variables() if v.secret}
    assert not secret_names & set(one(docs, "ConfigMap")["data"]), "a secret in the ConfigMap"
    documented = documented_secrets()
    assert set(documented) == {"deadline-cleanup-worker", "deadline-cleanup-migrate"}
    deployment_doc = (ROOT / "docs" / "deployment.md").read_text()
    for name, keys in documented.items():
        assert f"create secret generic {name}" in deployment_doc
        assert all(f"--from-file={key}=" in deployment_doc for key in keys)
    for doc, container in containers(docs):
        assert not [r for r in container.get("envFrom", []) if "secretRef" in r]
        env = {e["name"]: e for e in container["env"]}
        assert all(set(e) == {"name", "value"} for e in env.values()), "values only, never from a Secret"
        assert not secret_names & set(env), f"{doc['metadata']['name']}: a secret in the environment"
        paths = {e["value"] for name, e in env.items() if name.endswith(FILE_SUFFIX)}
        assert paths == mounted_files(doc, container), "each secret file is read, each read file is mounted"
    worker_env = {e["name"] for e in pod_spec(one(docs, "Deployment"))["containers"][0]["env"]}
    assert "PAYLOAD_ENCRYPTION_KEY_FILE" in worker_env, "payload encryption is configured"


@pytest.mark.parametrize(
    "key", [None, "", "CHANGE-ME", base64.b64encode(bytes(32)).decode(), base64.b64encode(b"short").decode()]
)
def test_a_worker_with_the_manifests_settings_refuses_a_missing_or_placeholder_key(
    docs: list[dict[str, Any]], tmp_path: Path, key: str | None
) -> None:
    """Exit 2 before connecting to anything, naming the variable and never the value."""
    run = run_worker_as_deployed(docs, tmp_path, key)
    assert run.returncode == 2, run.stderr
    assert "PAYLOAD_ENCRYPTION_KEY" in run.stderr
    assert not key or key not in run.stderr


def test_a_worker_with_the_manifests_settings_and_a_real_key_goes_on_to_connect(
    docs: list[dict[str, Any]], tmp_path: Path
) -> None:
    run = run_worker_as_deployed(docs, tmp_path, new_key())
    assert run.returncode != 2 and "PAYLOAD_ENCRYPTION_KEY" not in run.stderr, run.stderr
    assert "Connect call failed" in run.stderr, "it got as far as the (refused) database"


def run_worker_as_deployed(
    docs: list[dict[str, Any]], tmp_path: Path, key: str | None
) -> subprocess.CompletedProcess[str]:
    """worker.py with the Deployment's environment, its secret files in `tmp_path` (the key's absent
    when None), Temporal and the database on refused ports, the probes and metrics off."""
    refused = free_port()
    (tmp_path / "database-url").write_text(f"postgresql://app:pw@127.0.0.1:{refused}/x")
    (tmp_path / "mail-provider-token").write_text("tok-123")
    if key is not None:
        (tmp_path / "payload-encryption-key").write_text(key)
    ours = {v.name for v in variables()} | {v.name + FILE_SUFFIX for v in variables()}
    env = {k: v for k, v in os.environ.items() if k not in ours}
    env |= process_env(docs, pod_spec(one(docs, "Deployment"))["containers"][0], tmp_path)
    env |= {"TEMPORAL_ADDRESS": f"127.0.0.1:{refused}", "HEALTH_PORT": "", "METRICS_PORT": ""}
    env |= {"CLEANUP_STATE_DIR": str(tmp_path / "state")}
    return subprocess.run(
        [sys.executable, str(PROJECT_ROOT / "worker.py")], env=env, capture_output=True, text=True, timeout=60
    )


def test_no_pod_mounts_a_service_account_token(docs: list[dict[str, Any]]) -> None:
    pods = [doc for doc in docs if pod_spec(doc).get("containers")]
    assert {d["kind"] for d in pods} == {"Deployment", "Job"}
    for doc in pods:
        assert pod_spec(doc)["automountServiceAccountToken"] is False, doc["metadata"]["name"]


def narrow(peer: dict[str, Any]) -> bool:
    """A peer that names its destination: an address block short of the internet, or pods by label
    in a namespace by label."""
    if "ipBlock" in peer:
        return ipaddress.ip_network(peer["ipBlock"]["cidr"]).prefixlen >= 8
    namespace, pods = peer.get("namespaceSelector", {}), peer.get("podSelector", {})
    return bool(namespace.get("matchLabels")) and bool(pods.get("matchLabels"))


def test_egress_goes_only_to_named_destinations_and_dns(docs: list[dict[str, Any]]) -> None:
    for policy in (d for d in docs if d["kind"] == "NetworkPolicy"):
        assert "Egress" in policy["spec"]["policyTypes"]
        rules = policy["spec"]["egress"]
        for rule in rules:
            assert rule.get("to") and all(narrow(peer) for peer in rule["to"]), rule
            assert rule.get("ports"), rule
        dns = [r for r in rules if {(p["port"], p["protocol"]) for p in r["ports"]} == {(53, "UDP"), (53, "TCP")}]
        assert dns and dns[0]["to"][0]["podSelector"]["matchLabels"] == {"k8s-app": "kube-dns"}
    temporal_host, _, temporal_port = one(docs, "ConfigMap")["data"]["TEMPORAL_ADDRESS"].rpartition(":")
    worker = one(docs, "NetworkPolicy", "deadline-cleanup-worker")["spec"]["egress"]
    (to_temporal,) = [r for r in worker if r["ports"] == [{"port": int(temporal_port), "protocol": "TCP"}]]
    namespace = to_temporal["to"][0]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
    assert temporal_host.split(".")[1] == namespace, "the policy's namespace is TEMPORAL_ADDRESS's"
    migrate = one(docs, "NetworkPolicy", "deadline-cleanup-migrate")["spec"]["egress"]
    assert {p["port"] for r in migrate for p in r["ports"]} == {5432, 53}, "the migration needs no Temporal"


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
