"""Apply the Alembic migrations in models/migrations to a store URL.

One migration at a time per store: several upgrades started together (replicas' init
containers, a retried deploy job, two operators) each wait for the one migrating, then
find the store where it left it and go on from there (usually: nothing to do). On
PostgreSQL the migration's transaction holds an advisory lock (models/migrations/env.py);
on SQLite the upgrade holds an exclusive ``flock`` on the database file itself
(SQLite's own locks are POSIX record locks, which ``flock`` does not touch).
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, make_url
from sqlalchemy.pool import NullPool

if TYPE_CHECKING:
    from models.downgrade_guard import Stranded

MIGRATIONS = Path(__file__).resolve().parent / "migrations"

# The key of the PostgreSQL advisory lock migrations take (any fixed bigint: this one is
# "leasekeeper" in ASCII, cut to 8 bytes)
ADVISORY_LOCK_KEY = int.from_bytes(b"leasekee", "big") >> 1


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def sqlite_file(url: str) -> Path | None:
    """The database file of a SQLite store URL (None: another database, or in memory)."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    database = str(parsed.database)
    if str(parsed.query.get("uri", "")).lower() in ("true", "1") and database.startswith(
            "file:"):  # a URI filename (sqlite:///file:/path?mode=ro&uri=true)
        database = database.removeprefix("file:")
        if database.startswith("//"):  # an authority (empty or localhost), then the path
            authority_and_path = database[2:]
            database = authority_and_path[authority_and_path.find("/"):] if (
                "/" in authority_and_path) else ""
        if database in ("", ":memory:") or parsed.query.get("mode") == "memory":
            return None
    return Path(database)


@contextlib.contextmanager
def _one_at_a_time(url: str) -> Iterator[None]:
    """On SQLite, the other upgrades of this file wait until this one is done."""
    path = sqlite_file(url)
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as held:  # SQLite takes an empty file for an empty database
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def upgrade(url: str, revision: str = "head") -> None:
    with _one_at_a_time(url):
        command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    """Undo the migrations above ``revision``; refused (``WouldStrand``) before anything
    changes when that would strand live leases (models/downgrade_guard.py)."""
    from models.downgrade_guard import refusal

    with _one_at_a_time(url):
        found = stranded_by(url, revision)
        if found:
            raise refusal(found)
        command.downgrade(alembic_config(url), revision)


def stranded_by(url: str, revision: str) -> list[Stranded]:
    """What going down to ``revision`` would strand (models/downgrade_guard.py); nothing
    when ``revision`` is not below the store's (alembic then says why it cannot go)."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory
    from alembic.script.revision import RevisionError
    from alembic.util.exc import CommandError

    from models.downgrade_guard import stranded

    script = ScriptDirectory.from_config(alembic_config(url))
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            undone: list[str] = []
            for head in MigrationContext.configure(conn).get_current_heads():
                try:
                    undone += [r.revision for r in script.iterate_revisions(head, revision)]
                except (CommandError, RevisionError):
                    continue
            return stranded(conn, undone)
    finally:
        engine.dispose()
