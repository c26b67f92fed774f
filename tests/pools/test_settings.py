"""Pool declarations (LEASEKEEPER_POOLS, LEASEKEEPER_POOLS_FILE as JSON or TOML): read and
validated with the settings; each bad declaration stops `leasekeeper up`, every command
and the worker at start, in one line naming the variable, the pool, the field and the
fix; the producer refuses a spec naming an unknown pool before anything is sent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from providers.errors import ConfigError, InvalidRequest
from tests.e2e.conftest import cli_env, leasekeeper
from tests.stack import REPO
from workers.pool_settings import PoolDeclaration
from workers.settings import Settings, load_settings

pytestmark = pytest.mark.timeout(180)
GOOD = [{"name": "py", "provider": "local", "size": 2,
         "template": {"command": ["sleep", "3600"], "env": {"A": "1"}, "tenant": "acme"}}]


def settings_error(monkeypatch: pytest.MonkeyPatch, **env: str) -> str:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as err:
        load_settings(read_env_file=False)
    return str(err.value)


def test_pools_from_the_environment_with_their_defaults(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.setenv("LEASEKEEPER_POOLS", json.dumps(GOOD))
    (pool,) = load_settings(read_env_file=False).pools
    assert (pool.name, pool.provider, pool.size, pool.max_size) == ("py", "local", 2, 2)
    assert (pool.max_age_s, pool.fill_batch_size, pool.backend) == (3600, 5, None)
    member = pool.member_spec()
    assert member.pool == "py" and member.provider == "local" and member.tenant == "acme"
    assert member.command == ["sleep", "3600"] and member.secret_env == {}


def test_pools_from_a_json_or_a_toml_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path
                                          ) -> None:
    as_json = tmp_path / "pools.json"
    as_json.write_text(json.dumps({"pools": GOOD}))
    as_toml = tmp_path / "pools.toml"
    as_toml.write_text('[[pools]]\nname = "py"\nprovider = "local"\nsize = 2\nmax_size = 3\n'
                       '[pools.template]\ncommand = ["sleep", "3600"]\n'
                       '[pools.template.env]\nA = "1"\n')
    for path in (as_json, as_toml):
        monkeypatch.setenv("LEASEKEEPER_POOLS_FILE", str(path))
        (pool,) = load_settings(read_env_file=False).pools
        assert pool.name == "py" and pool.template.env == {"A": "1"}
    assert pool.max_size == 3  # the TOML one


@pytest.mark.parametrize(("pools", "expected"), [
    ('[{"name": "py", "provider": "local", "size": 3, "max_size": 2}]',
     "LEASEKEEPER_POOLS: pool 0 ('py'): max_size 2 is below size 3; raise max_size or lower "
     "size"),
    ('[{"name": "Py_1", "provider": "local", "size": 1}]',
     "name: must be 1-40 lowercase letters, digits or '-'"),
    ('[{"name": "py", "provider": "kubernetes", "size": 1}]',
     "pool 'py' uses provider 'kubernetes', which is not among "
     "LEASEKEEPER_PROVIDERS='local'; add it there, or give the pool one of those"),
    ('[{"name": "py", "provider": "local", "size": "2"}]',
     "size: Input should be a valid integer"),
    ('[{"name": "py", "provider": "local", "size": -1}]',
     "size: Input should be greater than or equal to 0"),
    ('[{"name": "py", "provider": "local", "size": 1, "max_age_s": 0}]',
     "max_age_s: Input should be greater than 0"),
    ('[{"name": "py", "provider": "local", "size": 1, "template": {"secret_env": {"K": "v"}}}]',
     "template.secret_env: per-run data has no place in a pool's template"),
    ('[{"name": "py", "provider": "local", "size": 1, "template": {"imgae": "x"}}]',
     "template.imgae: not a template field (a template takes command, env, image, labels, "
     "resources, tenant)"),
    ('[{"name": "py", "provider": "local", "sise": 1}]',
     "size: missing (required); sise: not a pool setting (a pool takes name, provider, "
     "backend, template, size, max_size, max_age_s, fill_batch_size)"),
    ('[{"name": "py", "provider": "local", "size": 1}, '
     '{"name": "py", "provider": "local", "size": 2}]',
     "pool 'py' is declared twice; give each pool its own name"),
    ('{"name": "py"}', "LEASEKEEPER_POOLS: expected a list of pools, got dict"),
    ('[{"name": "py",', "LEASEKEEPER_POOLS is not valid JSON"),
], ids=["max-below-size", "bad-name", "unknown-provider", "string-size", "negative-size",
        "zero-age", "secret-in-template", "typo-in-template", "typo-in-pool", "duplicate",
        "not-a-list", "not-json"])
def test_a_bad_declaration_is_refused_saying_what_and_how(
        monkeypatch: pytest.MonkeyPatch, pools: str, expected: str) -> None:
    message = settings_error(monkeypatch, LEASEKEEPER_POOLS=pools, LEASEKEEPER_PROVIDERS="local",
                             LEASEKEEPER_PROVIDER="local")
    assert message.startswith("invalid settings: LEASEKEEPER_POOLS"), message
    assert expected in message, message


def test_a_bad_pools_file_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    assert (f"LEASEKEEPER_POOLS_FILE={missing}: cannot read it" in
            settings_error(monkeypatch, LEASEKEEPER_POOLS_FILE=str(missing)))
    broken = tmp_path / "pools.toml"
    broken.write_text("[[pools]\nname = ")
    assert (f"LEASEKEEPER_POOLS_FILE={broken} is not valid TOML" in
            settings_error(monkeypatch, LEASEKEEPER_POOLS_FILE=str(broken)))
    both = settings_error(monkeypatch, LEASEKEEPER_POOLS=json.dumps(GOOD))
    assert "LEASEKEEPER_POOLS and LEASEKEEPER_POOLS_FILE are both set" in both


def test_up_and_every_command_stop_at_a_bad_declaration(tmp_path: Path) -> None:
    bad = '[{"name": "py", "provider": "local", "size": 3, "max_size": 2}]'
    for command in (["up"], ["pools"], ["status"], ["leases", "list"]):
        done = leasekeeper(*command, env=cli_env(LEASEKEEPER_POOLS=bad,
                                                 LEASEKEEPER_VAR_DIR=str(tmp_path)))
        assert done.returncode == 2, (command, done.stdout, done.stderr)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
        assert "LEASEKEEPER_POOLS: pool 0 ('py'): max_size 2 is below size 3" in lines[0]
    assert not (tmp_path / "logs").exists()  # up started nothing


def test_a_worker_with_a_bad_declaration_does_not_start(tmp_path: Path) -> None:
    bad = '[{"name": "py", "provider": "local", "size": 1, "template": {"reuse": true}}]'
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "workers.app", "worker", "-c", "1"],
        cwd=REPO, env=cli_env(LEASEKEEPER_POOLS=bad, LEASEKEEPER_VAR_DIR=str(tmp_path),
                              LEASEKEEPER_BROKER_URL="redis://127.0.0.1:1/0"),
        capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "LEASEKEEPER_POOLS: pool 0 ('py'): template.reuse: per-run data has no place" in last


def test_leasekeeper_pools_lists_the_declared_pools(tmp_path: Path) -> None:
    env = cli_env(LEASEKEEPER_POOLS=json.dumps(GOOD), LEASEKEEPER_VAR_DIR=str(tmp_path))
    assert leasekeeper("db", "upgrade", env=env).returncode == 0
    shown = leasekeeper("pools", env=env)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines()[0].split() == [
        "POOL", "PROVIDER", "SIZE", "MAX", "WARM", "PROVISIONING", "DRAINING", "BREAKER",
        "FAILURES", "LAST", "ERROR"]
    assert shown.stdout.splitlines()[1].split()[:8] == ["py", "local", "2", "2", "0", "0",
                                                        "0", "closed"]
    as_json = json.loads(leasekeeper("pools", "--json", env=env).stdout)
    assert as_json["pools"][0]["pool"] == "py" and as_json["pools"][0]["breaker"] == "closed"


def test_the_producer_refuses_an_unknown_pool_or_a_conflicting_spec_before_sending(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tasks import producer
    from workers.settings import get_settings

    monkeypatch.setenv("LEASEKEEPER_POOLS", json.dumps(GOOD))
    get_settings.cache_clear()
    try:
        with pytest.raises(InvalidRequest, match="unknown pool 'go': this installation "
                                                 "declares py"):
            producer.acquire_lease("run-1", {"pool": "go"})
        with pytest.raises(InvalidRequest, match=r"spec\.command differs from pool 'py'"):
            producer.acquire_lease("run-1", {"pool": "py", "command": ["bash"]})
        with pytest.raises(InvalidRequest, match="pool must be a pool name"):
            producer.acquire_lease("run-1", {"pool": "Not A Pool"})
    finally:
        get_settings.cache_clear()


def test_a_declaration_is_strict_and_frozen() -> None:
    pool = PoolDeclaration.model_validate(GOOD[0])
    with pytest.raises(ValueError, match="frozen"):
        pool.size = 3  # type: ignore[misc]
    assert Settings(pools=GOOD).pools == (pool,)
