"""Setting-up mistakes an operator made, each run as a real `leasekeeper` process: one
line naming what is wrong and the fix, the documented exit code, never a traceback.

(Each case was first seen as a traceback, a wrong fix, a hang or a wrong exit code.)
"""

from __future__ import annotations

import json
import socket
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import cli_env, leasekeeper
from tests.e2e.test_cli_errors import short_error
from tests.services import PostgresServer, RedisServer

pytestmark = pytest.mark.timeout(120)


def migrated(tmp_path: Path) -> dict[str, str]:
    env = cli_env(LEASEKEEPER_VAR_DIR=str(tmp_path))
    done = leasekeeper("db", "upgrade", env=env)
    assert done.returncode == 0, done.stderr
    return env


def test_db_upgrade_to_a_revision_that_does_not_exist(tmp_path: Path) -> None:
    done = leasekeeper("db", "upgrade", "--revision", "bogus",
                       env=cli_env(LEASEKEEPER_VAR_DIR=str(tmp_path)))
    assert done.returncode == 2
    short_error(done, "'bogus'", "leave --revision out")


def test_a_store_a_newer_leasekeeper_migrated_says_so(tmp_path: Path) -> None:
    # Before: "is at migration 0099_future, this leasekeeper needs ...: run leasekeeper db
    # upgrade", and that upgrade was a traceback.
    env = migrated(tmp_path)
    with sqlite3.connect(tmp_path / "leasekeeper.db") as db:
        db.execute("UPDATE alembic_version SET version_num = '0099_future'")
    for command in (["leases", "list"], ["db", "upgrade"]):
        done = leasekeeper(*command, env=env)
        assert done.returncode == 2, command
        err = short_error(done, "0099_future", "newer leasekeeper migrated it")
        assert "run `leasekeeper db upgrade`" not in err


@pytest.mark.parametrize("var_dir", ["a-file", "a-file/below"])
def test_a_var_dir_that_cannot_be_a_folder(tmp_path: Path, var_dir: str) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    env = cli_env(LEASEKEEPER_VAR_DIR=str(tmp_path / var_dir))
    done = leasekeeper("db", "upgrade", env=env)
    assert done.returncode == 2
    short_error(done, "cannot create the store's folder", "LEASEKEEPER_VAR_DIR")
    listed = leasekeeper("leases", "list", env=env)
    assert listed.returncode == 2
    short_error(listed, "LEASEKEEPER_VAR_DIR")
    if var_dir == "a-file":
        assert "is not a folder" in listed.stderr


@pytest.mark.parametrize("url", ["garbage", "http://u:secret-pw@127.0.0.1:6379/0",
                                 "redis://127.0.0.1:notaport/0"])
def test_a_broker_url_that_is_not_redis(tmp_path: Path, url: str) -> None:
    for command in (["status"], ["health"], ["leases", "list"]):
        done = leasekeeper(*command, env=cli_env(LEASEKEEPER_VAR_DIR=str(tmp_path),
                                                 LEASEKEEPER_BROKER_URL=url))
        assert done.returncode == 2, (command, done.stderr)
        err = short_error(done, "LEASEKEEPER_BROKER_URL", "Redis URL")
        assert "secret-pw" not in err


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/abc", "redis://127.0.0.1:6379/1/2"])
def test_a_broker_url_whose_database_is_no_number(tmp_path: Path, url: str) -> None:
    # Before (a QA pass): `health --broker` passed it (exit 0), then `leases destroy` and the
    # producer failed with "unexpected ValueError: invalid literal for int()".
    env = cli_env(LEASEKEEPER_VAR_DIR=str(tmp_path), LEASEKEEPER_BROKER_URL=url)
    for command in (["health", "--broker"], ["leases", "destroy", "01a24f0f43ea963e"]):
        done = leasekeeper(*command, env=env)
        assert done.returncode == 2, (command, done.stderr)
        short_error(done, "LEASEKEEPER_BROKER_URL", "database number", "redis://host:6379/0")
    sent = subprocess.run(
        [sys.executable, "-c", "from tasks import producer; producer.acquire_lease('r-1', {})"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert "ConfigError" in sent.stderr and "database number" in sent.stderr, sent.stderr
    assert "ValueError: invalid literal" not in sent.stderr


def test_a_broker_url_naming_a_database_redis_has_not(tmp_path: Path,
                                                      redis_server: RedisServer) -> None:
    # Before (a QA pass): "the broker ... is unreachable (DB index is out of range). Start
    # Redis there", exit 3, about a Redis that answers.
    url = f"redis://127.0.0.1:{redis_server.port}/99"
    env = cli_env(LEASEKEEPER_VAR_DIR=str(tmp_path), LEASEKEEPER_BROKER_URL=url)
    assert leasekeeper("db", "upgrade", env=env).returncode == 0
    done = leasekeeper("leases", "destroy", "--state", "active", "--yes", env=env)
    assert done.returncode == 2, done.stderr
    short_error(done, "has no such database", "LEASEKEEPER_BROKER_URL")
    assert "unreachable" not in done.stderr and "Start Redis" not in done.stderr
    sent = subprocess.run(
        [sys.executable, "-c", "from tasks import producer; producer.acquire_lease('r-1', {})"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert "ConfigError" in sent.stderr and "has no such database" in sent.stderr, sent.stderr


def test_a_store_url_with_a_port_that_is_no_number(tmp_path: Path) -> None:
    for command in (["leases", "list"], ["db", "upgrade"], ["health", "--store"]):
        done = leasekeeper(*command, env=cli_env(
            LEASEKEEPER_VAR_DIR=str(tmp_path),
            LEASEKEEPER_STORE_URL="postgresql+psycopg://u:secret-pw@127.0.0.1:notaport/lk"))
        assert done.returncode == 2, (command, done.stderr)
        err = short_error(done, "LEASEKEEPER_STORE_URL", "not a database URL")
        assert "secret-pw" not in err


def test_an_unknown_provider_in_the_list_is_refused(tmp_path: Path) -> None:
    done = leasekeeper("leases", "list", env=cli_env(LEASEKEEPER_VAR_DIR=str(tmp_path),
                                                     LEASEKEEPER_PROVIDERS="local,nope"))
    assert done.returncode == 2
    short_error(done, "LEASEKEEPER_PROVIDERS", "'nope'", "local, kubernetes")


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port that accepts connections and never answers (a frozen server's)."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield int(server.getsockname()[1])
    stop.set()
    thread.join(5)
    for conn in accepted:
        conn.close()
    server.close()


@pytest.mark.timeout(60)
def test_db_upgrade_against_a_server_that_never_answers_gives_up(
        tmp_path: Path, silent_server: int) -> None:
    # Before: 131 s, then a traceback. The connect timeout is 5 s.
    done = leasekeeper("db", "upgrade", env=cli_env(
        LEASEKEEPER_VAR_DIR=str(tmp_path),
        LEASEKEEPER_STORE_URL=f"postgresql+psycopg://lk:secret-pw@127.0.0.1:{silent_server}/lk"),
        timeout_s=50)
    assert done.returncode == 3
    err = short_error(done, "cannot migrate the store", f"127.0.0.1:{silent_server}")
    assert "secret-pw" not in err


def test_a_console_or_metrics_port_in_use_names_the_setting(tmp_path: Path) -> None:
    env = migrated(tmp_path)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        console = leasekeeper("console", env={
            **env, "LEASEKEEPER_CONSOLE_PORT": port, "LEASEKEEPER_FLOWER_BASIC_AUTH": "u:p"})
        metrics = leasekeeper("metrics", env={**env, "LEASEKEEPER_METRICS_PORT": port})
    for done, setting in ((console, "LEASEKEEPER_CONSOLE_PORT"),
                          (metrics, "LEASEKEEPER_METRICS_PORT")):
        assert done.returncode == 2, done.stderr
        short_error(done, f"port {port} is in use", setting)
    bad_host = leasekeeper("metrics", env={**env, "LEASEKEEPER_METRICS_HOST": "999.1.1.1"})
    assert bad_host.returncode == 2
    short_error(bad_host, "LEASEKEEPER_METRICS_HOST='999.1.1.1' is not an address")


def test_up_refuses_a_negative_demo(tmp_path: Path) -> None:
    done = leasekeeper("up", "--demo", "-3", env=cli_env(LEASEKEEPER_VAR_DIR=str(tmp_path)))
    assert done.returncode == 2
    assert "--demo" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.postgres
def test_a_wrong_database_or_user_on_a_live_server_is_a_setting_to_fix(
        tmp_path: Path, postgres_server: PostgresServer) -> None:
    # Before: "cannot reach the store" (exit 3, the code for a service that is down).
    url = postgres_server.create_database("cli_setup")
    scheme, rest = url.split("://", 1)
    host = rest.split("@", 1)[-1]
    for wrong, says in ((f"{url.rsplit('/', 1)[0]}/no_such_db", 'database "no_such_db"'),
                        (f"{scheme}://nobody:secret-pw@{host}", 'role "nobody"')):
        for command in (["leases", "list"], ["db", "upgrade"]):
            done = leasekeeper(*command, env=cli_env(LEASEKEEPER_VAR_DIR=str(tmp_path),
                                                     LEASEKEEPER_STORE_URL=wrong))
            assert done.returncode == 2, (command, done.stderr)
            err = short_error(done, says, "does not exist", "fix the URL")
            assert "secret-pw" not in err


@pytest.mark.parametrize("mine", ["LEASEKEEPER_POOLS", "LEASEKEEPER_POOLS_FILE"])
def test_pools_set_in_the_environment_win_over_up_s_env_file_either_way(
        tmp_path: Path, mine: str) -> None:
    # given an `up` started with one way of declaring pools (its env file says so), and a
    # client shell declaring its own pools the other way. Before: every command refused
    # "LEASEKEEPER_POOLS and LEASEKEEPER_POOLS_FILE are both set", naming a variable the
    # user never set, where the README says a variable set in the environment wins.
    up_pools, own_pools = tmp_path / "up-pools.toml", tmp_path / "own-pools.toml"
    up_pools.write_text('[[pools]]\nname = "up"\nprovider = "local"\nsize = 1\n')
    own_pools.write_text('[[pools]]\nname = "mine"\nprovider = "local"\nsize = 1\n')
    env = migrated(tmp_path)
    up_decl = json.dumps([{"name": "up", "provider": "local", "size": 1}])
    up_said = (f"export LEASEKEEPER_POOLS='{up_decl}'" if mine == "LEASEKEEPER_POOLS_FILE"
               else f"export LEASEKEEPER_POOLS_FILE={up_pools}")
    (tmp_path / "env").write_text(up_said + "\n")
    own = (json.dumps([{"name": "mine", "provider": "local", "size": 1}])
           if mine == "LEASEKEEPER_POOLS" else str(own_pools))
    # when a command runs there; then it judges by the pools of its own environment
    done = leasekeeper("pools", "--json", env={**env, mine: own})
    assert done.returncode == 0, done.stdout + done.stderr
    assert [p["pool"] for p in json.loads(done.stdout)["pools"]] == ["mine"], done.stdout
    # and without a declaration of its own, by up's
    done = leasekeeper("pools", "--json", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [p["pool"] for p in json.loads(done.stdout)["pools"]] == ["up"], done.stdout
