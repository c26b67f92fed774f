"""What an operator hit with `leasekeeper leases ...` and `runs list`, each run as a real
`leasekeeper` process on a real store (SQLite and PostgreSQL): durations out of range,
retry/forget on a lease that is not abandoned, a destroy no worker answers, the destroy
preview with --json, a prefix too short, and empty filter values. Each answers in one line
on stderr, with the README's exit code and no traceback."""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from datetime import timedelta
from itertools import pairwise
from pathlib import Path

import pytest
from sqlalchemy import insert

from models.schema import Lease, LeaseState, Run, utcnow
from models.store import Store
from tasks.leases import new_lease_id
from tests.e2e.conftest import cli_env, leasekeeper
from tests.services import RedisServer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    s = Store(store_url)
    yield s
    s.dispose()


@pytest.fixture
def env(store_url: str, tmp_path: Path) -> dict[str, str]:
    return cli_env(LEASEKEEPER_STORE_URL=store_url, LEASEKEEPER_VAR_DIR=str(tmp_path))


def add(store: Store, state: str, tenant: str = "acme", lease_id: str | None = None) -> str:
    """One lease in ``state`` (created an hour ago, no run); its id."""
    lease_id = lease_id or new_lease_id()
    at = utcnow() - timedelta(hours=1)
    with store.tx() as s:
        s.execute(insert(Lease).values(
            lease_id=lease_id, sandbox_key=f"k-{lease_id}", provider="noop",
            provider_lease_id=f"lk-{lease_id}", state=state, tenant=tenant,
            live_key=f"k-{lease_id}" if state == LeaseState.ACTIVE else None,
            created_at=at, updated_at=at, acquire_deadline_at=at, deadline_at=at,
            idle_timeout_s=60))
    return lease_id


def one_line(done: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    """The command exited ``code`` with one `leasekeeper: ` line on stderr holding each
    needle, nothing on stdout, no traceback."""
    assert done.returncode == code, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("leasekeeper: "), done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def refused(done: subprocess.CompletedProcess[str], option: str, *needles: str) -> None:
    """Refused as bad input (exit 2) naming the option, its error on one line."""
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and option in errors[0], done.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]


def test_a_duration_past_100_years_is_refused(store: Store, env: dict[str, str]) -> None:
    # Before: OverflowError tracebacks ("date value out of range", "Python int too large").
    add(store, LeaseState.ACTIVE)
    for value in ("999999d", "99999999999d", "36501d", "9" * 400 + "s"):
        for command in (["leases", "list"], ["leases", "destroy", "--state", "active"]):
            refused(leasekeeper(*command, "--older-than", value, env=env), "--older-than",
                    "100 years")
    listed = leasekeeper("leases", "list", "--older-than", "36500d", "--json", env=env)
    assert listed.returncode == 0 and json.loads(listed.stdout)["total"] == 0, listed.stderr


@pytest.mark.parametrize("command", ["retry", "forget"])
def test_retry_and_forget_name_the_state_of_a_lease_not_abandoned(
        store: Store, env: dict[str, str], command: str) -> None:
    # Before: "only abandoned leases retry" on stdout, exit 1.
    active, destroyed, abandoned = (add(store, state) for state in (
        LeaseState.ACTIVE, LeaseState.DESTROYED, LeaseState.ABANDONED))
    one_line(leasekeeper("leases", command, active, env=env), 2, active, "is active",
             "abandoned", f"leasekeeper leases destroy {active}")
    one_line(leasekeeper("leases", command, destroyed, env=env), 2, destroyed,
             "is destroyed", "nothing to")
    assert store.get_lease(active).state == LeaseState.ACTIVE
    done = leasekeeper("leases", command, abandoned, env=env)
    assert done.returncode == 0, done.stderr
    assert store.get_lease(abandoned).state == (
        LeaseState.PENDING_CLEANUP if command == "retry" else LeaseState.DESTROYED)


def test_a_destroy_no_worker_answers_says_it_is_queued(
        store: Store, env: dict[str, str], redis_server: RedisServer) -> None:
    # Before: "RESULT failed ... TimeoutError: The operation timed out.", exit 1.
    import redis

    queue = f"noworker-{uuid.uuid4().hex[:8]}"  # a queue no worker of the session serves
    env = {**env, "LEASEKEEPER_BROKER_URL": redis_server.url,
           "LEASEKEEPER_TASK_QUEUE": queue}
    lease_id = add(store, LeaseState.ACTIVE)
    try:
        done = leasekeeper("leases", "destroy", lease_id, "--wait", "1", "--json", env=env)
        assert "TimeoutError" not in done.stdout + done.stderr
        one_line(done, 1, "no worker answered within 1 s",
                 "queued and runs when a worker takes it", "leasekeeper health --worker")
        answer = json.loads(done.stdout)
        assert [(r["lease_id"], r["result"]) for r in answer["destroyed"]] == [
            (lease_id, "queued")]
        assert (answer["failed"], answer["unanswered"]) == (0, 1)
        text = leasekeeper("leases", "destroy", lease_id, "--wait", "0.5", env=env)
        one_line(text, 1, "no worker answered within 0.5 s")
        assert "queued" in text.stdout.splitlines()[1]
    finally:
        client = redis.Redis.from_url(redis_server.url)
        for key in client.scan_iter(f"{queue}*"):
            client.delete(key)
    assert store.get_lease(lease_id).state == LeaseState.ACTIVE  # nothing ran it


def test_the_destroy_preview_is_json_with_json_and_exits_0(store: Store,
                                                           env: dict[str, str]) -> None:
    # Before: a table with --json, and exit 2 (bad input) for doing what was asked.
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    active = [add(store, LeaseState.ACTIVE, tenant) for _ in range(2)]
    add(store, LeaseState.ACTIVE, "someone-else")
    done = leasekeeper("leases", "destroy", "--state", "active", "--tenant", tenant,
                       "--json", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    preview = json.loads(done.stdout)
    assert [x["lease_id"] for x in preview["would_destroy"]] == active[::-1]
    assert preview["would_destroy"][0]["tenant"] == tenant
    assert (preview["dry_run"], preview["destroyed"]) == (True, [])
    assert "nothing was destroyed" in done.stderr
    table = leasekeeper("leases", "destroy", "--state", "active", "--tenant", tenant, env=env)
    assert table.returncode == 0, table.stderr
    assert all(x in table.stdout for x in active) and "add --yes" in table.stderr
    assert {store.get_lease(x).state for x in active} == {LeaseState.ACTIVE}


def test_a_prefix_shorter_than_8_characters_is_bad_input(store: Store, env: dict[str, str]
                                                          ) -> None:
    # Before: "no lease ...; `leasekeeper leases list` shows the ids"; then "no lease
    # '01a2' in the store; a prefix needs at least 8 characters", exit 4 (no such lease).
    lease_id = add(store, LeaseState.ACTIVE)
    for command in ("show", "retry", "forget"):
        line = one_line(leasekeeper("leases", command, lease_id[:7], env=env), 2,
                        f"a lease id prefix needs at least 8 characters; got {lease_id[:7]!r}")
        assert "no lease" not in line
    done = leasekeeper("leases", "destroy", lease_id[:7], env=env)
    assert done.returncode == 2 and "at least 8 characters" in done.stderr, done.stderr
    shown = leasekeeper("leases", "show", lease_id[:8], "--json", env=env)
    assert shown.returncode == 0 and lease_id in shown.stdout, shown.stderr


@pytest.mark.parametrize("args", [
    ["leases", "list", "--tenant", ""],
    ["leases", "list", "--provider", ""],
    ["leases", "list", "--pool", ""],
    ["leases", "list", "--state", ""],
    ["leases", "list", "--state", "active", "--state", " "],
    ["leases", "list", "--older-than", ""],
    ["leases", "destroy", "--tenant", "", "--state", "active"],
    ["leases", "destroy", "--provider", "", "--state", "active", "--yes"],
    ["leases", "destroy", "--state", "active", "--older-than", " ", "--yes"],
    ["runs", "list", "--thread", ""],
    ["runs", "list", "--status", ""],
], ids=lambda args: " ".join(repr(a) if not a.strip() else a for a in args))
def test_an_empty_filter_is_refused(store: Store, env: dict[str, str], args: list[str]
                                    ) -> None:
    # Before: dropped, so `destroy --tenant '' --state active` listed every tenant's leases.
    lease_id = add(store, LeaseState.ACTIVE)
    option = next(a for a, value in pairwise(args) if not value.strip())
    done = leasekeeper(*args, env=env)
    refused(done, option, "empty")
    assert lease_id not in done.stdout
    assert store.get_lease(lease_id).state == LeaseState.ACTIVE


def test_an_ambiguous_prefix_is_bad_input_naming_the_candidates(
        store: Store, env: dict[str, str]) -> None:
    # Before: "no lease ...; several ids start with it", exit 4 (no such lease).
    first = add(store, LeaseState.ACTIVE, lease_id="0badcafe" + "0" * 23 + "1")
    second = add(store, LeaseState.ACTIVE, lease_id="0badcafe" + "0" * 23 + "2")
    done = leasekeeper("leases", "show", "0badcafe", env=env)
    one_line(done, 2, "several leases' ids start with '0badcafe'", first, second,
             "give more of the id")


UNDECODABLE = "\udcff\udcfeabcdefgh"  # the bytes ff fe then text, as argv decodes them


@pytest.mark.parametrize("args", [
    ["leases", "show", "bad id!"], ["leases", "show", UNDECODABLE], ["leases", "show", ""],
    ["leases", "destroy", "bad id!"], ["leases", "destroy", UNDECODABLE],
    ["leases", "retry", "x" * 129], ["leases", "forget", UNDECODABLE],
    ["runs", "show", "bad id!"], ["runs", "show", UNDECODABLE],
], ids=lambda args: " ".join(a.encode("ascii", "backslashreplace").decode()[:20]
                             for a in args))
def test_a_malformed_id_is_bad_input_saying_why(store: Store, env: dict[str, str],
                                                args: list[str]) -> None:
    # Before: "no lease 'bad id!' in the store" (exit 4), and for undecodable bytes
    # "unexpected UnicodeEncodeError ... This is a leasekeeper bug" (exit 1).
    add(store, LeaseState.ACTIVE)
    kind = "run id" if args[0] == "runs" else "lease id"
    line = one_line(leasekeeper(*args, env=env), 2, f"{kind} must be 1-128 characters",
                    "got ")
    assert "bug" not in line and "no lease" not in line


@pytest.mark.parametrize("args", [
    ["leases", "list", "--tenant", UNDECODABLE],
    ["leases", "destroy", "--state", "active", "--provider", UNDECODABLE],
    ["runs", "list", "--thread", UNDECODABLE],
], ids=lambda args: " ".join(a.encode("ascii", "backslashreplace").decode()[:20]
                             for a in args))
def test_an_undecodable_filter_is_bad_input(store: Store, env: dict[str, str],
                                            args: list[str]) -> None:
    # Before: "unexpected UnicodeEncodeError ... This is a leasekeeper bug", exit 1.
    add(store, LeaseState.ACTIVE)
    refused(leasekeeper(*args, env=env), args[-2], "not valid text")


@pytest.mark.parametrize("run_id", ["exp-1", "experiment-1"])
def test_a_run_id_given_as_a_lease_names_the_runs_command(store: Store, env: dict[str, str],
                                                         run_id: str) -> None:
    # Before: "no lease 'exp-1' in the store; a prefix needs at least 8 characters".
    add(store, LeaseState.ACTIVE)
    with store.tx() as s:
        s.execute(insert(Run).values(run_id=run_id, status="running", provider="noop"))
    one_line(leasekeeper("leases", "show", run_id, env=env), 4,
             f"no lease {run_id!r} in the store; {run_id!r} is a run: "
             f"`leasekeeper runs show {run_id}`")
    # an id that is no run gets no such hint
    line = one_line(leasekeeper("leases", "show", "nosuch-lease-id", env=env), 4,
                    "no lease 'nosuch-lease-id' in the store")
    assert "is a run" not in line


def test_a_lease_id_given_as_a_run_names_the_leases_command(store: Store,
                                                            env: dict[str, str]) -> None:
    # Before: "no run '<lease id>' in the store; `leasekeeper runs list` shows them".
    lease_id = add(store, LeaseState.ACTIVE)
    one_line(leasekeeper("runs", "show", lease_id, env=env), 4,
             f"no run {lease_id!r} in the store; {lease_id!r} is a lease: "
             f"`leasekeeper leases show {lease_id}`")


def test_leases_list_before_an_unknown_lease_is_refused(store: Store, env: dict[str, str]
                                                        ) -> None:
    # Before: exit 0 with the newest leases, as if --before were not given.
    lease_id = add(store, LeaseState.ACTIVE)
    for args in (["--before", "zzz"], ["--before", "zzz", "--json"]):
        done = leasekeeper("leases", "list", *args, env=env)
        one_line(done, 4, "no lease 'zzz' to list leases before; pass the lease id the "
                 "previous page named (--before)")
        assert lease_id not in done.stdout
    listed = leasekeeper("leases", "list", "--before", lease_id, "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)["leases"] == []


def test_a_destroy_past_its_limit_says_how_many_more_in_good_grammar(
        store: Store, env: dict[str, str], redis_server: RedisServer) -> None:
    # Before: "1 more were not destroyed".
    import redis

    queue = f"noworker-{uuid.uuid4().hex[:8]}"  # no worker: each destroy stays queued
    env = {**env, "LEASEKEEPER_BROKER_URL": redis_server.url,
           "LEASEKEEPER_TASK_QUEUE": queue}
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    for _ in range(3):
        add(store, LeaseState.ACTIVE, tenant)
    try:
        for limit, more in (("2", "1 more was not destroyed"),
                            ("1", "2 more were not destroyed")):
            done = leasekeeper("leases", "destroy", "--state", "active", "--tenant", tenant,
                               "--yes", "--limit", limit, "--wait", "0.2", env=env)
            assert done.returncode == 1, done.stdout + done.stderr
            assert f"took the newest {limit}: {more}; run the same command again" \
                in done.stderr, done.stderr
    finally:
        client = redis.Redis.from_url(redis_server.url)
        for key in client.scan_iter(f"{queue}*"):
            client.delete(key)


@pytest.mark.parametrize("command", [["leases", "list"],
                                     ["leases", "destroy", "--state", "active"]])
def test_a_duration_without_a_unit_is_refused_naming_the_units(
        store: Store, env: dict[str, str], command: list[str]) -> None:
    # Before: `--older-than 10` was taken as 10 seconds, though the help asks for a unit.
    add(store, LeaseState.ACTIVE)
    for value in ("10", "1.5", " 10 "):
        refused(leasekeeper(*command, "--older-than", value, env=env), "--older-than",
                "unit", "90s, 15m, 2h or 1d")
    assert leasekeeper(*command, "--older-than", "10s", env=env).returncode == 0


@pytest.mark.parametrize("args", [
    ["leases", "list", "--tenant", "\x01bad"],
    ["leases", "list", "--provider", "no\nop"],
    ["leases", "destroy", "--state", "active", "--tenant", "\x1b[31m", "--yes"],
    ["runs", "list", "--thread", "t\x7f"],
], ids=lambda args: " ".join(a.encode("unicode_escape").decode()[:20] for a in args))
def test_a_control_character_in_a_filter_is_bad_input(store: Store, env: dict[str, str],
                                                      args: list[str]) -> None:
    # Before: accepted (and matched nothing), where the console answers 400.
    lease_id = add(store, LeaseState.ACTIVE)
    refused(leasekeeper(*args, env=env), args[-2] if args[-1] != "--yes" else args[-3],
            "control characters")
    assert store.get_lease(lease_id).state == LeaseState.ACTIVE


def test_destroying_an_abandoned_lease_names_retry_and_forget(
        redis_server: RedisServer, tmp_path: Path) -> None:
    # Before: "already_ended abandoned", exit 0, and nothing said what to do instead.
    from tests.stack import own_queue_stack

    with own_queue_stack("abandoned-destroy", redis_server.url, tmp_path) as stack:
        store = Store(stack.store_url)
        try:
            lease_id = add(store, LeaseState.ABANDONED)
            done = leasekeeper("leases", "destroy", lease_id, env=stack.env)
            assert done.returncode == 0, done.stdout + done.stderr
            assert "already_ended" in done.stdout and "abandoned" in done.stdout
            one_line(done, 0, f"lease {lease_id} is abandoned",
                     f"`leasekeeper leases retry {lease_id}`",
                     f"`leasekeeper leases forget {lease_id}`")
            assert store.get_lease(lease_id).state == LeaseState.ABANDONED
        finally:
            store.dispose()


@pytest.mark.parametrize(("ended", "says"), [
    (LeaseState.DESTROYED, "already destroyed: nothing is left to destroy"),
    (LeaseState.ABANDONED, "`leasekeeper leases retry <id>`"),
])
def test_destroy_by_a_state_destroy_never_leaves_is_refused(
        store: Store, env: dict[str, str], ended: str, says: str) -> None:
    # Before: each matching lease answered already_ended, and past --limit the command said
    # "run the same command again for the next ones" (exit 1): the same leases, for ever.
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    ids = [add(store, ended, tenant) for _ in range(3)]
    for extra in ([], ["--state", "active"]):
        done = leasekeeper("leases", "destroy", "--state", ended, *extra, "--tenant", tenant,
                           "--yes", "--limit", "2", env=env)
        refused(done, "--state", f"--state {ended} matches leases", says)
        assert "run the same command again" not in done.stderr
    assert [store.get_lease(i).state for i in ids] == [ended] * 3
