"""A password given in a URL's query (libpq's ``?password=``) is never printed.

Before (a QA pass), every place that printed the store URL masked only a password in its
user part (SQLAlchemy's ``render_as_string(hide_password=True)``): `db current` (and its
``--json``), `db upgrade`, the store's error messages ("cannot reach the store
...?password=...") and `up`'s banner showed ``?password=...`` in clear, and `up` printed
the store URL's export line instead of pointing at the env file. Through the CLI as a
child process, on a real PostgreSQL (trust auth: the password is taken and not needed).
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.e2e.conftest import cli_env, leasekeeper
from tests.e2e.test_cli_errors import closed_port
from tests.services import PostgresServer, RedisServer

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(400)]

PASSWORD = "PgQueryPw_Zz41"


def with_password(url: str) -> str:
    return f"{url}?password={PASSWORD}&application_name=lk-test"


def test_db_commands_never_print_a_query_password(postgres_server: PostgresServer) -> None:
    url = with_password(postgres_server.create_database(f"lk_{uuid.uuid4().hex[:12]}"))
    for args in (["db", "upgrade"], ["db", "current"], ["db", "current", "--json"]):
        done = leasekeeper(*args, env=cli_env(LEASEKEEPER_STORE_URL=url))
        said = done.stdout + done.stderr
        assert done.returncode == 0, said
        assert PASSWORD not in said, said
        assert "?password=**&application_name=lk-test" in said, said
    gone = with_password(f"postgresql+psycopg://postgres@127.0.0.1:{closed_port()}/lk")
    done = leasekeeper("db", "current", env=cli_env(LEASEKEEPER_STORE_URL=gone))
    said = done.stdout + done.stderr
    assert done.returncode != 0, said
    assert "cannot reach the store" in said and "?password=**" in said, said
    assert PASSWORD not in said, said


def test_up_never_prints_a_store_query_password(postgres_server: PostgresServer,
                                                redis_server: RedisServer,
                                                tmp_path: Path) -> None:
    url = with_password(postgres_server.create_database(f"lk_{uuid.uuid4().hex[:12]}"))
    env = cli_env(LEASEKEEPER_STORE_URL=url, LEASEKEEPER_BROKER_URL=redis_server.url,
                  LEASEKEEPER_TASK_QUEUE=f"pw-{uuid.uuid4().hex[:8]}",
                  LEASEKEEPER_FLOWER_PORT="0", LEASEKEEPER_METRICS_PORT="0",
                  LEASEKEEPER_CONSOLE_PORT="0")
    done = subprocess.run([sys.executable, "-m", "workers.cli", "up", "--demo", "1",
                           "--exit-after-demo"], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, check=False)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-3000:]
    assert PASSWORD not in said, said[-3000:]
    assert "?password=**&application_name=lk-test" in done.stdout, done.stdout
    assert "export LEASEKEEPER_STORE_URL=" not in done.stdout, done.stdout
    assert "LEASEKEEPER_STORE_URL holds a password" in done.stdout, done.stdout
