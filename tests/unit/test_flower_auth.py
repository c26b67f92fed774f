"""The Flower login `leasekeeper up` uses (workers/flower_auth.py), on real files: generated
once with mode 0600 and read back after; the setting wins and leaves the file alone; a
file made readable by others is made ours alone again; one holding something else is
refused naming the file and the fix, without showing what it holds."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from providers.errors import ConfigError
from workers.flower_auth import GENERATED, flower_basic_auth
from workers.settings import Settings


def settings(var: Path, auth: str | None = None) -> Settings:
    return Settings(var_dir=var, flower_basic_auth=auth)


def test_generated_once_then_read_back(tmp_path: Path) -> None:
    first = flower_basic_auth(settings(tmp_path / "var"))  # the folder is made
    user, password = first.split(":", 1)
    assert user == "admin" and len(password) >= 16
    kept = tmp_path / "var" / GENERATED
    assert kept.read_text() == f"{password}\n"
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert flower_basic_auth(settings(tmp_path / "var")) == first
    assert sorted(p.name for p in (tmp_path / "var").iterdir()) == [GENERATED]  # no temp


def test_the_setting_wins_and_leaves_the_kept_one_alone(tmp_path: Path) -> None:
    assert flower_basic_auth(settings(tmp_path, "ops:chosen-by-me")) == "ops:chosen-by-me"
    assert not (tmp_path / GENERATED).exists()
    kept = flower_basic_auth(settings(tmp_path))
    assert flower_basic_auth(settings(tmp_path, "ops:chosen-by-me")) == "ops:chosen-by-me"
    assert flower_basic_auth(settings(tmp_path)) == kept


def test_a_kept_password_readable_by_others_is_made_ours_alone(tmp_path: Path) -> None:
    kept = flower_basic_auth(settings(tmp_path))
    (tmp_path / GENERATED).chmod(0o644)
    assert flower_basic_auth(settings(tmp_path)) == kept
    assert stat.S_IMODE((tmp_path / GENERATED).stat().st_mode) == 0o600


@pytest.mark.parametrize("held", ["", "short", "has:colon-in-it-123456", "two words here 1234"])
def test_a_file_holding_something_else_is_refused(tmp_path: Path, held: str) -> None:
    (tmp_path / GENERATED).write_text(held + "\n")
    with pytest.raises(ConfigError) as refused:
        flower_basic_auth(settings(tmp_path))
    said = str(refused.value)
    assert str(tmp_path / GENERATED) in said and "LEASEKEEPER_FLOWER_BASIC_AUTH" in said
    assert "delete it" in said
    assert not held or held not in said
