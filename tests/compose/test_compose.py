"""docker-compose.yml's configuration, checked offline (Debian's ``docker-compose`` parses
it; no engine needed). test_stack.py brings the stack up for real."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"


def _compose_cli() -> list[str]:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
    if shutil.which("docker") and probe.returncode == 0:
        return ["docker", "compose"]
    raise AssertionError(
        "neither docker-compose nor the docker compose plugin is installed; `make test` "
        "installs Debian's docker-compose (scripts/system-deps.sh)"
    )


def _config(**env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LEASEKEEPER_")}
    return subprocess.run([*_compose_cli(), "-f", str(COMPOSE_FILE), "config"],
                          capture_output=True, text=True, check=False, env={**clean, **env},
                          cwd=REPO)


def _services(output: str) -> dict[str, Any]:
    import yaml

    loaded: dict[str, Any] = yaml.safe_load(output)
    return dict(loaded["services"])


def test_compose_config_has_the_whole_backend() -> None:
    done = _config()
    assert done.returncode == 0, done.stderr
    services = _services(done.stdout)
    assert set(services) == {"redis", "postgres", "migrate", "worker", "beat", "flower",
                             "metrics", "console"}
    for name in ("worker", "beat", "flower", "metrics", "console"):
        svc = services[name]
        assert svc["environment"]["LEASEKEEPER_BROKER_URL"] == "redis://redis:6379/0"
        assert svc["environment"]["LEASEKEEPER_STORE_URL"].startswith("postgresql+psycopg://")
        assert svc["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert services["migrate"]["command"] == ["leasekeeper", "db", "upgrade"]
    assert services["worker"]["command"][:4] == ["celery", "-A", "workers.app", "worker"]
    assert "-E" in services["worker"]["command"]  # events on, so Flower shows every task
    assert services["beat"]["command"][:4] == ["celery", "-A", "workers.app", "beat"]
    assert services["metrics"]["command"] == ["leasekeeper", "metrics"]
    assert services["console"]["command"] == ["leasekeeper", "console"]
    for name in ("metrics", "console"):  # published on loopback only
        assert all(str(p.get("host_ip", p) if isinstance(p, dict) else p).startswith("127.0.0.1")
                   for p in services[name]["ports"]), services[name]["ports"]


def test_flower_is_on_loopback_and_never_runs_without_basic_auth() -> None:
    services = _services(_config().stdout)
    flower = services["flower"]
    (port,) = flower["ports"]
    published = port if isinstance(port, str) else f"{port['host_ip']}:{port['published']}"
    assert published.startswith("127.0.0.1:")
    assert flower["environment"]["FLOWER_BASIC_AUTH"] == ""
    assert flower["environment"]["FLOWER_PORT"] == "5555"  # Flower reads FLOWER_* itself
    script = flower["command"][-1].replace("$$", "$")  # `config` prints compose escapes
    assert 'test -n "$FLOWER_BASIC_AUTH"' in script and "exit 2" in script
    # The guard really refuses: run the service's own script without credentials.
    refused = subprocess.run(["sh", "-c", script], capture_output=True, text=True,
                             env={"PATH": os.environ["PATH"], "FLOWER_BASIC_AUTH": ""},
                             check=False)
    assert refused.returncode == 2 and "LEASEKEEPER_FLOWER_BASIC_AUTH" in refused.stderr
    chosen = _services(_config(LEASEKEEPER_FLOWER_BASIC_AUTH="ops:s3cret").stdout)
    assert chosen["flower"]["environment"]["FLOWER_BASIC_AUTH"] == "ops:s3cret"


def test_no_docker_engine_skips_with_the_reason_but_fails_under_ci(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.compose.engine import unavailable

    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="dockerd needs root"):
        unavailable("dockerd needs root")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI must run the Docker tests, but: no"):
        unavailable("no kernel support")


def test_a_stopped_worker_has_longer_than_the_soft_time_limit_to_finish() -> None:
    # A stop that kills a running task leaves it to the visibility timeout (an hour) before
    # another worker gets it: the grace must outlast the longest task (its soft limit).
    from workers.settings import Settings

    worker = _services(_config().stdout)["worker"]
    grace = worker["stop_grace_period"]
    seconds = int(grace[:-1]) * {"s": 1, "m": 60}[grace[-1]] if isinstance(grace, str) else grace
    assert seconds > Settings().task_soft_time_limit_s, grace
