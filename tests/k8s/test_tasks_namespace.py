"""Owns the tests of an acquire the API server refuses at its very first request because of
the worker's namespace, through a real worker (``kube_stack``) and the real API server: a
namespace that does not exist (404 on the create), and one the worker's ServiceAccount has
no RoleBinding in (403 on the create). Before, the first was told about the Sandbox CRD,
even for a Job; the second to add a verb its Role already has; and both left the lease
``pending_cleanup`` (``acquire_failed``), its cleanup failing on the same 404/403 on every
sweep, though nothing was ever created. Now each says what is wrong with the namespace,
and the lease ends ``destroyed`` at once: the provider knows nothing was made."""

from __future__ import annotations

import secrets
from typing import Any

import pytest

from models.schema import LeaseState, RunStatus
from providers.errors import TerminalProviderError
from tasks import producer
from tests.k8s.conftest import KubeStack
from tests.k8s.test_tasks import LOOP, rid

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(180)]


def refused_acquire(ks: KubeStack, **spec: Any) -> tuple[str, str]:
    """Acquire, expecting a terminal refusal: (its message, the run id)."""
    run_id = rid()
    with pytest.raises(TerminalProviderError) as info:
        producer.acquire_lease(run_id, {"tenant": "acme", **spec}).get(60)
    return str(info.value), run_id


def assert_ended_with_nothing_pending(ks: KubeStack, run_id: str) -> None:
    run = ks.run(run_id)
    assert run.status == RunStatus.FAILED and run.lease_id is not None
    lease = ks.lease(run.lease_id)
    assert (lease.state, lease.end_reason) == (LeaseState.DESTROYED, "acquire_failed"), (
        lease.state, lease.end_reason, lease.last_error)
    assert lease.cleanup_attempts == 0


def test_a_missing_namespace_is_named_and_leaves_nothing_pending(kube_stack: KubeStack
                                                                 ) -> None:
    # given a worker whose LEASEKEEPER_KUBE_NAMESPACE does not exist
    ks = kube_stack
    missing = f"nope-{secrets.token_hex(3)}"
    ks.restart_worker(LEASEKEEPER_KUBE_NAMESPACE=missing)
    # when a Job sandbox is acquired
    text, run_id = refused_acquire(ks, backend="job", command=LOOP)
    # then it fails at once, saying the namespace does not exist and what to do
    assert "HTTP 404" in text, text
    assert (f'namespace "{missing}" does not exist: create it, or set '
            "LEASEKEEPER_KUBE_NAMESPACE to the namespace the worker's Role is bound in") in text
    assert "agent-sandbox CRD" not in text, text
    # and the lease ended: nothing was created, so nothing is left to clean up
    assert_ended_with_nothing_pending(ks, run_id)


def test_a_namespace_the_worker_is_not_bound_in_is_named_and_leaves_nothing_pending(
        kube_stack: KubeStack, kube_cluster: Any) -> None:
    # given a worker whose ServiceAccount has no RoleBinding in its namespace
    ks = kube_stack
    token = kube_cluster.service_account_token(ks.namespace, "unbound")
    ks.restart_worker(LEASEKEEPER_KUBE_CONFIG_PATH=str(ks.proxy.kubeconfig_for_token(token)))
    # when a Sandbox is acquired
    text, run_id = refused_acquire(ks, command=LOOP)
    # then it fails at once, naming the identity, and saying to bind the Role there
    assert "HTTP 403" in text, text
    assert f"(system:serviceaccount:{ks.namespace}:unbound)" in text, text
    assert (f"if the worker's Role is not bound in namespace {ks.namespace}, it may not "
            "create anything there: bind the Role in that namespace "
            "(deploy/rbac/rolebinding.yaml), or set LEASEKEEPER_KUBE_NAMESPACE") in text, text
    # and the lease ended: nothing was created, so nothing is left to clean up
    assert_ended_with_nothing_pending(ks, run_id)
