"""Owns the end-to-end tests of warm pools on Kubernetes: a real Celery worker whose provider is
``kubernetes`` (``kube_stack_maker``, the pool declared in its ``LEASEKEEPER_POOLS``), the
real API server with its Job controller and garbage collector, the kubelet and Sandbox
controller simulators, driven through the producer API and ``sweep.fill_pools``; both
backends (a module-scoped parameter: one pool declaration per worker).

What they prove: the fill makes real members (workloads whose pods run, leases warm), never
more than ``max_size`` at any sampled instant (in the store and among the API server's
objects by label); ``lease.acquire`` with ``spec.pool`` answers ``claimed`` and the member's
run directory holds exactly that run's env and secret (read back by exec), a second claim
gets another member and never the first's data, and the sandbox's own command (waiting for
``claimed``) starts with that env; an empty pool starts the run cold, the same template
given its data the same way; a member whose pod was deleted behind our back is destroyed
and the next member (or a cold start) serves the run; a 500 on the exec is retried and the
data delivered once; a 403 on the exec (a real RBAC Role without ``pods/exec``) fails the
run at once saying what to grant, the member destroyed; drains (a shrunk pool, an aged
member) and the run's end remove every object. No secret value in any object of the
namespace, the worker's log, a result, Redis or any table of the store."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from models.pool_store import PoolStore
from models.schema import FINAL_STATES, Lease, LeaseState, ReclaimOutcome, RunStatus, utcnow
from providers.base import RUN_DIR_ENV, LeaseHandle
from providers.errors import TerminalProviderError
from providers.kubernetes.manifests import (
    LABEL_LEASE_ID,
    LABEL_POOL,
    SANDBOX_GROUP,
    SANDBOX_PLURAL,
    installation_selector,
)
from tasks import producer
from tests.cluster.cluster import ClusterAccess, KubeCluster
from tests.cluster.fault_proxy import FaultProxy
from tests.cluster.k8s_json import read_json
from tests.cluster.kubeconfig import api_client_from_kubeconfig
from tests.cluster.kubelet_sim import KubeletSim
from tests.cluster.waits import gone
from tests.contract.test_by_name import redis_dump
from tests.k8s.conftest import KubeStack, KubeStackMaker, KubeStackPool
from tests.k8s.test_provider_pools import in_pod, namespace_dump
from tests.k8s.test_rbac import ACCOUNT, allowed, apply_deploy, exec_verb, role_rules
from tests.k8s.test_tasks import eventually
from workers.app import app

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(240)]

POOL, SIZE, MAX_SIZE = "warm", 2, 3
RUN_DIR = f'"${RUN_DIR_ENV}"'
# The sandbox's side of the claim (README "Warm pools on Kubernetes"): wait for its run, take
# its environment, then start; "started" is its marker (the run it got, a plain variable and a
# digest of the secret: never the secret itself), written whole by a rename.
WAITS_FOR_ITS_RUN = [
    "sh", "-c",
    f'while [ ! -e {RUN_DIR}/claimed ]; do sleep 0.2; done; '
    f'set -a; . {RUN_DIR}/env; set +a; '
    f'printf "run=%s greeting=%s key=%s\\n" "$(cat {RUN_DIR}/claimed)" "$GREETING" '
    f'"$(printf %s "$API_KEY" | sha256sum | cut -c1-16)" > {RUN_DIR}/.started; '
    f'mv {RUN_DIR}/.started {RUN_DIR}/started; exec sleep 3600']
TEMPLATE = {"command": WAITS_FOR_ITS_RUN, "env": {"STAGE": "warm"},
            "labels": {"team": "pools"}}


def declared(backend: str, **overrides: Any) -> str:
    """LEASEKEEPER_POOLS: the one pool of this module, on ``backend``."""
    return json.dumps([{"name": POOL, "provider": "kubernetes", "backend": backend,
                        "size": SIZE, "max_size": MAX_SIZE, "fill_batch_size": MAX_SIZE,
                        "template": TEMPLATE, **overrides}])


@pytest.fixture(scope="module", params=["sandbox-cr", "job"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def pool_stacks(kube_stack_maker: KubeStackMaker, backend: str) -> Iterator[KubeStackPool]:
    """Workers with the pool declared on ``backend``, one started a test ahead."""
    stacks = KubeStackPool(dataclasses.replace(
        kube_stack_maker, extra_env=(("LEASEKEEPER_POOLS", declared(backend)),)))
    yield stacks
    stacks.close()


@pytest.fixture
def ks(pool_stacks: KubeStackPool) -> Iterator[KubeStack]:
    from tests.stack import sending_to

    stack = pool_stacks.take()
    try:
        with sending_to(stack.queue):
            yield stack
    finally:
        pool_stacks.retire(stack)
        destroy_what_is_left(stack)


def destroy_what_is_left(ks: KubeStack) -> None:
    """Once the worker stopped (nothing more created), every workload of the installation,
    destroyed directly: a member waiting for its run polls its run directory, and idle ones
    add up on a two-core machine."""
    ks.worker.wait(30)
    provider = ks.env.provider
    for resource in provider.list_managed():
        provider.destroy(LeaseHandle(resource.name, resource.backend,
                                     {"namespace": ks.namespace}))


# -- reading the installation -----------------------------------------------------------------

def rid(tag: str = "run") -> str:
    return f"{tag}-{secrets.token_hex(5)}"


def new_secret() -> str:
    return f"sk-{secrets.token_hex(16)}"


def workload_kind(backend: str) -> str:
    return "sandbox" if backend == "sandbox-cr" else "job"


def fill(ks: KubeStack) -> dict[str, Any]:
    """One tick of sweep.fill_pools that ran (not skipped for another tick's lock)."""
    summary: dict[str, Any] = {}

    def ran() -> bool:
        summary.update(app.send_task("sweep.fill_pools").get(60))
        return bool(summary["run"] == "ran")

    eventually(ran, "a fill tick that ran")
    return summary


def members(ks: KubeStack, *states: str) -> list[Lease]:
    """The pool's unclaimed members (no run), oldest first; only in ``states`` if given."""
    return [lease for lease in ks.store.leases(states or None)
            if lease.pool == POOL and lease.run_id is None]


def warm_members(ks: KubeStack, count: int) -> list[Lease]:
    """Once the pool has ``count`` warm members: them, oldest first."""
    def found() -> list[Lease] | None:
        warm = members(ks, LeaseState.WARM)
        return warm if len(warm) == count else None

    return eventually(found, f"{count} warm members", 90)


def filled(ks: KubeStack, count: int = SIZE) -> list[Lease]:
    """A fill tick, then its members warm: ``count`` of them, oldest first."""
    fill(ks)
    return warm_members(ks, count)


def pod_of(lease: Lease) -> str:
    return str(lease.provider_meta["pod_name"])


def acquire(run_id: str, secret: str, greeting: str, **spec: Any) -> dict[str, Any]:
    result: dict[str, Any] = producer.acquire_lease(run_id, {
        "pool": POOL, "tenant": "acme", "env": {"GREETING": greeting},
        "secret_env": {"API_KEY": secret}, **spec}).get(90)
    assert result["state"] == "active", result
    return result


def run_dir(ks: KubeStack, pod: str, name: str) -> str:
    """A file of the pod's run directory, read by an exec into it ("" if missing)."""
    return in_pod(ks.env, pod, f'cat {RUN_DIR}/{name} 2>/dev/null || true')


def env_file(greeting: str, secret: str) -> str:
    """The run's env file: the template's env, the run's, then its secret_env, sh-quoted."""
    return f"STAGE='warm'\nGREETING='{greeting}'\nAPI_KEY='{secret}'\n"


def marker(run_id: str, greeting: str, secret: str) -> str:
    digest = hashlib.sha256(secret.encode()).hexdigest()[:16]
    return f"run={run_id} greeting={greeting} key={digest}\n"


def started(ks: KubeStack, pod: str) -> str:
    """The sandbox command's marker, once it wrote it (it started with its run's env)."""
    return eventually(lambda: run_dir(ks, pod, "started"), f"the sandbox in {pod} to start",
                      60)


def objects_of(ks: KubeStack, lease_id: str) -> list[str]:
    """Every Sandbox, Job, pod and Secret labelled with this lease, as "kind/name"."""
    found = []
    for kind, listed in lists(ks, f"{LABEL_LEASE_ID}={lease_id}").items():
        found += [f"{kind}/{obj['metadata']['name']}" for obj in listed]
    return found


def lists(ks: KubeStack, selector: str) -> dict[str, list[dict[str, Any]]]:
    """The installation's objects matching ``selector``, by kind (admin client, direct)."""
    selector = f"{installation_selector(ks.env.installation)},{selector}"
    core, batch = ks.env.core, ks.env.batch
    custom = ks.env.custom
    calls: dict[str, Callable[..., Any]] = {
        "sandbox": functools.partial(custom.list_namespaced_custom_object, SANDBOX_GROUP,
                                     "v1alpha1", ks.namespace, SANDBOX_PLURAL),
        "job": functools.partial(batch.list_namespaced_job, ks.namespace),
        "pod": functools.partial(core.list_namespaced_pod, ks.namespace),
        "secret": functools.partial(core.list_namespaced_secret, ks.namespace),
    }
    return {kind: read_json(call(label_selector=selector, _preload_content=False)
                            ).get("items") or [] for kind, call in calls.items()}


def all_gone(ks: KubeStack, lease_id: str) -> None:
    eventually(lambda: not objects_of(ks, lease_id), f"lease {lease_id}'s objects to go", 60)


def ended(ks: KubeStack, lease_id: str) -> Lease:
    def final() -> Lease | None:
        lease = ks.lease(lease_id)
        return lease if lease.state in FINAL_STATES else None

    return eventually(final, f"lease {lease_id} to end", 60)


def no_secret_anywhere(ks: KubeStack, values: list[str], *results: Any) -> None:
    places = {"namespace": namespace_dump(ks.env), "worker log": ks.worker_log(),
              "store": ks.store_dump(), "redis (broker, results)": redis_dump(
                  ks.stack.broker_url), "results": json.dumps(results, default=str)}
    leaks = [f"{where}" for where, text in places.items() for value in values
             if value in text]
    assert not leaks, f"a secret value is in {leaks}"


@dataclasses.dataclass
class MemberSampler:
    """Samples the pool's members while a block runs: in the store (its unclaimed members
    that exist, as max_size counts them) and on the API server (the pool's workloads, not
    being deleted, whose lease is an unclaimed member when looked up right after listing)."""

    ks: KubeStack
    store_peak: int = 0
    api_peak: int = 0
    samples: int = 0
    errors: list[BaseException] = dataclasses.field(default_factory=list)
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)

    def sample(self) -> None:
        counts = PoolStore(self.ks.store).member_counts([POOL])[POOL]
        listed = lists(self.ks, f"{LABEL_POOL}={POOL}")
        live = {obj["metadata"]["labels"][LABEL_LEASE_ID]
                for obj in listed["sandbox"] + listed["job"]
                if not obj["metadata"].get("deletionTimestamp")}
        unclaimed = {lease.lease_id for lease in self.ks.store.leases()
                     if lease.pool == POOL and lease.run_id is None
                     and lease.state not in FINAL_STATES}
        self.store_peak = max(self.store_peak, sum(counts.values()))
        self.api_peak = max(self.api_peak, len(live & unclaimed))
        self.samples += 1

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.sample()
            except Exception as exc:  # reported by the test, never lost in the thread
                self.errors.append(exc)
                return
            time.sleep(0.02)

    def __enter__(self) -> MemberSampler:
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)
        assert not self.errors, self.errors
        assert self.samples > 10, self.samples
        assert self.store_peak <= MAX_SIZE and self.api_peak <= MAX_SIZE, (
            self.store_peak, self.api_peak)


# -- fill, claim, deliver, start, destroy -----------------------------------------------------

def test_fill_then_two_claims_each_get_their_own_member_and_data_then_destroy_all(
        ks: KubeStack, backend: str, kubelet_sim: KubeletSim | None) -> None:
    first_secret, second_secret = new_secret(), new_secret()
    with MemberSampler(ks) as sampler:
        # when the fill runs; then the pool has its size in warm members: real workloads
        # whose pods run, labelled with the pool, with their run directory and nothing in it
        summary = fill(ks)
        assert summary["created"] == SIZE, summary
        a, b = warm_members(ks, SIZE)
        for lease in (a, b):
            assert lease.backend == backend and lease.claimed_at is None
            pod = ks.env.read("pod", pod_of(lease))
            assert pod is not None and pod["status"]["phase"] == "Running"
            assert pod["metadata"]["labels"][LABEL_POOL] == POOL
            workload = ks.env.read(workload_kind(backend), lease.provider_lease_id)
            assert workload is not None and workload["metadata"]["labels"][LABEL_POOL] == POOL
            assert in_pod(ks.env, pod_of(lease), f"ls -A {RUN_DIR}") == ""
        assert fill(ks)["full"] == 1  # and a second tick creates nothing
        # when a run claims from the pool; then it gets the oldest member, active
        first_run = rid("first")
        first = acquire(first_run, first_secret, "hello")
        assert (first["result"], first["lease_id"]) == ("claimed", a.lease_id), first
        assert (first["provider"], first["backend"]) == ("kubernetes", backend)
        lease = ks.lease(a.lease_id)
        assert lease.state == LeaseState.ACTIVE and lease.run_id == first_run
        assert lease.claimed_at is not None and lease.tenant == "acme"
        # its run directory holds exactly that run's data, and the sandbox started with it
        assert run_dir(ks, pod_of(a), "env") == env_file("hello", first_secret)
        assert json.loads(run_dir(ks, pod_of(a), "run.json"))["run_id"] == first_run
        assert started(ks, pod_of(a)) == marker(first_run, "hello", first_secret)
        # when a second run claims; then it gets the other member and its own data only
        second_run = rid("second")
        second = acquire(second_run, second_secret, "bonjour")
        assert (second["result"], second["lease_id"]) == ("claimed", b.lease_id), second
        assert run_dir(ks, pod_of(b), "env") == env_file("bonjour", second_secret)
        assert started(ks, pod_of(b)) == marker(second_run, "bonjour", second_secret)
        assert run_dir(ks, pod_of(a), "env") == env_file("hello", first_secret)
        # the pool refills behind them, never beyond max_size
        fill(ks)
        eventually(lambda: len(members(ks, LeaseState.WARM)) == SIZE, "the refill", 90)
    assert sampler.store_peak == sampler.api_peak == SIZE  # (it saw the pool full, twice)
    pod_uids = [ks.env.read("pod", pod_of(lease))["metadata"]["uid"]  # type: ignore[index]
                for lease in (a, b)]
    # when the runs finish; then their sandboxes are reclaimed: every object gone
    for run_id in (first_run, second_run):
        assert producer.finish_run(run_id, "completed", 0).get(30)["reclaim_enqueued"]
    for run_id, lease in ((first_run, a), (second_run, b)):
        eventually(functools.partial(lambda r: ks.run(r).reclaim_outcome, run_id),
                   "the reclaim")
        assert ks.run(run_id).reclaim_outcome == ReclaimOutcome.DESTROYED
        assert ended(ks, lease.lease_id).state == LeaseState.DESTROYED
        all_gone(ks, lease.lease_id)
    if kubelet_sim is not None:  # the node's copy of the run directory (tmpfs) too
        for uid in pod_uids:
            assert kubelet_sim.wait_volumes_removed(uid, 30)
    no_secret_anywhere(ks, [first_secret, second_secret], first, second)


def test_an_empty_pool_starts_the_run_cold_with_its_data_delivered_the_same_way(
        ks: KubeStack, backend: str) -> None:
    # given a pool nobody filled; when a run asks it
    secret, run_id = new_secret(), rid("cold")
    cold = acquire(run_id, secret, "cold start")
    # then it starts cold: its own sandbox of the pool's template, no member taken
    assert cold["result"] == "acquired", cold
    lease = ks.lease(cold["lease_id"])
    assert lease.pool == POOL and lease.claimed_at is None and lease.run_id == run_id
    assert members(ks) == []
    # and the template's command, waiting for its run, starts with the run's env
    assert run_dir(ks, pod_of(lease), "env") == env_file("cold start", secret)
    assert started(ks, pod_of(lease)) == marker(run_id, "cold start", secret)
    # its secret is in no Secret (nor any other object): it went into the pod's tmpfs
    producer.destroy_lease(cold["lease_id"]).get(60)
    all_gone(ks, cold["lease_id"])
    no_secret_anywhere(ks, [secret], cold)


@pytest.mark.parametrize("dead", [1, 2])
def test_a_member_whose_pod_was_deleted_is_destroyed_and_the_next_or_a_cold_start_serves(
        ks: KubeStack, backend: str, dead: int, request: pytest.FixtureRequest) -> None:
    # given a full pool whose ``dead`` oldest members lost their pod behind our back (the
    # Sandbox controller frozen for them, so the Sandbox still says Ready; a Job's
    # controller may start another pod, but the member's is gone)
    warm = filled(ks)
    controller = (request.getfixturevalue("steered_controller")
                  if backend == "sandbox-cr" else None)
    for lease in warm[:dead]:
        if controller is not None:
            controller.freeze(ks.namespace, lease.provider_lease_id)
        ks.env.core.delete_namespaced_pod(pod_of(lease), ks.namespace, grace_period_seconds=0,
                                          _preload_content=False)
        ks.env.wait("pod", pod_of(lease), gone)
    # when a run asks the pool, and the fill runs right after
    secret, run_id = new_secret(), rid("next")
    with MemberSampler(ks):  # (never above max_size, the dead ones' objects going meanwhile)
        result = acquire(run_id, secret, "next")
        fill(ks)
        warm_members(ks, SIZE)
    # then each dead member was let go (never the run's) and destroyed, all its objects gone
    for lease in warm[:dead]:
        ended_lease = ended(ks, lease.lease_id)
        assert ended_lease.state == LeaseState.DESTROYED, ended_lease.state
        assert (ended_lease.end_reason, ended_lease.run_id) == ("not_resumable", None)
        assert any(f"not resumable at its claim by run {run_id}: Pod {pod_of(lease)} no "
                   "longer exists" in e.reason for e in ks.store.events(lease.lease_id))
        all_gone(ks, lease.lease_id)
        if controller is not None:
            controller.reset(ks.namespace, lease.provider_lease_id)
    # and the run got the next member, or (none left) a cold start, with its data
    if dead < SIZE:
        assert (result["result"], result["lease_id"]) == ("claimed", warm[dead].lease_id)
    else:
        assert result["result"] == "acquired"
        assert result["lease_id"] not in {lease.lease_id for lease in warm}
    lease = ks.lease(result["lease_id"])
    assert started(ks, pod_of(lease)) == marker(run_id, "next", secret)
    assert ks.run(run_id).lease_id == lease.lease_id
    no_secret_anywhere(ks, [secret], result)


# -- the API server failing the exec ----------------------------------------------------------

EXEC = r"/pods/[^/]+/exec$"


def test_a_500_on_the_exec_is_retried_and_the_claim_ends_claimed_delivered_once(
        ks: KubeStack) -> None:
    # given a full pool, and an API server that fails the next exec with a 500
    oldest, other = filled(ks)
    failing = ks.proxy.fail("GET", EXEC, 500, message="error dialing backend: EOF")
    ks.proxy.reset_counts()
    secret, run_id = new_secret(), rid("retried")
    # when a run claims; then the acquire retried the delivery and the member is claimed
    result = acquire(run_id, secret, "again")
    assert (result["result"], result["lease_id"]) == ("claimed", oldest.lease_id), result
    # two execs: the failed one (the proxy answered it; nothing reached the pod) and the one
    # that delivered; the other member was never touched
    assert failing.hits == 1 and ks.proxy.count("GET", EXEC) == 2
    assert run_dir(ks, pod_of(oldest), "env") == env_file("again", secret)
    assert started(ks, pod_of(oldest)) == marker(run_id, "again", secret)
    assert in_pod(ks.env, pod_of(oldest), f"ls -A {RUN_DIR}").split() == [
        "claimed", "env", "run.json", "started"]  # no leftover of a second delivery
    assert in_pod(ks.env, pod_of(other), f"ls -A {RUN_DIR}") == ""
    assert ks.lease(other.lease_id).state == LeaseState.WARM
    # one claim and one activation in its history: the retry continued the same claim
    history = [(e.to_state, e.reason) for e in ks.store.events(oldest.lease_id)]
    claimed_by = f"claimed from pool {POOL} by run {run_id}"
    assert history[2:] == [(LeaseState.PROVISIONING, claimed_by),
                           (LeaseState.ACTIVE, f"{claimed_by}: its data delivered")], history
    assert [state for state, _ in history[:2]] == [LeaseState.PROVISIONING, LeaseState.WARM]
    assert "HTTP 500" in ks.worker_log()  # (the retry was for the injected error)
    no_secret_anywhere(ks, [secret], result)


def without_pods_exec(cluster: ClusterAccess, admin: client.ApiClient,
                      namespace: str, proxy: FaultProxy) -> Path:
    """The worker's identity: deploy/'s ServiceAccount, its Role without ``pods/exec``, through
    ``proxy``; returned once the authorizer agrees with that Role."""
    without = {("pods/exec", "get"), ("pods/exec", "create")}
    apply_deploy(admin, namespace, without)
    token = cluster.service_account_token(namespace, ACCOUNT, create=False)
    api = api_client_from_kubeconfig(cluster.kubeconfig_for_token(token, namespace=namespace))
    try:
        eventually(lambda: all(allowed(api, namespace, *rule) == ((rule[1], rule[2])
                                                                  not in without)
                               for rule in role_rules()), "RBAC to take the Role", 30)
    finally:
        api.close()  # type: ignore[no-untyped-call]
    return proxy.kubeconfig_for_token(token)


@pytest.fixture
def rbac_ks(kube_stack_maker: KubeStackMaker, kube_cluster: ClusterAccess,
            kube_api: client.ApiClient, backend: str) -> Iterator[KubeStack]:
    """A pool worker whose ServiceAccount may do everything deploy/'s Role grants except
    exec into pods (an RBAC-mode API server)."""
    from tests.stack import sending_to

    if isinstance(kube_cluster, KubeCluster):
        assert kube_cluster.authorization_mode == "RBAC", (
            "this test needs an RBAC-mode API server: unset LEASEKEEPER_TEST_AUTHZ")

    stacks = KubeStackPool(dataclasses.replace(
        kube_stack_maker, extra_env=(("LEASEKEEPER_POOLS", declared(backend)),),
        identity=functools.partial(without_pods_exec, kube_cluster, kube_api)))
    stack = stacks.make()
    try:
        stack.stack.await_worker(stack.worker)
        with sending_to(stack.queue):
            yield stack
    finally:
        stacks.retire(stack)
        destroy_what_is_left(stack)
        stacks.close()


def test_a_403_on_the_exec_fails_the_run_at_once_saying_what_to_grant_member_destroyed(
        rbac_ks: KubeStack) -> None:
    ks = rbac_ks
    # given a pool filled by a worker whose Role lacks pods/exec
    oldest, other = filled(ks)
    secret, run_id = new_secret(), rid("forbidden")
    # when a run claims; then it fails at once (no retry), naming what to grant
    with pytest.raises(TerminalProviderError) as info:
        producer.acquire_lease(run_id, {"pool": POOL, "secret_env": {"API_KEY": secret},
                                        "env": {"GREETING": "no"}}).get(90)
    text, verb = str(info.value), exec_verb(ks.env.admin)
    assert "HTTP 403" in text, text
    assert f'add verb "{verb}" on resource "pods/exec"' in text, text
    assert "deploy/rbac/role.yaml" in text, text
    assert ks.proxy.count("GET", EXEC) == 1  # terminal: not retried
    # the member it took is destroyed (it may hold nothing of the run, but it was the
    # run's), every object gone; the run failed with that error
    lease = ended(ks, oldest.lease_id)
    assert (lease.state, lease.end_reason) == (LeaseState.DESTROYED, "acquire_failed")
    all_gone(ks, oldest.lease_id)
    run = ks.run(run_id)
    assert run.status == RunStatus.FAILED and "HTTP 403" in (run.error or "")
    # the other member waits, untouched; nothing leaked
    assert ks.lease(other.lease_id).state == LeaseState.WARM
    assert secret not in text
    no_secret_anywhere(ks, [secret])


# -- drains -----------------------------------------------------------------------------------

def test_a_shrunk_pool_and_an_aged_member_are_drained_with_their_objects(
        ks: KubeStack, backend: str) -> None:
    # given a full pool
    a, b = filled(ks)
    # when the pool is redeclared with size 1 and members that age after 2 seconds (a
    # deploy: the worker restarted with the new declaration) and the fill runs
    ks.restart_worker(LEASEKEEPER_POOLS=declared(backend, size=1, max_age_s=2))
    summary = fill(ks)
    # then the oldest member is drained as excess, its objects removed; the other stays
    assert summary["excess"] == 1 and any(a.lease_id in item for item in summary["items"])
    drained = ended(ks, a.lease_id)
    assert (drained.state, drained.end_reason) == (LeaseState.DESTROYED, "pool_excess")
    all_gone(ks, a.lease_id)
    assert ks.lease(b.lease_id).state == LeaseState.WARM
    # given a member made under the new declaration (the old one claimed by a run)
    claimed = acquire(rid("aged"), new_secret(), "aged")
    assert claimed["lease_id"] == b.lease_id
    (c,) = filled(ks, 1)
    # when it is older than max_age_s and the fill runs
    eventually(lambda: ks.lease(c.lease_id).deadline_at < utcnow(), "the member to age")
    summary = fill(ks)
    # then it is drained as expired, its objects removed, and a new member replaces it
    assert summary["expired"] == 1 and summary["created"] == 1, summary
    expired = ended(ks, c.lease_id)
    assert (expired.state, expired.end_reason) == (LeaseState.DESTROYED, "pool_expired")
    all_gone(ks, c.lease_id)
    producer.destroy_lease(claimed["lease_id"]).get(60)
    all_gone(ks, claimed["lease_id"])
