"""Warm pools through a real worker: claim latency, and a burst of claims against refill.

Latency (producer call → result returned, one at a time, the worker otherwise idle): a
warm claim (``spec.pool``) against a cold acquire of the same sandbox and against a bare
Celery round trip (``leasekeeper.ping``), the three one after the other in every sample so
a shared machine's noise hits them alike. Before each sample the pool is refilled (a
``sweep.fill_pools`` sent by hand) and the worker is idle again (no task active), so every
claim finds a warm member; every lease is destroyed after its sample (not timed).
Targets: claim p50 <= 50 ms and <= 2x the bare round trip.

Burst: ``--burst`` claims sent at once at a pool of ``--burst-size`` (max_size 20% above),
with celery beat filling every second: the hit rate, the time until the pool is full again
(from the first send), and the most unclaimed members the store held at any instant
(sampled every 5 ms; must be <= max_size).

Every sample also times a cold start *from the pool* (``spec.pool`` naming a third pool, of
size 0, with the same template): the sandbox made as a member is and given the run's data as
a claim is, ready to run the template's agent. On Kubernetes it is the fair cold baseline: a
plain cold acquire of a Job returns once the Job exists (its pod may still be Pending), a
pool's sandbox only once its pod runs and has its data.

A provider is a setup (``SETUPS``): the worker's settings for it, the pool template, its
backends (each measured with a worker and store of its own), optionally a count of the
pools' members among the provider's own objects (sampled during the burst beside the
store's), and what to stop afterwards. ``local``: the local provider. ``kubernetes``: the
test cluster of tests/cluster (kube-apiserver, controller manager, the kubelet and Sandbox
controller simulators, as bench/kube_ops.py starts them), the worker on the kubernetes
provider straight to the API server, both backends (``sandbox-cr``, ``job``). Every server
started is stopped on the way out, whatever failed (SIGTERM included). Prints JSON.

    python bench/pools.py [--provider local|kubernetes] [--store sqlite|postgres]
                          [--samples 60] [--burst 50] [--burst-size 10]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import signal
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from workload import WORK, Services, services

LATENCY_POOL, BURST_POOL, COLD_POOL = "bench", "burst", "cold"
# What a pool's sandbox runs (README "Warm pools"): wait for its run's data, take its env,
# then the agent (here: sleep).
WAITING_TEMPLATE = {"command": [
    "sh", "-c", 'while [ ! -e "$LEASEKEEPER_RUN_DIR/claimed" ]; do sleep 0.1; done; '
    'set -a; . "$LEASEKEEPER_RUN_DIR/env"; set +a; exec sleep 3600']}


@dataclass
class ProviderSetup:
    """How to run the bench on one provider: the worker's extra settings, the pools'
    template, the backends to measure (None: the provider's only one), how many of a pool's
    unclaimed members the provider really has (None: not measured), and what to stop."""

    name: str
    env: dict[str, str]
    template: dict[str, Any] = field(default_factory=dict)
    stop: Callable[[], None] = lambda: None
    backends: tuple[str | None, ...] = (None,)
    real_members: Callable[[Any, str], int] | None = None


def local_setup(_svc: Services) -> ProviderSetup:
    return ProviderSetup("local", {"LEASEKEEPER_PROVIDERS": "local",
                                   "LEASEKEEPER_PROVIDER": "local"})


def kubernetes_setup(_svc: Services) -> ProviderSetup:
    """The cluster of tests/cluster on loopback (as bench/kube_ops.py starts it) and a
    namespace; the worker reaches the API server directly. Stops everything it started if
    any step fails."""
    from contextlib import ExitStack

    from tests.cluster.binaries import locate_binaries
    from tests.cluster.cluster import KubeCluster
    from tests.cluster.fixtures import create_namespace
    from tests.cluster.kubelet_sim import KubeletSim
    from tests.cluster.sandbox_controller import SandboxController, install_sandbox_crd

    started = ExitStack()
    try:
        cluster = started.enter_context(
            KubeCluster(locate_binaries(), before_controllers=install_sandbox_crd))
        admin = started.enter_context(cluster.api_client())
        started.enter_context(KubeletSim(admin, workdir=WORK / "kubelet"))
        started.enter_context(SandboxController(admin))
        namespace = create_namespace(admin)
    except BaseException:
        started.close()
        raise
    installation = "bench-pools"
    return ProviderSetup(
        "kubernetes", {"LEASEKEEPER_PROVIDERS": "kubernetes",
                       "LEASEKEEPER_PROVIDER": "kubernetes",
                       "LEASEKEEPER_KUBE_CONFIG_PATH": str(cluster.kubeconfig_path),
                       "LEASEKEEPER_KUBE_NAMESPACE": namespace,
                       "LEASEKEEPER_INSTALLATION_ID": installation},
        template=WAITING_TEMPLATE, stop=started.close, backends=("sandbox-cr", "job"),
        real_members=lambda stack, pool: kube_members(admin, namespace, installation,
                                                      stack, pool))


def kube_members(admin: Any, namespace: str, installation: str, stack: Any, pool: str) -> int:
    """The pool's workloads on the API server (not being deleted) whose lease is one of its
    unclaimed members when the store is read right after the listing."""
    from kubernetes import client

    from models.schema import FINAL_STATES
    from providers.kubernetes.manifests import (
        LABEL_LEASE_ID,
        LABEL_POOL,
        SANDBOX_GROUP,
        SANDBOX_PLURAL,
        installation_selector,
    )
    from tests.cluster.k8s_json import read_json

    selector = f"{installation_selector(installation)},{LABEL_POOL}={pool}"
    listed = [read_json(client.CustomObjectsApi(admin).list_namespaced_custom_object(
                  SANDBOX_GROUP, "v1alpha1", namespace, SANDBOX_PLURAL,
                  label_selector=selector, _preload_content=False)),
              read_json(client.BatchV1Api(admin).list_namespaced_job(
                  namespace, label_selector=selector, _preload_content=False))]
    live = {obj["metadata"]["labels"][LABEL_LEASE_ID] for found in listed
            for obj in found.get("items") or [] if not obj["metadata"].get("deletionTimestamp")}
    with store_at(stack.store_url).tx() as s:
        from sqlalchemy import select

        from models.schema import Lease

        unclaimed = set(s.scalars(select(Lease.lease_id).where(
            Lease.pool == pool, Lease.run_id.is_(None), Lease.state.not_in(FINAL_STATES))))
    return len(live & unclaimed)


SETUPS: dict[str, Callable[[Services], ProviderSetup]] = {
    "local": local_setup, "kubernetes": kubernetes_setup}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--provider", choices=sorted(SETUPS), default="local")
    parser.add_argument("--store", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--samples", type=int, default=60)
    parser.add_argument("--burst", type=int, default=50)
    parser.add_argument("--burst-size", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=2)
    args = parser.parse_args()
    # A SIGTERM unwinds like an error: every finally below stops what it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with services() as svc:
        setup = SETUPS[args.provider](svc)
        try:
            result = run(svc, setup, args)
        finally:
            setup.stop()
    print(json.dumps(result, indent=2))


def run(svc: Services, setup: ProviderSetup, args: argparse.Namespace) -> dict[str, Any]:
    measured: dict[str, Any] = {}
    for backend in setup.backends:
        measured[backend or setup.name] = run_backend(svc, setup, backend, args)
    head = {"benchmark": "warm_pool_claims", "provider": setup.name, "store": args.store,
            "worker_concurrency": args.concurrency}
    if setup.backends == (None,):
        return {**head, **measured[setup.name]}
    return {**head, "backends": measured}


def run_backend(svc: Services, setup: ProviderSetup, backend: str | None,
                args: argparse.Namespace) -> dict[str, Any]:
    burst_max = args.burst_size + max(1, args.burst_size // 5)
    on = {"provider": setup.name, "template": setup.template,
          **({"backend": backend} if backend else {})}
    pools = [{"name": LATENCY_POOL, "size": 2, "max_size": 2, **on},
             {"name": BURST_POOL, "size": args.burst_size, "max_size": burst_max,
              "fill_batch_size": burst_max, **on},
             {"name": COLD_POOL, "size": 0, **on}]  # always empty: every run starts cold
    with pool_stack(svc, setup, args.store, pools, args.concurrency) as stack:
        latency = measure_latency(stack, setup, backend, args.samples)
        burst = measure_burst(stack, setup, args.burst, args.burst_size, burst_max)
    return {**latency, "burst": burst}


@contextlib.contextmanager
def pool_stack(svc: Services, setup: ProviderSetup, store: str, pools: list[dict[str, Any]],
               concurrency: int) -> Iterator[Any]:
    import os

    from tests.stack import WorkerStack
    from workers.settings import get_settings

    name = f"pools-{uuid.uuid4().hex[:6]}"
    url = svc.store_url(store)
    stack = WorkerStack(name=name, store_url=url, root=WORK / name, broker_url=svc.broker_url,
                        extra_env={**setup.env, "LEASEKEEPER_POOLS": json.dumps(pools),
                                   # every sweep but the fill, out of the way
                                   **{f"LEASEKEEPER_{s}_INTERVAL_S": "3600" for s in (
                                       "REAP_RUNS", "EXPIRE_LEASES", "RETRY_CLEANUP",
                                       "FINISH_EXITED", "STUCK_PROVISIONING", "ORPHANS")}})
    stack.root.mkdir(parents=True, exist_ok=True)
    os.environ["LEASEKEEPER_STORE_URL"] = url
    # This process is the installation's producer: it enables the same providers.
    os.environ.update({k: v for k, v in setup.env.items()
                       if k in ("LEASEKEEPER_PROVIDERS", "LEASEKEEPER_PROVIDER")})
    get_settings.cache_clear()
    try:
        stack.start_worker(concurrency=concurrency)
        yield stack
    finally:
        stack.stop()
        destroy_sandboxes(stack, setup.name)
        store_at(url).dispose()


def destroy_sandboxes(stack: Any, provider_name: str) -> None:
    """Every sandbox the provider still has for this installation, destroyed (the worker
    stopped first); a failure is printed, never raised over the bench's own error."""
    from providers.base import LeaseHandle

    try:
        provider = stack.runtime().provider(provider_name)
        for resource in provider.list_managed():
            provider.destroy(LeaseHandle(resource.name, resource.backend, {}))
    except Exception as exc:
        print(f"bench/pools.py: cleaning up the {provider_name} sandboxes failed: {exc!r}",
              file=sys.stderr)


@functools.cache
def store_at(url: str) -> Any:
    """One Store per store URL for the samplers (not a new engine per sample)."""
    from models.store import Store

    return Store(url)


def counts(stack: Any, pool: str) -> dict[str, int]:
    from models.pool_store import PoolStore

    found: dict[str, int] = PoolStore(store_at(stack.store_url)).member_counts([pool])[pool]
    return found


def wait_until(probe: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds until ``probe()`` held (a monotonic deadline; polled every 5 ms)."""
    started = time.monotonic()
    while not probe():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"{what} did not happen within {timeout_s} s")
        time.sleep(0.005)
    return time.monotonic() - started


def measure_latency(stack: Any, setup: ProviderSetup, backend: str | None,
                    samples: int) -> dict[str, Any]:
    from tasks import producer
    from workers.app import app

    def timed(send: Callable[[], Any]) -> tuple[float, dict[str, Any]]:
        started = time.perf_counter()
        reply = send().get(120)
        return time.perf_counter() - started, reply

    hostname = stack.hostname(1)

    def idle() -> bool:
        active = app.control.inspect(destination=[hostname], timeout=1).active() or {}
        return hostname in active and not active[hostname]

    def refill() -> None:
        """The pool full and the worker idle again (its pool.provision tasks finished)."""
        app.send_task("sweep.fill_pools").get(60)
        wait_until(lambda: counts(stack, LATENCY_POOL)["warm"] == 2, 60, "the pool refilled")
        wait_until(idle, 60, "the worker idle")

    cold_spec = {"provider": setup.name, **setup.template,
                 **({"backend": backend} if backend else {})}
    secret = {"secret_env": {"API_KEY": "bench-" + "x" * 32}, "env": {"MODE": "bench"}}
    claim_s, cold_s, pool_cold_s, bare_s, results = [], [], [], [], []
    for i in range(samples + 3):  # the first three warm the worker's processes up
        refill()
        took, _ = timed(lambda: app.send_task("leasekeeper.ping"))
        claim_took, claimed = timed(lambda: producer.acquire_lease(
            f"claim-{uuid.uuid4().hex[:10]}", {"pool": LATENCY_POOL, **secret}))
        cold_took, cold = timed(lambda: producer.acquire_lease(
            f"cold-{uuid.uuid4().hex[:10]}", {**cold_spec, **secret}))
        pool_cold_took, pool_cold = timed(lambda: producer.acquire_lease(
            f"pool-cold-{uuid.uuid4().hex[:10]}", {"pool": COLD_POOL, **secret}))
        assert pool_cold["result"] == "acquired", pool_cold
        for reply in (claimed, cold, pool_cold):
            producer.destroy_lease(reply["lease_id"]).get(120)
        if i >= 3:
            bare_s.append(took)
            claim_s.append(claim_took)
            cold_s.append(cold_took)
            pool_cold_s.append(pool_cold_took)
            results.append(claimed["result"])
    claim, cold, bare = stats(claim_s), stats(cold_s), stats(bare_s)
    pool_cold = stats(pool_cold_s)
    return {"samples": samples, "claim_results": {r: results.count(r) for r in set(results)},
            "claim_ms": claim, "cold_acquire_ms": cold,
            "cold_start_from_pool_ms": pool_cold, "bare_celery_ms": bare,
            "claim_vs_bare_p50": round(claim["p50"] / bare["p50"], 2),
            "claim_vs_cold_p50": round(claim["p50"] / cold["p50"], 3),
            "claim_vs_cold_from_pool_p50": round(claim["p50"] / pool_cold["p50"], 3),
            "targets": {"claim_p50_le_50_ms": claim["p50"] <= 50,
                        "claim_p50_le_2x_bare": claim["p50"] <= 2 * bare["p50"]}}


def stats(samples_s: list[float]) -> dict[str, float]:
    ordered = sorted(samples_s)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50": round(statistics.median(ordered) * 1000, 1), "p99": round(p99 * 1000, 1),
            "min": round(ordered[0] * 1000, 1)}


def measure_burst(stack: Any, setup: ProviderSetup, claims: int, size: int,
                  max_size: int) -> dict[str, Any]:
    from tasks import producer
    from tests.sweeps.beats import beats

    seen: list[int] = []
    on_provider: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            seen.append(sum(counts(stack, BURST_POOL).values()))
            time.sleep(0.005)

    def sample_provider(real: Callable[[Any, str], int]) -> None:
        while not stop.is_set():
            on_provider.append(real(stack, BURST_POOL))
            time.sleep(0.02)

    samplers = [threading.Thread(target=sample)]
    if setup.real_members is not None:
        samplers.append(threading.Thread(target=sample_provider, args=(setup.real_members,)))
    with beats(stack.env, stack.root, 1, interval_s=1.0, tag="burst"):
        wait_until(lambda: counts(stack, BURST_POOL)["warm"] == size, 180, "the pool filled")
        for sampler in samplers:
            sampler.start()
        try:
            started = time.monotonic()
            sent = [producer.acquire_lease(f"burst-{uuid.uuid4().hex[:10]}",
                                           {"pool": BURST_POOL}) for _ in range(claims)]
            replies = [r.get(300) for r in sent]
            served_s = time.monotonic() - started
            wait_until(lambda: counts(stack, BURST_POOL)["warm"] == size, 300,
                       "the pool refilled")
            refill_s = time.monotonic() - started
        finally:
            stop.set()
            for sampler in samplers:
                if sampler.is_alive():
                    sampler.join(30)
    for reply in replies:
        producer.destroy_lease(reply["lease_id"]).get(120)
    hits = sum(1 for r in replies if r["result"] == "claimed")
    found = {"claims": claims, "pool_size": size, "max_size": max_size, "claimed": hits,
             "hit_rate": round(hits / claims, 3), "all_served_s": round(served_s, 2),
             "refilled_s": round(refill_s, 2), "max_members_observed": max(seen),
             "samples_of_members": len(seen), "within_max_size": max(seen) <= max_size}
    if setup.real_members is not None:
        found |= {"max_members_on_provider": max(on_provider),
                  "samples_on_provider": len(on_provider),
                  "within_max_size_on_provider": max(on_provider) <= max_size}
    return found


if __name__ == "__main__":
    main()
