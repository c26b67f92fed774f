"""Alembic environment: runs migrations online against the URL models/migrate.py sets."""

from __future__ import annotations

from alembic import context
from sqlalchemy import engine_from_config, pool, text

from models.migrate import ADVISORY_LOCK_KEY
from models.schema import Base
from models.store import pg_connect_args

# TCP_USER_TIMEOUT of a migration's connection: data unacknowledged this long means the
# server's host is gone (a long statement on a live server is never cut by it)
MIGRATION_USER_TIMEOUT_MS = 60_000

config = context.config


def run_migrations_online() -> None:
    url = config.get_main_option("sqlalchemy.url") or ""
    # The store's connection options (connect timeout, keepalives): a server that
    # accepts the connection and never answers fails the upgrade in seconds, not minutes.
    # No statement timeout: a migration may take long on a big store.
    connectable = engine_from_config(
        config.get_section(config.config_ini_section, {}),
        prefix="sqlalchemy.",
        poolclass=pool.NullPool,
        connect_args=pg_connect_args(url, MIGRATION_USER_TIMEOUT_MS),
    )
    with connectable.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=Base.metadata,
            render_as_batch=connection.dialect.name == "sqlite",
        )
        with context.begin_transaction():
            if connection.dialect.name == "postgresql":
                # One migration at a time (models/migrate.py): wait for any other to
                # finish, then read the revision it left. A transaction's lock, released
                # by its commit or rollback: a session lock would outlive the upgrade on a
                # pooler's server connection (PgBouncer in transaction mode) and make the
                # next upgrade wait forever.
                connection.execute(text("SELECT pg_advisory_xact_lock(:key)"),
                                   {"key": ADVISORY_LOCK_KEY})
            context.run_migrations()


run_migrations_online()
