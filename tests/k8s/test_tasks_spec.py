"""Specs the Kubernetes provider can never run, refused before anything is recorded or
created: by the producer where it can tell (a web process that knows the provider is
``kubernetes``), else by a real worker's ``check_spec`` (``kube_stack``). Each refusal is
checked to leave no run, no lease row and no object; and a lease an earlier version left
with an unknown backend is destroyed (nothing of it can exist) instead of failing forever."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from models.schema import LeaseState, utcnow
from models.store import NewLease
from providers.errors import InvalidRequest, TerminalProviderError
from providers.spec import SandboxSpec
from tasks import producer
from tests.k8s.conftest import KubeStack
from workers.app import app
from workers.settings import get_settings

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(120)]


def rid() -> str:
    return f"run-{uuid.uuid4().hex[:12]}"


def by_name(run_id: str, spec: dict[str, Any]) -> Any:
    """lease.acquire sent by name, as a backend without leasekeeper does: the worker checks."""
    return app.send_task("lease.acquire", kwargs={"run_id": run_id, "spec": spec}).get(60)


def nothing_recorded_or_made(ks: KubeStack, run_id: str) -> None:
    assert ks.store.get_run(run_id) is None
    assert ks.store.leases() == []
    assert ks.env.provider.list_managed() == []


@contextlib.contextmanager
def web_process(**env: str) -> Iterator[None]:
    """This process's producer configured as a web backend with these settings (the
    kube_stack's settings are read before; the test session's are back after)."""
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(f"LEASEKEEPER_{key}", value)
        get_settings.cache_clear()
        try:
            yield
        finally:
            get_settings.cache_clear()


def test_the_producer_refuses_an_unknown_kubernetes_backend_in_the_workers_words(
        kube_stack: KubeStack) -> None:
    ks = kube_stack
    run_id = rid()
    # given the QA's spec; when acquiring through the producer of a web process that
    # enables kubernetes: refused before sending
    with (web_process(PROVIDERS="kubernetes,local"),
          pytest.raises(InvalidRequest) as named):
        producer.acquire_lease(run_id, {"tenant": "acme", "provider": "kubernetes",
                                        "backend": "foo"})
    assert str(named.value) == ("kubernetes: unknown backend 'foo'; use 'sandbox-cr' or "
                                "'job' (or leave backend unset for LEASEKEEPER_KUBE_BACKEND's)")
    # and a process whose own default provider is kubernetes refuses it unnamed too
    with (web_process(PROVIDERS="kubernetes", PROVIDER="kubernetes"),
          pytest.raises(InvalidRequest, match="unknown backend 'foo'")):
        producer.acquire_lease(run_id, {"tenant": "acme", "backend": "foo"})
    nothing_recorded_or_made(ks, run_id)


def test_the_worker_refuses_an_unknown_backend_before_writing_a_lease(
        kube_stack: KubeStack) -> None:
    ks = kube_stack
    run_id = rid()
    # when the same spec is sent by name: the worker's check refuses it, same words
    with pytest.raises(TerminalProviderError) as refused:
        by_name(run_id, {"tenant": "acme", "provider": "kubernetes", "backend": "foo"})
    assert str(refused.value).startswith("kubernetes: unknown backend 'foo'; use 'sandbox-cr'")
    assert "provider bug" not in str(refused.value)
    nothing_recorded_or_made(ks, run_id)


def test_a_lease_left_with_an_unknown_backend_is_destroyed_not_retried_forever(
        kube_stack: KubeStack) -> None:
    ks = kube_stack
    run_id, lease_id = rid(), f"lease-{uuid.uuid4().hex[:10]}"
    # given the lease an earlier version left: intent written, acquire refused, cleanup due
    now = utcnow()
    new = NewLease(lease_id=lease_id, sandbox_key=f"sk-{lease_id}", provider="kubernetes",
                   provider_lease_id=ks.env.provider.lease_name(lease_id), reuse=False,
                   tenant="acme", thread_id=None, run_id=run_id,
                   spec={"tenant": "acme", "provider": "kubernetes", "backend": "foo"},
                   acquire_deadline_at=now + timedelta(minutes=5),
                   deadline_at=now + timedelta(hours=1), idle_timeout_s=600)
    assert ks.store.start_run_with_intent(run_id, new, None)
    assert ks.store.transition(lease_id, {LeaseState.PROVISIONING}, LeaseState.PENDING_CLEANUP,
                               "acquire failed: unknown backend", None,
                               end_reason="acquire_failed", next_cleanup_at=utcnow())
    # when it is destroyed; then it is, as already gone: nothing of it was ever created
    assert producer.destroy_lease(lease_id).get(60)["result"] == "destroyed"
    lease = ks.lease(lease_id)
    assert lease.state == LeaseState.DESTROYED
    assert "already_gone" in ks.store.events(lease_id)[-1].reason
    assert "backend 'foo' is none this provider has" in ks.worker_log()


@pytest.mark.parametrize(("resources", "says"), [
    ({"cpu_request": "3"}, "resources.cpu_request 3 is more than the default cpu limit 2 "
                           "(LEASEKEEPER_KUBE_CPU_LIMIT; the spec sets no cpu_limit)"),
    ({"memory_limit": "256Mi"}, "resources.memory_limit 256Mi is less than the default "
                                "memory request 512Mi (LEASEKEEPER_KUBE_MEMORY_REQUEST"),
])
def test_a_request_over_the_limit_the_manifest_carries_is_refused(
        kube_stack: KubeStack, resources: dict[str, str], says: str) -> None:
    ks = kube_stack
    run_id = rid()
    with pytest.raises(TerminalProviderError) as refused:
        producer.acquire_lease(run_id, {"tenant": "acme", "resources": resources}).get(60)
    assert says in str(refused.value) and "Kubernetes refuses such a pod" in str(refused.value)
    nothing_recorded_or_made(ks, run_id)
    # and with the limit given too, the same request is one the provider takes
    ks.env.provider.check_spec(SandboxSpec(resources={"cpu_request": "3", "cpu_limit": "4",
                                                      "memory_limit": "256Mi",
                                                      "memory_request": "128Mi"}))


def test_the_managed_by_label_is_refused_like_leasekeepers_own(kube_stack: KubeStack) -> None:
    ks = kube_stack
    run_id = rid()
    spec = {"tenant": "acme", "labels": {"app.kubernetes.io/managed-by": "me"}}
    says = ("label 'app.kubernetes.io/managed-by': leasekeeper sets it on everything it "
            "makes (=leasekeeper); use another label key")
    with pytest.raises(InvalidRequest, match=says.replace("(", r"\(").replace(")", r"\)")):
        producer.acquire_lease(run_id, spec)
    with pytest.raises(InvalidRequest, match="leasekeeper sets it on everything it makes"):
        by_name(run_id, spec)
    nothing_recorded_or_made(ks, run_id)
