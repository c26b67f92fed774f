"""What an operator living in the CLI hit, each command run as a real `leasekeeper`
process on a real store (SQLite and PostgreSQL) and Redis: a `destroy --wait 0` no worker
took reported as done, a SQLite store URL naming a directory called never migrated, a
closed stdout (`| head`) exiting 1, a typo'd --provider matching nothing silently,
non-ASCII digits taken as a duration, and store errors with the wrong exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from models.migrate import upgrade
from models.schema import LeaseState
from models.store import Store
from providers.errors import READ_ONLY_STORE
from tests.e2e.conftest import cli_env, leasekeeper
from tests.e2e.test_cli_leases_input import add, one_line, refused
from tests.services import PostgresServer, RedisServer
from tests.store.test_store_refuses_writes import admin

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    s = Store(store_url)
    yield s
    s.dispose()


@pytest.fixture
def env(store_url: str, tmp_path: Path) -> dict[str, str]:
    return cli_env(LEASEKEEPER_STORE_URL=store_url, LEASEKEEPER_VAR_DIR=str(tmp_path))


@pytest.fixture
def no_worker_env(env: dict[str, str], redis_server: RedisServer) -> Iterator[dict[str, str]]:
    """The broker, on a queue no worker of the session serves; its keys gone after."""
    import redis

    queue = f"noworker-{uuid.uuid4().hex[:8]}"
    yield {**env, "LEASEKEEPER_BROKER_URL": redis_server.url, "LEASEKEEPER_TASK_QUEUE": queue}
    client = redis.Redis.from_url(redis_server.url)
    for key in client.scan_iter(f"{queue}*"):
        client.delete(key)


def test_a_destroy_with_wait_0_is_never_reported_done(store: Store,
                                                      no_worker_env: dict[str, str]) -> None:
    # Before: {"result": "sent"}, "failed": 0, "unanswered": 0, exit 0 with no worker at
    # all: a script using --wait 0 --yes believed every lease destroyed.
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    one = add(store, LeaseState.ACTIVE, tenant)
    done = leasekeeper("leases", "destroy", one, "--wait", "0", "--json", env=no_worker_env)
    one_line(done, 1, "--wait 0", "sent, not awaited", "leasekeeper health --worker")
    answer = json.loads(done.stdout)
    assert [(r["lease_id"], r["result"]) for r in answer["destroyed"]] == [(one, "sent")]
    assert (answer["failed"], answer["unanswered"]) == (0, 1)
    both = leasekeeper("leases", "destroy", "--state", "active", "--tenant", tenant, "--yes",
                       "--wait", "0", env=no_worker_env)
    one_line(both, 1, "the destroy of 1 lease(s) was sent, not awaited")
    assert "sent" in both.stdout.splitlines()[1]
    assert store.get_lease(one).state == LeaseState.ACTIVE  # nothing ran it


def test_a_sqlite_store_url_naming_a_directory_says_so(tmp_path: Path) -> None:
    # Before: "there is no store at ... (never migrated): run leasekeeper db upgrade", and
    # db upgrade then "cannot create the store's folder ...: Is a directory".
    folder = tmp_path / "dirdb"
    folder.mkdir()
    env = cli_env(LEASEKEEPER_STORE_URL=f"sqlite:///{folder}",
                  LEASEKEEPER_VAR_DIR=str(tmp_path))
    wanted = (f"the store's path {folder} is a directory", "it must name a file",
              str(folder / "store.db"))
    for command in (["leases", "list"], ["db", "upgrade"], ["db", "current"], ["check"]):
        said = one_line(leasekeeper(*command, env=env), 2, *wanted)
        assert "never migrated" not in said and "cannot create" not in said, (command, said)
    health = leasekeeper("health", "--store", env=env)
    assert health.returncode == 1, health.stdout + health.stderr
    assert health.stderr.startswith("unhealthy store: "), health.stderr
    for needle in wanted:
        assert needle in health.stderr, health.stderr
    assert list(folder.iterdir()) == []  # nothing was created in it


def into_a_closed_pipe(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`leasekeeper ... | true`: its stdout a pipe whose reader is gone."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([sys.executable, "-m", "workers.cli", *args], env=env,
                              stdout=write, stderr=subprocess.PIPE, text=True, timeout=120,
                              check=False)
    finally:
        os.close(write)


def test_a_closed_stdout_stops_quietly_with_sigpipes_status(store: Store,
                                                            env: dict[str, str]) -> None:
    # Before: exit 1 ("something needs a person") for `leasekeeper leases list | head -1`.
    lease_id = add(store, LeaseState.ACTIVE)
    for command in (["leases", "list"], ["leases", "list", "--json"], ["runs", "list"],
                    ["leases", "show", lease_id], ["leases", "show", lease_id, "--json"]):
        done = into_a_closed_pipe(*command, env=env)
        assert (done.returncode, done.stderr) == (141, ""), (command, done.stderr)


def test_an_unknown_provider_is_refused_and_an_empty_destroy_says_so(
        store: Store, no_worker_env: dict[str, str]) -> None:
    # Before: an empty table, exit 0, and the destroy preview "would destroy 0 lease(s);
    # nothing was destroyed: add --yes to do it". (--yes still checks the broker first.)
    env = no_worker_env
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    add(store, LeaseState.ACTIVE, tenant)
    refused(leasekeeper("leases", "list", "--provider", "nope", env=env), "--provider",
            "unknown provider 'nope'", "local, kubernetes, noop")
    for yes in ([], ["--yes"]):
        refused(leasekeeper("leases", "destroy", "--state", "active", "--provider", "locl",
                            *yes, env=env), "--provider", "unknown provider 'locl'")
    # a provider leasekeeper has, not enabled here: its leases stay listable
    listed = leasekeeper("leases", "list", "--provider", "kubernetes", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)["leases"] == []
    for yes in ([], ["--yes"]):
        done = leasekeeper("leases", "destroy", "--state", "active", "--provider",
                           "kubernetes", "--tenant", tenant, *yes, env=env)
        said = one_line(done, 0, "no lease matched --state active --provider kubernetes "
                                 f"--tenant {tenant}; nothing to destroy")
        assert "--yes" not in said.split(";")[-1], said
        assert done.stdout == ""
    as_json = leasekeeper("leases", "destroy", "--state", "active", "--tenant", "nobody",
                          "--yes", "--json", env=env)
    one_line(as_json, 0, "no lease matched --state active --tenant nobody")
    assert json.loads(as_json.stdout)["destroyed"] == []


def test_non_ascii_digits_are_not_a_duration(store: Store, env: dict[str, str]) -> None:
    # Before: '\u0661s' (ARABIC-INDIC DIGIT ONE, s) was taken as 1 s, '\u0662h' as 2 h.
    refused(leasekeeper("leases", "list", "--older-than", "\u0661s", env=env),
            "--older-than", "is not a duration")
    refused(leasekeeper("leases", "destroy", "--state", "active", "--older-than",
                        "\u0662h", env=env), "--older-than", "is not a duration")


def test_a_store_url_with_a_bad_option_is_a_setting_not_an_outage(tmp_path: Path) -> None:
    # Before: "cannot reach the store ... invalid sslmode value", exit 3 (unreachable).
    for option, needle in (("sslmode=bogus", 'invalid sslmode value: "bogus"'),
                           ("nosuch=1", 'invalid connection option "nosuch"')):
        url = f"postgresql+psycopg://lk:secret@127.0.0.1:5432/lk?{option}"
        env = cli_env(LEASEKEEPER_STORE_URL=url, LEASEKEEPER_VAR_DIR=str(tmp_path))
        said = one_line(leasekeeper("leases", "list", env=env), 2, needle,
                        "LEASEKEEPER_STORE_URL")
        assert "secret" not in said


@pytest.mark.postgres
def test_writes_refused_by_a_read_only_database_are_exit_2_worded_as_status(
        postgres_server: PostgresServer, tmp_path: Path, redis_server: RedisServer) -> None:
    # Before: `leases forget`, `leases retry` and `reap` exited 3 (unreachable) with "the
    # lease store at ... refused (ReadOnlySqlTransaction: ...)"; status said it otherwise.
    from workers.preflight import shown

    name = f"lk_ro_{uuid.uuid4().hex[:8]}"
    url = postgres_server.create_database(name)
    upgrade(url)
    store = Store(url)
    try:
        lease_id = add(store, LeaseState.ABANDONED)
        add(store, LeaseState.ACTIVE)  # expired: a sweep has something to write
    finally:
        store.dispose()
    env = cli_env(LEASEKEEPER_STORE_URL=url, LEASEKEEPER_BROKER_URL=redis_server.url,
                  LEASEKEEPER_VAR_DIR=str(tmp_path))
    admin(postgres_server, "postgres",
          f"ALTER DATABASE {name} SET default_transaction_read_only = on")
    status = json.loads(leasekeeper("status", "--json", env=env).stdout)
    worded = next(p for p in status["verdict"]["problems"] if "is not writable" in p)
    assert f"the store {shown(url)} is not writable" in worded and READ_ONLY_STORE in worded
    for command in (("leases", "forget", lease_id), ("leases", "retry", lease_id),
                    ("reap",)):
        said = one_line(leasekeeper(*command, env=env), 2,
                        f"the store {shown(url)} is not writable", READ_ONLY_STORE)
        assert "refused (" not in said and "task will retry" not in said, (command, said)
