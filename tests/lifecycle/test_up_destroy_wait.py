"""`up` interrupted during its demo destroys the demo's leases before it stops the worker.
A lease another task is destroying (the demo's own reclaim: ``in_progress``) or an
acquire still under way is waited for, within a deadline, so neither is cut short and no
sandbox appears after `up` said what stays running (workers/cli_up.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from models.schema import LeaseState
from providers.spec import SandboxSpec
from tasks.acquire import acquire_lease
from tests.sweeps.conftest import set_lease
from workers.cli_up import _destroy_demo_leases
from workers.runtime import Runtime, set_runtime

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def destroying(rt: Runtime) -> Iterator[str]:
    """run-1's lease, whose destroy another worker holds (claimed: state destroying)."""
    lease_id = acquire_lease(rt, "run-1", SandboxSpec(), None, False).lease_id
    set_lease(rt, lease_id, state=LeaseState.DESTROYING)
    set_runtime(rt)
    yield lease_id
    set_runtime(None)


def test_up_waits_for_a_destroy_under_way(rt: Runtime, destroying: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    ended = threading.Timer(0.5, lambda: rt.store.move(
        destroying, {LeaseState.DESTROYING}, LeaseState.DESTROYED, "destroyed", None))
    ended.start()
    try:
        _destroy_demo_leases(["run-1"], wait_s=30)
    finally:
        ended.join()
    assert rt.store.get_lease(destroying).state == LeaseState.DESTROYED  # waited for it
    assert "still under way" not in capsys.readouterr().out


def test_up_stops_waiting_at_the_deadline_and_says_who_finishes_it(
    rt: Runtime, destroying: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _destroy_demo_leases(["run-1"], wait_s=0.5)
    assert ("still under way: the leases of run(s) run-1 (the sweeps finish them when "
            "leasekeeper runs again)") in capsys.readouterr().out
    assert rt.store.get_lease(destroying).state == LeaseState.DESTROYING


def test_up_waits_for_an_acquire_whose_run_has_no_lease_yet(
    rt: Runtime, capsys: pytest.CaptureFixture[str]
) -> None:
    # The run is recorded, its intent not yet written: the acquire is under way.
    rt.store.start_run("run-2", None, "local", "sk-run-2")
    set_runtime(rt)
    try:
        _destroy_demo_leases(["run-2"], wait_s=0.5)
    finally:
        set_runtime(None)
    assert "still under way: the leases of run(s) run-2" in capsys.readouterr().out
