"""Session services and fixtures shared by every test.

The broker URL is fixed in ``pytest_configure`` (before any test module imports the
Celery app), and the Redis server behind it is started on first use.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.services import PostgresServer, RedisServer, free_port, start_postgres, start_redis

_SESSION_DIR = Path(tempfile.mkdtemp(prefix="leasekeeper-tests-"))
_SESSION_DIR.chmod(0o755)  # the postgres user must reach its data dir
_REDIS_PORT = free_port()


def pytest_configure(config: pytest.Config) -> None:
    os.environ["LEASEKEEPER_BROKER_URL"] = f"redis://127.0.0.1:{_REDIS_PORT}/0"
    os.environ["LEASEKEEPER_VAR_DIR"] = str(_SESSION_DIR / "var")
    os.environ["LEASEKEEPER_PROVIDERS"] = "local,noop,faulty"


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = start_redis(_SESSION_DIR / "redis", _REDIS_PORT)
    yield server
    _close_result_subscriptions()
    server.stop()


def _close_result_subscriptions() -> None:
    """Results no test waited for stay subscribed in Celery's Redis result backend; their
    ``__del__`` would unsubscribe at interpreter exit, after this Redis is gone, and print
    tracebacks. Close the subscriptions while Redis is still up."""
    from workers.app import app

    consumer = getattr(app.backend, "result_consumer", None)
    if consumer is not None:
        consumer.stop()
        consumer.subscribed_to.clear()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    server = start_postgres(_SESSION_DIR / "postgres")
    yield server
    server.stop()


def _fresh_store_url(request: pytest.FixtureRequest, kind: str, where: Path) -> str:
    from models.migrate import upgrade

    if kind == "sqlite":
        url = f"sqlite:///{where / 'store.db'}"
    else:
        server: PostgresServer = request.getfixturevalue("postgres_server")
        url = server.create_database(f"lk_{uuid.uuid4().hex[:12]}")
    upgrade(url)
    return url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A freshly migrated, empty store on each backend."""
    return _fresh_store_url(request, str(request.param), tmp_path)


@pytest.fixture(scope="session",
                params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def stack(request: pytest.FixtureRequest, redis_server: RedisServer,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A running worker on the test Redis with its own store, one per store backend."""
    import redis

    from tests.stack import WorkerStack

    root = tmp_path_factory.mktemp(f"stack-{request.param}")
    redis.Redis.from_url(redis_server.url).flushdb()
    stack = WorkerStack(name=str(request.param),
                        store_url=_fresh_store_url(request, str(request.param), root),
                        root=root, broker_url=redis_server.url)
    stack.start_worker()
    yield stack
    stack.stop()
