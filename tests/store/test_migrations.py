"""The migrations go down and up again on SQLite and PostgreSQL, and head has exactly the
indexes models/schema.py declares."""

from __future__ import annotations

from sqlalchemy import create_engine, inspect

from models.migrate import downgrade, upgrade
from models.schema import Base

TABLES = ("leases", "runs", "lease_events", "sweep_ticks", "provider_errors")


def index_names(url: str) -> dict[str, set[str]]:
    engine = create_engine(url)
    try:
        found = inspect(engine)
        return {table: {ix["name"] for ix in found.get_indexes(table)
                        if ix["name"] and "duplicates_constraint" not in ix}
                for table in TABLES if found.has_table(table)}
    finally:
        engine.dispose()


def declared() -> dict[str, set[str]]:
    return {table: {ix.name for ix in Base.metadata.tables[table].indexes if ix.name}
            for table in TABLES}


def test_head_has_the_declared_indexes_and_the_migrations_reverse(store_url: str) -> None:
    # given a store at head
    assert index_names(store_url) == declared()
    # when it goes back to 0001 and up again
    downgrade(store_url, "0001")
    before = index_names(store_url)
    assert "ix_leases_state" in before["leases"] and "ix_runs_status" in before["runs"]
    assert "provider_errors" not in before  # 0004_errors10 went down
    upgrade(store_url)
    # then it is at head again
    assert index_names(store_url) == declared()
