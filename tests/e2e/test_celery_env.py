"""A web process's own Celery set-up and leasekeeper's app, in one process (a QA pass acting
as a Django backend), against a real worker and Redis:

- CELERY_BROKER_URL / CELERY_BROKER_READ_URL / CELERY_BROKER_WRITE_URL /
  CELERY_RESULT_BACKEND are the user's own Celery app's: leasekeeper's producer, CLI and
  worker use LEASEKEEPER_BROKER_URL and leave those variables in os.environ. Before,
  Celery's Settings read them first: the producer published to the user's Redis database
  and the task stayed PENDING for ever. A worker or beat started with one that differs
  from leasekeeper's broker refuses to start, in one line naming both (`celery --broker`
  sets CELERY_BROKER_URL itself); before, it logged leasekeeper's broker and consumed the
  other one.
- Importing the producer leaves the process's current Celery app alone: a Django-style
  app's `@shared_task` is sent through that app. Before, leasekeeper's app became current
  at import and the user's task went to leasekeeper's broker and queue, where the worker
  failed it as unregistered.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.stack import REPO, WorkerStack

pytestmark = pytest.mark.timeout(240)


def other_db(stack: WorkerStack, db: int, password: str = "") -> str:
    """The stack's Redis, another database (where a user's own Celery app would be)."""
    base = stack.broker_url.rsplit("/", 1)[0]
    if password:
        base = base.replace("redis://", f"redis://:{password}@", 1)
    return f"{base}/{db}"


def run_python(code: str, env: dict[str, str], cwd: Path, *args: str) -> Any:
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


PRODUCER = """
import json, os, sys
from tasks import producer
from workers.app import app
sent = producer.attach_run(sys.argv[1])
answer = sent.get(timeout=60, propagate=False)
print(json.dumps({
    "state": sent.state, "answer": repr(answer),
    "conf": [app.conf.broker_url, app.conf.broker_read_url, app.conf.broker_write_url,
             app.conf.result_backend],
    "env": {k: v for k, v in os.environ.items() if k.startswith("CELERY_")}}))
"""


def test_celery_env_variables_do_not_redirect_the_producer(stack: WorkerStack,
                                                           tmp_path: Path) -> None:
    theirs = other_db(stack, 7)
    celery_env = {"CELERY_BROKER_URL": theirs, "CELERY_BROKER_READ_URL": theirs,
                  "CELERY_BROKER_WRITE_URL": theirs, "CELERY_RESULT_BACKEND": theirs}
    redis.Redis.from_url(theirs).flushdb()
    run_id = f"run-{uuid.uuid4().hex[:12]}"
    answer = run_python(PRODUCER, {**stack.env, **celery_env}, tmp_path, run_id)
    assert answer["conf"] == [stack.broker_url] * 4, answer
    # The worker on LEASEKEEPER_BROKER_URL answered it (there is no such run: its refusal).
    assert answer["state"] == "FAILURE" and "RunNotRecorded" in str(answer["answer"]), answer
    assert answer["env"] == celery_env  # still there for the user's own app
    assert redis.Redis.from_url(theirs).dbsize() == 0  # nothing published to theirs


def test_the_cli_uses_leasekeepers_broker_despite_celery_env(stack: WorkerStack,
                                                             tmp_path: Path) -> None:
    from tests.e2e.conftest import leasekeeper

    env = {**stack.env, "CELERY_BROKER_URL": other_db(stack, 7, "hidden-pw")}
    done = leasekeeper("status", "--json", env=env, cwd=tmp_path)
    report = json.loads(done.stdout)  # exit 1 without beat; the report is what counts
    assert stack.hostname(1) in report["workers"], report  # it pinged through our broker
    assert "hidden-pw" not in done.stdout + done.stderr


@pytest.mark.parametrize("process", ["worker", "beat"])
@pytest.mark.parametrize("how", ["env", "--broker", "backend"])
def test_a_worker_or_beat_refuses_a_celery_broker_that_differs(
        stack: WorkerStack, tmp_path: Path, process: str, how: str) -> None:
    theirs = other_db(stack, 7, "hidden-pw")
    variable = "CELERY_RESULT_BACKEND" if how == "backend" else "CELERY_BROKER_URL"
    setting = ("LEASEKEEPER_RESULT_BACKEND_URL" if how == "backend"
               else "LEASEKEEPER_BROKER_URL")
    env = {**stack.env, "LEASEKEEPER_VAR_DIR": str(tmp_path)}
    args = [sys.executable, "-m", "celery", "-A", "workers.app"]
    if how == "--broker":
        args += ["--broker", theirs]
    else:
        env[variable] = theirs
    args += [process, "-l", "info"]
    done = subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 2, (done.stdout + done.stderr)[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr[-3000:]
    ours = stack.broker_url
    assert lines[0] == (
        f"leasekeeper {process} not started: {variable} is {other_db(stack, 7, '**')} but "
        f"leasekeeper's {'result backend' if how == 'backend' else 'broker'} is {ours} "
        f"(from LEASEKEEPER_BROKER_URL); leasekeeper ignores the CELERY_* variables (they "
        f"are for your own Celery app; `celery --broker` sets CELERY_BROKER_URL): set "
        f"{setting} instead, and unset {variable} for this process"), lines[0]
    assert "hidden-pw" not in done.stdout + done.stderr


USER_APP = """
import json, sys
import redis
from celery import Celery, current_app, shared_task

class Config:                       # as a Django settings module with namespace="CELERY"
    CELERY_BROKER_URL = sys.argv[1]
    CELERY_RESULT_BACKEND = sys.argv[1]
    CELERY_TASK_DEFAULT_QUEUE = "myapp"

user = Celery("myapp")
user.config_from_object(Config, namespace="CELERY")

@shared_task(name="myapp.send_email")
def send_email(to):
    return to

from tasks import producer

sent = send_email.delay("someone@example.com")
ours = producer.attach_run(sys.argv[2])
print(json.dumps({
    "current_is_user": current_app._get_current_object() is user,
    "shared_task_app": send_email.app.main,
    "sent_app": sent.app.main,
    "queued_in_theirs": redis.Redis.from_url(sys.argv[1]).llen("myapp"),
    "ours_state": (ours.get(timeout=60, propagate=False), ours.state)[1],  # answered
    "ours_app": ours.app.main}))
"""


def test_importing_the_producer_leaves_the_current_app_alone(stack: WorkerStack,
                                                             tmp_path: Path) -> None:
    theirs = other_db(stack, 5)
    redis.Redis.from_url(theirs).flushdb()
    answer = run_python(USER_APP, stack.env, tmp_path, theirs, f"run-{uuid.uuid4().hex[:12]}")
    assert answer == {"current_is_user": True, "shared_task_app": "myapp",
                      "sent_app": "myapp", "queued_in_theirs": 1, "ours_state": "FAILURE",
                      "ours_app": "leasekeeper"}, answer



BY_NAME = """
import json, sys
from tests.e2e.test_celery_env import readme_by_name_client
print(json.dumps(readme_by_name_client()["start_run_by_name"]("run-45", {"tenant": "acme"})))
"""


def readme_by_name_client() -> dict[str, object]:
    """The README's bounded by-name client block, its definitions executed as written."""
    text = (REPO / "README.md").read_text()
    at = text.index("def start_run_by_name(")
    block = text[text.rindex("```python", 0, at) + len("```python"):text.index("```", at)]
    names: dict[str, object] = {"__name__": "readme_by_name"}
    exec(compile(block, "README.md", "exec"), names)  # our own README's code
    return names


def test_the_readme_by_name_client_answers_503_with_redis_stopped(tmp_path: Path) -> None:
    from tests.e2e.conftest import cli_env
    from tests.services import start_redis

    server = start_redis(tmp_path / "redis")
    server.stop()  # stopped: nothing listens on its port any more
    env = cli_env(LEASEKEEPER_BROKER_URL=server.url)
    code, body = run_python(BY_NAME, env, tmp_path)
    assert code == 503, body  # one of the two exceptions the README says to map was raised
    assert body["error"].startswith("the task queue is unavailable, retry later ("), body


@pytest.mark.parametrize("process", ["worker", "beat"])
def test_a_celery_broker_url_that_does_not_parse_is_refused_showing_none_of_it(
        stack: WorkerStack, tmp_path: Path, process: str) -> None:
    # Before (a QA pass): a password with an unencoded '/' crashed the refusal itself
    # (kombu's maybe_sanitize_url raised): Celery's "Unable to load celery application"
    # traceback ending "ValueError: Port could not be cast to integer value as 'Cel'".
    env = {**stack.env, "LEASEKEEPER_VAR_DIR": str(tmp_path),
           "CELERY_BROKER_URL": "redis://:Cel/Pw_Cc3@xyz@127.0.0.1:6390/0"}
    done = subprocess.run([sys.executable, "-m", "celery", "-A", "workers.app", process,
                           "-l", "info"], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False)
    said = done.stdout + done.stderr
    assert done.returncode == 2, said[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, said[-3000:]
    assert lines[0].startswith(f"leasekeeper {process} not started: CELERY_BROKER_URL is "
                               "<unparseable URL> but leasekeeper's broker is "), lines[0]
    assert not any(part in said for part in (":Cel", "Cel/", "Pw_Cc3", "xyz")), said[-3000:]
