"""`leasekeeper up` stopped (Ctrl-C) while its worker runs a task: the worker's warm
shutdown lets the task finish before anything is killed, and `up` says it waits."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import eventually, leasekeeper
from tests.e2e.test_up import up, user_env

# A sandbox that ignores SIGTERM: its destroy takes the whole grace, then SIGKILL.
STUBBORN = ["sh", "-c", "trap '' TERM; while :; do sleep 1; done"]


def _kill_sandboxes(root: Path) -> None:
    """What a destroy cut short leaves (its leader may be gone: `sh` ignoring SIGTERM
    lives on in the group, whose id the kernel keeps while it has a member)."""
    from providers.local import _group_members

    for record in root.glob("*/lease.json"):
        pgid = json.loads(record.read_text()).get("pid")
        if isinstance(pgid, int) and _group_members(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)


def _lease(lease_id: str, env: dict[str, str], cwd: Path) -> dict[str, object]:
    shown = leasekeeper("leases", "show", lease_id, "--json", env=env, cwd=cwd)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    lease: dict[str, object] = json.loads(shown.stdout)["lease"]
    return lease


@pytest.mark.timeout(900)
def test_ctrl_c_lets_a_destroy_under_way_finish(tmp_path: Path) -> None:
    # Before: up sent SIGTERM to the worker's whole process group, so its pool processes
    # died at once: "WorkerLostError('Worker exited prematurely: signal 15 (SIGTERM)')" in
    # worker.log, the lease left `destroying` with its sandbox running until its claim
    # expired (~6 min after the next up started), counted as a failed cleanup attempt.
    # The grace is long so the destroy is surely under way when Ctrl-C comes.
    env = user_env(LEASEKEEPER_FLOWER_PORT="0", LEASEKEEPER_LOCAL_DESTROY_GRACE_S="20")
    with contextlib.ExitStack() as stack:
        stack.callback(_kill_sandboxes, tmp_path / ".var" / "sandboxes")  # if cut short
        lease_id, said, code = _destroy_then_ctrl_c(tmp_path, env)
    assert code == 0, said
    # The destroy, and any sweep that happened to be running too.
    assert re.search(r"waiting for \d running task\(s\) to finish, at most 50 s", said), said
    assert "no lease is live and no sandbox is running" in said, said
    assert "being destroyed" not in said, said
    assert _lease(lease_id, env, tmp_path)["state"] == "destroyed"
    assert not any(p for p in (tmp_path / ".var" / "sandboxes").iterdir()
                   if not p.name.startswith("."))
    log = "".join(path.read_text() for path in (tmp_path / ".var" / "logs").glob("worker*"))
    assert "lease.destroy" in log
    assert "WorkerLostError" not in log, log


def _destroy_then_ctrl_c(tmp_path: Path, env: dict[str, str]) -> tuple[str, str, int | None]:
    """Acquire a stubborn lease, start its destroy, Ctrl-C while the destroy runs."""
    with up(tmp_path, env) as process:
        process.wait_for("press Ctrl-C to stop")
        acquire = subprocess.run(
            [sys.executable, "-c", "import json, sys; from tasks import producer; print("
             "json.dumps(producer.acquire_lease('stop-1', {'command': json.loads("
             "sys.argv[1])}).get(120)))", json.dumps(STUBBORN)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, check=False)
        assert acquire.returncode == 0, acquire.stderr
        lease_id = json.loads(acquire.stdout)["lease_id"]
        destroy = leasekeeper("leases", "destroy", lease_id, "--wait", "1", "--json",
                              env=env, cwd=tmp_path)
        assert destroy.returncode in (0, 1), destroy.stdout + destroy.stderr
        # The destroy task holds the lease: it waits out the sandbox's grace now.
        eventually(lambda: _lease(lease_id, env, tmp_path)["state"] == "destroying", 120,
                   "the destroy under way")
        said = process.interrupt()
    return lease_id, said, process.proc.returncode
