"""What `up` tells another shell: with LEASEKEEPER_VAR_DIR elsewhere than ./.var, clients
find the env file only with that variable exported (a QA pass: the hint said a shell in
the same directory would find it, and it found nothing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.cli_up import client_hint
from workers.settings import env_file_path

pytestmark = pytest.mark.timeout(30)


def test_the_default_var_dir_needs_only_the_directory(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LEASEKEEPER_VAR_DIR", raising=False)
    hint = client_hint(env_file_path(), tmp_path, "leasekeeper")
    assert hint.startswith(f"In another shell in {tmp_path}, `leasekeeper status`"), hint
    assert "LEASEKEEPER_VAR_DIR" not in hint


@pytest.mark.parametrize("var_dir", ["var", "elsewhere/state"])
def test_a_var_dir_elsewhere_says_to_export_it(tmp_path: Path, var_dir: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LEASEKEEPER_VAR_DIR", var_dir)
    hint = client_hint(env_file_path(), tmp_path, "leasekeeper")
    assert f"export LEASEKEEPER_VAR_DIR={tmp_path / var_dir}" in hint, hint
    # what a client in another directory with that variable reads is that very file
    monkeypatch.chdir("/")
    monkeypatch.setenv("LEASEKEEPER_VAR_DIR", str(tmp_path / var_dir))
    assert env_file_path() == tmp_path / var_dir / "env"
