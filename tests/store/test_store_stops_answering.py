"""A PostgreSQL store that stops answering fails the statement, in bounded time, as
StoreUnavailable (which the tasks retry); it never holds a worker's process until the hard
time limit kills it. Three ways it happens:

- the server process stops answering (frozen, or its host gone with no reset): the hot
  path waits for the answer at most ``statement_timeout_s`` plus a grace, then drops the
  connection (here the backend serving the hot path is SIGSTOPped);
- a statement waits on a lock someone else holds: the server cancels it after
  ``statement_timeout_s`` (its ``statement_timeout``);
- a task's soft time limit fires while a statement is waiting: the wait is interrupted at
  once (Celery raises SoftTimeLimitExceeded from a signal handler), and the connection,
  which still has that statement in flight, is dropped, so the next call works.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest

from models.migrate import upgrade
from models.schema import LeaseState
from models.store import Store
from providers.errors import StoreUnavailable
from tests.services import PostgresServer
from tests.store.test_plain_sql import new_lease

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(180)]


@pytest.fixture
def store(postgres_server: PostgresServer) -> Iterator[Store]:
    url = postgres_server.create_database(f"lk_{uuid.uuid4().hex[:12]}")
    upgrade(url)
    s = Store(url, statement_timeout_s=1.0)
    s.start_run_with_intent("run-1", new_lease("l1", "k1", "run-1"), None)
    yield s
    s.dispose()


# A wait that ignores both the store's deadline and signals would hang the test for good
# (pytest-timeout's own alarm cannot interrupt it either): a watchdog releases what the
# test holds after this long, and the test then fails on what the watchdog records.
WATCHDOG_S = 20.0


@contextlib.contextmanager
def watchdog(release: Callable[[], None], after_s: float = WATCHDOG_S
             ) -> Iterator[threading.Event]:
    fired = threading.Event()

    def fire() -> None:
        fired.set()
        release()

    timer = threading.Timer(after_s, fire)
    timer.start()
    try:
        yield fired
    finally:
        timer.cancel()


@contextlib.contextmanager
def frozen_backend(store: Store) -> Iterator[threading.Event]:
    """The server process behind this thread's hot-path connection, stopped; the event
    says whether the watchdog had to let it go on."""
    pid = store._hot().driver.info.backend_pid
    os.kill(pid, signal.SIGSTOP)
    try:
        with watchdog(lambda: os.kill(pid, signal.SIGCONT)) as fired:
            yield fired
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_server_that_stops_answering_fails_the_statement_as_unavailable(
        store: Store) -> None:
    with frozen_backend(store) as released:
        with pytest.raises(StoreUnavailable) as failed:
            store.transition("l1", {LeaseState.PROVISIONING}, LeaseState.ACTIVE, "ready")
        assert not released.is_set(), "the call returned only once the server went on"
    # the error says what happened and what comes next, and names no secret
    assert "did not answer within 6 s" in str(failed.value)
    assert "will retry" in str(failed.value)
    # nothing moved, and the next call works on a new connection
    assert store.get_lease("l1").state == LeaseState.PROVISIONING
    assert store.transition("l1", {LeaseState.PROVISIONING}, LeaseState.ACTIVE,
                            "ready") is not None


def test_a_statement_waiting_on_a_lock_is_cancelled_by_the_server(
        store: Store, postgres_server: PostgresServer) -> None:
    plain = store.url.replace("+psycopg", "")
    with psycopg.connect(plain) as holder:  # a transaction holding the lease's row
        holder.execute("SELECT 1 FROM leases WHERE lease_id = 'l1' FOR UPDATE")
        holder_pid = holder.info.backend_pid

        def end_holder() -> None:
            with psycopg.connect(plain, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (holder_pid,))

        with watchdog(end_holder) as released:
            with pytest.raises(StoreUnavailable, match="statement timeout"):
                store.transition("l1", {LeaseState.PROVISIONING}, LeaseState.ACTIVE,
                                 "ready")
            # a session's statement is cancelled the same way
            with pytest.raises(StoreUnavailable, match="statement timeout"):
                store.extend_acquire_deadline("run-1",
                                              new_lease("l1", "k1", "run-1").deadline_at)
        assert not released.is_set(), "the calls returned only once the lock was gone"
        holder.rollback()
    assert store.transition("l1", {LeaseState.PROVISIONING}, LeaseState.ACTIVE,
                            "ready") is not None


class SoftTimeLimit(Exception):
    """Stands in for Celery's SoftTimeLimitExceeded, raised from a signal handler."""


def test_a_soft_time_limit_interrupts_a_waiting_statement(store: Store) -> None:
    def soft_limit(_signum: int, _frame: object) -> None:
        raise SoftTimeLimit()

    # a store deadline far past the limit: only the interrupted wait can end the call
    # before the test's own timeout (a wait that ignores signals hangs until SIGCONT)
    patient = Store(store.url, statement_timeout_s=600.0)
    previous = signal.signal(signal.SIGALRM, soft_limit)
    try:
        with frozen_backend(patient) as released:
            signal.setitimer(signal.ITIMER_REAL, 0.5)
            with pytest.raises(SoftTimeLimit):
                patient.transition("l1", {LeaseState.PROVISIONING}, LeaseState.ACTIVE,
                                   "ready")
            assert not released.is_set(), "the limit acted only once the server went on"
        # the connection with the interrupted statement is gone: the next call just works
        assert patient.transition("l1", {LeaseState.PROVISIONING}, LeaseState.ACTIVE,
                                  "ready") is not None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        patient.dispose()
