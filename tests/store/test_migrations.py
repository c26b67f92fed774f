"""The migrations go down and up again on SQLite and PostgreSQL, and head has exactly the
indexes models/schema.py declares."""

from __future__ import annotations

from sqlalchemy import create_engine, inspect

from models.migrate import downgrade, upgrade
from models.schema import Base

TABLES = ("leases", "runs", "lease_events", "sweep_ticks", "provider_errors", "pools")


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


def partial_and_unique(url: str) -> dict[str, tuple[bool, bool]]:
    """Each index's (partial, unique) as the database has it."""
    engine = create_engine(url)
    try:
        found = inspect(engine)
        return {ix["name"]: (any(k.endswith("_where") and v is not None
                                 for k, v in ix.get("dialect_options", {}).items()),
                             bool(ix["unique"]))
                for table in TABLES if found.has_table(table)
                for ix in found.get_indexes(table)
                if ix["name"] and "duplicates_constraint" not in ix}
    finally:
        engine.dispose()


def declared_partial_and_unique() -> dict[str, tuple[bool, bool]]:
    return {ix.name: (any(ix.dialect_options[d].get("where") is not None
                          for d in ("sqlite", "postgresql")), bool(ix.unique))
            for table in TABLES for ix in Base.metadata.tables[table].indexes if ix.name}


def test_head_indexes_are_partial_and_unique_as_declared(store_url: str) -> None:
    """A migration that rebuilds a SQLite table (0010's batch copy of leases) keeps every
    partial index partial; the live-key index stays unique among live leases."""
    # given a store at head, also after going down to 0009 and up again
    assert partial_and_unique(store_url) == declared_partial_and_unique()
    downgrade(store_url, "0009_runs12")
    assert partial_and_unique(store_url)["ix_runs_thread_id"] == (False, False)
    upgrade(store_url)
    # then every index is as declared
    found = partial_and_unique(store_url)
    assert found == declared_partial_and_unique()
    assert found["uq_leases_live_key"] == (True, True)
    assert found["ix_leases_active_deadline"] == (True, False)


def columns(url: str, table: str) -> set[str]:
    engine = create_engine(url)
    try:
        return {c["name"] for c in inspect(engine).get_columns(table)}
    finally:
        engine.dispose()


def test_the_warm_pools_migration_goes_down_and_up_keeping_leases(store_url: str) -> None:
    from sqlalchemy import text

    from models.schema import Pool

    # given a lease written before warm pools existed
    downgrade(store_url, "0004_errors10")
    assert "pool" not in columns(store_url, "leases") and "pools" not in index_names(store_url)
    engine = create_engine(store_url)
    try:
        with engine.begin() as conn:
            conn.execute(text(
                "INSERT INTO leases (lease_id, sandbox_key, live_key, provider, "
                "provider_lease_id, provider_meta, state, reuse, tenant, spec, created_at, "
                "updated_at, acquire_deadline_at, deadline_at, idle_timeout_s, "
                "cleanup_attempts, version) VALUES ('old-1', 'k', 'k', 'local', 'lk-old-1', "
                "'{}', 'active', false, 'default', '{}', '2026-01-01', '2026-01-01', "
                "'2026-01-01', '2026-01-02', 60, 0, 1)"))
        # when the store goes to head
        upgrade(store_url)
        # then the lease is there, in no pool, and the pools table is as declared
        with engine.connect() as conn:
            row = conn.execute(text("SELECT pool, claimed_at FROM leases "
                                    "WHERE lease_id = 'old-1'")).one()
    finally:
        engine.dispose()
    assert tuple(row) == (None, None)
    assert columns(store_url, "pools") == set(Pool.__table__.columns.keys())
    assert {"pool", "claimed_at"} <= columns(store_url, "leases")
