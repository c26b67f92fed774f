"""`leasekeeper metrics`: serve the exporter's /metrics (prometheus-client's own HTTP
server) on LEASEKEEPER_METRICS_HOST:LEASEKEEPER_METRICS_PORT until SIGTERM or Ctrl-C,
reading the store through a Store of its own and pinging the workers over the broker,
each bounded so that a scrape answers whatever they do."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

from kombu.exceptions import OperationalError
from prometheus_client import CollectorRegistry, start_http_server
from redis import RedisError

from models.observe import Observe
from models.store import Store
from workers.metrics.collector import LeaseCollector, Ping, Pinger
from workers.preflight import cannot_listen, host_port, store_fit_to_start
from workers.queues import Lane, lanes_served
from workers.runtime import open_store
from workers.settings import Settings

log = logging.getLogger("leasekeeper.metrics")


def celery_pinger(task_queue: str) -> Pinger:
    """A ping whose broker calls take about its timeout in all: the exporter's connection
    tries once (kombu's retries took 6 s on a refused port) and gives up on a broker that
    does not answer after the timeout (the app's socket timeout is 10 s), and the scrape
    waits for the ping's thread no longer than the timeout, counting the replies so far.

    The ping is Celery's ``active_queues`` broadcast: every worker on the broker answers
    it, and only those consuming a queue of this installation (LEASEKEEPER_TASK_QUEUE) are
    counted, so another installation's workers on a shared Redis do not keep NoWorker
    quiet; each lane counts the workers consuming its queue (LaneUnserved)."""
    from workers.app import app

    def ping(timeout_s: float) -> Ping | None:
        reached = threading.Event()
        served: dict[str, set[Lane]] = {}
        lock = threading.Lock()  # replies still arriving once the scrape stops waiting

        def count(reply: Any) -> None:
            with lock:
                served.update(lanes_served(reply, task_queue))

        def run() -> None:
            options = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
                       "max_retries": 0}
            try:
                with app.connection_for_write(transport_options=options) as conn:
                    conn.ensure_connection(max_retries=0)  # connected, and Redis answers
                    reached.set()
                    app.control.broadcast("active_queues", reply=True, timeout=timeout_s,
                                          connection=conn, callback=count)
            except (OSError, OperationalError, RedisError) as exc:
                log.warning("metrics: broker unreachable: %s", exc)

        pinging = threading.Thread(target=run, name="metrics-ping", daemon=True)
        pinging.start()
        pinging.join(timeout_s)
        with lock:
            return Ping.of(served) if reached.is_set() else None

    return ping


def build_registry(settings: Settings, store: Store,
                   ping: Pinger | None = None) -> CollectorRegistry:
    """The exporter's registry; its counters count from now (LeaseCollector.start_counting)."""
    registry = CollectorRegistry()
    collector = LeaseCollector(Observe(store), settings,
                               ping or celery_pinger(settings.task_queue))
    collector.start_counting()
    registry.register(collector)
    return registry


def serve(settings: Settings, on_ready: Callable[[str], None] = print) -> None:
    # It only reads (a replica will do), but needs the schema: not at this leasekeeper's
    # migration, every scrape would fail on SQL errors (ConfigError, exit 2).
    store_fit_to_start("metrics", settings.effective_store_url, writes=False)
    store = open_store(settings, reader=True)
    registry = build_registry(settings, store)
    try:
        server, thread = start_http_server(settings.metrics_port, settings.metrics_host,
                                           registry=registry)
    except OSError as exc:
        raise cannot_listen("metrics", "LEASEKEEPER_METRICS", settings.metrics_host,
                            settings.metrics_port, exc) from None
    host, port = server.server_address[:2]
    on_ready(f"metrics: http://{host_port(str(host), port)}/metrics")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with contextlib.suppress(KeyboardInterrupt):
        stop.wait()
    server.shutdown()
    thread.join(5)
    store.dispose()
