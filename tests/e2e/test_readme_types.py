"""The README's Python examples type-check as a user's own code would: copied verbatim into
a directory outside the repository and checked with `mypy --strict` against leasekeeper as
pip installs it (a wheel built from a copy of this source; no MYPYPATH or PYTHONPATH to the
source). Before (a QA pass): no package shipped `py.typed`, so mypy called `tasks` and
`providers` "installed, but missing library stubs or py.typed marker"; `from
tasks.producer import InvalidRequest` said the module "does not explicitly export" it; and
the handler example's bare `dict` was "Missing type arguments for generic type"."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.e2e.test_readme_examples import readme_blocks
from tests.stack import REPO

pytestmark = pytest.mark.timeout(900)

# What a user of the producer imports from it, beyond the README's blocks: the errors its
# functions raise and the status it returns, each by name from `tasks.producer`.
PRODUCER_NAMES = """
from tasks.producer import (BrokerUnavailable, ConfigError, InvalidRequest,
                            LeasekeeperError, TaskState, TaskStatus, task_status)

def state_of(task_id: str) -> TaskState | None:
    try:
        status: TaskStatus = task_status(task_id)
    except (InvalidRequest, BrokerUnavailable, ConfigError):
        return None
    except LeasekeeperError:
        raise
    return status.state
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Python whose site-packages holds leasekeeper installed from a wheel (not the
    editable install, whose import hook mypy cannot follow) and, by a .pth line, this test
    run's dependencies (celery, pydantic, ...)."""
    tmp = tmp_path_factory.mktemp("installed")
    source = tmp / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".var", "build", "*.egg-info", "__pycache__", ".mypy_cache",
        ".ruff_cache", "tests", "bench", "deploy", "docs"))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(tmp),
         str(source)], capture_output=True, text=True, check=False, timeout=840)
    assert built.returncode == 0, (built.stdout + built.stderr)[-3000:]
    wheel = next(tmp.glob("leasekeeper-*.whl"))
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, timeout=60).stdout.strip())
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--target", str(site), str(wheel)], check=True, timeout=300)
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def mypy_strict(python: Path, code: str, where: Path) -> subprocess.CompletedProcess[str]:
    example = where / "example.py"
    example.write_text(code)
    env = {k: v for k, v in os.environ.items()
           if k not in {"PYTHONPATH", "MYPYPATH"} and not k.startswith("LEASEKEEPER_")}
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental",
         "--python-executable", str(python), str(example)],
        cwd=where, env=env, capture_output=True, text=True, check=False, timeout=600)


def test_the_installed_package_is_not_the_source(installed: Path, tmp_path: Path) -> None:
    found = subprocess.run(
        [str(installed), "-c", "import tasks.producer; print(tasks.producer.__file__)"],
        cwd=tmp_path, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        capture_output=True, text=True, check=True, timeout=120).stdout
    assert str(installed.parent.parent) in found, found


@pytest.mark.parametrize(("line", "code"), readme_blocks(),
                         ids=[f"README.md:{line}" for line, _ in readme_blocks()])
def test_a_readme_example_passes_mypy_strict(installed: Path, tmp_path: Path, line: int,
                                             code: str) -> None:
    done = mypy_strict(installed, code, tmp_path)
    assert done.returncode == 0, f"README.md line {line}:\n{code}\n{done.stdout}{done.stderr}"


def test_the_producer_exports_its_errors_and_status(installed: Path, tmp_path: Path) -> None:
    done = mypy_strict(installed, PRODUCER_NAMES, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
