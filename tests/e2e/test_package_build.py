"""The package builds as `make run` and `make test` build it (pip, an isolated build with
the newest setuptools the requirement allows) without a deprecation warning: a new user's
first command printed 50 lines of setuptools' BuildBackendWarning ("`project.license` as a
TOML table is deprecated ... By 2027-Feb-18 ... your builds will no longer be supported"),
then, once that was fixed, setuptools' boxed "Editable installation" note on every
`pip install -e`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(600)


def test_the_package_builds_without_a_deprecation_warning(tmp_path: Path) -> None:
    # from a copy: a build leaves build/ and *.egg-info where it ran
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".var", "build", "*.egg-info", "__pycache__", ".mypy_cache",
        ".ruff_cache"))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(tmp_path),
         str(source)], capture_output=True, text=True, check=False, timeout=540)
    said = built.stdout + built.stderr
    assert built.returncode == 0, said[-3000:]
    for warning in ("deprecated", "Deprecat", "will no longer be supported"):
        assert warning not in said, said[-3000:]
    wheel = next(tmp_path.glob("leasekeeper-*.whl"))
    with zipfile.ZipFile(wheel) as whl:
        metadata = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        assert "License-Expression: Apache-2.0" in whl.read(metadata).decode()


def test_the_editable_install_make_runs_prints_no_build_note(tmp_path: Path) -> None:
    # given the commands `make run` sets up its virtualenv with, as make would run them
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".var", "build", "*.egg-info", "__pycache__", ".mypy_cache",
        ".ruff_cache"))
    venv = tmp_path / "venv"
    # as a user's shell runs it: not as a sub-make of `make test` (whose MAKEFLAGS and
    # MAKELEVEL would add "make[1]: Entering directory" lines to the plan)
    env = {k: v for k, v in os.environ.items()
           if k not in {"MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES"}}
    planned = subprocess.run(
        ["make", "--no-print-directory", "--dry-run", "--always-make", f"VENV={venv}",
         f"{venv}/.installed"],
        cwd=source, env=env, capture_output=True, text=True, check=True, timeout=60).stdout
    assert "pip install --quiet --upgrade pip" in planned and " -e '.[test]'" in planned
    # when they run (the package alone: its dependencies are this test run's own)
    done = subprocess.run(planned.replace(" -e '.[test]'", " -e . --no-deps"), shell=True,
                          cwd=source, env=env, capture_output=True, text=True, check=False,
                          timeout=540)
    said = done.stdout + done.stderr
    # then they install it, and say nothing of its build
    assert done.returncode == 0, said[-3000:]
    for noise in ("Editable installation", "BuildBackendWarning", "!!"):
        assert noise not in said, said[-3000:]
