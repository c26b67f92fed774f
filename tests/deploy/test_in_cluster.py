"""deploy/overlays/job running for real on the test cluster: the manifests applied as in
test_manifests.py, the Secret pointing at the session's Redis and a fresh PostgreSQL
database, and the pods run by the kubelet simulator (tests/cluster/kubelet_sim.py) as real
processes: the migration Job's `leasekeeper db upgrade`, the worker Deployment's two
`celery worker`s (as the leasekeeper-worker ServiceAccount, through its in-cluster token and
`load_incluster_config`; each under its pod's hostname), beat, Flower, the metrics exporter
and the lease console. A producer outside the cluster then acquires a lease and destroys it
through those workers, and its Job is created and deleted on the API server; meanwhile the
exporter's /metrics counts the active lease and the console (behind the Secret's basic
auth) lists it.

Pods run on the host's network here, so the HTTP servers' ports are rewritten to free
loopback ones (their Services are what a cluster's pods would reach instead).

The one seam: the image. `leasekeeper:0.1.0` maps to this checkout's virtualenv (its `bin`
first on PATH, the repository on PYTHONPATH), as the Dockerfile's image would provide. The
simulator runs no probes, so the test runs each probe's own command with the pod's
environment.
"""

from __future__ import annotations

import base64
import os
import secrets
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from models.schema import LeaseState
from models.store import Store
from tests.cluster.cluster import ClusterAccess
from tests.cluster.fixtures import delete_namespace
from tests.cluster.kubelet_sim import KubeletSim, PodRun
from tests.deploy.test_manifests import (
    _has_policy_v1,
    container,
    for_test_cluster,
    kubectl,
    one,
    render,
)
from tests.e2e.conftest import eventually
from tests.services import PostgresServer, RedisServer, free_port
from tests.stack import REPO

IMAGE = "leasekeeper:0.1.0"
LOOP = ["sh", "-c", "while :; do sleep 1; done"]


def image_env() -> dict[str, str]:
    """What the image's ENV gives a container: here, this checkout's virtualenv."""
    venv_bin = Path(sys.executable).parent
    return {"PATH": f"{venv_bin}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"}


def on_loopback(docs: list[dict[str, Any]]) -> dict[str, int]:
    """Flower's, the exporter's and the console's ports moved to free loopback ones (every
    pod shares the host's network here); their ports by component."""
    ports = {"flower": free_port(), "metrics": free_port(), "console": free_port()}
    moved = {"FLOWER_PORT": ports["flower"], "LEASEKEEPER_METRICS_PORT": ports["metrics"],
             "LEASEKEEPER_CONSOLE_PORT": ports["console"]}
    hosts = {"LEASEKEEPER_METRICS_HOST", "LEASEKEEPER_CONSOLE_HOST"}
    for component in ports:
        main = container(one(docs, "Deployment", f"leasekeeper-{component}"))
        for var in main.get("env", []):
            if var["name"] in moved:
                var["value"] = str(moved[var["name"]])
            elif var["name"] in hosts:
                var["value"] = "127.0.0.1"
        main.pop("readinessProbe", None)  # the simulator runs none; the test asks instead
        main.pop("livenessProbe", None)
    flower = container(one(docs, "Deployment", "leasekeeper-flower"))
    flower["env"].append({"name": "FLOWER_ADDRESS", "value": "127.0.0.1"})
    return ports


def http_get(url: str, auth: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url)
    if auth is not None:
        request.add_header("Authorization",
                           "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def probe(run: PodRun, command: list[str]) -> subprocess.CompletedProcess[str]:
    """Run a probe's exec command as the kubelet would: with the container's environment."""
    return subprocess.run(command, env=run.envs[run.containers[0]], cwd=run.cwd,
                          capture_output=True, text=True, check=False, timeout=120)


def started(run: PodRun, command: list[str], attempts: int = 12,
            ) -> subprocess.CompletedProcess[str]:
    """The probe's first success, tried as a startupProbe would (a worker needs some seconds
    to connect); fails with the probe's output and the container's log."""
    for _ in range(attempts):
        done = probe(run, command)
        if done.returncode == 0:
            return done
        assert run.alive(), f"{run.name} exited: {run.log_path.read_text()[-3000:]}"
    raise AssertionError(f"{run.name}: probe failed {attempts} times: {done.stderr}\n"
                         f"{run.log_path.read_text()[-3000:]}")


@pytest.mark.k8s
@pytest.mark.postgres
@pytest.mark.timeout(420)
def test_the_job_overlay_runs_in_cluster_and_serves_a_lease(
        kube_cluster: ClusterAccess, kube_api: client.ApiClient,
        kubelet_sim: KubeletSim | None, redis_server: RedisServer,
        postgres_server: PostgresServer) -> None:
    if kubelet_sim is None:
        pytest.skip("real kubelets: the leasekeeper image is not built for this cluster")
    from tasks import producer  # imports the Celery app, pointed at the session's Redis

    namespace = f"lk-{secrets.token_hex(4)}"
    store_url = postgres_server.create_database(f"lk_{uuid.uuid4().hex[:12]}")
    docs = for_test_cluster(render("job"), namespace, _has_policy_v1(kube_api),
                            broker_url=redis_server.url, store_url=store_url)
    ports = on_loopback(docs)
    auth = f"ops:{secrets.token_urlsafe(16)}"
    one(docs, "Secret", "leasekeeper-secrets")["stringData"]["FLOWER_BASIC_AUTH"] = auth
    core, batch = client.CoreV1Api(kube_api), client.BatchV1Api(kube_api)
    store = Store(store_url)
    kubelet_sim.images[IMAGE] = image_env()
    try:
        for part in ([d for d in docs if d["kind"] == "Namespace"],
                     [d for d in docs if d["kind"] != "Namespace"]):
            applied = kubectl(kube_cluster, part, "apply")
            assert applied.returncode == 0, applied.stderr

        def pods(component: str) -> list[Any]:
            return list(core.list_namespaced_pod(
                namespace, label_selector=f"app.kubernetes.io/component={component}").items)

        def running(component: str, count: int) -> list[Any] | None:
            found = [p for p in pods(component) if p.status.phase == "Running"
                     and all(s.ready for s in p.status.container_statuses or [])]
            return found if len(found) == count else None

        # the migration Job runs `leasekeeper db upgrade` against PostgreSQL and completes
        eventually(lambda: batch.read_namespaced_job("leasekeeper-migrate", namespace)
                   .status.succeeded == 1, 180, "the migration Job to complete")
        workers = eventually(lambda: running("worker", 2), 120, "2 worker pods Running")
        (beat,) = eventually(lambda: running("beat", 1), 120, "the beat pod Running")

        # each worker answers its own probe: `inspect ping -d leasekeeper@$HOSTNAME`, so its
        # node name is its pod's hostname, and it runs with the in-cluster token only
        worker_probe = container(one(docs, "Deployment", "leasekeeper-worker"))[
            "readinessProbe"]["exec"]["command"]
        worker_runs = []
        for pod in workers:
            run = kubelet_sim.run_for(namespace, pod.metadata.name)
            assert run is not None and run.alive()
            assert not {"KUBECONFIG", "LEASEKEEPER_KUBE_CONFIG_PATH"} & run.envs["worker"].keys()
            assert (Path(run.envs["worker"]["HOME"]) / ".kube").exists() is False
            assert run.command[0] == "unshare"  # the token is mounted at the in-cluster path
            answered = started(run, worker_probe)
            assert f"leasekeeper@{pod.metadata.name}: OK" in answered.stdout
            worker_runs.append(run)
        beat_run = kubelet_sim.run_for(namespace, beat.metadata.name)
        assert beat_run is not None and beat_run.command[0] == "celery"  # no token for beat
        eventually(lambda: "beat: Starting..." in beat_run.log_path.read_text(), 60,
                   "beat to start its scheduler")
        beat_probe = container(one(docs, "Deployment", "leasekeeper-beat"))[
            "livenessProbe"]["exec"]["command"]
        started(beat_run, beat_probe)

        # a producer outside the cluster acquires a lease: a worker pod creates its Job
        run_id = f"run-{uuid.uuid4().hex[:12]}"
        sent = producer.acquire_lease(run_id, {"tenant": "acme", "command": LOOP})
        acquired = sent.get(180)
        assert (acquired["result"], acquired["state"]) == ("acquired", "active"), acquired
        assert (acquired["provider"], acquired["backend"]) == ("kubernetes", "job")
        name, lease_id = acquired["provider_lease_id"], acquired["lease_id"]
        job = batch.read_namespaced_job(name, namespace)
        assert job.metadata.labels["leasekeeper.dev/lease-id"] == lease_id
        assert store.get_lease(lease_id).state == LeaseState.ACTIVE
        assert any(sent.id in run.log_path.read_text() for run in worker_runs)

        # the exporter counts it and sees both workers; the console lists it behind auth,
        # and Flower serves behind the same auth
        metrics_url = f"http://127.0.0.1:{ports['metrics']}/metrics"
        last: list[tuple[int, str]] = []

        def scraped() -> str | None:
            last[:] = [http_get(metrics_url)]
            status, body = last[0]
            active = 'leasekeeper_leases{provider="kubernetes",state="active",tenant="acme"} 1.0'
            return body if status == 200 and active in body else None

        try:
            body = eventually(scraped, 120, "the exporter's /metrics to count the active lease")
        except AssertionError:
            (exporter,) = pods("metrics")
            run = kubelet_sim.run_for(namespace, exporter.metadata.name)
            log = run.log_path.read_text()[-3000:] if run else "(no process)"
            raise AssertionError(f"last answer {str(last)[:3000]}; the exporter's log: {log}"
                                 ) from None
        assert "leasekeeper_store_up 1.0" in body and "leasekeeper_broker_up 1.0" in body
        assert eventually(lambda: "leasekeeper_workers_up 2.0" in http_get(metrics_url)[1],
                          60, "the exporter to see both worker pods")
        console_url = f"http://127.0.0.1:{ports['console']}/leases"
        eventually(lambda: http_get(console_url)[0] == 401, 120,
                   "the console to answer, refusing a request without auth")
        status, page = http_get(console_url, auth)
        assert status == 200 and lease_id in page, page[-2000:]
        assert http_get(console_url, "ops:wrong")[0] == 401
        flower_url = f"http://127.0.0.1:{ports['flower']}/api/workers"
        eventually(lambda: http_get(flower_url)[0] == 401, 120,
                   "Flower to answer, refusing a request without auth")
        assert http_get(flower_url, auth)[0] == 200

        # and destroys it: the Job is deleted on the API server
        destroyed = producer.destroy_lease(lease_id).get(120)
        assert destroyed["result"] == "destroyed", destroyed
        assert store.get_lease(lease_id).state == LeaseState.DESTROYED

        def job_gone() -> bool:
            try:
                batch.read_namespaced_job(name, namespace)
            except client.ApiException as exc:
                return exc.status == 404
            return False

        eventually(job_gone, 60, f"Job {name} to be deleted")
    finally:
        kubelet_sim.images.pop(IMAGE, None)
        store.dispose()
        delete_namespace(kube_api, namespace)
        try:  # the pods' processes stop on SIGTERM (warm shutdown) as the namespace goes
            eventually(lambda: not kubelet_sim.alive_in(namespace), 60,
                       f"every process of namespace {namespace} to stop")
        finally:
            kubelet_sim.kill_namespace(namespace)
