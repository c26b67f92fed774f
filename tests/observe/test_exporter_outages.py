"""The real exporter (`leasekeeper metrics`, over HTTP, scraped by a real Prometheus) answers
every scrape while what it reads is down, and says which part is down:

- PostgreSQL stops answering (every process of its cluster SIGSTOPped: a frozen server,
  whose kernel still acknowledges): two scrapes at once answer leasekeeper_store_up 0,
  Prometheus records the target up and MetricsStoreUnreadable goes pending; once the
  server goes on, store_up is 1 again;
- the broker refuses connections, or accepts them and never answers: scrapes answer
  leasekeeper_broker_up 0 (and no worker) within Prometheus' scrape timeout, BrokerDown
  goes pending and NoWorker does not (no worker could have been reached);
- with the broker and a worker up, broker_up is 1 and the worker is counted.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from models.migrate import upgrade
from tests.e2e.conftest import eventually
from tests.observe.exporter import Exporter, Samples, running_exporter
from tests.observe.prometheus import running_prometheus
from tests.services import PostgresServer, RedisServer, free_port, start_postgres
from tests.stack import WorkerStack
from tests.store.test_store_stops_answering import watchdog

pytestmark = pytest.mark.timeout(300)
# Longer than the frozen part of the test takes when the exporter answers: a scrape that
# answers only after this had waited for the server.
FROZEN_FOR_S = 90.0


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL cluster of this test's (the session's is not frozen), outside pytest's
    private tmp dir: the postgres user must reach its data dir."""
    root = Path(tempfile.mkdtemp(prefix="leasekeeper-frozen-"))
    root.chmod(0o755)
    server = start_postgres(root / "postgres")
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def frozen(server: PostgresServer) -> Iterator[threading.Event]:
    """Every process of the cluster stopped (postmaster, backends, background workers);
    the event says whether the watchdog had to let them go on."""
    postmaster = psutil.Process(server.proc.pid)
    processes = [postmaster, *postmaster.children(recursive=True)]

    def release() -> None:
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.resume()

    for process in processes:
        process.suspend()
    try:
        with watchdog(release, FROZEN_FOR_S) as fired:
            yield fired
    finally:
        release()


@pytest.mark.postgres
def test_a_scrape_answers_store_up_0_while_postgresql_does_not_answer(
        own_postgres: PostgresServer, redis_server: RedisServer, tmp_path: Path) -> None:
    store_url = own_postgres.create_database("lk_frozen")
    upgrade(store_url)
    with running_exporter(tmp_path / "exporter.log", LEASEKEEPER_STORE_URL=store_url,
                          LEASEKEEPER_BROKER_URL=redis_server.url,
                          LEASEKEEPER_VAR_DIR=str(tmp_path / "var")) as exporter, \
            running_prometheus(tmp_path / "prometheus", [exporter.address],
                               scrape_s=10) as prom:  # Prometheus' default scrape timeout
        prom.wait_value("leasekeeper_store_up", 1)
        with frozen(own_postgres) as released:
            with ThreadPoolExecutor(2) as scrapes:  # neither waits behind the other
                answers = list(scrapes.map(lambda _: exporter.scrape(), range(2)))
            assert not released.is_set(), "the scrapes answered only once the server went on"
            for answer in answers:
                assert answer.value("leasekeeper_store_up") == 0
                assert answer.value("leasekeeper_broker_up") == 1  # the rest is there
                assert answer.value("leasekeeper_leases_abandoned") is None  # not stale
            prom.wait_value("leasekeeper_store_up", 0)
            assert prom.value('up{job="leasekeeper"}') == 1
            prom.wait_true('ALERTS{alertname="MetricsStoreUnreadable"}')
            assert not released.is_set(), "Prometheus' scrapes waited for the server"
        eventually(lambda: exporter.scrape().value("leasekeeper_store_up") == 1, 60,
                   "the exporter to read the store again")


@pytest.fixture
def silent_broker() -> Iterator[str]:
    """A broker URL whose port accepts connections (the kernel completes them) and never
    answers a command."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"


def test_a_scrape_says_the_broker_is_down_whether_it_refuses_or_never_answers(
        silent_broker: str, tmp_path: Path) -> None:
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    upgrade(store_url)
    refusing = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    with contextlib.ExitStack() as started:
        exporters = [started.enter_context(running_exporter(
            tmp_path / f"exporter-{i}.log", LEASEKEEPER_STORE_URL=store_url,
            LEASEKEEPER_BROKER_URL=broker, LEASEKEEPER_VAR_DIR=str(tmp_path / "var")))
            for i, broker in enumerate((refusing, silent_broker))]
        for exporter in exporters:
            seen = exporter.scrape()
            assert seen.value("leasekeeper_broker_up") == 0
            assert seen.value("leasekeeper_workers_up") == 0
            assert seen.value("leasekeeper_store_up") == 1
        # A scrape timeout of half Prometheus' default: the broker's part of a scrape is
        # about LEASEKEEPER_METRICS_WORKER_PING_TIMEOUT_S (1 s), not kombu's retries or the
        # broker's socket timeout.
        prom = started.enter_context(running_prometheus(
            tmp_path / "prometheus", [e.address for e in exporters], scrape_s=5))
        prom.wait_value('count(up{job="leasekeeper"} == 1)', 2)
        prom.wait_value("count(leasekeeper_broker_up == 0)", 2)
        prom.wait_true('ALERTS{alertname="BrokerDown"}')
        assert prom.query('ALERTS{alertname="NoWorker"}') == []


def test_with_the_broker_up_a_scrape_counts_the_workers_that_answer(
        own_stack: WorkerStack, exporter: str, tmp_path: Path) -> None:
    scraped = Exporter(exporter, tmp_path / "exporter.log")

    def worker_seen() -> Samples | None:  # a ping can miss under load: a later one sees it
        seen = scraped.scrape()
        return seen if (seen.value("leasekeeper_workers_up") or 0) >= 1 else None

    assert eventually(worker_seen, 60, "the worker to answer").value(
        "leasekeeper_broker_up") == 1
