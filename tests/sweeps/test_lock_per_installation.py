"""Two installations on one Redis (two LEASEKEEPER_TASK_QUEUE values) each hold their own
sweep locks: installation A's tick holding its lock does not make installation B's real
worker skip B's tick, while B's own lock still does. Before (a QA pass): the lock was
`leasekeeper:sweep:<name>` for every installation, so B's `sweep.reap_runs` answered
`run: skipped` while A's tick ran."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.services import RedisServer
from tests.stack import WorkerStack, own_queue_stack
from workers.app import app

pytestmark = pytest.mark.timeout(300)
SWEEP = "sweep.reap_runs"


@pytest.fixture(scope="module")
def installation_b(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[WorkerStack]:
    with own_queue_stack("sweep-b", redis_server.url, tmp_path_factory.mktemp("b")) as stack:
        yield stack


def test_another_installations_lock_does_not_skip_this_ones_tick(
        installation_b: WorkerStack, tmp_path: Path) -> None:
    from tasks.sweeping import single_flight

    other = installation_b.runtime(task_queue=f"sweep-a-{uuid.uuid4().hex[:8]}")
    with single_flight(other, SWEEP) as held:  # installation A's tick, running
        assert held
        summary = app.send_task(SWEEP).get(120)  # to installation B's worker
    assert summary["sweep"] == SWEEP and summary["run"] == "ran", summary


def test_this_installations_own_lock_still_skips_its_tick(installation_b: WorkerStack) -> None:
    from tasks.sweeping import single_flight

    with single_flight(installation_b.runtime(), SWEEP) as held:  # B's other tick, running
        assert held
        summary = app.send_task(SWEEP).get(120)
    assert summary["run"] == "skipped", summary
    assert app.send_task(SWEEP).get(120)["run"] == "ran"
