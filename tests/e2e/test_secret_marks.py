"""A run's error is scrubbed of its secrets whichever worker stores it (tasks/secret_marks.py).

Through real workers on real Redis and SQLite: the worker that ran an acquire is killed,
and a new one, which never saw the secret, stores a finish quoting it; a later run of the
thread quotes the first run's secret; the marks cannot be read at finish (the worker's
Redis connection drops every command on them): the finish is retried, then fails, and the
error is not stored. Redis never holds a secret in clear. Marks lost since the acquire
withhold the text of a run that was given secrets: its lease's own, a pool member's claimed
by it, or a reused lease's whose later run brought secrets of its own.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from providers.errors import BrokerUnavailable
from tests.contract.test_by_name import redis_dump
from tests.e2e.conftest import eventually
from tests.services import RedisServer
from tests.stack import WorkerStack, sending_to
from workers.app import app

pytestmark = pytest.mark.timeout(300)
CORE = uuid.uuid4().hex
SECRET = f"tok-{CORE}"
OTHER = f"other-{uuid.uuid4().hex}"
POOLS = [{"name": "warm", "provider": "noop", "size": 1}]  # its template: no secret_env


class DroppingProxy:
    """A TCP relay in front of Redis. While ``drop`` is set, a connection whose client
    sends bytes containing it is closed before they reach Redis (the client sees a dropped
    connection), every time; everything else passes."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.drop: bytes | None = None
        self.dropped = 0
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):  # the listener closed: the test is over
            while True:
                client = self.listener.accept()[0]
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
                with self._lock:
                    self._socks += [client, upstream]
                threading.Thread(target=self._pipe, args=(client, upstream, True),
                                 daemon=True).start()
                threading.Thread(target=self._pipe, args=(upstream, client, False),
                                 daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, inspect: bool) -> None:
        tail = b""
        with contextlib.suppress(OSError):
            while chunk := src.recv(65536):
                drop = self.drop
                if inspect and drop is not None and drop in tail + chunk:
                    self.dropped += 1
                    break
                tail = chunk[-64:]
                dst.sendall(chunk)
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def stop(self) -> None:
        self.listener.close()
        with self._lock:
            for sock in self._socks:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()


@pytest.fixture
def marks_stack(redis_server: RedisServer, tmp_path: Path
                ) -> Iterator[tuple[WorkerStack, DroppingProxy]]:
    """Workers whose every Redis connection goes through the proxy, on a queue and an
    installation of their own; this test process talks to Redis directly."""
    from models.migrate import upgrade

    name = f"marks-{uuid.uuid4().hex[:8]}"
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    upgrade(store_url)
    proxy = DroppingProxy(redis_server.port)
    stack = WorkerStack(name=name, store_url=store_url, root=tmp_path,
                        broker_url=f"redis://127.0.0.1:{proxy.port}/0",
                        extra_env={"LEASEKEEPER_TASK_QUEUE": name,
                                   "LEASEKEEPER_INSTALLATION_ID": name,
                                   "LEASEKEEPER_SECRET_MARKS_KEY": uuid.uuid4().hex,
                                   "LEASEKEEPER_POOLS": json.dumps(POOLS)})
    with sending_to(name):
        try:
            yield stack, proxy
        finally:
            stack.stop()
            proxy.stop()


def by_name(name: str, **kwargs: Any) -> Any:
    """As a web backend sends it (this process knows no secret: nothing scrubs it here)."""
    return app.send_task(name, kwargs=kwargs).get(90)


def acquire(run_id: str, **spec: Any) -> str:
    return str(by_name("lease.acquire", run_id=run_id,
                       spec={"provider": "noop", **spec})["lease_id"])


def all_acked(stack: WorkerStack, redis_server: RedisServer) -> None:
    """Wait until the worker acked every message it took from the stack's queue (a task's
    result is stored before its message is acked): until then Redis holds the message, and
    its arguments, as any broker does."""
    client = redis.Redis.from_url(redis_server.url)
    queue = stack.name.encode()
    eventually(lambda: not any(queue in v for v in client.hvals("unacked")), 60,
               f"the worker to ack every message of {stack.name}")


def test_a_finish_stored_by_another_worker_is_scrubbed_for_the_run_and_its_thread(
        marks_stack: tuple[WorkerStack, DroppingProxy], redis_server: RedisServer) -> None:
    stack, _ = marks_stack
    rt = stack.runtime()
    first = stack.start_worker(concurrency=1)
    thread = f"th-{uuid.uuid4().hex[:8]}"
    run_a, run_b = f"run-a-{uuid.uuid4().hex[:8]}", f"run-b-{uuid.uuid4().hex[:8]}"
    acquire(run_a, thread_id=thread, secret_env={"API_TOKEN": SECRET})
    # The only process that saw the secret dies; a new worker stores the finish.
    all_acked(stack, redis_server)  # else the acquire is redelivered to the new worker
    stack.kill_worker(first)
    stack.start_worker(concurrency=1)
    by_name("run.finish", run_id=run_a, status="failed", exit_code=1,
            error=f"401 from api: Authorization: Bearer {SECRET} refused")
    stored = rt.store.get_run(run_a)
    assert stored is not None and stored.error == "401 from api: Authorization: Bearer *** refused"

    # A later run of the thread, with secrets of its own, quotes the first run's secret.
    acquire(run_b, thread_id=thread, secret_env={"OTHER_TOKEN": OTHER})
    by_name("run.finish", run_id=run_b, status="failed", exit_code=2,
            error=f"env dump: API_TOKEN={SECRET}\nOTHER_TOKEN={OTHER}")
    stored = rt.store.get_run(run_b)
    assert stored is not None and stored.error == "env dump: API_TOKEN=***\nOTHER_TOKEN=***"

    # The marks are in Redis, per run and per thread, for a week at most; no secret is.
    client = redis.Redis.from_url(redis_server.url)
    prefix = f"leasekeeper:{stack.name}:secret-marks"
    for key in (f"{prefix}:run:{run_a}", f"{prefix}:thread:{thread}"):
        assert client.smembers(key) and 0 < client.ttl(key) <= 7 * 24 * 3600, key
    all_acked(stack, redis_server)
    dump = redis_dump(redis_server.url)
    assert prefix in dump
    shown = [line[:300] for line in dump.splitlines() if CORE in line or OTHER in line]
    assert not shown, shown


def test_a_finish_that_cannot_read_the_marks_is_retried_and_stores_nothing(
        marks_stack: tuple[WorkerStack, DroppingProxy]) -> None:
    stack, proxy = marks_stack
    rt = stack.runtime()
    stack.start_worker(concurrency=1)
    run_id = f"run-c-{uuid.uuid4().hex[:8]}"
    acquire(run_id, thread_id=f"th-{uuid.uuid4().hex[:8]}", secret_env={"API_TOKEN": SECRET})
    proxy.drop = b"secret-marks"  # Redis is unreachable for the marks, and only for them
    sent = app.send_task("run.finish", kwargs={"run_id": run_id, "status": "failed",
                                               "error": f"token {SECRET} rejected"})
    with pytest.raises(BrokerUnavailable, match="could not read the marks of run"):
        sent.get(90)
    assert proxy.dropped >= 1
    log = stack.logfile.read_text(errors="replace")
    assert f"run.finish[{sent.id}] transient failure, retry 1" in log
    stored = rt.store.get_run(run_id)
    assert stored is not None and stored.status == "running" and stored.error is None

    proxy.drop = None  # Redis answers again: the next finish stores the error, scrubbed
    by_name("run.finish", run_id=run_id, status="failed", error=f"token {SECRET} rejected")
    stored = rt.store.get_run(run_id)
    assert stored is not None and stored.error == "token *** rejected"


def test_marks_lost_since_the_acquire_withhold_the_text_instead_of_storing_it(
        marks_stack: tuple[WorkerStack, DroppingProxy], redis_server: RedisServer) -> None:
    # Before: the embedded Redis of `leasekeeper up` keeps no data, so after `up` was
    # restarted a finish (and a destroy's reason) quoting the run's secret was stored and
    # shown in clear: no marks, nothing to scrub.
    stack, _ = marks_stack
    rt = stack.runtime()
    stack.start_worker(concurrency=1)
    thread = f"th-{uuid.uuid4().hex[:8]}"
    run_id, plain = f"run-d-{uuid.uuid4().hex[:8]}", f"run-e-{uuid.uuid4().hex[:8]}"
    lease_id = acquire(run_id, thread_id=thread, secret_env={"API_TOKEN": SECRET})
    acquire(plain, thread_id=f"th-{uuid.uuid4().hex[:8]}")
    client = redis.Redis.from_url(redis_server.url)
    prefix = f"leasekeeper:{stack.name}:secret-marks"
    assert client.delete(f"{prefix}:run:{run_id}", f"{prefix}:thread:{thread}") == 2

    error = f"401 from api: Authorization: Bearer {SECRET} refused"
    by_name("run.finish", run_id=run_id, status="failed", exit_code=1, error=error)
    stored = rt.store.get_run(run_id)
    assert stored is not None and stored.error is not None
    assert CORE not in stored.error
    assert stored.error.startswith(f"[error withheld: {len(error)} chars"), stored.error

    # A run whose lease was given no secret keeps its error: nothing was lost.
    by_name("run.finish", run_id=plain, status="failed", exit_code=1, error="plain failure")
    assert rt.store.get_run(plain).error == "plain failure"  # type: ignore[union-attr]

    # A destroy's reason on the lease that had the secret: withheld too.
    other = f"run-f-{uuid.uuid4().hex[:8]}"
    second = acquire(other, thread_id=f"th-{uuid.uuid4().hex[:8]}",
                     secret_env={"API_TOKEN": SECRET})
    client.delete(*client.keys(f"{prefix}:*{other}*"))
    client.delete(*[k for k in client.keys(f"{prefix}:thread:*")])
    by_name("lease.destroy", lease_id=second, reason=f"rotating {SECRET} now")
    ended = rt.store.get_lease(second)
    assert ended.end_reason == "withheld: its run's secret marks are lost", ended.end_reason
    assert lease_id != second


def test_an_operators_own_reason_is_kept_when_the_marks_are_lost(
        marks_stack: tuple[WorkerStack, DroppingProxy], redis_server: RedisServer) -> None:
    # Before: `leasekeeper leases destroy <id>` (reason "operator") and the console's
    # "operator <user> (console)" on a lease whose marks were lost were recorded as
    # "withheld: its run's secret marks are lost": the history no longer said who ended
    # it, though leasekeeper wrote those reasons itself and no run's secret is in them.
    from tests.e2e.conftest import leasekeeper

    stack, _ = marks_stack
    rt = stack.runtime()
    stack.start_worker(concurrency=1)
    client = redis.Redis.from_url(redis_server.url)
    prefix = f"leasekeeper:{stack.name}:secret-marks"
    leases = {}
    for how in ("cli", "console", "given"):
        run_id = f"run-{how}-{uuid.uuid4().hex[:8]}"
        leases[how] = acquire(run_id, thread_id=f"th-{uuid.uuid4().hex[:8]}",
                              secret_env={"API_TOKEN": SECRET})
        assert client.delete(*client.keys(f"{prefix}:*")) >= 1
    done = leasekeeper("leases", "destroy", leases["cli"], env=stack.env)
    assert done.returncode == 0, done.stdout + done.stderr
    by_name("lease.destroy", lease_id=leases["console"], reason="operator ops (console)")
    by_name("lease.destroy", lease_id=leases["given"], reason=f"rotating {SECRET} now")
    ended = {how: rt.store.get_lease(lease_id) for how, lease_id in leases.items()}
    assert ended["cli"].end_reason == "operator", ended["cli"].end_reason
    assert ended["console"].end_reason == "operator ops (console)"
    # a reason the caller wrote may quote the secret: still withheld
    assert ended["given"].end_reason == "withheld: its run's secret marks are lost"
    for how in ("cli", "console"):
        history = " | ".join(e.reason for e in rt.store.events(leases[how]))
        assert "withheld" not in history and "operator" in history, (how, history)


def lose_marks(stack: WorkerStack, redis_server: RedisServer, run_id: str, thread: str) -> None:
    """What a Redis without persistence restarted (or a flush) does to the run's marks."""
    client = redis.Redis.from_url(redis_server.url)
    prefix = f"leasekeeper:{stack.name}:secret-marks"
    assert client.delete(f"{prefix}:run:{run_id}", f"{prefix}:thread:{thread}") == 2


def finish_quoting_the_secret(stack: WorkerStack, redis_server: RedisServer, worker: Any,
                              run_id: str) -> None:
    """By a worker that never saw the secret (the one that ran the acquire is killed)."""
    all_acked(stack, redis_server)
    stack.kill_worker(worker)
    stack.start_worker(concurrency=1)
    error = f"401 from api: Authorization: Bearer {SECRET} refused"
    by_name("run.finish", run_id=run_id, status="failed", exit_code=1, error=error)
    stored = stack.runtime().store.get_run(run_id)
    assert stored is not None and stored.error is not None
    assert CORE not in stored.error, stored.error
    assert stored.error.startswith(f"[error withheld: {len(error)} chars"), stored.error


def test_marks_lost_for_a_run_claimed_from_a_warm_pool_withhold_its_error(
        marks_stack: tuple[WorkerStack, DroppingProxy], redis_server: RedisServer) -> None:
    # Before: the lost-marks check read the lease's spec only; a claimed member's lease
    # is the pool's, so a run's own secret_env had to be found there or nowhere.
    stack, _ = marks_stack
    rt = stack.runtime()
    worker = stack.start_worker(concurrency=1)
    by_name("sweep.fill_pools")
    eventually(lambda: rt.store.leases(["warm"]), 60,
               "the pool's member to be warm")
    thread, run_id = f"th-{uuid.uuid4().hex[:8]}", f"run-g-{uuid.uuid4().hex[:8]}"
    done = by_name("lease.acquire", run_id=run_id, spec={
        "pool": "warm", "thread_id": thread, "secret_env": {"API_TOKEN": SECRET}})
    assert done["result"] == "claimed", done
    lose_marks(stack, redis_server, run_id, thread)
    finish_quoting_the_secret(stack, redis_server, worker, run_id)


def test_marks_lost_for_a_reused_run_with_secrets_of_its_own_withhold_its_error(
        marks_stack: tuple[WorkerStack, DroppingProxy], redis_server: RedisServer) -> None:
    # Before: the thread's lease was made for its first run, which had no secret_env; the
    # second run's own secret_env (not delivered, but marked) was then stored in clear.
    stack, _ = marks_stack
    worker = stack.start_worker(concurrency=1)
    thread = f"th-{uuid.uuid4().hex[:8]}"
    first, second = f"run-h-{uuid.uuid4().hex[:8]}", f"run-i-{uuid.uuid4().hex[:8]}"
    lease_id = acquire(first, thread_id=thread, reuse=True)
    done = by_name("lease.acquire", run_id=second, spec={
        "provider": "noop", "thread_id": thread, "reuse": True,
        "secret_env": {"API_TOKEN": SECRET}})
    assert done["result"] == "reused" and done["lease_id"] == lease_id, done
    lose_marks(stack, redis_server, second, thread)
    finish_quoting_the_secret(stack, redis_server, worker, second)

    # The shared sandbox's destroy reason quoting it: withheld too.
    by_name("lease.destroy", lease_id=lease_id, reason=f"rotating {SECRET} now")
    ended = stack.runtime().store.get_lease(lease_id)
    assert ended.end_reason == "withheld: its run's secret marks are lost", ended.end_reason


def test_overlapping_secrets_are_hidden_whole_in_a_finish_and_a_destroy_reason(
        marks_stack: tuple[WorkerStack, DroppingProxy], redis_server: RedisServer) -> None:
    # Before: "overlap OverlapAbcdefghIJKLmnop99 end" quoting two secrets that share
    # "efgh" was stored as "overlap ***IJKLmnop99 end" (10 of the second's characters in
    # clear): each scrub replaced one secret, then went on past it. Both scrubs are tried:
    # the worker that ran the acquire knows the values; a new one has only the marks.
    stack, _ = marks_stack
    rt = stack.runtime()
    first = stack.start_worker(concurrency=1)
    core = uuid.uuid4().hex[:8]
    a, b = f"Overlap{core}efgh", f"efghIJKL{core}99"
    quoted = f"overlap Overlap{core}efghIJKL{core}99 end"
    runs = [f"run-o{n}-{uuid.uuid4().hex[:8]}" for n in range(3)]
    leases = [acquire(run_id, thread_id=f"th-{run_id}", secret_env={"A": a, "B": b})
              for run_id in runs]
    by_name("run.finish", run_id=runs[0], status="failed", exit_code=1, error=quoted)
    all_acked(stack, redis_server)
    stack.kill_worker(first)
    stack.start_worker(concurrency=1)  # never saw the values: the marks only
    by_name("run.finish", run_id=runs[1], status="failed", exit_code=1, error=quoted)
    by_name("lease.destroy", lease_id=leases[2], reason=quoted)
    for run_id in runs[:2]:
        stored = rt.store.get_run(run_id)
        assert stored is not None and stored.error == "overlap *** end", stored.error
    assert rt.store.get_lease(leases[2]).end_reason == "overlap *** end"
