"""The README's by-hand production path: `celery -A workers.app worker|beat` started from
any directory, with or without LEASEKEEPER_BROKER_URL. No broker is listening here: what
is checked happens at start-up, before either process reaches Redis."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.e2e.conftest import eventually
from tests.services import free_port
from tests.stack import REPO
from workers.settings import Settings

pytestmark = pytest.mark.timeout(180)


def plain_env(tmp_path: Path, **settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEKEEPER_")}
    return {**env, "PYTHONPATH": str(REPO), "LEASEKEEPER_VAR_DIR": str(tmp_path / "var"),
            **{f"LEASEKEEPER_{k.upper()}": v for k, v in settings.items()}}


@contextmanager
def celery(args: list[str], env: dict[str, str], cwd: Path, log: Path) -> Iterator[None]:
    cwd.mkdir(parents=True, exist_ok=True)
    # the store migrated first, as the README's by-hand steps do (a worker or beat refuses
    # a store never migrated)
    subprocess.run([sys.executable, "-m", "workers.cli", "db", "upgrade"], cwd=cwd, env=env,
                   check=True, capture_output=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", "workers.app", *args],
                                cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        yield
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.mark.parametrize("configured", [False, True], ids=["default", "from-env"])
def test_the_worker_says_which_broker_it_uses_and_where_that_came_from(
    tmp_path: Path, configured: bool,
) -> None:
    password = f"pw-{uuid.uuid4().hex}"
    port = free_port()  # nothing listens there
    settings = {"broker_url": f"redis://:{password}@127.0.0.1:{port}/0"} if configured else {}
    log = tmp_path / "worker.log"
    # The default log level (WARNING), as someone starting it by hand would.
    with celery(["worker", "-c", "1", "--without-gossip", "--without-mingle"],
                plain_env(tmp_path, **settings), tmp_path / "cwd", log):
        expected = (f"broker redis://:**@127.0.0.1:{port}/0 (from LEASEKEEPER_BROKER_URL)"
                    if configured else "broker redis://127.0.0.1:6379/0 (from the default, "
                    "LEASEKEEPER_BROKER_URL is not set)")
        eventually(lambda: expected in log.read_text(errors="replace"), 60,
                   f"the worker's start-up line: {expected}")
    assert password not in log.read_text(errors="replace")


def test_beat_keeps_its_schedule_in_the_var_dir_not_the_working_directory(
    tmp_path: Path,
) -> None:
    env = plain_env(tmp_path, broker_url=f"redis://127.0.0.1:{free_port()}/0")
    cwd = tmp_path / "elsewhere"
    with celery(["beat", "-l", "info"], env, cwd, tmp_path / "beat.log"):
        eventually(lambda: list((tmp_path / "var").glob("celerybeat-schedule*")), 60,
                   "beat's schedule file in LEASEKEEPER_VAR_DIR")
    assert not list(cwd.glob("celerybeat-schedule*"))


def test_a_relative_local_root_is_under_the_var_dir(tmp_path: Path) -> None:
    settings = Settings(var_dir=tmp_path / "var", local_root_dir=Path("boxes"))
    assert settings.effective_local_root == (tmp_path / "var" / "boxes").resolve()
    absolute = Settings(var_dir=tmp_path / "var", local_root_dir=tmp_path / "abs")
    assert absolute.effective_local_root == (tmp_path / "abs").resolve()
    assert Settings(var_dir=tmp_path).effective_local_root == (tmp_path / "sandboxes").resolve()
