"""A web project with its OWN Celery app and worker, whose code imports leasekeeper's producer
(a QA pass acting as that developer), against a real Redis and the user's real
``celery -A myweb.celery worker``:

- the user's worker lists and runs only the user's tasks: leasekeeper's tasks are bound to
  leasekeeper's app alone (``shared=False``); before, ``@app.task``'s default
  ``shared=True`` added ``lease.acquire``, ``lease.destroy``, ... to every app in the process.
- leasekeeper's signal handlers act for leasekeeper's worker and beat only: the user's worker
  starts with no leasekeeper store at all, its CELERY_BROKER_URL (the user's broker, not
  leasekeeper's) is not refused, its log lines keep Celery's format on its stderr (not
  LEASEKEEPER_LOG_FORMAT / LEASEKEEPER_LOG_FILE) and nothing says "leasekeeper worker".
  Before, it exited 2 ("leasekeeper worker not started: the store's folder ... does not
  exist") or logged "leasekeeper worker: broker ...", a worker it is not.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from celery import Celery

from tests.e2e.test_celery_env import other_db
from tests.stack import REPO, WorkerStack

pytestmark = pytest.mark.timeout(300)

USER_APP = '''
import os

from celery import Celery

# Its broker and backend: MYWEB_BROKER, else CELERY_BROKER_URL / CELERY_RESULT_BACKEND.
app = Celery("myweb", broker=os.environ.get("MYWEB_BROKER"),
             backend=os.environ.get("MYWEB_BROKER"))
app.conf.task_default_queue = "myweb"


@app.task(name="myweb.add")
def add(x, y):
    return x + y


from tasks import producer  # noqa: E402,F401  (the web code starts leases too)
'''


def user_project(root: Path) -> Path:
    (root / "myweb").mkdir(parents=True)
    (root / "myweb" / "__init__.py").write_text("")
    (root / "myweb" / "celery.py").write_text(USER_APP)
    return root


def run_user_worker(env: dict[str, str], cwd: Path, broker: str, log: Path) -> str:
    """Start the user's worker, have it run one of its tasks, stop it (SIGTERM, a warm
    shutdown); its whole output, after checking it started and stopped cleanly."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "myweb.celery", "worker", "-P", "prefork",
             "-c", "1", "-n", "myweb@test", "--without-gossip", "--without-mingle",
             "-l", "info"], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        client = Celery("client", broker=broker, backend=broker, set_as_current=False)
        sent = client.send_task("myweb.add", (2, 3), queue="myweb")
        while proc.poll() is None and not sent.ready():
            with contextlib.suppress(Exception):  # not done yet
                sent.get(timeout=1)
        assert proc.poll() is None, f"exited {proc.returncode}: {log.read_text()[-3000:]}"
        assert sent.get(timeout=5) == 5
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(120) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return log.read_text()


def registered(output: str) -> list[str]:
    """The task names under the banner's ``[tasks]``."""
    listing = output.split("[tasks]", 1)[1]
    return re.findall(r"^  \. (\S+)", listing, flags=re.MULTILINE)


def check_only_the_users_worker(output: str) -> None:
    assert registered(output) == ["myweb.add"], output[-3000:]
    assert "leasekeeper" not in output.lower(), output[-3000:]
    assert re.search(r"^\[[^\]]+: INFO/MainProcess\] myweb@test ready\.$", output,
                     flags=re.MULTILINE), output[-3000:]  # Celery's own log format
    assert not [line for line in output.splitlines() if line.startswith("{")], output[-3000:]


def test_a_users_worker_with_no_store_starts_and_lists_only_its_tasks(
        stack: WorkerStack, tmp_path: Path) -> None:
    theirs = other_db(stack, 6)
    redis.Redis.from_url(theirs).flushdb()
    root = user_project(tmp_path / "web")  # no .var: leasekeeper has no store here
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LEASEKEEPER_", "CELERY_"))}
    env.update(PYTHONPATH=f"{root}{os.pathsep}{REPO}", LEASEKEEPER_BROKER_URL=stack.broker_url,
               MYWEB_BROKER=theirs)
    output = run_user_worker(env, root, theirs, tmp_path / "worker.out")
    check_only_the_users_worker(output)
    assert not (root / ".var").exists()


def test_a_users_worker_beside_a_configured_store_keeps_its_own_logs(
        stack: WorkerStack, tmp_path: Path) -> None:
    theirs = other_db(stack, 6)
    redis.Redis.from_url(theirs).flushdb()
    root = user_project(tmp_path / "web")
    ours_log = tmp_path / "leasekeeper.log"
    env = {k: v for k, v in stack.env.items() if not k.startswith("CELERY_")}
    env.update(PYTHONPATH=f"{root}{os.pathsep}{REPO}", CELERY_BROKER_URL=theirs,
               CELERY_RESULT_BACKEND=theirs, LEASEKEEPER_LOG_FORMAT="json",
               LEASEKEEPER_LOG_FILE=str(ours_log))
    output = run_user_worker(env, root, theirs, tmp_path / "worker.out")
    check_only_the_users_worker(output)
    assert not ours_log.exists()
