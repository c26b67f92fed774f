"""LEASEKEEPER_LOG_FORMAT=json: one JSON object a line from a real worker (with the task's
ids on each line about a task, and no secret), and from the CLI; LEASEKEEPER_LOG_FILE
rotates by size."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from tests.e2e.conftest import cli_env, eventually, leasekeeper
from tests.services import RedisServer
from tests.stack import WorkerStack

SECRET = "s3cr3t-" + uuid.uuid4().hex


@pytest.mark.timeout(300)
def test_a_worker_logs_json_lines_with_task_ids_to_a_rotating_file(
        redis_server: RedisServer, tmp_path: Path) -> None:
    from models.migrate import upgrade
    from tasks.acquire import acquire
    from tasks.destroy import destroy

    store = f"sqlite:///{tmp_path / 'store.db'}"
    upgrade(store)
    queue = f"logs-{uuid.uuid4().hex[:8]}"
    logfile = tmp_path / "logs" / "worker.log"
    stack = WorkerStack(name="json-logs", store_url=store, root=tmp_path,
                        broker_url=redis_server.url, extra_env={
                            "LEASEKEEPER_LOG_FORMAT": "json", "LEASEKEEPER_TASK_QUEUE": queue,
                            "LEASEKEEPER_LOG_FILE": str(logfile),
                            "LEASEKEEPER_LOG_FILE_MAX_BYTES": "8000",
                            "LEASEKEEPER_LOG_FILE_BACKUPS": "9"})
    try:
        stack.start_worker(concurrency=1)
        for i in range(8):
            lease = acquire.apply_async(kwargs={"run_id": f"{queue}-{i}", "spec": {
                "tenant": "acme", "secret_env": {"TOKEN": SECRET}}}, queue=queue).get(120)
            destroy.apply_async(kwargs={"lease_id": lease["lease_id"]}, queue=queue).get(120)
    finally:
        stack.stop()
    files = sorted(logfile.parent.glob("worker.log*"))
    assert len(files) >= 2, "the log did not rotate"  # 8000 bytes hold a few lines
    assert all(f.stat().st_size <= 8000 for f in files)
    lines = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    assert all({"ts", "level", "logger", "process", "message"} <= set(x) for x in lines)
    assert all(x["process"] == "worker" for x in lines)
    done = [x for x in lines if x.get("task_name") == "lease.destroy" and "succeeded" in
            x["message"]]
    assert done and all(x.get("lease_id") and x.get("task_id") for x in done)
    acquired = [x for x in lines if x.get("task_name") == "lease.acquire" and "succeeded" in
                x["message"]]
    assert acquired and all(x.get("run_id", "").startswith(queue) and x.get("provider")
                            for x in acquired)
    for f in [*files, stack.logfile]:
        assert SECRET not in f.read_text()


def test_the_cli_logs_json_lines(tmp_path: Path) -> None:
    done = leasekeeper("leases", "show", "nosuch", env=cli_env(
        LEASEKEEPER_LOG_FORMAT="json", LEASEKEEPER_LEASE_TTL="5",
        LEASEKEEPER_VAR_DIR=str(tmp_path)))
    lines = [json.loads(line) for line in done.stderr.splitlines()]
    assert [(x["level"], x["process"]) for x in lines] == [("WARNING", "cli"), ("ERROR", "cli")]
    assert "did you mean LEASEKEEPER_LEASE_TTL_S?" in lines[0]["message"]
    assert "leasekeeper db upgrade" in lines[1]["message"]
    assert eventually(lambda: done.returncode == 2, 1, "exit code 2")
