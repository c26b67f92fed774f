"""Kubernetes provider: API requests per operation, and the latency from a pod becoming Ready
to its lease being marked ready, against the real test cluster. Prints JSON.

Starts the harness of tests/cluster (kube-apiserver 1.20, controller manager, the kubelet and
Sandbox controller simulators, all on loopback) and:

- requests: runs acquire, resume check on a live lease, destroy (both backends) and
  list_managed with the provider behind the fault proxy, which counts every request;
- latency (backend sandbox-cr): the kubelet simulator, in this process, notes the moment it
  sends the pod's Running/Ready status (t0). Measured from t0, each run records when
  * a bare pod watch (this process, no proxy) sees the pod Ready       (baseline: the API's
    own propagation),
  * a bare Sandbox watch sees the Sandbox Ready                        (baseline: plus the
    Sandbox controller's hop, which any Sandbox client waits for),
  * the provider's acquire returns, in this process                    (the provider),
  * the lease row gets ``ready_at`` through a real Celery worker       (the whole task).
  Medians over ``--runs`` runs (after one warm-up); the ratios divide by the Sandbox-watch
  baseline, the earliest moment anyone can know the Sandbox is Ready. All in one process
  with the simulators, on a 2-core machine: expect tens of milliseconds of scheduling noise.
- claim (warm pools, both backends): ``provider.claim`` of a warm pool member, direct to the
  API server (its two reads and the exec that delivers the run's data on stdin), repeated
  ``--claims`` times on one member (a claim is idempotent), against a bare exec of ``true``
  through the same API server (the floor of any exec); its API requests are counted above.

    python bench/kube_ops.py [--runs 9] [--claims 20] [--no-worker]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import UTC
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

Obj = dict[str, Any]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--claims", type=int, default=20)
    parser.add_argument("--no-worker", action="store_true",
                        help="skip the through-Celery latency (no Redis, no worker)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="lk-kube-bench-"))
    work.chmod(0o755)
    from tests.services import free_port

    redis_port = free_port()
    os.environ["LEASEKEEPER_BROKER_URL"] = f"redis://127.0.0.1:{redis_port}/0"
    with ExitStack() as stack:
        env = stack.enter_context(Harness(work))
        requests = count_requests(env, runs=3)
        claims = measure_claims(env, args.claims)
        latency = measure_latency(env, args.runs, None if args.no_worker else
                                  lambda: stack.enter_context(Worker(env, work, redis_port)))
    print(json.dumps({
        "benchmark": "kube_ops",
        "cluster": "kube-apiserver 1.20 + kube-controller-manager (Debian source build), "
                   "kubelet and Sandbox controller simulators, loopback",
        "api_requests_per_operation": requests,
        "ready_latency": latency,
        "claim_latency": claims,
    }, indent=2))


# -- the cluster ------------------------------------------------------------------------------

class Harness:
    """Cluster, simulators, fault proxy, a namespace, and two providers: one through the
    proxy (counted), one direct (timed, like the bare watches)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.stack = ExitStack()

    def __enter__(self) -> Harness:
        from kubernetes import client

        from tests.cluster.binaries import locate_binaries
        from tests.cluster.cluster import KubeCluster
        from tests.cluster.fixtures import create_namespace, new_fault_proxy
        from tests.cluster.sandbox_controller import SandboxController, install_sandbox_crd

        self.cluster = self.stack.enter_context(
            KubeCluster(locate_binaries(), before_controllers=install_sandbox_crd))
        self.admin = self.stack.enter_context(self.cluster.api_client())
        self.kubelet = self.stack.enter_context(
            TimedKubelet(self.admin, workdir=self.work / "kubelet"))
        self.stack.enter_context(SandboxController(self.admin))
        self.proxy = self.stack.enter_context(new_fault_proxy(self.cluster, self.work / "proxy"))
        self.namespace = create_namespace(self.admin)
        self.installation = "bench"
        self.counted = self._provider(self.proxy.kubeconfig_path)
        self.direct = self._provider(self.cluster.kubeconfig_path)
        self.watches = ReadyWatches(client.ApiClient(self.admin.configuration), self.namespace)
        self.stack.enter_context(self.watches)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()

    def _provider(self, kubeconfig: Path) -> Any:
        from providers.kubernetes.provider import build_kubernetes_provider
        from workers.settings import Settings

        provider = build_kubernetes_provider(Settings(
            kube_config_path=kubeconfig, kube_namespace=self.namespace,
            installation_id=self.installation, providers=["kubernetes"],
            provider="kubernetes"))
        self.stack.callback(provider.api.api_client.close)
        return provider

    def request(self, backend: str = "sandbox-cr", pool: str | None = None) -> Any:
        from providers.base import AcquireRequest
        from providers.spec import SandboxSpec

        lease_id = f"bench-{uuid.uuid4().hex[:12]}"
        spec = SandboxSpec(tenant="bench", backend=backend,
                           command=["sh", "-c", "while :; do sleep 1; done"]
                           if backend == "job" else None)
        labels = {} if pool else {"leasekeeper.dev/run-id": lease_id}
        return AcquireRequest(lease_id=lease_id, name=self.counted.lease_name(lease_id),
                              spec=spec, labels=labels, timeout_s=60, pool=pool)

    @staticmethod
    def handle(request: Any, meta: Obj) -> Any:
        from providers.base import LeaseHandle

        return LeaseHandle(request.name, request.spec.backend, meta)


def _timed_kubelet_class() -> type:
    from tests.cluster.kubelet_sim import KubeletSim

    class Timed(KubeletSim):  # type: ignore[misc]
        """The kubelet simulator, noting when it sends each pod's Ready status."""

        ready_sent: dict[str, tuple[float, float]]  # pod name → (monotonic, wall clock)

        def _patch(self, run: Any, status: Obj) -> None:
            ready = status.get("phase") == "Running" and any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in status.get("conditions", []))
            if ready and run.name not in self.ready_sent:
                self.ready_sent[run.name] = (time.monotonic(), time.time())
            super()._patch(run, status)

    return Timed


def TimedKubelet(api: Any, workdir: Path) -> Any:
    kubelet = _timed_kubelet_class()(api, workdir=workdir)
    kubelet.ready_sent = {}
    return kubelet


@dataclass
class ReadyWatches:
    """Two bare watches (pods, Sandboxes) noting when each object is first seen Ready."""

    api: Any
    namespace: str
    pods: dict[str, float] = field(default_factory=dict)
    sandboxes: dict[str, float] = field(default_factory=dict)
    _watches: list[Any] = field(default_factory=list)
    stopping: bool = False

    def __enter__(self) -> ReadyWatches:
        from kubernetes import client

        core, custom = client.CoreV1Api(self.api), client.CustomObjectsApi(self.api)
        self._start(lambda **kw: core.list_namespaced_pod(self.namespace, **kw), self.pods)
        self._start(lambda **kw: custom.list_namespaced_custom_object(
            "agents.x-k8s.io", "v1alpha1", self.namespace, "sandboxes", **kw), self.sandboxes)
        return self

    def _start(self, list_call: Callable[..., Any], seen: dict[str, float]) -> None:
        from kubernetes import watch

        w = watch.Watch()  # type: ignore[no-untyped-call]
        self._watches.append(w)
        rv = json.loads(list_call(_preload_content=False).data)["metadata"]["resourceVersion"]

        def run() -> None:
            try:
                for event in w.stream(list_call, resource_version=rv,  # type: ignore[no-untyped-call]
                                      deserialize=False):
                    obj = event["object"]
                    conditions = (obj.get("status") or {}).get("conditions") or []
                    if any(c.get("type") == "Ready" and c.get("status") == "True"
                           for c in conditions):
                        seen.setdefault(obj["metadata"]["name"], time.monotonic())
            except Exception:  # the cluster stopping under the watch at the end
                if not self.stopping:
                    raise

        threading.Thread(target=run, daemon=True).start()

    def __exit__(self, *exc: object) -> None:
        self.stopping = True
        for w in self._watches:
            w.stop()

    @staticmethod
    def wait(seen: dict[str, float], name: str, timeout_s: float = 30.0) -> float:
        deadline = time.monotonic() + timeout_s
        while name not in seen:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no Ready event for {name} in {timeout_s}s")
            time.sleep(0.005)
        return seen[name]


# -- requests per operation -------------------------------------------------------------------

def count_requests(env: Harness, runs: int) -> dict[str, Any]:
    from providers.base import ResumeOutcome

    provider, proxy = env.counted, env.proxy
    samples: dict[str, list[int]] = {}

    def counted(label: str, call: Callable[[], Any]) -> Any:
        proxy.reset_counts()
        result = call()
        samples.setdefault(label, []).append(proxy.count())
        return result

    for _ in range(runs):
        for backend in ("sandbox-cr", "job"):
            request = env.request(backend)
            acquired = counted(f"{backend} acquire", lambda r=request: provider.acquire(r))
            handle = env.handle(request, acquired.meta)
            if backend == "job":  # a live Job is Running: its pod exists
                wait_job_active(env, request.name)
            checked = counted(f"{backend} resume_check (live)",
                              lambda h=handle: provider.resume_check(h, 10))
            assert checked.outcome is ResumeOutcome.RESUMABLE, checked
            counted(f"{backend} destroy", lambda h=handle: provider.destroy(h))
            member = env.request(backend, pool="bench")
            acquired = counted(f"{backend} acquire (pool member)",
                               lambda r=member: provider.acquire(r))
            handle = env.handle(member, acquired.meta)
            claimed = counted(f"{backend} claim", lambda h=handle, r=member: provider.claim(
                h, claim_request(r.lease_id)))
            assert claimed.outcome.value == "claimed", claimed
            provider.destroy(handle)
        counted("list_managed", provider.list_managed)
    return {label: _summary(values) for label, values in samples.items()}


def claim_request(lease_id: str) -> Any:
    from providers.base import ClaimRequest

    return ClaimRequest(lease_id=lease_id, run_id=f"run-{lease_id}", tenant="bench",
                        labels={"team": "bench"}, env={"GREETING": "hello", "MODE": "bench"},
                        secret_env={"API_KEY": "bench-secret-" + "x" * 32})


def measure_claims(env: Harness, claims: int) -> dict[str, Any]:
    """provider.claim of one warm member per backend, ``claims`` times (after a warm-up),
    and a bare ``true`` exec through the same API server, in milliseconds."""
    from kubernetes import client
    from kubernetes.stream import stream

    # its own ApiClient: stream() swaps call_api on the one it is given, and the kubelet
    # simulator's threads use env.admin
    core = client.CoreV1Api(client.ApiClient(env.admin.configuration))

    def bare_exec(pod: str) -> float:
        started = time.perf_counter()
        resp = stream(core.connect_get_namespaced_pod_exec, pod, env.namespace,
                      container="sandbox", command=["true"], stdin=False, stdout=True,
                      stderr=True, tty=False, _preload_content=False)
        resp.run_forever(timeout=30)
        assert resp.returncode == 0
        return time.perf_counter() - started

    results: dict[str, Any] = {"claims": claims}
    for backend in ("sandbox-cr", "job"):
        member = env.request(backend, pool="bench")
        acquired = env.direct.acquire(member)
        handle = env.handle(member, acquired.meta)
        claim = claim_request(member.lease_id)
        series: dict[str, list[float]] = {"provider_claim": [], "bare_exec_true": []}
        for run in range(claims + 1):
            started = time.perf_counter()
            claimed = env.direct.claim(handle, claim)
            elapsed = time.perf_counter() - started
            assert claimed.outcome.value == "claimed", claimed
            bare = bare_exec(acquired.meta["pod_name"])
            if run:  # the first is a warm-up
                series["provider_claim"].append(elapsed)
                series["bare_exec_true"].append(bare)
        env.direct.destroy(handle)
        medians = {k: round(statistics.median(v) * 1000, 1) for k, v in series.items()}
        results[backend] = {
            "median_ms": medians,
            "p90_ms": {k: round(statistics.quantiles(v, n=10)[-1] * 1000, 1)
                       for k, v in series.items()},
            "ratio_to_bare_exec": round(medians["provider_claim"] / medians["bare_exec_true"],
                                        2),
            "samples_ms": {k: [round(x * 1000, 1) for x in v] for k, v in series.items()},
        }
    return results


def wait_job_active(env: Harness, name: str, timeout_s: float = 30.0) -> None:
    from kubernetes import client

    batch = client.BatchV1Api(env.admin)
    deadline = time.monotonic() + timeout_s
    while (batch.read_namespaced_job(name, env.namespace).status.active or 0) < 1:
        if time.monotonic() > deadline:
            raise TimeoutError(f"Job {name} not active in {timeout_s}s")
        time.sleep(0.02)


def _summary(values: list[int]) -> int | dict[str, int]:
    """The count when every run agreed, else min/median/max."""
    if len(set(values)) == 1:
        return values[0]
    return {"min": min(values), "median": int(statistics.median(values)), "max": max(values)}


# -- latency ----------------------------------------------------------------------------------

class Worker:
    """Redis, a SQLite store and a real Celery worker whose provider is kubernetes (direct)."""

    def __init__(self, env: Harness, work: Path, redis_port: int) -> None:
        self.env, self.work, self.redis_port = env, work, redis_port

    def __enter__(self) -> Worker:
        from models.migrate import upgrade
        from models.store import Store
        from tests.services import start_redis
        from tests.stack import WorkerStack

        self.redis = start_redis(self.work / "redis", self.redis_port)
        url = f"sqlite:///{self.work / 'store.db'}"
        upgrade(url)
        self.store = Store(url)
        self.stack = WorkerStack(
            name="kube-bench", store_url=url, root=self.work,
            broker_url=os.environ["LEASEKEEPER_BROKER_URL"], extra_env={
                "LEASEKEEPER_PROVIDERS": "kubernetes", "LEASEKEEPER_PROVIDER": "kubernetes",
                "LEASEKEEPER_KUBE_CONFIG_PATH": str(self.env.cluster.kubeconfig_path),
                "LEASEKEEPER_KUBE_NAMESPACE": self.env.namespace,
                "LEASEKEEPER_INSTALLATION_ID": self.env.installation})
        self.stack.start_worker(concurrency=1)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.stop()
        self.store.dispose()
        self.redis.stop()

    def acquire(self) -> tuple[str, float]:
        """Acquire through the producer API; (pod name, ready_at as epoch seconds)."""
        from tasks import producer

        result = producer.acquire_lease(f"bench-{uuid.uuid4().hex[:12]}", {"tenant": "bench"})
        done = result.get(60)
        lease = self.store.get_lease(done["lease_id"])
        assert lease.ready_at is not None
        producer.destroy_lease(done["lease_id"]).get(60)
        return done["provider_lease_id"], lease.ready_at.replace(tzinfo=UTC).timestamp()


def measure_latency(env: Harness, runs: int,
                    start_worker: Callable[[], Worker] | None) -> dict[str, Any]:
    provider, sent, watches = env.direct, env.kubelet.ready_sent, env.watches
    series: dict[str, list[float]] = {"bare_pod_watch": [], "bare_sandbox_watch": [],
                                      "provider_acquire_returns": []}
    for run in range(runs + 1):
        request = env.request()
        acquired = provider.acquire(request)
        returned = time.monotonic()
        t0 = sent[request.name][0]
        pod_seen = watches.wait(watches.pods, request.name)
        sandbox_seen = watches.wait(watches.sandboxes, request.name)
        provider.destroy(env.handle(request, acquired.meta))
        if run == 0:
            continue  # warm-up: connections, caches
        series["bare_pod_watch"].append(pod_seen - t0)
        series["bare_sandbox_watch"].append(sandbox_seen - t0)
        series["provider_acquire_returns"].append(returned - t0)
    if start_worker is not None:
        worker = start_worker()
        series["celery_task_lease_ready_at"] = []
        for run in range(runs + 1):
            name, ready_at = worker.acquire()
            if run:
                series["celery_task_lease_ready_at"].append(ready_at - sent[name][1])
    medians = {k: round(statistics.median(v) * 1000, 1) for k, v in series.items()}
    baseline = medians["bare_sandbox_watch"]
    return {
        "from": "the kubelet sending the pod's Ready status",
        "runs": runs,
        "median_ms": medians,
        "ratio_to_bare_sandbox_watch": {
            k: round(v / baseline, 2) for k, v in medians.items()
            if k not in ("bare_pod_watch", "bare_sandbox_watch")},
        "samples_ms": {k: [round(x * 1000, 1) for x in v] for k, v in series.items()},
    }


if __name__ == "__main__":
    main()
