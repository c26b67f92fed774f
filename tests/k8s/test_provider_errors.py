"""Owns the tests of the Kubernetes provider's error boundary against the real client and API
server: which answers are transient (the task retries) and which terminal (it fails at once),
each carrying the API's reason; timeouts, dropped connections, bad credentials, and a 404
where none is expected."""

from __future__ import annotations

from typing import Any

import pytest

from providers.errors import (
    ProviderConflict,
    ProviderError,
    TerminalProviderError,
    TransientProviderError,
    is_transient,
)
from providers.kubernetes.provider import build_kubernetes_provider
from tests.k8s.conftest import KubeEnv, provider_settings

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(120)]

REASONS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound",
           408: "Timeout", 409: "Conflict", 422: "Invalid", 429: "TooManyRequests",
           500: "InternalError", 502: "BadGateway", 503: "ServiceUnavailable", 504: "Timeout"}
TRANSIENT = {408, 429, 500, 502, 503, 504}


@pytest.mark.parametrize("code", sorted(REASONS))
def test_each_answer_to_a_create_is_transient_or_terminal_with_the_reason(
        kenv: KubeEnv, code: int) -> None:
    # given the API server answering the Sandbox create with ``code``
    kenv.proxy.fail("POST", r"/sandboxes$", code, reason=REASONS[code],
                    message=f"the server says {code}")
    request = kenv.request()
    # when acquiring; then the error's class says whether a retry can help, and its message
    # carries the status, the API's reason and its message
    with pytest.raises((TransientProviderError, TerminalProviderError)) as info:
        kenv.provider.acquire(request)
    error = info.value
    assert is_transient(error) is (code in TRANSIENT), error
    assert f"HTTP {code} {REASONS[code]}: the server says {code}" in str(error)
    assert error.status == code  # for leasekeeper_provider_errors_total's status label
    if code == 409:  # a Conflict that is not AlreadyExists is never adopted
        assert isinstance(error, ProviderConflict)
    # nothing was created, so nothing was cleaned up
    assert kenv.proxy.count("DELETE") == 0
    assert kenv.read("sandbox", request.name) is None


def test_a_request_timeout_is_transient(kenv: KubeEnv, fault_proxy: Any) -> None:
    provider = build_kubernetes_provider(provider_settings(
        fault_proxy.kubeconfig_path, kenv.namespace, kenv.installation,
        kube_request_timeout_s=0.5))
    try:
        kenv.proxy.delay("GET", r"/sandboxes/lk-slow$", seconds=2)
        with pytest.raises(TransientProviderError,
                           match=r"did not answer within .*\(ReadTimeoutError\)"):
            provider.resume_check(kenv.handle("lk-slow"), 5)
    finally:
        provider.api.api_client.close()


def test_a_dropped_connection_is_transient(kenv: KubeEnv) -> None:
    kenv.proxy.drop("GET", r"/sandboxes/lk-dropped$")
    with pytest.raises(TransientProviderError,
                       match=r"connection to the API server failed \(ProtocolError\)"):
        kenv.provider.resume_check(kenv.handle("lk-dropped"), 5)


def test_rejected_credentials_are_terminal(kenv: KubeEnv) -> None:
    kubeconfig = kenv.proxy.kubeconfig_for_token("not-a-valid-token")
    provider = build_kubernetes_provider(
        provider_settings(kubeconfig, kenv.namespace, kenv.installation))
    try:
        with pytest.raises(TerminalProviderError, match="HTTP 401") as info:
            provider.acquire(kenv.request())
        assert "credentials were rejected" in str(info.value)
    finally:
        provider.api.api_client.close()


def test_a_404_where_none_is_expected_is_terminal(kenv: KubeEnv, fault_proxy: Any) -> None:
    # a namespace that does not exist: the create answers 404, which no retry fixes
    provider = build_kubernetes_provider(provider_settings(
        fault_proxy.kubeconfig_path, "no-such-namespace", kenv.installation))
    try:
        with pytest.raises(TerminalProviderError, match="HTTP 404 NotFound") as info:
            provider.acquire(kenv.request())
        assert not is_transient(info.value)
    finally:
        provider.api.api_client.close()


@pytest.mark.parametrize("call", ["resume", "destroy"])
def test_a_429_with_retry_after_on_a_read_or_delete_keeps_its_status(
        kenv: KubeEnv, call: str) -> None:
    # urllib3 retried an idempotent call answered with a Retry-After, ran out of retries at
    # once and hid the answer: "connection to the API server failed", status None.
    request = kenv.request()
    acquired = kenv.provider.acquire(request)
    handle = kenv.handle(request.name, **acquired.meta)
    kenv.proxy.throttle("GET" if call == "resume" else "DELETE",
                        rf"/sandboxes/{request.name}$", retry_after=1, times=None)
    with pytest.raises(ProviderError) as info:
        if call == "resume":
            kenv.provider.resume_check(handle, 3)
        else:
            kenv.provider.destroy(handle)
    error = info.value
    failures = getattr(error, "failures", None)
    if failures:  # a destroy reports each part: the workload's is the throttled one
        error = next(f.error for f in failures if f.part == "workload")
    assert is_transient(error) and error.status == 429, error
    assert "HTTP 429 TooManyRequests" in str(error)
    kenv.proxy.clear_rules()
    kenv.provider.destroy(handle)


QUOTA = ('{kind} "lk-x" is forbidden: exceeded quota: q, requested: count/{kind}=1, used: '
         'count/{kind}=0, limited: count/{kind}=0')


@pytest.mark.parametrize("kind", ["sandboxes", "secrets"])
def test_a_used_up_quota_is_no_missing_rbac_rule_and_passes(kenv: KubeEnv, kind: str) -> None:
    kenv.proxy.forbid("POST", rf"/{kind}$", message=QUOTA.format(kind=kind))
    with pytest.raises(TransientProviderError) as info:
        kenv.provider.acquire(kenv.request())
    text = str(info.value)
    assert "HTTP 403" in text and "exceeded quota" in text and "ResourceQuota" in text, text
    assert "RBAC" not in text
    assert info.value.status == 403


def test_a_namespace_being_deleted_is_named(kenv: KubeEnv) -> None:
    kenv.proxy.forbid("POST", r"/sandboxes$", message=(
        f'sandboxes "lk-x" is forbidden: unable to create new content in namespace '
        f"{kenv.namespace} because it is being terminated"))
    with pytest.raises(TerminalProviderError) as info:
        kenv.provider.acquire(kenv.request())
    assert "namespace is being deleted" in str(info.value)
    assert "RBAC" not in str(info.value)
