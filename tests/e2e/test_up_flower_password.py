"""`leasekeeper up` keeps the Flower password it generates in the var dir (mode 0600) and
logs in with the same one on the next `up` in that folder, so a bookmarked login or a
browser's saved password keeps working; a LEASEKEEPER_FLOWER_BASIC_AUTH that is set wins,
and leaves the kept one alone. The password is never printed nor logged."""

from __future__ import annotations

import re
import stat
from pathlib import Path

import pytest

from tests.e2e.test_up import flower_status, up, user_env
from workers.flower_auth import GENERATED


def one_up(tmp_path: Path, **settings: str) -> tuple[str, str]:
    """Start `up` here, read the credentials it uses, check Flower takes them, stop it;
    return (the credentials, everything up printed)."""
    with up(tmp_path, user_env(LEASEKEEPER_FLOWER_PORT="0", **settings)) as process:
        text = process.wait_for("press Ctrl-C to stop")
        auth = (tmp_path / ".var" / "flower-credentials").read_text().strip()
        url = re.search(r"Flower: (http://127\.0\.0\.1:\d+) ", text).group(1)  # type: ignore[union-attr]
        assert flower_status(url, auth) == 200
        said = process.interrupt()
    assert process.proc.returncode == 0, said
    return auth, said


def never_shown(password: str, var: Path, *outputs: str) -> None:
    for output in outputs:
        assert password not in output
    for log in (var / "logs").iterdir():
        assert password not in log.read_text(errors="replace"), log


@pytest.mark.timeout(900)
def test_the_generated_flower_password_is_kept_for_the_next_up(tmp_path: Path) -> None:
    # Before: every `up` made a new password, so the last login stopped working.
    var = tmp_path / ".var"
    first, said_first = one_up(tmp_path)
    kept = var / GENERATED
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    chosen, said_chosen = one_up(tmp_path, LEASEKEEPER_FLOWER_BASIC_AUTH="ops:chosen-by-me")
    assert chosen == "ops:chosen-by-me"  # the setting wins ...
    again, said_again = one_up(tmp_path)
    assert again == first  # ... and the kept one is used again once it is unset
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    password = first.split(":", 1)[1]
    assert len(password) >= 16
    # What `up` says about them is true of each: before, a set LEASEKEEPER_FLOWER_BASIC_AUTH
    # was also called "kept for the next `up` here; set LEASEKEEPER_FLOWER_BASIC_AUTH to
    # choose them", and the next `up` without it made (or took) the generated ones.
    flower_line = {name: next(line for line in said.splitlines() if "Flower: " in line)
                   for name, said in (("first", said_first), ("chosen", said_chosen))}
    assert f"kept in {var.resolve() / GENERATED} for the next `up` here" in flower_line["first"]
    assert "set LEASEKEEPER_FLOWER_BASIC_AUTH to choose them" in flower_line["first"]
    assert "from LEASEKEEPER_FLOWER_BASIC_AUTH" in flower_line["chosen"], flower_line
    assert "kept" not in flower_line["chosen"] and "to choose" not in flower_line["chosen"]
    never_shown(password, var, said_first, said_chosen, said_again)
    never_shown("chosen-by-me", var, said_first, said_chosen, said_again)
