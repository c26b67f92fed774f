"""docker-compose.yml: its configuration is checked on every machine (Debian's
``docker-compose`` parses it offline; ``make test`` installs it), and where a Docker engine
runs, the whole stack is brought up and a lease goes through it end to end."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
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
    script = flower["command"][-1].replace("$$", "$")  # `config` prints compose escapes
    assert 'test -n "$FLOWER_BASIC_AUTH"' in script and "exit 2" in script
    # The guard really refuses: run the service's own script without credentials.
    refused = subprocess.run(["sh", "-c", script], capture_output=True, text=True,
                             env={"PATH": os.environ["PATH"], "FLOWER_BASIC_AUTH": ""},
                             check=False)
    assert refused.returncode == 2 and "LEASEKEEPER_FLOWER_BASIC_AUTH" in refused.stderr
    chosen = _services(_config(LEASEKEEPER_FLOWER_BASIC_AUTH="ops:s3cret").stdout)
    assert chosen["flower"]["environment"]["FLOWER_BASIC_AUTH"] == "ops:s3cret"


def _docker_engine() -> bool:
    if not shutil.which("docker"):
        return False
    return subprocess.run(["docker", "info"], capture_output=True, check=False).returncode == 0


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not _docker_engine(),
                    reason="no Docker engine on this machine: the compose stack cannot start "
                           "(its configuration is checked by the tests above)")
def test_compose_stack_runs_a_lease_end_to_end() -> None:  # pragma: no cover - needs Docker
    project = f"lk{uuid.uuid4().hex[:8]}"
    cli = [*_compose_cli(), "-p", project, "-f", str(COMPOSE_FILE)]
    env = {**os.environ, "LEASEKEEPER_FLOWER_BASIC_AUTH": "ops:smoke-test"}
    try:
        subprocess.run([*cli, "up", "-d", "--build", "--wait"], check=True, env=env, cwd=REPO)
        script = ("from tasks import producer; import json; r = producer.acquire_lease("
                  "'compose-smoke-1').get(120); print(json.dumps(r)); "
                  "print(json.dumps(producer.destroy_lease(r['lease_id']).get(120)))")
        out = subprocess.run([*cli, "exec", "-T", "worker", "python", "-c", script],
                             check=True, env=env, cwd=REPO, capture_output=True, text=True)
        acquired, destroyed = (json.loads(line) for line in out.stdout.strip().splitlines())
        assert acquired["state"] == "active" and destroyed["result"] == "destroyed"
    finally:
        subprocess.run([*cli, "down", "-v"], check=False, env=env, cwd=REPO)
