"""Errors a person can act on: each case the issue quoted, run as a real `leasekeeper`
process (or a real producer call in a child process), answers in one or two lines that
name the setting, the address and the fix, with a non-zero exit and no traceback."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from kombu.utils.url import maybe_sanitize_url

from models.schema import utcnow
from models.store import NewLease, Store
from tests.e2e.conftest import HIDDEN_PACKAGES, cli_env, leasekeeper
from tests.services import free_port

pytestmark = pytest.mark.timeout(120)


def closed_port() -> int:
    port = free_port()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    return port


def short_error(done: object, *needles: str) -> str:
    stderr = getattr(done, "stderr", "")
    assert "Traceback" not in stderr + getattr(done, "stdout", ""), stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert 1 <= len(lines) <= 2, stderr
    for needle in needles:
        assert needle in stderr, stderr
    return stderr


def test_up_with_the_broker_on_a_closed_port_fails_at_once(tmp_path: Path) -> None:
    # Before: ~10 s of silence, then a 327-line traceback.
    url = f"redis://127.0.0.1:{closed_port()}/0"
    done = leasekeeper("up", env=cli_env(LEASEKEEPER_BROKER_URL=url,
                                         LEASEKEEPER_VAR_DIR=str(tmp_path)))
    assert done.returncode == 3, done.stdout + done.stderr
    short_error(done, url, "LEASEKEEPER_BROKER_URL", "unreachable")
    assert not (tmp_path / "logs" / "worker.log").exists()  # nothing was started


def test_a_producer_call_with_the_broker_down_raises_broker_unavailable(tmp_path: Path
                                                                       ) -> None:
    # Before: ~100 lines ending "RuntimeError: Retry limit exceeded while trying to
    # reconnect to the Celery result store backend", after seconds of retries.
    import subprocess
    import sys

    url = f"redis://127.0.0.1:{closed_port()}/0"
    probe = (
        "from tasks import producer\n"
        "from providers.errors import BrokerUnavailable, is_transient\n"
        "try:\n"
        "    producer.acquire_lease('run-1', {'tenant': 'acme'})\n"
        "except BrokerUnavailable as exc:\n"
        "    print('transient' if is_transient(exc) else 'terminal', exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env=cli_env(LEASEKEEPER_BROKER_URL=url,
                                      LEASEKEEPER_VAR_DIR=str(tmp_path)),
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("transient "), done.stdout + done.stderr
    assert url in done.stdout and "LEASEKEEPER_BROKER_URL" in done.stdout
    assert "Traceback" not in done.stderr


def test_health_names_a_broker_that_is_down(tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{closed_port()}/0"
    done = leasekeeper("health", "--broker", env=cli_env(LEASEKEEPER_BROKER_URL=url,
                                                         LEASEKEEPER_VAR_DIR=str(tmp_path)))
    assert done.returncode == 1
    short_error(done, url)


def test_a_missing_store_folder_is_named(tmp_path: Path) -> None:
    # Before: "... is unavailable (OperationalError: unable to open database file); the
    # task will retry" (there is no task at the command line).
    folder = tmp_path / "no-such-folder"
    done = leasekeeper("leases", "list", env=cli_env(
        LEASEKEEPER_STORE_URL=f"sqlite:///{folder}/leasekeeper.db",
        LEASEKEEPER_VAR_DIR=str(tmp_path)))
    assert done.returncode == 2
    err = short_error(done, str(folder), "does not exist", "leasekeeper db upgrade")
    assert "task will retry" not in err
    assert not folder.exists()


def test_a_store_never_migrated_names_db_upgrade_and_creates_nothing(tmp_path: Path) -> None:
    # Before: "no such table: leases; the task will retry", and an empty .db was created.
    for command in (["leases", "list"], ["runs", "list"], ["status"], ["leases", "show",
                                                                       "01a23c6c5e8ec5d4"]):
        done = leasekeeper(*command, env=cli_env(LEASEKEEPER_VAR_DIR=str(tmp_path),
                                                 LEASEKEEPER_BROKER_URL="redis://127.0.0.1:"
                                                 f"{closed_port()}/0"))
        assert done.returncode != 0, command
        assert "leasekeeper db upgrade" in done.stdout + done.stderr, command
        assert "no such table" not in done.stdout + done.stderr
        assert "Traceback" not in done.stderr
    assert not (tmp_path / "leasekeeper.db").exists()
    migrated = leasekeeper("db", "upgrade", env=cli_env(LEASEKEEPER_VAR_DIR=str(tmp_path)))
    assert migrated.returncode == 0, migrated.stderr
    listed = leasekeeper("leases", "list", "--json",
                         env=cli_env(LEASEKEEPER_VAR_DIR=str(tmp_path)))
    assert listed.returncode == 0, listed.stderr
    assert '"total": 0' in listed.stdout


def test_a_mysql_url_is_refused_in_one_line(tmp_path: Path) -> None:
    # Before: an 83-line traceback.
    for command in (["leases", "list"], ["db", "upgrade"]):
        done = leasekeeper(*command, env=cli_env(
            LEASEKEEPER_STORE_URL="mysql://lk:secret-pw@127.0.0.1:3306/lk",
            LEASEKEEPER_VAR_DIR=str(tmp_path)))
        assert done.returncode == 2
        err = short_error(done, "LEASEKEEPER_STORE_URL", "mysql", "postgresql+psycopg://")
        assert "secret-pw" not in err


def test_db_upgrade_on_postgres_without_psycopg_names_the_package(tmp_path: Path) -> None:
    # Before (plain install): a 132-line traceback ending "No module named 'psycopg'".
    done = leasekeeper("db", "upgrade", env=cli_env(
        LEASEKEEPER_STORE_URL="postgresql+psycopg://lk:secret-pw@127.0.0.1:5432/lk",
        LEASEKEEPER_VAR_DIR=str(tmp_path), LEASEKEEPER_TEST_HIDE_PACKAGES="psycopg",
        PYTHONPATH=f"{HIDDEN_PACKAGES}:{cli_env()['PYTHONPATH']}"))
    assert done.returncode == 2
    err = short_error(done, "psycopg", "pip install", "leasekeeper[postgres]")
    assert "secret-pw" not in err


def test_unknown_leasekeeper_variables_are_warned_with_the_closest_name(tmp_path: Path
                                                                        ) -> None:
    # Before: LEASEKEEPER_LEASE_TTL was silently ignored.
    done = leasekeeper("--version", env=cli_env(LEASEKEEPER_LEASE_TTL="60",
                                                LEASEKEEPER_VAR_DIR=str(tmp_path)))
    assert done.returncode == 0
    assert ("LEASEKEEPER_LEASE_TTL is not a leasekeeper setting and is ignored; did you mean "
            "LEASEKEEPER_LEASE_TTL_S?") in done.stderr


def test_an_invalid_filter_is_refused_naming_the_known_values(tmp_path: Path) -> None:
    leasekeeper("db", "upgrade", env=cli_env(LEASEKEEPER_VAR_DIR=str(tmp_path)))
    done = leasekeeper("leases", "list", "--state", "actve",
                       env=cli_env(LEASEKEEPER_VAR_DIR=str(tmp_path)))
    assert done.returncode == 2
    assert "unknown state(s) actve" in done.stderr and "active" in done.stderr
    assert "Traceback" not in done.stderr
    done = leasekeeper("leases", "list", "--older-than", "two hours",
                       env=cli_env(LEASEKEEPER_VAR_DIR=str(tmp_path)))
    assert done.returncode == 2 and "not a duration" in done.stderr


def test_db_upgrade_with_postgres_down_names_the_address_without_the_password(
        tmp_path: Path) -> None:
    port = closed_port()
    done = leasekeeper("db", "upgrade", env=cli_env(
        LEASEKEEPER_STORE_URL=f"postgresql+psycopg://lk:secret-pw@127.0.0.1:{port}/lk",
        LEASEKEEPER_VAR_DIR=str(tmp_path)))
    assert done.returncode == 3
    err = short_error(done, "cannot migrate the store", f"127.0.0.1:{port}",
                      "LEASEKEEPER_STORE_URL")
    assert "secret-pw" not in err


# Make the result consumer's subscription see the lost broker before the next send: its
# socket is written to once after the kill, so the peer's reset is already in. The next
# send's SUBSCRIBE (Celery subscribes before it publishes) then fails at once, Celery's
# reconnect fails too, and it raises "must be restarted" (a RuntimeError). Without this
# the first SUBSCRIBE may still be accepted by the kernel and the publish fail instead:
# which of the two a real client gets is a race (CI saw both).
_SUBSCRIPTION_SEES_THE_RESET = (
    "from workers.app import app\n"
    "sock = app.backend.result_consumer._pubsub.connection._sock\n"
    "try:\n"
    "    sock.sendall(b'PING\\r\\n'); time.sleep(0.2)\n"
    "except OSError:\n"
    "    pass\n"
)


@pytest.mark.parametrize("subscription", ["as found", "reset seen"])
def test_a_broker_lost_between_two_sends_fails_each_send_as_broker_unavailable(
        tmp_path: Path, subscription: str) -> None:
    # Sends within a second of one that reached the broker skip their PING; a broker lost
    # meanwhile must still fail those sends as BrokerUnavailable, never leave Celery's
    # result consumer in its "must be restarted" state (a RuntimeError after 5 s).
    import subprocess
    import sys

    from tests.services import start_redis

    port = free_port()
    redis = start_redis(tmp_path / "redis", port)
    probe = (
        "import os, signal\n"
        "from tasks import producer\n"
        "from providers.errors import BrokerUnavailable\n"
        "producer.acquire_lease('run-1', {'tenant': 'acme'})\n"
        "producer.destroy_lease('0123456789abcdef')\n"
        "os.kill(int(os.environ['REDIS_PID']), signal.SIGKILL)\n"
        "import time; time.sleep(0.2)\n"
        + (_SUBSCRIPTION_SEES_THE_RESET if subscription == "reset seen" else "") +
        "for _ in range(3):\n"
        "    try:\n"
        "        producer.destroy_lease('0123456789abcdef')\n"
        "        print('sent')\n"
        "    except BrokerUnavailable as exc:\n"
        "        print('unavailable', exc)\n"
    )
    try:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                              env=cli_env(LEASEKEEPER_BROKER_URL=f"redis://127.0.0.1:{port}/0",
                                          LEASEKEEPER_VAR_DIR=str(tmp_path),
                                          REDIS_PID=str(redis.proc.pid)),
                              timeout=90, check=False)
    finally:
        redis.stop()
    assert done.returncode == 0, done.stdout + done.stderr
    answers = done.stdout.splitlines()
    assert [a.split()[0] for a in answers] == ["unavailable"] * 3, done.stdout + done.stderr
    assert all("LEASEKEEPER_BROKER_URL" in a for a in answers)
    assert "Traceback" not in done.stderr


@contextlib.contextmanager
def http_server() -> Iterator[int]:
    """A port where something other than Redis answers: an HTTP server's 400, then close."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with contextlib.suppress(OSError):  # the listener closed: the test is over
            while True:
                conn = listener.accept()[0]
                with conn:
                    conn.settimeout(5)
                    with contextlib.suppress(OSError):
                        conn.recv(4096)  # the request, as an HTTP server reads it first
                        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield int(listener.getsockname()[1])
    finally:
        listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        listener.close()
        thread.join(5)


def a_lease(store_url: str, lease_id: str) -> None:
    """A provisioning lease (and its run) in the store, for a command that looks it up."""
    store = Store(store_url)
    try:
        store.start_run("run-1", "thread-1", "noop", "key-1")
        store.create_intent(NewLease(
            lease_id=lease_id, sandbox_key="key-1", provider="noop",
            provider_lease_id=f"lk-{lease_id}", reuse=False, tenant="acme",
            thread_id="thread-1", run_id="run-1", spec={}, acquire_deadline_at=utcnow(),
            deadline_at=utcnow() + timedelta(hours=1), idle_timeout_s=60), task_id=None)
    finally:
        store.dispose()


def test_a_broker_address_where_something_else_answers_is_named_not_redis(
        tmp_path: Path) -> None:
    # Before: health --broker/--worker/--beat and leases destroy printed a traceback ending
    # "redis.exceptions.InvalidResponse: Protocol Error: b'HTTP/1.1 400 Bad Request'".
    migrated = leasekeeper("db", "upgrade", env=cli_env(LEASEKEEPER_VAR_DIR=str(tmp_path)))
    assert migrated.returncode == 0, migrated.stderr
    a_lease(f"sqlite:///{tmp_path / 'leasekeeper.db'}", "0123456789abcdef")
    with http_server() as port:
        url = f"redis://:secret-pw@127.0.0.1:{port}/0"
        env = cli_env(LEASEKEEPER_BROKER_URL=url, LEASEKEEPER_VAR_DIR=str(tmp_path))
        for command, code in ((["health", "--broker"], 1), (["health", "--worker"], 1),
                              (["health", "--beat"], 1),
                              (["leases", "destroy", "0123456789abcdef"], 3)):
            done = leasekeeper(*command, env=env)
            assert done.returncode == code, (command, done.stdout + done.stderr)
            err = short_error(done, f"127.0.0.1:{port}", "LEASEKEEPER_BROKER_URL",
                              "not Redis")
            assert "secret-pw" not in err, command
        status = leasekeeper("status", env=env)
    assert status.returncode == 1, status.stdout + status.stderr
    assert "not Redis" in status.stdout and "LEASEKEEPER_BROKER_URL" in status.stdout
    assert "secret-pw" not in status.stdout + status.stderr
    assert "Traceback" not in status.stderr


def test_reap_with_the_broker_down_names_the_setting_and_the_fix(tmp_path: Path) -> None:
    # Before: "Redis lock for sweep.finish_exited unavailable: Error 111 connecting to
    # 127.0.0.1:<port>. Connection refused." (no setting, no fix).
    migrated = leasekeeper("db", "upgrade", env=cli_env(LEASEKEEPER_VAR_DIR=str(tmp_path)))
    assert migrated.returncode == 0, migrated.stderr
    url = f"redis://:secret-pw@127.0.0.1:{closed_port()}/0"
    done = leasekeeper("reap", env=cli_env(LEASEKEEPER_BROKER_URL=url,
                                           LEASEKEEPER_VAR_DIR=str(tmp_path)))
    assert done.returncode == 3, done.stdout + done.stderr
    err = short_error(done, "sweep.finish_exited", maybe_sanitize_url(url),
                      "LEASEKEEPER_BROKER_URL", "Start Redis there")
    assert "secret-pw" not in err


def test_a_stale_env_file_of_an_up_that_was_killed_says_to_start_up_again(
    tmp_path: Path,
) -> None:
    # Before, after `up` was killed (or the machine restarted): "the broker at
    # redis://127.0.0.1:<port>/0 ... is unreachable. Start Redis there or fix the URL",
    # when the address was that dead `up`'s own, read from its env file.
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    var = tmp_path / ".var"
    var.mkdir()
    url = f"redis://127.0.0.1:{closed_port()}/0"
    (var / "env").write_text(f"export LEASEKEEPER_BROKER_URL={url}\n")
    (var / "up.lock").write_text(gone.stdout)  # the pid of a process that has ended
    env = cli_env()
    for command, code in ((["status"], 1), (["health", "--broker"], 1)):
        done = leasekeeper(*command, env=env, cwd=tmp_path)
        assert done.returncode == code, done.stdout + done.stderr
        said = done.stdout + done.stderr
        assert url in said and "Start Redis there or fix the URL" in said, said
        assert (".var/env, written by a `leasekeeper up` that is no longer running "
                "(killed, or the machine restarted): start `leasekeeper up` again") in said
    # an `up` still running there: its own broker is the one to fix, nothing else said
    (var / "up.lock").write_text(f"{os.getpid()}\n")
    done = leasekeeper("health", "--broker", env=env, cwd=tmp_path)
    assert done.returncode == 1 and "no longer running" not in done.stdout + done.stderr



def test_the_default_broker_address_unreachable_says_how_to_start_one(
    tmp_path: Path,
) -> None:
    # Before, on a new machine with nothing started: only "Start Redis there or fix the
    # URL", about an address the user never chose. (The default address itself may have
    # a Redis on a machine; the message is built the same way for any unreachable URL.)
    from tasks.broker_words import broker_unreachable
    from workers.up_lock import broker_hint

    with pytest.MonkeyPatch.context() as env:
        env.delenv("LEASEKEEPER_BROKER_URL", raising=False)
        env.setenv("LEASEKEEPER_VAR_DIR", str(tmp_path / ".var"))  # no env file there
        said = broker_unreachable(f"redis://127.0.0.1:{closed_port()}/0",
                                  ConnectionRefusedError("Connection refused"))
    assert ("LEASEKEEPER_BROKER_URL is not set, so this is the default address: "
            "`leasekeeper up` (`make run` in a checkout) starts a broker") in said, said
    assert broker_hint({"LEASEKEEPER_BROKER_URL": "redis://h:1/0"}, tmp_path / "env") == ""
