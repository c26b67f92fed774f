"""Checks a command runs before it uses the broker or the store, so a person gets one line
naming the setting, the address and the fix, never a traceback or a silent hang.

    check_broker(url)   Redis answers a PING within a second or two  -> BrokerUnavailable
    check_store(url)    the driver is installed, the SQLite folder and file exist, the
                        schema is at the latest migration            -> ConfigError
                                                                         StoreUnavailable
Nothing here creates anything: a store that was never migrated stays absent (no empty
SQLite file), and the message names `leasekeeper db upgrade`.
"""

from __future__ import annotations

from pathlib import Path

import redis
from sqlalchemy import create_engine, make_url
from sqlalchemy.engine import URL
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.pool import NullPool

from providers.errors import BrokerUnavailable, ConfigError, StoreUnavailable

UPGRADE = "run `leasekeeper db upgrade` (with the same LEASEKEEPER_STORE_URL)"


def check_broker(url: str, timeout_s: float = 2.0) -> None:
    from tasks.producer import broker_unreachable

    client = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                  socket_connect_timeout=timeout_s)
    try:
        client.ping()
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise BrokerUnavailable(broker_unreachable(url, exc)
                                .replace("; nothing was sent.", ".")) from None
    except redis.ResponseError as exc:  # e.g. a password is needed
        raise BrokerUnavailable(broker_unreachable(url, exc)
                                .replace("; nothing was sent.", ".")) from None
    finally:
        client.close()


def shown(url: str | URL) -> str:
    """A store URL as it may be printed: no password."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "<unparseable URL>"


def check_driver(url: str) -> None:
    """The database driver the URL names is importable, or say which package to install."""
    try:
        make_url(url).get_dialect().import_dbapi()
    except ArgumentError as exc:
        raise ConfigError(f"LEASEKEEPER_STORE_URL is not a database URL ({exc})") from None
    except ModuleNotFoundError as exc:
        package = {"psycopg": "'leasekeeper[postgres]' (psycopg)",
                   "psycopg2": "psycopg2-binary, or use postgresql+psycopg:// with "
                               "'leasekeeper[postgres]'"}.get(exc.name or "", str(exc.name))
        raise ConfigError(
            f"the store {shown(url)} (LEASEKEEPER_STORE_URL) needs the Python package "
            f"{exc.name!r}, which is not installed: pip install {package}"
        ) from None


def migrate(url: str, revision: str = "head") -> None:
    """`leasekeeper db upgrade` (and `up`): the driver checked first, failures in one line."""
    from models.migrate import upgrade

    check_driver(url)
    try:
        upgrade(url, revision)
    except SQLAlchemyError as exc:
        orig = getattr(exc, "orig", None) or exc
        raise StoreUnavailable(
            f"cannot migrate the store {shown(url)} (LEASEKEEPER_STORE_URL): "
            f"{type(orig).__name__}: {str(orig).strip().splitlines()[0][:200]}") from None


def check_store(url: str) -> None:
    check_driver(url)
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        path = Path(str(parsed.database))
        if not path.parent.is_dir():
            raise ConfigError(
                f"the store's folder {path.parent} does not exist (LEASEKEEPER_STORE_URL="
                f"{shown(url)}): point LEASEKEEPER_STORE_URL (or LEASEKEEPER_VAR_DIR) at the "
                f"right place, or create the folder and {UPGRADE}"
            )
        if not path.is_file():
            raise ConfigError(f"there is no store at {path} (never migrated): {UPGRADE}")
    missing = missing_migrations(url)
    if missing is not None:
        raise ConfigError(f"the store {shown(url)} {missing}: {UPGRADE}")


def missing_migrations(url: str) -> str | None:
    """None when the store is at the latest schema; else what is wrong with it."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    from models.migrate import alembic_config

    heads = set(ScriptDirectory.from_config(alembic_config(url)).get_heads())
    engine = create_engine(url, poolclass=NullPool, connect_args=_connect_args(url))
    try:
        with engine.connect() as conn:
            current = set(MigrationContext.configure(conn).get_current_heads())
    except SQLAlchemyError as exc:
        orig = getattr(exc, "orig", None) or exc
        raise StoreUnavailable(
            f"cannot reach the store {shown(url)} (LEASEKEEPER_STORE_URL): "
            f"{type(orig).__name__}: {str(orig).strip().splitlines()[0][:200]}"
        ) from None
    finally:
        engine.dispose()
    if not current:
        return "has no schema (it was never migrated)"
    if current != heads:
        return (f"is at migration {', '.join(sorted(current))}, this leasekeeper needs "
                f"{', '.join(sorted(heads))}")
    return None


def _connect_args(url: str) -> dict[str, object]:
    return {"connect_timeout": 5} if url.startswith("postgresql") else {}
