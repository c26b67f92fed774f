"""A worker's main process imports heavy provider modules before its pool forks, so no pool
process pays for the import on its first task (the kubernetes client: ~3.5 s of CPU, tens
of seconds on a loaded host, again for every child replacing a dead one; the chaos proof
found acquires stalled behind those imports)."""

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

from tests.services import RedisServer
from tests.stack import REPO
from workers.app import app

pytestmark = pytest.mark.timeout(120)


@contextmanager
def probe_worker(redis_server: RedisServer, providers: str, logfile: Path
                 ) -> Iterator[str]:
    """A real prefork worker of tests/e2e/preload_probe.py on a queue of its own."""
    queue = f"preload-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEKEEPER_")}
    env.update({"LEASEKEEPER_BROKER_URL": redis_server.url, "LEASEKEEPER_PROVIDERS": providers,
                "LEASEKEEPER_PROVIDER": "local", "LEASEKEEPER_TASK_QUEUE": queue,
                "LEASEKEEPER_VAR_DIR": str(logfile.parent), "PYTHONPATH": str(REPO)})
    # its store migrated first, as the README says (a worker refuses a store never migrated)
    subprocess.run([sys.executable, "-m", "workers.cli", "db", "upgrade"], cwd=REPO, env=env,
                   check=True, capture_output=True)
    with open(logfile, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.e2e.preload_probe", "worker",
             "-P", "prefork", "-c", "1", "-n", f"{queue}@test", "--without-gossip",
             "--without-mingle", "-l", "info"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield queue
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def loaded_in_pool_process(queue: str) -> list[str]:
    result = app.send_task("probe.provider_modules_loaded", queue=queue)
    loaded: list[str] = result.get(timeout=60)
    return loaded


def test_pool_processes_inherit_the_enabled_providers_modules(
        redis_server: RedisServer, tmp_path: Path) -> None:
    # given a worker with the kubernetes provider enabled
    with probe_worker(redis_server, "local,kubernetes", tmp_path / "worker.log") as queue:
        # when its pool process runs its first task
        loaded = loaded_in_pool_process(queue)
    # then the kubernetes provider was already imported: by the main process, before forking
    assert loaded == ["providers.kubernetes.provider"]


def test_providers_not_enabled_are_not_imported(
        redis_server: RedisServer, tmp_path: Path) -> None:
    with probe_worker(redis_server, "local", tmp_path / "worker.log") as queue:
        assert loaded_in_pool_process(queue) == []
