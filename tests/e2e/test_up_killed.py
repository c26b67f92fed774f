"""`leasekeeper up` killed outright (SIGKILL: the OOM killer, `kill -9`, a CI runner
cancelling the job) cannot stop its children itself, and each runs in its own session: the
kernel stops them instead (PR_SET_PDEATHSIG, workers/die_with_parent.py), so no Redis,
worker, beat, Flower, exporter or console outlives it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil
import pytest

from tests.e2e.conftest import eventually
from tests.e2e.test_up import (
    _children,
    _kill_leftovers,
    assert_closed,
    broker_port,
    up,
    user_env,
)


def running(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (a zombie has ended: only its parent's wait is due)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.mark.timeout(600)
def test_a_sigkilled_up_takes_every_child_with_it(tmp_path: Path) -> None:
    # Before: Redis, worker (and its pool), beat, Flower, the exporter and the console all
    # kept running after `kill -9 <up>`, holding their ports, with nobody to stop them.
    with up(tmp_path, user_env(LEASEKEEPER_FLOWER_PORT="0")) as process:
        text = process.wait_for("press Ctrl-C to stop")
        children = _children(process.proc.pid)  # with the worker's pool processes
        names = " ".join(" ".join(psutil.Process(pid).cmdline()) for pid in children)
        for child in ("redis-server", " worker ", " beat ", " flower", " metrics", " console"):
            assert child in names, names
        try:
            os.kill(process.proc.pid, signal.SIGKILL)
            process.proc.wait(30)
            eventually(lambda: not running(children), 120, "every child of up to exit")
        finally:
            left = _kill_leftovers(children)  # by pid, whatever happens above
    assert left == [], f"still running after up was SIGKILLed: {left}"
    assert_closed(broker_port(text))
