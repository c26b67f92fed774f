"""End-to-end helpers: wait for a store condition with a monotonic deadline, or for a
sandbox's process to be gone; run the `leasekeeper` command as a child process, with a
clean environment."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from workers.runtime import Runtime

T = TypeVar("T")


def eventually(probe: Callable[[], T | None], timeout_s: float = 30.0, what: str = "") -> T:
    """Return probe()'s first truthy value; fail with ``what`` once the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


def until_gone(rt: Runtime, provider: str, lease_id: str, what: str) -> None:
    """Wait until ``provider`` finds the lease's sandbox not resumable: kill() returns, and a
    command exits, before the process is gone, and a busy host takes its time."""
    from providers.base import ResumeOutcome
    from tasks.leases import handle

    eventually(lambda: rt.provider(provider).resume_check(
        handle(rt.store.get_lease(lease_id)), 1).outcome == ResumeOutcome.NOT_RESUMABLE,
        10, what)


HIDDEN_PACKAGES = Path(__file__).resolve().parent / "hidden_packages"


def cli_env(**settings: str) -> dict[str, str]:
    """The environment of a `leasekeeper` child: no LEASEKEEPER_* from the test session."""
    from tests.stack import REPO

    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEKEEPER_")}
    return {**env, "PYTHONPATH": str(REPO), **settings}


def leasekeeper(*args: str, env: dict[str, str], cwd: Path | None = None,
                timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the `leasekeeper` command as a user would (a child process)."""
    return subprocess.run([sys.executable, "-m", "workers.cli", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout_s, check=False)
