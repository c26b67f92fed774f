"""`leasekeeper db current` and `leasekeeper db downgrade`, run as real processes on SQLite
and PostgreSQL stores that hold a lease: where the store stands against this leasekeeper's
migrations (exit 0 only at the latest), and a release rolled back (migrations undone only
with --yes, data in what stays kept, up again with `db upgrade`). Wrong revisions, a store
above the target and one a newer leasekeeper migrated are refused in one line, exit 2."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from models.store import Store
from tests.e2e.conftest import cli_env, leasekeeper
from tests.e2e.test_cli_errors import a_lease, short_error
from tests.services import RedisServer
from workers.preflight import migration_heads

pytestmark = pytest.mark.timeout(180)

LEASE = "0123456789abcdef"


def db(store_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return leasekeeper("db", *args, env=cli_env(LEASEKEEPER_STORE_URL=store_url))


def revision_of(store_url: str) -> str | None:
    engine = create_engine(store_url)
    try:
        with engine.connect() as conn:
            return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
    finally:
        engine.dispose()


def test_a_release_is_rolled_back_and_forward_keeping_the_leases(store_url: str) -> None:
    # given a store at this leasekeeper's latest migration, holding a lease
    (head,) = migration_heads()
    a_lease(store_url, LEASE)
    current = db(store_url, "current")
    assert current.returncode == 0, current.stderr
    assert f"at migration {head}, this leasekeeper's latest: up to date" in current.stdout

    # when a downgrade is asked without --yes: it says what it would undo, and does nothing
    asked = db(store_url, "downgrade", "0009")
    assert asked.returncode == 1, asked.stderr
    assert "would undo" in asked.stdout and "0010_perf12" in asked.stdout
    assert "--yes" in asked.stdout
    assert revision_of(store_url) == head

    # with --yes it goes down to 0009_runs12 (a leading part of its name is enough)
    done = db(store_url, "downgrade", "0009", "--yes")
    assert done.returncode == 0, done.stderr
    assert ("is at 0009_runs12 (undone: 0014_perf12, 0013_marks14, 0012_perf12, 0011_perf12, "
            "0010_perf12)") in done.stdout
    assert revision_of(store_url) == "0009_runs12"
    behind = db(store_url, "current")
    assert behind.returncode == 1
    assert "behind this leasekeeper's latest" in behind.stdout
    assert "0010_perf12, 0011_perf12, 0012_perf12, 0013_marks14, 0014_perf12" in behind.stdout
    assert "leasekeeper db upgrade" in behind.stdout
    again = db(store_url, "downgrade", "0009_runs12", "--yes")
    assert again.returncode == 0 and "nothing to undo" in again.stdout

    # then up again: the lease is still there
    up = db(store_url, "upgrade")
    assert up.returncode == 0, up.stderr
    assert db(store_url, "current").returncode == 0
    store = Store(store_url)
    try:
        assert store.get_lease(LEASE).tenant == "acme"
    finally:
        store.dispose()


def test_down_to_base_leaves_an_empty_store_that_upgrades_again(store_url: str) -> None:
    done = db(store_url, "downgrade", "base", "--yes")
    assert done.returncode == 0, done.stderr
    assert "is at base" in done.stdout and "0001)" in done.stdout
    never = db(store_url, "current")
    assert never.returncode == 1 and "never migrated" in never.stdout
    short_error(db(store_url, "downgrade", "base", "--yes"), "never migrated")
    assert db(store_url, "upgrade").returncode == 0
    assert db(store_url, "current").returncode == 0


def test_current_json_says_where_the_store_stands_with_the_same_exit_code(
        store_url: str, tmp_path: Path) -> None:
    # Before: "No such option: --json" (exit 2), though the README says every read command
    # takes --json.
    (head,) = migration_heads()
    at_head = db(store_url, "current", "--json")
    assert at_head.returncode == 0, at_head.stderr
    said = json.loads(at_head.stdout)
    assert said["position"] == "at_head" and said["current"] == [head], said
    assert said["latest"] == [head] and said["pending"] == [] and said["exists"] is True
    assert "up to date" in said["message"]
    assert db(store_url, "downgrade", "0009", "--yes").returncode == 0
    behind = db(store_url, "current", "--json")
    assert behind.returncode == 1, behind.stderr
    said = json.loads(behind.stdout)
    assert said["position"] == "behind" and said["current"] == ["0009_runs12"], said
    assert said["pending"][0] == "0010_perf12" and said["pending"][-1] == head, said
    path = tmp_path / "absent.db"
    never = db(f"sqlite:///{path}", "current", "--json")
    assert never.returncode == 1, never.stderr
    said = json.loads(never.stdout)
    assert said["position"] == "never_migrated" and said["exists"] is False, said
    assert not path.exists()


@pytest.mark.parametrize(("revision", "says"), [
    ("nope", "'nope' names no single migration: name one of 0001, 0002_perf12"),
    ("00", "'00' names no single migration"),  # more than one starts so
])
def test_a_revision_that_names_no_migration_is_refused(store_url: str, revision: str,
                                                       says: str) -> None:
    refused = db(store_url, "downgrade", revision, "--yes")
    assert refused.returncode == 2
    short_error(refused, says, "`base`")
    assert revision_of(store_url) == next(iter(migration_heads()))


def test_a_downgrade_above_the_store_is_refused_naming_upgrade(store_url: str) -> None:
    assert db(store_url, "downgrade", "0004", "--yes").returncode == 0
    refused = db(store_url, "downgrade", "0011_perf12", "--yes")
    assert refused.returncode == 2
    short_error(refused, "is at migration 0004_errors10, below 0011_perf12",
                "leasekeeper db upgrade --revision 0011_perf12")
    assert revision_of(store_url) == "0004_errors10"


def test_a_store_a_newer_leasekeeper_migrated_is_named_and_not_touched(store_url: str,
                                                                      ) -> None:
    # given a store a newer release migrated (a revision this one does not have)
    engine = create_engine(store_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = '0099_future'"))
    finally:
        engine.dispose()
    current = db(store_url, "current")
    assert current.returncode == 1
    (head,) = migration_heads()
    assert "0099_future, which this leasekeeper does not have" in current.stdout
    assert f"leasekeeper db downgrade {head} --yes` with that newer one" in current.stdout
    refused = db(store_url, "downgrade", "0009", "--yes")
    assert refused.returncode == 2
    short_error(refused, "0099_future", "with that newer version")
    assert revision_of(store_url) == "0099_future"


@pytest.mark.parametrize(("revision", "named"), [
    ("0005", "0005_pools13"), ("0010", "0010_perf12"), ("0010_perf12", "0010_perf12")])
def test_an_upgrade_to_a_revision_the_store_is_past_says_where_it_really_is(
        store_url: str, revision: str, named: str) -> None:
    # Before: "store ... is at 0005" (rc 0), the argument echoed; `db current` said 0012.
    (head,) = migration_heads()
    done = db(store_url, "upgrade", "--revision", revision)
    assert done.returncode == 0, done.stderr
    assert f"is already at {head}, past {named}: nothing to do" in done.stdout, done.stdout
    assert f"is at {revision}" not in done.stdout
    assert revision_of(store_url) == head


def test_an_upgrade_names_the_revision_it_reached(store_url: str) -> None:
    (head,) = migration_heads()
    assert db(store_url, "downgrade", "0004", "--yes").returncode == 0
    up = db(store_url, "upgrade", "--revision", "0005")
    assert up.returncode == 0, up.stderr
    assert up.stdout.strip().endswith("is at 0005_pools13"), up.stdout
    latest = db(store_url, "upgrade", "--revision", "head")
    assert latest.returncode == 0, latest.stderr
    assert latest.stdout.strip().endswith(f"is at {head}"), latest.stdout
    assert revision_of(store_url) == head


def test_current_and_downgrade_on_a_never_migrated_sqlite_path_create_nothing(
        tmp_path: Path) -> None:
    # Before: both left an empty 0-byte file where the store would be.
    path = tmp_path / "never.db"
    url = f"sqlite:///{path}"
    current = db(url, "current")
    assert current.returncode == 1, current.stderr  # never migrated: exit 1 (README)
    assert f"there is no store at {path}" in current.stdout, current.stdout
    assert "never migrated" in current.stdout and "leasekeeper db upgrade" in current.stdout
    refused = db(url, "downgrade", "base", "--yes")
    assert refused.returncode == 2
    short_error(refused, "never migrated", "nothing to downgrade")
    assert list(tmp_path.iterdir()) == []


def test_current_in_a_folder_that_does_not_exist_says_so_as_leases_list_does(
        tmp_path: Path) -> None:
    # Before: "cannot reach the store ... unable to open database file", rc 3.
    url = f"sqlite:///{tmp_path}/nonexistent/dir/x.db"
    said = f"the store's folder {tmp_path}/nonexistent/dir does not exist"
    listed = leasekeeper("leases", "list", env=cli_env(LEASEKEEPER_STORE_URL=url))
    assert listed.returncode == 2
    short_error(listed, said)
    current = db(url, "current")
    assert current.returncode == 2
    short_error(current, said, "LEASEKEEPER_STORE_URL")
    assert list(tmp_path.iterdir()) == []


def test_a_downgrade_under_running_workers_is_refused_unless_forced(
        redis_server: RedisServer, tmp_path: Path) -> None:
    # Before: `db downgrade R --yes` undid migrations under running workers, whose next
    # acquire failed for good ('column "secret_env_given" of relation "runs" does not
    # exist'): the README says to stop them first, and nothing checked.
    from tests.stack import own_queue_stack

    with own_queue_stack("downgrade", redis_server.url, tmp_path) as stack:
        (head,) = migration_heads()
        env = {**cli_env(**{k: v for k, v in stack.env.items()
                            if k.startswith("LEASEKEEPER_")})}
        # when a downgrade is asked for with a worker of the installation running
        done = leasekeeper("db", "downgrade", "0009", "--yes", env=env)
        # then it is refused, naming what runs and how to go on, and nothing is undone
        assert done.returncode == 1, done.stdout + done.stderr
        err = short_error(done, "not undone: 1 worker(s)", "running on the broker", "--force")
        assert "downgrade" in err
        assert revision_of(stack.store_url) == head
        # and --force does it anyway
        forced = leasekeeper("db", "downgrade", "0009", "--yes", "--force", env=env)
        assert forced.returncode == 0, forced.stdout + forced.stderr
        assert revision_of(stack.store_url) == "0009_runs12"
        assert leasekeeper("db", "upgrade", env=env).returncode == 0


def test_a_beat_stopped_cleanly_or_long_gone_does_not_refuse_a_downgrade(
        redis_server: RedisServer, tmp_path: Path) -> None:
    # Before: for ~35 s after beat stopped cleanly, `db downgrade --yes` said "not undone:
    # beat ... running on the broker": its mark stayed in Redis, and any mark, however
    # old, counted as a running beat.
    import os
    import signal
    import sys
    import time
    import uuid

    import redis

    from models.migrate import upgrade
    from tests.e2e.conftest import eventually
    from tests.stack import REPO, WorkerStack
    from workers.heartbeats import beat_key, last_beat

    queue = f"beatstop-{uuid.uuid4().hex[:8]}"
    stack = WorkerStack(name=queue, store_url=f"sqlite:///{tmp_path / 'store.db'}",
                        root=tmp_path, broker_url=redis_server.url,
                        extra_env={"LEASEKEEPER_TASK_QUEUE": queue})
    upgrade(stack.store_url)
    env = cli_env(**{k: v for k, v in stack.env.items() if k.startswith("LEASEKEEPER_")})
    client = redis.Redis.from_url(redis_server.url)
    with open(tmp_path / "beat.log", "ab") as log:
        beat = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "workers.app", "beat", "-l", "info"],
            cwd=REPO, env=stack.env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        # given a real beat of the installation that ticked
        eventually(lambda: last_beat(client, queue), 60, "beat's first tick")
        # while it runs, the downgrade is refused, saying when beat last ticked
        refused = leasekeeper("db", "downgrade", "0009", "--yes", env=env)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        short_error(refused, "not undone: beat (last ticked ", " ago) of this installation")
        # when beat is stopped cleanly (SIGTERM, as `up`, compose and Kubernetes stop it)
        os.killpg(beat.pid, signal.SIGTERM)
        assert beat.wait(60) == 0
    finally:
        if beat.poll() is None:
            os.killpg(beat.pid, signal.SIGKILL)
            beat.wait(10)
    # then its mark is gone, and the downgrade goes at once
    assert last_beat(client, queue) is None
    done = leasekeeper("db", "downgrade", "0009", "--yes", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert revision_of(stack.store_url) == "0009_runs12"
    # and a mark older than three of beat's longest sleeps (a killed beat's, in a Redis
    # that kept it) is a beat that is gone, as `health --beat` judges it
    client.set(beat_key(queue), repr(time.time() - 3600), ex=3600)
    try:
        older = leasekeeper("db", "downgrade", "0004", "--yes", env=env)
        assert older.returncode == 0, older.stdout + older.stderr
        assert leasekeeper("health", "--beat", env=env).returncode == 1
    finally:
        client.delete(beat_key(queue))
        client.close()
