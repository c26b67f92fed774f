"""Owns the tests of the cluster harness itself, against the real kube-apiserver: API error
bodies, the Job controller and garbage collector, the kubelet simulator (real exit codes, env
from Secrets, exec, logs, graceful deletion), the Sandbox controller simulator, RBAC identities
and the fault proxy."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from kubernetes import client
from kubernetes.stream import stream

from tests.cluster.cluster import ClusterAccess, KubeCluster
from tests.cluster.fault_proxy import FaultProxy
from tests.cluster.k8s_json import body, exec_core, read_json
from tests.cluster.kubeconfig import api_client_from_kubeconfig
from tests.cluster.kubelet_sim import KubeletSim
from tests.cluster.sandbox_controller import GROUP, NAME_HASH_LABEL, PLURAL, SandboxController
from tests.cluster.waits import condition_is, gone, pod_phase_in, wait_for_object, wait_for_pod

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(120)]
Obj = dict[str, Any]


def _pod(name: str, command: list[str], **container: Any) -> Any:
    return body({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                 "spec": {"restartPolicy": "Never",
                          "containers": [{"name": "main", "image": "sim", "command": command,
                                          **container}]}})


def _status(exc: client.ApiException) -> Obj:
    data: Obj = json.loads(exc.body or "{}")
    return data


def _secret(name: str, **meta: Any) -> Any:
    return body({"metadata": {"name": name, **meta}, "stringData": {"k": "v"}})


def test_not_found_has_status_body(kube_api: client.ApiClient, k8s_namespace: str) -> None:
    core = client.CoreV1Api(kube_api)
    with pytest.raises(client.ApiException) as info:
        core.read_namespaced_pod("missing", k8s_namespace)
    status = _status(info.value)
    assert info.value.status == 404
    assert status["kind"] == "Status" and status["reason"] == "NotFound"
    assert status["details"] == {"name": "missing", "kind": "pods"}


def test_duplicate_create_is_already_exists(kube_api: client.ApiClient,
                                            k8s_namespace: str) -> None:
    core = client.CoreV1Api(kube_api)
    core.create_namespaced_secret(k8s_namespace, _secret("dup"))
    with pytest.raises(client.ApiException) as info:
        core.create_namespaced_secret(k8s_namespace, _secret("dup"))
    assert info.value.status == 409
    assert _status(info.value)["reason"] == "AlreadyExists"


def test_job_pod_runs_real_command_and_job_fails(
        kube_api: client.ApiClient, kubelet_sim: KubeletSim | None, k8s_namespace: str) -> None:
    batch, core = client.BatchV1Api(kube_api), client.CoreV1Api(kube_api)
    job = {"metadata": {"name": "exit3"},
           "spec": {"backoffLimit": 0, "template": {"spec": {
               "restartPolicy": "Never",
               "containers": [{"name": "main", "image": "sim",
                               "command": ["sh", "-c", "echo failing; exit 3"]}]}}}}
    batch.create_namespaced_job(k8s_namespace, body(job))
    wait_for_object(batch.list_namespaced_job, "exit3", condition_is("Failed"), timeout=60,
                    namespace=k8s_namespace)
    pods = read_json(core.list_namespaced_pod(k8s_namespace, label_selector="job-name=exit3",
                                              _preload_content=False))["items"]
    assert len(pods) == 1
    status = pods[0]["status"]
    assert status["phase"] == "Failed"
    assert status["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 3
    log = core.read_namespaced_pod_log(pods[0]["metadata"]["name"], k8s_namespace)
    assert log == "failing\n"


def test_secret_owned_by_deleted_pod_is_garbage_collected(
        kube_api: client.ApiClient, kubelet_sim: KubeletSim | None, k8s_namespace: str) -> None:
    core = client.CoreV1Api(kube_api)
    pod = read_json(core.create_namespaced_pod(k8s_namespace, _pod("owner", ["sleep", "300"]),
                                               _preload_content=False))
    wait_for_pod(core, k8s_namespace, "owner", pod_phase_in("Running"))
    owner = {"apiVersion": "v1", "kind": "Pod", "name": "owner", "uid": pod["metadata"]["uid"]}
    core.create_namespaced_secret(k8s_namespace, _secret("owned", ownerReferences=[owner]))
    started = time.monotonic()
    core.delete_namespaced_pod("owner", k8s_namespace)  # graceful: SIGTERM, then grace 0
    wait_for_pod(core, k8s_namespace, "owner", gone, timeout=30)
    assert time.monotonic() - started < 10, "graceful deletion should end when sleep exits"
    wait_for_object(core.list_namespaced_secret, "owned", gone, timeout=30,
                    namespace=k8s_namespace)


def test_env_from_secret_and_exec(kube_api: client.ApiClient, kubelet_sim: KubeletSim | None,
                                  k8s_namespace: str) -> None:
    core = client.CoreV1Api(kube_api)
    core.create_namespaced_secret(k8s_namespace, body({"metadata": {"name": "creds"},
                                                       "stringData": {"TOKEN": "s3cret"}}))
    core.create_namespaced_pod(k8s_namespace, _pod(
        "shell", ["sleep", "300"], envFrom=[{"secretRef": {"name": "creds"}}],
        env=[{"name": "GREETING", "value": "hello $(TOKEN)"}]))
    wait_for_pod(core, k8s_namespace, "shell", condition_is("Ready"))
    execs = exec_core(kube_api)  # not the simulators' shared client: stream() swaps its call_api
    resp = stream(execs.connect_get_namespaced_pod_exec, "shell", k8s_namespace,
                  command=["sh", "-c", 'echo "$GREETING"; echo oops >&2; exit 5'],
                  stdout=True, stderr=True, stdin=False, tty=False, _preload_content=False)
    resp.run_forever(timeout=30)
    assert resp.read_stdout() == "hello s3cret\n"
    assert resp.read_stderr() == "oops\n"
    assert resp.returncode == 5
    out = stream(execs.connect_get_namespaced_pod_exec, "shell", k8s_namespace,
                 command=["printf", "done"], stdout=True, stderr=True, stdin=False, tty=False)
    assert out == "done"


def _sandboxes(custom: client.CustomObjectsApi, namespace: str) -> Any:
    def list_call(**kwargs: Any) -> Any:
        return custom.list_namespaced_custom_object(GROUP, "v1beta1", namespace, PLURAL,
                                                    **kwargs)
    return list_call


def test_sandbox_gets_pod_and_ready(kube_api: client.ApiClient,
                                    sandbox_controller: SandboxController | None,
                                    k8s_namespace: str) -> None:
    custom, core = client.CustomObjectsApi(kube_api), client.CoreV1Api(kube_api)
    custom.create_namespaced_custom_object(GROUP, "v1alpha1", k8s_namespace, PLURAL, {
        "apiVersion": f"{GROUP}/v1alpha1", "kind": "Sandbox", "metadata": {"name": "sb"},
        "spec": {"podTemplate": {"metadata": {"labels": {"app": "agent"}},
                                 "spec": {"containers": [{"name": "main", "image": "sim"}]}}}})
    sandbox = wait_for_object(_sandboxes(custom, k8s_namespace), "sb", condition_is("Ready"))
    assert sandbox is not None
    ready = next(c for c in sandbox["status"]["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "DependenciesReady"
    pod = read_json(core.read_namespaced_pod("sb", k8s_namespace, _preload_content=False))
    labels = pod["metadata"]["labels"]
    assert labels["app"] == "agent" and NAME_HASH_LABEL in labels
    ref = pod["metadata"]["ownerReferences"][0]
    assert (ref["kind"], ref["name"], ref["controller"], ref["blockOwnerDeletion"]) == \
        ("Sandbox", "sb", True, True)
    assert sandbox["status"]["selector"] == f"{NAME_HASH_LABEL}={labels[NAME_HASH_LABEL]}"


def test_sandbox_never_ready_and_failed_controls(
        kube_api: client.ApiClient, sandbox_controller: SandboxController | None,
        k8s_namespace: str) -> None:
    if sandbox_controller is None:
        pytest.skip("a real agent-sandbox controller cannot be steered")
    custom = client.CustomObjectsApi(kube_api)
    sandbox_controller.never_ready(k8s_namespace, "stuck")
    sandbox_controller.mark_failed(k8s_namespace, "broken", "image pull failed")
    for name in ("stuck", "broken"):
        custom.create_namespaced_custom_object(GROUP, "v1beta1", k8s_namespace, PLURAL, {
            "apiVersion": f"{GROUP}/v1beta1", "kind": "Sandbox", "metadata": {"name": name},
            "spec": {"podTemplate": {"spec": {"containers": [{"name": "m", "image": "sim"}]}}}})
    list_call = _sandboxes(custom, k8s_namespace)
    stuck = wait_for_object(list_call, "stuck", condition_is("Ready", "False"))
    broken = wait_for_object(list_call, "broken", condition_is("Finished"))
    assert stuck and stuck["status"]["conditions"][0]["reason"] == "DependenciesNotReady"
    assert broken and broken["status"]["conditions"][0]["reason"] == "PodFailed"
    with pytest.raises(client.ApiException):
        client.CoreV1Api(kube_api).read_namespaced_pod("stuck", k8s_namespace)


def test_rbac_least_privilege_service_account(kube_cluster: ClusterAccess,
                                              kube_api: client.ApiClient,
                                              k8s_namespace: str) -> None:
    if isinstance(kube_cluster, KubeCluster) and kube_cluster.authorization_mode != "RBAC":
        pytest.skip("cluster runs with AlwaysAllow")
    rbac = client.RbacAuthorizationV1Api(kube_api)
    rbac.create_namespaced_role(k8s_namespace, body({
        "metadata": {"name": "secret-reader"},
        "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list"]}]}))
    rbac.create_namespaced_role_binding(k8s_namespace, body({
        "metadata": {"name": "reader"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                    "name": "secret-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "reader",
                      "namespace": k8s_namespace}]}))
    path = kube_cluster.kubeconfig_for_service_account(k8s_namespace, "reader")
    with api_client_from_kubeconfig(path) as api:
        core = client.CoreV1Api(api)
        core.list_namespaced_secret(k8s_namespace)
        with pytest.raises(client.ApiException) as info:
            core.create_namespaced_secret(k8s_namespace, _secret("x"))
        assert info.value.status == 403
        assert _status(info.value)["reason"] == "Forbidden"


def test_fault_proxy_injects_500_and_counts(fault_proxy: FaultProxy, k8s_namespace: str) -> None:
    with api_client_from_kubeconfig(fault_proxy.kubeconfig_path) as api:
        core = client.CoreV1Api(api)
        path = f"^/api/v1/namespaces/{k8s_namespace}/secrets$"
        fault_proxy.fail("GET", path, code=500, times=1, message="etcd is sad")
        with pytest.raises(client.ApiException) as info:
            core.list_namespaced_secret(k8s_namespace)
        assert info.value.status == 500
        status = _status(info.value)
        assert (status["kind"], status["reason"], status["message"]) == \
            ("Status", "InternalError", "etcd is sad")
        # the rule is used up: the next request goes through
        assert core.list_namespaced_secret(k8s_namespace, label_selector="x=y").items == []
        fault_proxy.forbid("POST", path)
        with pytest.raises(client.ApiException) as denied:
            core.create_namespaced_secret(k8s_namespace, _secret("s"))
        assert denied.value.status == 403
        assert fault_proxy.count("GET", path) == 2
        assert fault_proxy.count("POST", path) == 1
        assert fault_proxy.counts[("GET", f"/api/v1/namespaces/{k8s_namespace}/secrets")] == 2


def test_fault_proxy_streams_watch_and_tunnels_exec(
        fault_proxy: FaultProxy, kubelet_sim: KubeletSim | None, k8s_namespace: str) -> None:
    with api_client_from_kubeconfig(fault_proxy.kubeconfig_path) as api:
        core = client.CoreV1Api(api)
        core.create_namespaced_pod(k8s_namespace, _pod("via-proxy", ["sleep", "300"]))
        wait_for_pod(core, k8s_namespace, "via-proxy", condition_is("Ready"))
        assert fault_proxy.count("GET", r"/pods$") >= 1
        out = stream(core.connect_get_namespaced_pod_exec, "via-proxy", k8s_namespace,
                     command=["echo", "through"], stdout=True, stderr=True, stdin=False,
                     tty=False)
        assert out == "through\n"
        assert fault_proxy.count("GET", r"/pods/via-proxy/exec$") == 1
