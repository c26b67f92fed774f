"""A SQLite store whose disk is full, on a real filesystem that is full (a small tmpfs of
the test's): `leasekeeper health --store` and `status` must say so. Before: health was
silent with exit 0 (its probe, an UPDATE that matches no row, needs no free page), while
every acquire failed "database or disk is full" (a QA pass)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from models.migrate import upgrade
from tests.e2e.conftest import cli_env, leasekeeper

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs of this test's (we run as root, as `make test` does)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
                   check=True, capture_output=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, capture_output=True)


def fill(disk: Path) -> None:
    with open(disk / "filler", "wb") as out, contextlib.suppress(OSError):
        while True:
            out.write(b"\0" * 65536)
            out.flush()


def test_health_and_status_say_a_full_disk_under_a_sqlite_store(small_disk: Path) -> None:
    upgrade(f"sqlite:///{small_disk / 'leasekeeper.db'}")
    env = cli_env(LEASEKEEPER_VAR_DIR=str(small_disk))
    assert leasekeeper("health", "--store", env=env).returncode == 0
    # when the disk fills up
    fill(small_disk)
    # then health fails, saying where and what to do
    done = leasekeeper("health", "--store", env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    said = done.stdout + done.stderr
    assert "unhealthy store" in said and "is full" in said and "free space" in said, said
    assert str(small_disk) in said, said
    # and status counts it among its problems
    status = leasekeeper("status", env=env)
    assert status.returncode == 1 and "is full" in status.stdout + status.stderr, (
        status.stdout + status.stderr)
    # once space is freed, healthy again
    (small_disk / "filler").unlink()
    assert leasekeeper("health", "--store", env=env).returncode == 0
