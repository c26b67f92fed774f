"""Where a store's schema stands against this leasekeeper's migrations, and what a
downgrade would undo: for `leasekeeper db current` and `leasekeeper db downgrade`."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from sqlalchemy.exc import SQLAlchemyError

from models.downgrade_guard import Stranded
from providers.errors import ConfigError
from workers.preflight import (
    NewerStore,
    check_driver,
    current_revisions,
    migration_heads,
    migration_script,
    newer_store_message,
    shown,
    sqlite_store_file,
    store_error,
    unknown_revisions,
)

BASE = "base"  # alembic's name for "before the first migration": an empty store


class SchemaPosition(StrEnum):
    AT_HEAD = "at_head"  # what this leasekeeper needs
    BEHIND = "behind"  # `leasekeeper db upgrade` brings it up
    NEVER_MIGRATED = "never_migrated"
    NEWER = "newer"  # a newer leasekeeper migrated it


@dataclass(frozen=True)
class Where:
    position: SchemaPosition
    current: tuple[str, ...]
    heads: tuple[str, ...]
    pending: tuple[str, ...]  # what `db upgrade` would apply, oldest first

    def describe(self) -> str:
        at, head = ", ".join(self.current) or "nothing", ", ".join(self.heads)
        match self.position:
            case SchemaPosition.AT_HEAD:
                return f"at migration {at}, this leasekeeper's latest: up to date"
            case SchemaPosition.NEVER_MIGRATED:
                return (f"never migrated (this leasekeeper's latest is {head}): run "
                        "`leasekeeper db upgrade`")
            case SchemaPosition.BEHIND:
                return (f"at migration {at}, behind this leasekeeper's latest {head} by "
                        f"{', '.join(self.pending)}: run `leasekeeper db upgrade`")
            case SchemaPosition.NEWER:
                return (f"at migration {at}, which this leasekeeper does not have (its latest "
                        f"is {head}): a newer leasekeeper migrated it; to go back to this "
                        "version, run `leasekeeper db downgrade "
                        f"{head} --yes` with that newer one")


def schema_position(url: str) -> Where:
    """Where the store's schema stands (its driver already checked: ``check_driver``)."""
    current = tuple(sorted(_recorded(url)))
    heads = tuple(sorted(migration_heads()))
    if unknown_revisions(url, set(current)):
        return Where(SchemaPosition.NEWER, current, heads, ())
    if current == heads:
        return Where(SchemaPosition.AT_HEAD, current, heads, ())
    position = SchemaPosition.BEHIND if current else SchemaPosition.NEVER_MIGRATED
    return Where(position, current, heads, _above(heads, current))


def _recorded(url: str) -> set[str]:
    """The migrations the store records; none, without connecting, for a SQLite file that
    is not there (connecting would create it, empty). ConfigError if its folder is not
    there either."""
    path = sqlite_store_file(url)
    return set() if path is not None and not path.is_file() else current_revisions(url)


def reached(url: str, revision: str) -> str:
    """What `db upgrade --revision REVISION` says once done: where the store is, and,
    when it is past REVISION (upgrade leaves it there), that nothing was to be done."""
    from alembic.script.revision import RevisionError
    from alembic.util.exc import CommandError

    at = ", ".join(sorted(current_revisions(url))) or BASE
    try:
        target = migration_script().get_revision(revision)
    except (CommandError, RevisionError):  # "heads", "+1": the store is where it is
        target = None
    if target is None or target.revision == at or revision == BASE:
        return f"is at {at}"
    return f"is already at {at}, past {target.revision}: nothing to do"


def _above(heads: tuple[str, ...], current: tuple[str, ...]) -> tuple[str, ...]:
    """The migrations above ``current`` (none: an empty store) up to the head, oldest
    first: what `db upgrade` applies (the history is one line)."""
    (head,) = heads
    lower = current[0] if current else BASE
    return tuple(reversed([r.revision for r in migration_script().iterate_revisions(head, lower)]))


@dataclass(frozen=True)
class Downgrade:
    target: str  # the revision's full name, or ``base``
    undone: tuple[str, ...]  # newest first; empty: the store is there already


def plan_downgrade(url: str, revision: str) -> Downgrade:
    """What going down to ``revision`` (a full or unique leading part of a migration's
    name, or ``base``) undoes. Refused, saying why and what to do: a store a newer leasekeeper
    migrated, an unknown revision, or one above the store's current one."""
    from alembic.script.revision import RevisionError
    from alembic.util.exc import CommandError

    check_driver(url)
    current = _recorded(url)
    newer = unknown_revisions(url, current)
    if newer:
        raise NewerStore(newer_store_message(url, newer))
    if not current:
        raise ConfigError(f"the store {shown(url)} was never migrated: there is nothing to "
                          "downgrade")
    script = migration_script()
    target = BASE
    if revision != BASE:
        try:
            found = script.get_revision(revision)
        except (CommandError, RevisionError):
            found = None
        if found is None:
            known = ", ".join(r.revision for r in reversed(list(script.walk_revisions())))
            raise ConfigError(f"{revision!r} names no single migration: name one of "
                              f"{known}, or `base` for an empty store")
        target = found.revision
    (head,) = sorted(current)
    if target == head:
        return Downgrade(target, ())
    try:  # from the head down, ``target`` itself not included
        undone = tuple(r.revision for r in script.iterate_revisions(head, target))
    except (CommandError, RevisionError):
        raise ConfigError(f"the store {shown(url)} is at migration {head}, below {target}: "
                          "a downgrade cannot go there; run `leasekeeper db upgrade "
                          f"--revision {target}` to go up") from None
    return Downgrade(target, undone)


def run_downgrade(url: str, revision: str) -> None:
    from models.migrate import downgrade

    try:
        downgrade(url, revision)  # WouldStrand: refused, nothing changed
    except SQLAlchemyError as exc:
        raise store_error(url, exc, "cannot downgrade") from None


def stranding(url: str, revision: str) -> list[Stranded]:
    """What going down to ``revision`` would strand (models/downgrade_guard.py)."""
    from models.migrate import stranded_by

    try:
        return stranded_by(url, revision)
    except SQLAlchemyError as exc:
        raise store_error(url, exc, "cannot read the leases a downgrade would strand") from None
