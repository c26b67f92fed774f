"""`leasekeeper flower`, the by-hand path: never without basic auth, on 127.0.0.1 unless
told otherwise, and a taken port named at once."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import cli_env, eventually, leasekeeper
from tests.e2e.test_up import flower_status
from tests.services import RedisServer, free_port

pytestmark = pytest.mark.timeout(240)


def test_flower_refuses_to_start_without_basic_auth(tmp_path: Path) -> None:
    # Before: `celery -A workers.app flower` served its UI with no auth on 0.0.0.0 and [::].
    done = leasekeeper("flower", env=cli_env(LEASEKEEPER_VAR_DIR=str(tmp_path)))
    assert done.returncode == 2
    assert done.stderr.strip() == ("leasekeeper: Flower never runs without basic auth: set "
                                   "LEASEKEEPER_FLOWER_BASIC_AUTH=user:password")
    done = leasekeeper("flower", env=cli_env(LEASEKEEPER_VAR_DIR=str(tmp_path),
                                             LEASEKEEPER_FLOWER_BASIC_AUTH="no-colon"))
    assert done.returncode == 2 and "must be user:password" in done.stderr
    assert "no-colon" not in done.stderr


def listening_addresses(port: int) -> set[str]:
    """The local addresses of sockets listening on ``port`` (IPv4, from /proc/net/tcp)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:
            found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


def test_flower_listens_on_loopback_with_auth(redis_server: RedisServer, tmp_path: Path
                                              ) -> None:
    port = free_port()
    env = cli_env(LEASEKEEPER_VAR_DIR=str(tmp_path), LEASEKEEPER_BROKER_URL=redis_server.url,
                  LEASEKEEPER_FLOWER_BASIC_AUTH="ops:a-long-password",
                  LEASEKEEPER_FLOWER_PORT=str(port))
    with open(tmp_path / "flower.out", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "workers.cli", "flower"], env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        eventually(lambda: proc.poll() is None and flower_status(url, "ops:a-long-password")
                   == 200 if listening_addresses(port) else None, 120, "Flower answering")
        assert listening_addresses(port) == {"127.0.0.1"}
        assert flower_status(url, "ops:wrong") == 401
        assert "a-long-password" not in " ".join(Path(f"/proc/{proc.pid}/cmdline")
                                                 .read_text().split("\0"))
        taken = leasekeeper("flower", env=env)
        assert taken.returncode == 2
        assert f"port {port} is taken" in taken.stderr
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
