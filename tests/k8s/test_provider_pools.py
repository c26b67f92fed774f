"""Owns the integration tests of the Kubernetes provider's side of warm pools, against the real
API server (both backends): a pool member's run directory (memory-backed emptyDir, its
variable, the pool label, no run secret in its Secret), a Job member acquired only once its
pod runs, ``claim`` delivering exactly its run's data into that pod's run directory by an exec
(read back by another exec in the pod, and by the sandbox's own command) and into no other,
no secret value in any object, exception or log, the NOT_RESUMABLE answers (workload gone,
not Ready, terminating, failed, pod gone), exec failures (500: transient; a hung API server:
transient at the deadline; a pod that is no pool member: terminal), idempotence, and destroy
after a claim removing everything, the pod's volume included."""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
import secrets
import signal
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import pytest
from kubernetes.stream import stream
from pydantic import SecretStr

from providers.base import (
    RUN_DIR_ENV,
    AcquireRequest,
    ClaimOutcome,
    ClaimRequest,
    DestroyOutcome,
    LeaseHandle,
)
from providers.errors import InvalidRequest, TerminalProviderError, TransientProviderError
from providers.kubernetes.manifests import (
    RUN_DIR_PATH,
    Backend,
    LeaseIdentity,
    OwnerRef,
    build_job,
    build_secret,
)
from providers.spec import SandboxSpec
from tests.cluster.k8s_json import exec_core
from tests.cluster.kubelet_sim import KubeletSim
from tests.cluster.waits import condition_is, gone
from tests.k8s.conftest import GROUP, PLURAL, KubeEnv

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(120)]

BACKENDS = ["sandbox-cr", "job"]
POOL = "warm-py"
# What a pool's sandbox does (README: "Warm pools on Kubernetes"): wait for its run, then
# take its environment. It prints a plain variable, never a secret.
WAITS_FOR_ITS_RUN = ["sh", "-c",
                     f'while [ ! -e "${RUN_DIR_ENV}/claimed" ]; do sleep 0.1; done; '
                     f'. "${RUN_DIR_ENV}/env"; echo "run started: GREETING=$GREETING"; '
                     "exec sleep 300"]
LOOP = ["sh", "-c", "while :; do sleep 1; done"]


def pool_request(kenv: KubeEnv, backend: str, command: list[str] | None = None,
                 timeout_s: float = 30.0) -> AcquireRequest:
    lease_id = kenv.new_lease()
    spec = SandboxSpec(tenant="acme", backend=backend, env={"STAGE": "warm"},
                       command=command or WAITS_FOR_ITS_RUN)
    return AcquireRequest(lease_id=lease_id, name=kenv.provider.lease_name(lease_id),
                          spec=spec, labels={"team": "core"}, timeout_s=timeout_s, pool=POOL)


def claim_request(lease_id: str, secret: str, timeout_s: float = 30.0) -> ClaimRequest:
    return ClaimRequest(
        lease_id=lease_id, run_id=f"run-{secrets.token_hex(3)}", tenant="acme",
        labels={"team": "core", "ticket": "42"},
        env={"GREETING": "hello it's me", "SHARED": "plain"},
        secret_env={"API_KEY": secret, "SHARED": "from-secret"}, timeout_s=timeout_s)


def new_secret() -> str:
    return f"sk-{secrets.token_hex(12)}"


def member(kenv: KubeEnv, backend: str, **kw: Any) -> tuple[AcquireRequest, LeaseHandle]:
    request = pool_request(kenv, backend, **kw)
    acquired = kenv.provider.acquire(request)
    return request, kenv.handle(request.name, backend, **acquired.meta)


def in_pod(kenv: KubeEnv, pod: str, script: str) -> str:
    """stdout of ``sh -c script`` exec'd in the pod's sandbox container (admin client);
    fails on a non-zero exit."""
    resp = stream(exec_core(kenv.admin).connect_get_namespaced_pod_exec, pod, kenv.namespace,
                  container="sandbox", command=["sh", "-c", script], stdin=False, stdout=True,
                  stderr=True, tty=False, _preload_content=False)
    resp.run_forever(timeout=30)
    out, err = resp.read_stdout(timeout=0), resp.read_stderr(timeout=0)
    assert resp.returncode == 0, (script, out, err)
    return str(out)


def run_dir_listing(kenv: KubeEnv, pod: str) -> str:
    """Every name in the run directory (hidden ones too), then each file's mode."""
    return in_pod(kenv, pod, f'cd "${RUN_DIR_ENV}" && ls -A && stat -c "%a %n" *')


def namespace_dump(kenv: KubeEnv) -> str:
    """Every object a secret could leak into, as JSON, Secrets' data decoded too."""
    def items(call: Callable[..., Any], *args: Any) -> list[Any]:
        return list(json.loads(call(*args, _preload_content=False).data)["items"])

    ns = kenv.namespace
    found: list[Any] = []
    for secret in items(kenv.core.list_namespaced_secret, ns):
        found.append(secret)
        found += [base64.b64decode(v).decode(errors="replace")
                  for v in (secret.get("data") or {}).values()]
    for call in (kenv.core.list_namespaced_pod, kenv.core.list_namespaced_event,
                 kenv.core.list_namespaced_config_map, kenv.batch.list_namespaced_job):
        found += items(call, ns)
    found += items(kenv.custom.list_namespaced_custom_object, GROUP, "v1alpha1", ns, PLURAL)
    return json.dumps(found)


def sourced(kenv: KubeEnv, pod: str, names: list[str]) -> list[str]:
    printed = in_pod(kenv, pod, f'. "${RUN_DIR_ENV}/env"; ' + "; ".join(
        f'printf "%s\\n" "${name}"' for name in names))
    return printed.splitlines()


def follow_log_until(kenv: KubeEnv, pod: str, text: str) -> str:
    """The pod's log, followed (a stream, no polling) until ``text`` appears."""
    response = kenv.core.read_namespaced_pod_log(pod, kenv.namespace, container="sandbox",
                                                 follow=True, _preload_content=False,
                                                 _request_timeout=30)
    seen = ""
    try:
        for chunk in response.stream(1024):
            seen += chunk.decode(errors="replace")
            if text in seen:
                return seen
    finally:
        response.release_conn()
    raise AssertionError(f"{text!r} never appeared in {pod}'s log: {seen!r}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pool_member_has_its_run_directory_and_label_and_no_run_secret(
        kenv: KubeEnv, backend: str) -> None:
    # when a pool member is acquired
    request, handle = member(kenv, backend)
    # then it is claimable at once: its pod runs, and is named in the lease's meta
    pod = kenv.read("pod", handle.meta["pod_name"])
    assert pod is not None and pod["status"]["phase"] == "Running"
    assert handle.meta["pool"] == POOL
    # its workload, pod and Secret carry the pool's label
    workload = kenv.read("sandbox" if backend == "sandbox-cr" else "job", request.name)
    secret = kenv.read("secret", f"{request.name}-env")
    assert workload is not None and secret is not None
    for obj in (workload, pod, secret):
        assert obj["metadata"]["labels"]["leasekeeper.dev/pool"] == POOL
    # the Secret holds the bootstrap token alone
    assert set(secret["data"]) == {"LEASEKEEPER_BOOTSTRAP_TOKEN"}
    # the pod has the run directory: a small memory-backed emptyDir, named by its variable
    assert pod["spec"]["volumes"][0] == {
        "name": "leasekeeper-run", "emptyDir": {"medium": "Memory", "sizeLimit": "4Mi"}}
    container = pod["spec"]["containers"][0]
    assert {"name": RUN_DIR_ENV, "value": RUN_DIR_PATH} in container["env"]
    assert container["volumeMounts"][0]["mountPath"] == RUN_DIR_PATH
    # and inside the pod it is an empty tmpfs, there before anything is claimed
    assert in_pod(kenv, pod["metadata"]["name"],
                  f'stat -f -c %T "${RUN_DIR_ENV}"; ls -A "${RUN_DIR_ENV}"') == "tmpfs\n"
    # and the orphan sweep's listing says which pool it belongs to
    listed = {r.name: r for r in kenv.provider.list_managed()}
    assert listed[request.name].meta["pool"] == POOL


def test_a_pool_member_with_a_secret_env_is_refused_before_anything_exists(
        kenv: KubeEnv) -> None:
    request = dataclasses.replace(pool_request(kenv, "sandbox-cr"), spec=SandboxSpec(
        tenant="acme", secret_env={"K": SecretStr("v")}))
    kenv.proxy.reset_counts()
    with pytest.raises(InvalidRequest, match="carries no secret_env"):
        kenv.provider.acquire(request)
    assert kenv.proxy.count() == 0


def test_a_job_member_whose_command_ended_is_refused_and_cleaned_up(kenv: KubeEnv) -> None:
    # given a pool member's Job and Secret whose command already ended (an earlier attempt
    # of this acquire created them: the acquire adopts them)
    request = pool_request(kenv, "job", command=["sh", "-c", "exit 0"])
    identity = LeaseIdentity(request.lease_id, request.name, kenv.installation, "acme",
                             extra_labels=(("team", "core"),), pool=POOL)
    job = json.loads(kenv.batch.create_namespaced_job(
        kenv.namespace, build_job(identity, request.spec, kenv.provider.defaults),
        _preload_content=False).data)
    kenv.core.create_namespaced_secret(kenv.namespace, build_secret(
        identity, request.spec, kenv.provider.defaults, Backend.JOB, "token",
        OwnerRef("batch/v1", "Job", request.name, job["metadata"]["uid"])),
        _preload_content=False)
    kenv.wait("job", request.name, condition_is("Complete"))
    # when acquiring it; then it is refused for good, and what exists is deleted
    with pytest.raises(TerminalProviderError,
                       match=r"cannot be a pool member: Pod .* is Succeeded before"):
        kenv.provider.acquire(request)
    kenv.wait("job", request.name, gone)
    kenv.wait("secret", f"{request.name}-env", gone)


def test_a_job_member_whose_pod_never_runs_times_out_transiently_and_is_cleaned_up(
        kenv: KubeEnv, frozen_controllers: Callable[[], AbstractContextManager[None]]) -> None:
    # given no Job controller to create the pod: the wait ends at the acquire's deadline
    request = pool_request(kenv, "job", timeout_s=2)
    with frozen_controllers(), pytest.raises(
            TransientProviderError, match="was not Running within 2s"):
        kenv.provider.acquire(request)
    # and the failed acquire deleted what it had created
    kenv.wait("job", request.name, gone)
    kenv.wait("secret", f"{request.name}-env", gone)


@pytest.mark.parametrize("backend", BACKENDS)
def test_claim_delivers_exactly_its_runs_data_into_that_pod_alone(
        kenv: KubeEnv, backend: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    # given two warm members of the pool
    request, handle = member(kenv, backend)
    _, other = member(kenv, backend)
    secret = new_secret()
    claim = claim_request(request.lease_id, secret)
    # when a run claims the first
    kenv.proxy.reset_counts()
    claimed = kenv.provider.claim(handle, claim)
    # then it is claimed, in two reads and one exec
    assert claimed.outcome is ClaimOutcome.CLAIMED, claimed.reason
    pod = handle.meta["pod_name"]
    assert claimed.meta["pod_name"] == pod and claimed.meta["claimed_at"]
    assert kenv.proxy.count("GET") == 3 and kenv.proxy.count() == 3
    assert kenv.proxy.count("GET", rf"/pods/{pod}/exec$") == 1
    # its run directory holds exactly the run's data, owner-only
    assert run_dir_listing(kenv, pod) == \
        "claimed\nenv\nrun.json\n600 claimed\n600 env\n600 run.json\n"
    assert json.loads(in_pod(kenv, pod, f'cat "${RUN_DIR_ENV}/run.json"')) == {
        "run_id": claim.run_id, "lease_id": request.lease_id, "tenant": "acme",
        "labels": {"team": "core", "ticket": "42"}}
    assert in_pod(kenv, pod, f'cat "${RUN_DIR_ENV}/claimed"') == f"{claim.run_id}\n"
    assert sourced(kenv, pod, ["GREETING", "API_KEY", "SHARED", "STAGE"]) == [
        "hello it's me", secret, "from-secret", "warm"]
    # the sandbox, waiting for its run, started with that environment
    follow_log_until(kenv, pod, "run started: GREETING=hello it's me")
    # the other member's run directory is untouched
    assert in_pod(kenv, other.meta["pod_name"], f'ls -A "${RUN_DIR_ENV}"') == ""
    # and the secret is in no object of the namespace, the meta, or any log line
    assert secret not in namespace_dump(kenv)
    assert base64.b64encode(secret.encode()).decode() not in namespace_dump(kenv)
    assert secret not in json.dumps(claimed.meta) and secret not in repr(claim)
    assert secret not in caplog.text
    assert f"/pods/{pod} HTTP/1.1" in caplog.text  # (the capture did see the claim's requests)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_repeated_claim_rewrites_the_same_files(kenv: KubeEnv, backend: str) -> None:
    request, handle = member(kenv, backend)
    claim = claim_request(request.lease_id, new_secret())
    pod = handle.meta["pod_name"]
    assert kenv.provider.claim(handle, claim).outcome is ClaimOutcome.CLAIMED
    first = in_pod(kenv, pod, f'cd "${RUN_DIR_ENV}" && ls -A && cat run.json env claimed')
    # a redelivered claim (the task retried) writes the same files, and leaves nothing else
    assert kenv.provider.claim(handle, claim).outcome is ClaimOutcome.CLAIMED
    assert in_pod(kenv, pod, f'cd "${RUN_DIR_ENV}" && ls -A && cat run.json env claimed') == \
        first
    assert first.startswith("claimed\nenv\nrun.json\n")


@pytest.mark.parametrize("backend", BACKENDS)
def test_destroy_after_a_claim_removes_everything_the_volume_included(
        kenv: KubeEnv, backend: str, kubelet_sim: KubeletSim | None) -> None:
    request, handle = member(kenv, backend)
    assert kenv.provider.claim(handle, claim_request(request.lease_id, new_secret())
                               ).outcome is ClaimOutcome.CLAIMED
    pod = kenv.read("pod", handle.meta["pod_name"])
    assert pod is not None
    assert kenv.provider.destroy(handle) is DestroyOutcome.DESTROYED
    kenv.wait("sandbox" if backend == "sandbox-cr" else "job", request.name, gone)
    kenv.wait("pod", pod["metadata"]["name"], gone)
    kenv.wait("secret", f"{request.name}-env", gone)
    if kubelet_sim is not None:  # the node's copy of the run directory is gone too
        run = kubelet_sim.run_for(kenv.namespace, pod["metadata"]["name"])
        assert run is not None and run.pod_dir is not None
        assert kubelet_sim.wait_volumes_removed(pod["metadata"]["uid"], 30)
        assert not (run.pod_dir / "volumes").exists()
    # and a claim of what is gone is not resumable, and says why
    gone_now = kenv.provider.claim(handle, claim_request(request.lease_id, new_secret()))
    assert gone_now.outcome is ClaimOutcome.NOT_RESUMABLE
    assert gone_now.reason in ("Sandbox CR no longer exists", "Job no longer exists")


# -- not resumable --------------------------------------------------------------------------

def test_claim_sandbox_not_ready_is_not_resumable(kenv: KubeEnv,
                                                  steered_controller: Any) -> None:
    request, handle = member(kenv, "sandbox-cr")
    steered_controller.freeze(kenv.namespace, request.name)
    kenv.custom.patch_namespaced_custom_object_status(
        GROUP, "v1alpha1", kenv.namespace, PLURAL, request.name,
        {"status": {"conditions": [{"type": "Ready", "status": "False",
                                    "reason": "DependenciesNotReady",
                                    "message": "Pod is not ready",
                                    "lastTransitionTime": "2026-01-01T00:00:00Z"}]}},
        _content_type="application/merge-patch+json", _preload_content=False)
    kenv.wait("sandbox", request.name, condition_is("Ready", "False"))
    claimed = kenv.provider.claim(handle, claim_request(request.lease_id, new_secret()))
    assert claimed.outcome is ClaimOutcome.NOT_RESUMABLE
    assert claimed.reason.startswith(f"Sandbox {request.name} is not Ready")
    assert "DependenciesNotReady" in claimed.reason
    steered_controller.reset(kenv.namespace, request.name)


def test_claim_sandbox_failed_is_not_resumable(kenv: KubeEnv, steered_controller: Any) -> None:
    request, handle = member(kenv, "sandbox-cr")
    steered_controller.mark_failed(kenv.namespace, request.name, "exit status 3")
    kenv.wait("sandbox", request.name, condition_is("Finished"))
    claimed = kenv.provider.claim(handle, claim_request(request.lease_id, new_secret()))
    assert claimed.outcome is ClaimOutcome.NOT_RESUMABLE
    assert "PodFailed" in claimed.reason and "exit status 3" in claimed.reason


def test_claim_sandbox_pod_gone_is_not_resumable(kenv: KubeEnv, steered_controller: Any) -> None:
    # given a Ready Sandbox whose controller has not yet seen its pod go
    request, handle = member(kenv, "sandbox-cr")
    steered_controller.freeze(kenv.namespace, request.name)
    kenv.core.delete_namespaced_pod(handle.meta["pod_name"], kenv.namespace,
                                    grace_period_seconds=0, _preload_content=False)
    kenv.wait("pod", handle.meta["pod_name"], gone)
    claimed = kenv.provider.claim(handle, claim_request(request.lease_id, new_secret()))
    assert (claimed.outcome, claimed.reason) == (
        ClaimOutcome.NOT_RESUMABLE, f"Pod {handle.meta['pod_name']} no longer exists")
    steered_controller.reset(kenv.namespace, request.name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_claim_terminating_is_not_resumable(
        kenv: KubeEnv, backend: str,
        frozen_controllers: Callable[[], AbstractContextManager[None]]) -> None:
    # given a member deleted in the foreground while the garbage collector is stuck: it
    # stays terminating (its pod still running)
    request, handle = member(kenv, backend)
    with frozen_controllers():
        if backend == "sandbox-cr":
            kenv.custom.delete_namespaced_custom_object(
                GROUP, "v1alpha1", kenv.namespace, PLURAL, request.name,
                propagation_policy="Foreground", _preload_content=False)
        else:
            kenv.batch.delete_namespaced_job(request.name, kenv.namespace,
                                             propagation_policy="Foreground",
                                             _preload_content=False)
        kenv.wait("sandbox" if backend == "sandbox-cr" else "job", request.name,
                  lambda obj: obj is not None and obj["metadata"].get("deletionTimestamp"))
        claimed = kenv.provider.claim(handle, claim_request(request.lease_id, new_secret()))
    assert claimed.outcome is ClaimOutcome.NOT_RESUMABLE
    assert claimed.reason == (f"Sandbox {request.name} is terminating"
                              if backend == "sandbox-cr" else f"Job {request.name} is terminating")


def test_claim_job_failed_is_not_resumable(kenv: KubeEnv,
                                           kubelet_sim: KubeletSim | None) -> None:
    if kubelet_sim is None:
        pytest.skip("kills the sandbox's process through the kubelet simulator")
    # given a member whose sandbox process dies (as a crashed container does)
    request, handle = member(kenv, "job")
    run = kubelet_sim.run_for(kenv.namespace, handle.meta["pod_name"])
    assert run is not None and run.popen is not None
    os.killpg(run.popen.pid, signal.SIGKILL)
    kenv.wait("job", request.name, condition_is("Failed"))
    claimed = kenv.provider.claim(handle, claim_request(request.lease_id, new_secret()))
    assert (claimed.outcome, claimed.reason) == (ClaimOutcome.NOT_RESUMABLE, "Job is Failed")


def test_claim_job_pod_gone_is_not_resumable(
        kenv: KubeEnv, frozen_controllers: Callable[[], AbstractContextManager[None]]) -> None:
    # given a running member whose pod is deleted before its Job controller reacts
    request, handle = member(kenv, "job")
    pod = handle.meta["pod_name"]
    with frozen_controllers():
        kenv.core.delete_namespaced_pod(pod, kenv.namespace, grace_period_seconds=0,
                                        _preload_content=False)
        kenv.wait("pod", pod, gone)
        claimed = kenv.provider.claim(handle, claim_request(request.lease_id, new_secret()))
    assert (claimed.outcome, claimed.reason) == (ClaimOutcome.NOT_RESUMABLE,
                                                f"Pod {pod} no longer exists")


# -- exec failures ----------------------------------------------------------------------------

@pytest.fixture
def sandbox_member(kenv: KubeEnv) -> Iterator[tuple[AcquireRequest, LeaseHandle]]:
    yield member(kenv, "sandbox-cr")


def test_a_500_on_the_exec_is_transient_and_names_no_secret(
        kenv: KubeEnv, sandbox_member: tuple[AcquireRequest, LeaseHandle],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    request, handle = sandbox_member
    secret = new_secret()
    kenv.proxy.fail("GET", r"/pods/[^/]+/exec$", 500, message="the kubelet is unreachable")
    with pytest.raises(TransientProviderError) as info:
        kenv.provider.claim(handle, claim_request(request.lease_id, secret))
    error = info.value
    assert error.status == 500
    assert "HTTP 500 InternalError: the kubelet is unreachable" in str(error)
    chain = [error, error.__cause__, error.__context__]
    assert not any(secret in repr(e) or secret in str(e) for e in chain if e is not None)
    assert secret not in caplog.text
    # nothing was delivered; the retry (the same claim) then succeeds
    assert in_pod(kenv, handle.meta["pod_name"], f'ls -A "${RUN_DIR_ENV}"') == ""
    assert kenv.provider.claim(handle, claim_request(request.lease_id, secret)
                               ).outcome is ClaimOutcome.CLAIMED


def test_an_exec_the_api_server_never_opens_is_transient_at_the_deadline(
        kenv: KubeEnv, sandbox_member: tuple[AcquireRequest, LeaseHandle]) -> None:
    request, handle = sandbox_member
    held = kenv.proxy.hold("GET", r"/pods/[^/]+/exec$")
    try:
        with pytest.raises(TransientProviderError, match="did not open the exec stream in time"):
            kenv.provider.claim(handle, claim_request(request.lease_id, new_secret(),
                                                      timeout_s=2))
        assert held.arrived.is_set()
    finally:
        held.released.set()


def test_a_dropped_exec_connection_is_transient(
        kenv: KubeEnv, sandbox_member: tuple[AcquireRequest, LeaseHandle]) -> None:
    request, handle = sandbox_member
    kenv.proxy.drop("GET", r"/pods/[^/]+/exec$")
    with pytest.raises(TransientProviderError):
        kenv.provider.claim(handle, claim_request(request.lease_id, new_secret()))


def test_claiming_a_pod_that_is_no_pool_member_fails_terminally_saying_so(
        kenv: KubeEnv) -> None:
    # given an ordinary lease (no pool: no run directory)
    request = kenv.request(command=LOOP)
    acquired = kenv.provider.acquire(request)
    secret = new_secret()
    with pytest.raises(TerminalProviderError) as info:
        kenv.provider.claim(kenv.handle(request.name, **acquired.meta),
                            claim_request(request.lease_id, secret))
    text = str(info.value)
    assert "exited 3" in text and "not created as a pool member" in text, text
    assert secret not in text
