"""`leasekeeper metrics`: serve the exporter's /metrics (prometheus-client's own HTTP
server) on LEASEKEEPER_METRICS_HOST:LEASEKEEPER_METRICS_PORT until SIGTERM or Ctrl-C."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable

from kombu.exceptions import OperationalError
from prometheus_client import CollectorRegistry, start_http_server
from redis import RedisError

from models.observe import Observe
from models.store import Store
from workers.metrics.collector import LeaseCollector
from workers.preflight import cannot_listen
from workers.settings import Settings


def celery_pinger() -> Callable[[float], int]:
    from workers.app import app

    def ping(timeout_s: float) -> int:
        try:
            return len(app.control.ping(timeout=timeout_s) or [])
        except (OSError, OperationalError, RedisError):  # broker down: no worker seen
            return 0

    return ping


def build_registry(settings: Settings, store: Store,
                   ping: Callable[[float], int] | None = None) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(LeaseCollector(Observe(store), settings, ping or celery_pinger()))
    return registry


def serve(settings: Settings, on_ready: Callable[[str], None] = print) -> None:
    store = Store(settings.effective_store_url, settings.store_statement_timeout_s)
    registry = build_registry(settings, store)
    try:
        server, thread = start_http_server(settings.metrics_port, settings.metrics_host,
                                           registry=registry)
    except OSError as exc:
        raise cannot_listen("metrics", "LEASEKEEPER_METRICS", settings.metrics_host,
                            settings.metrics_port, exc) from None
    host, port = server.server_address[:2]
    on_ready(f"metrics: http://{host!s}:{port}/metrics")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with contextlib.suppress(KeyboardInterrupt):
        stop.wait()
    server.shutdown()
    thread.join(5)
    store.dispose()
