"""`leasekeeper db downgrade` (a real process) over a store holding warm pool members that
the real fill made (real local sandboxes), on SQLite and PostgreSQL: a downgrade that would
strand them (undoing 0005_pools13, or everything) is refused before anything changes,
saying how many, in which state, and what to do first; once the pool is drained it goes."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from models.migrate import downgrade
from models.schema import LeaseState
from providers.errors import LeasekeeperError
from tests.e2e.test_cli_db import db, revision_of
from tests.pools.conftest import PoolRecorder, fill, members, sandboxes, warm
from workers.preflight import migration_heads
from workers.runtime import Runtime

pytestmark = pytest.mark.timeout(300)


def test_a_downgrade_that_would_strand_warm_members_is_refused_until_they_are_drained(
        store_url: str, rt: Runtime, effects: PoolRecorder,
        runtime_with: Callable[..., Runtime]) -> None:
    # Before: `db downgrade 0004 --yes` went (rc 0, its preview warned of nothing), dropping
    # leases.pool: the 2 warm members were then nobody's, their sandboxes ran for ever, and
    # after `db upgrade` `leasekeeper check` flagged each live-lease-without-run.
    (head,) = migration_heads()
    # given a pool's 2 warm members at the latest migration
    fill(rt, effects)
    assert len(warm(rt)) == 2

    # the preview says the downgrade would be refused, and why
    asked = db(store_url, "downgrade", "0004")
    assert asked.returncode == 1, asked.stdout + asked.stderr
    assert "would undo" in asked.stdout and "0005_pools13" in asked.stdout
    assert "refused as things stand" in asked.stderr
    assert "2 lease(s) (2 warm) are unclaimed members of warm pool(s) py" in asked.stderr

    # when it is asked for with --yes: refused, naming how many, the state, what to do first
    refused = db(store_url, "downgrade", "0004", "--yes")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    err = refused.stderr
    for said in ("not undone, nothing was changed", "2 lease(s) (2 warm)", "warm pool(s) py",
                 "LEASEKEEPER_POOLS", "leasekeeper leases destroy --state warm --yes",
                 "leasekeeper pools", "run the downgrade again"):
        assert said in err, err
    assert "Traceback" not in err
    # then nothing changed: the store is at the latest, the members still the pool's
    assert revision_of(store_url) == head
    assert [m.pool for m in warm(rt)] == ["py", "py"]

    # going to base would strand them too (and every other live lease): said once
    emptied = db(store_url, "downgrade", "base", "--yes")
    assert emptied.returncode == 1, emptied.stdout + emptied.stderr
    assert "2 lease(s) (2 warm) are not destroyed" in emptied.stderr, emptied.stderr
    assert "unclaimed members" not in emptied.stderr
    assert revision_of(store_url) == head
    # and so is the library's downgrade (what a deploy job's script calls)
    with pytest.raises(LeasekeeperError, match="2 lease"):  # WouldStrand
        downgrade(store_url, "0004_errors10")
    assert revision_of(store_url) == head

    # once the pool is removed and its members drained, the same downgrade goes
    gone = runtime_with(pools=[])
    fill(gone, PoolRecorder(gone, inline=True))
    assert all(m.state == LeaseState.DESTROYED for m in members(rt))
    assert sandboxes(rt) == set()
    done = db(store_url, "downgrade", "0004", "--yes")
    assert done.returncode == 0, done.stdout + done.stderr
    assert revision_of(store_url) == "0004_errors10"
    assert db(store_url, "upgrade").returncode == 0


def test_a_downgrade_that_keeps_what_warm_members_need_goes_ahead(
        store_url: str, rt: Runtime, effects: PoolRecorder) -> None:
    # only the migrations above 0005_pools13: the pool and the warm state stay
    fill(rt, effects)
    done = db(store_url, "downgrade", "0005", "--yes")
    assert done.returncode == 0, done.stdout + done.stderr
    assert revision_of(store_url) == "0005_pools13"
    assert db(store_url, "upgrade").returncode == 0
    assert len(warm(rt)) == 2
