"""`leasekeeper up --demo N --exit-after-demo`: the embedded backend, end to end."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.stack import REPO


@pytest.mark.timeout(240)
def test_up_runs_the_demo_and_leaves_nothing_running(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEKEEPER_")}
    env |= {"LEASEKEEPER_VAR_DIR": str(tmp_path), "LEASEKEEPER_FLOWER_PORT": "0",
            "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "workers.cli", "up", "--demo", "5",
                           "--exit-after-demo"], env=env, capture_output=True, text=True,
                          timeout=200, cwd=REPO, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "demo: every lease reached its expected state" in done.stdout
    assert done.stdout.count("  ok  lease") == 5
    assert "Flower: http://127.0.0.1:" in done.stdout
    assert re.search(r"metrics: http://127\.0\.0\.1:\d+/metrics; lease console: "
                     r"http://127\.0\.0\.1:\d+/", done.stdout), done.stdout
    credentials = (tmp_path / "flower-credentials").read_text().strip()
    assert credentials.split(":", 1)[1] not in done.stdout  # the password is not printed
    assert not any((tmp_path / "sandboxes").iterdir())  # every sandbox directory is gone
    # Every child process is gone: nothing listens on their ports any more.
    port = int(re.search(r"broker redis://127\.0\.0\.1:(\d+)/", done.stdout).group(1))
    observers = re.search(r"metrics: http://127\.0\.0\.1:(\d+)/metrics; lease console: "
                          r"http://127\.0\.0\.1:(\d+)/", done.stdout)
    for listened in (port, *map(int, observers.groups())):  # Redis, exporter, console
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", listened), timeout=1).close()
