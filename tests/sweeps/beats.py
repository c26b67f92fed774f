"""Real ``celery beat`` processes beside real workers, for the tests that depend on
Celery's scheduling: each beat has its own schedule file and log, and is stopped by pid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.stack import REPO

SWEEP_INTERVALS = ("REAP_RUNS", "EXPIRE_LEASES", "RETRY_CLEANUP", "FINISH_EXITED",
                   "STUCK_PROVISIONING", "ORPHANS", "FILL_POOLS")


def beat_env(env: dict[str, str], interval_s: float) -> dict[str, str]:
    return {**env, **{f"LEASEKEEPER_{name}_INTERVAL_S": str(interval_s)
                      for name in SWEEP_INTERVALS}}


@contextmanager
def beats(env: dict[str, str], root: Path, count: int, interval_s: float, tag: str
          ) -> Iterator[list[Path]]:
    """Run ``count`` beat processes (the workers' ``env``, every sweep every ``interval_s``)
    with their files under ``root``; yield their logs."""
    procs: list[subprocess.Popen[bytes]] = []
    logs = [root / f"beat-{tag}-{i}.log" for i in range(count)]
    try:
        for i, log_path in enumerate(logs):
            with open(log_path, "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "celery", "-A", "workers.app", "beat", "-l", "info",
                     "-s", str(root / f"beat-{tag}-{i}-schedule"),
                     "--pidfile", str(root / f"beat-{tag}-{i}.pid")],
                    cwd=REPO, env=beat_env(env, interval_s), stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True))
        yield logs
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
