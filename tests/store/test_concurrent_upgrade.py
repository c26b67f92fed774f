"""Several `leasekeeper db upgrade` at once (replicas' init containers, two operators, a
deploy job retried while the first still runs) on one store: each waits for the one
migrating, then finds the store at head; none fails, none leaves the schema half-made."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.stack import REPO
from tests.store.test_migrations import declared, index_names
from workers.preflight import check_store

UPGRADERS = 4


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'var' / 'store.db'}"
    server = request.getfixturevalue("postgres_server")
    return str(server.create_database(f"lk_cc_{uuid.uuid4().hex[:10]}"))


def upgrade_at_once(url: str, revision: str = "head") -> list[tuple[int, str]]:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("LEASEKEEPER_")},
           "LEASEKEEPER_STORE_URL": url, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-m", "workers.cli", "db", "upgrade",
                               "--revision", revision], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for _ in range(UPGRADERS)]
    try:
        return [(proc.wait(120), (proc.stdout.read() if proc.stdout else b"").decode())
                for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.timeout(300)
def test_upgrades_at_once_all_succeed_and_the_store_is_at_head(empty_url: str) -> None:
    # when several upgrades of a never-migrated store run at once
    results = upgrade_at_once(empty_url, "0004_errors10")
    # then each succeeds
    assert [code for code, _ in results] == [0] * UPGRADERS, results
    # and again from there to head
    results = upgrade_at_once(empty_url)
    assert [code for code, _ in results] == [0] * UPGRADERS, results
    # and the store is complete, at head
    check_store(empty_url)
    assert index_names(empty_url) == declared()
