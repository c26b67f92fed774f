"""What `up` writes to its env file for other shells (a QA pass: only broker, store and
queue, so `status` and `pools` elsewhere judged by default settings): every setting up was
started with, read back as it was, but never a secret nor the demo's temporary overrides."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from workers.cli_up import DEMO_SETTINGS, _client_env, _write_env_file
from workers.settings import Settings, load_settings

pytestmark = pytest.mark.timeout(30)

POOLS = json.dumps([{"name": "py", "provider": "local", "size": 1, "template": {
    "command": ["sh", "-c", 'while [ ! -e "$LEASEKEEPER_RUN_DIR/claimed" ]; do sleep 1; done']}}])


def test_the_env_file_carries_up_s_settings_but_no_secret(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    environ = {"LEASEKEEPER_POOLS": POOLS, "LEASEKEEPER_CLAIM_TIMEOUT_S": "77",
               "LEASEKEEPER_FLOWER_BASIC_AUTH": "op:hunter2",
               "LEASEKEEPER_SECRET_MARKS_KEY": "hunter3",
               "LEASEKEEPER_VAR_DIR": str(tmp_path),
               **{f"LEASEKEEPER_{k}": v for k, v in DEMO_SETTINGS.items()}}
    demo = {f"LEASEKEEPER_{k}" for k in DEMO_SETTINGS}
    env = _client_env(Settings(var_dir=tmp_path), environ, demo)
    assert not {"LEASEKEEPER_FLOWER_BASIC_AUTH", "LEASEKEEPER_SECRET_MARKS_KEY"} & env.keys()
    assert not demo & env.keys()
    env_file = tmp_path / "env"
    _write_env_file(env_file, env)
    assert env_file.stat().st_mode & 0o777 == 0o600
    text = env_file.read_text()
    assert "hunter" not in text
    # A client reading the file sees up's pools and intervals, the quotes intact.
    for key in [k for k in os.environ if k.startswith("LEASEKEEPER_")]:  # the session's
        monkeypatch.delenv(key)
    monkeypatch.setenv("LEASEKEEPER_VAR_DIR", str(tmp_path))
    read = load_settings()
    assert [pool.name for pool in read.pools] == ["py"]
    assert read.pools[0].template.command == json.loads(POOLS)[0]["template"]["command"]
    assert read.claim_timeout_s == 77, text
    assert read.reap_runs_interval_s == 60  # the demo's 1 s is not the backend's setting
