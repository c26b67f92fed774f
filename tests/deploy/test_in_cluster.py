"""deploy/overlays/job running for real on the test cluster: the manifests applied as in
test_manifests.py, the Secret pointing at the session's Redis and a fresh PostgreSQL
database, and the pods run by the kubelet simulator (tests/cluster/kubelet_sim.py) as real
processes: the migration Job's `leasekeeper db upgrade`, the worker Deployment's two
`celery worker`s (as the leasekeeper-worker ServiceAccount, through its in-cluster token and
`load_incluster_config`; each under its pod's hostname) and beat. A producer outside the
cluster then acquires a lease and destroys it through those workers, and its Job is created
and deleted on the API server.

The one seam: the image. `leasekeeper:0.1.0` maps to this checkout's virtualenv (its `bin`
first on PATH, the repository on PYTHONPATH), as the Dockerfile's image would provide. The
simulator runs no probes, so the test runs each probe's own command with the pod's
environment.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
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
from tests.services import PostgresServer, RedisServer
from tests.stack import REPO

IMAGE = "leasekeeper:0.1.0"
LOOP = ["sh", "-c", "while :; do sleep 1; done"]


def image_env() -> dict[str, str]:
    """What the image's ENV gives a container: here, this checkout's virtualenv."""
    venv_bin = Path(sys.executable).parent
    return {"PATH": f"{venv_bin}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"}


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
