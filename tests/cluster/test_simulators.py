"""Owns the tests of the simulators' finer behaviour against the real API server: Sandbox
suspension, expiry (Retain and Delete), pod failure mirrored into the Sandbox; kubelet restarts
for restartPolicy OnFailure, CreateContainerConfigError until a Secret appears, exec stdin, a
pod's in-cluster ServiceAccount token (the kubernetes client's own load_incluster_config), and
emptyDir volumes: each pod's own, at its mount path, memory-backed with its size limit, seen
and written by an exec into that pod alone, removed with the pod."""

from __future__ import annotations

import os
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.stream import stream

from tests.cluster.k8s_json import body, exec_core
from tests.cluster.kubelet_sim import KubeletSim
from tests.cluster.sandbox_controller import GROUP, PLURAL, SandboxController
from tests.cluster.waits import condition_is, gone, pod_phase_in, wait_for_object, wait_for_pod

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(120)]
Obj = dict[str, Any]


def _sandbox(name: str, command: list[str] | None = None, **spec: Any) -> Obj:
    container: Obj = {"name": "main", "image": "sim"}
    if command:
        container["command"] = command
    return {"apiVersion": f"{GROUP}/v1beta1", "kind": "Sandbox", "metadata": {"name": name},
            "spec": {"podTemplate": {"spec": {"restartPolicy": "Never",
                                              "containers": [container]}}, **spec}}


def _reason(obj: Obj | None, kind: str = "Ready") -> str | None:
    for cond in (obj or {}).get("status", {}).get("conditions") or []:
        if cond["type"] == kind:
            return str(cond.get("reason"))
    return None


def _reason_is(reason: str, kind: str = "Ready") -> Any:
    return lambda obj: _reason(obj, kind) == reason


class _Sandboxes:
    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.custom = client.CustomObjectsApi(api)
        self.namespace = namespace

    def create(self, obj: Obj) -> None:
        self.custom.create_namespaced_custom_object(GROUP, "v1beta1", self.namespace, PLURAL,
                                                    obj)

    def patch(self, name: str, patch: Obj) -> None:
        self.custom.patch_namespaced_custom_object(
            GROUP, "v1beta1", self.namespace, PLURAL, name, patch,
            _content_type="application/merge-patch+json")

    def wait(self, name: str, predicate: Any, timeout: float = 30) -> Obj | None:
        def list_call(**kwargs: Any) -> Any:
            return self.custom.list_namespaced_custom_object(GROUP, "v1beta1", self.namespace,
                                                             PLURAL, **kwargs)
        return wait_for_object(list_call, name, predicate, timeout, f"sandbox {name}")


def test_sandbox_suspend_and_resume(kube_api: client.ApiClient,
                                    sandbox_controller: SandboxController | None,
                                    k8s_namespace: str) -> None:
    sandboxes, core = _Sandboxes(kube_api, k8s_namespace), client.CoreV1Api(kube_api)
    sandboxes.create(_sandbox("pausable"))
    sandboxes.wait("pausable", condition_is("Ready"))
    sandboxes.patch("pausable", {"spec": {"operatingMode": "Suspended"}})
    suspended = sandboxes.wait("pausable", _reason_is("PodTerminated", "Suspended"))
    assert _reason(suspended) == "SandboxSuspended"
    wait_for_pod(core, k8s_namespace, "pausable", gone)
    sandboxes.patch("pausable", {"spec": {"operatingMode": "Running"}})
    sandboxes.wait("pausable", condition_is("Ready"))


def test_sandbox_expiry_retain_and_delete(kube_api: client.ApiClient,
                                          sandbox_controller: SandboxController | None,
                                          k8s_namespace: str) -> None:
    sandboxes, core = _Sandboxes(kube_api, k8s_namespace), client.CoreV1Api(kube_api)
    soon = (datetime.now(UTC) + timedelta(seconds=2)).strftime("%Y-%m-%dT%H:%M:%SZ")
    sandboxes.create(_sandbox("kept", shutdownTime=soon, shutdownPolicy="Retain"))
    sandboxes.create(_sandbox("dropped", shutdownTime=soon, shutdownPolicy="Delete"))
    sandboxes.wait("kept", _reason_is("SandboxExpired"), timeout=20)
    wait_for_pod(core, k8s_namespace, "kept", gone)
    sandboxes.wait("dropped", gone, timeout=20)
    wait_for_pod(core, k8s_namespace, "dropped", gone)


def test_failed_pod_is_mirrored_into_sandbox(kube_api: client.ApiClient,
                                             sandbox_controller: SandboxController | None,
                                             k8s_namespace: str) -> None:
    sandboxes = _Sandboxes(kube_api, k8s_namespace)
    sandboxes.create(_sandbox("crashy", ["sh", "-c", "exit 9"]))
    finished = sandboxes.wait("crashy", condition_is("Finished"))
    assert _reason(finished) == "PodFailed" and _reason(finished, "Finished") == "PodFailed"


def test_on_failure_restarts_the_process(kube_api: client.ApiClient,
                                         kubelet_sim: KubeletSim | None,
                                         k8s_namespace: str) -> None:
    core = client.CoreV1Api(kube_api)
    # fails on the first run, succeeds on the second (the marker file survives restarts)
    script = "if [ -e marker ]; then exit 0; fi; touch marker; exit 4"
    core.create_namespaced_pod(k8s_namespace, body({
        "metadata": {"name": "flaky"},
        "spec": {"restartPolicy": "OnFailure",
                 "containers": [{"name": "main", "image": "sim",
                                 "command": ["sh", "-c", script]}]}}))
    pod = wait_for_pod(core, k8s_namespace, "flaky", pod_phase_in("Succeeded"))
    assert pod is not None
    status = pod["status"]["containerStatuses"][0]
    assert status["restartCount"] == 1
    assert status["lastState"]["terminated"]["exitCode"] == 4


def test_missing_secret_blocks_until_created(kube_api: client.ApiClient,
                                             kubelet_sim: KubeletSim | None,
                                             k8s_namespace: str) -> None:
    core = client.CoreV1Api(kube_api)
    core.create_namespaced_pod(k8s_namespace, body({
        "metadata": {"name": "needs-secret"},
        "spec": {"restartPolicy": "Never",
                 "containers": [{"name": "main", "image": "sim",
                                 "command": ["sh", "-c", 'test "$KEY" = late'],
                                 "envFrom": [{"secretRef": {"name": "later"}}]}]}}))

    def waiting(pod: Obj | None) -> bool:
        statuses = (pod or {}).get("status", {}).get("containerStatuses") or []
        return bool(statuses) and \
            statuses[0]["state"].get("waiting", {}).get("reason") == "CreateContainerConfigError"

    wait_for_pod(core, k8s_namespace, "needs-secret", waiting)
    core.create_namespaced_secret(k8s_namespace, body({"metadata": {"name": "later"},
                                                       "stringData": {"KEY": "late"}}))
    wait_for_pod(core, k8s_namespace, "needs-secret", pod_phase_in("Succeeded"))


def test_exec_with_stdin(kube_api: client.ApiClient, kubelet_sim: KubeletSim | None,
                         k8s_namespace: str) -> None:
    core = client.CoreV1Api(kube_api)
    core.create_namespaced_pod(k8s_namespace, body({
        "metadata": {"name": "cat"},
        "spec": {"containers": [{"name": "main", "image": "sim"}]}}))
    wait_for_pod(core, k8s_namespace, "cat", condition_is("Ready"))
    resp = stream(exec_core(kube_api).connect_get_namespaced_pod_exec, "cat", k8s_namespace,
                  command=["sh", "-c", "read line; echo got:$line"], stdin=True, stdout=True,
                  stderr=True, tty=False, _preload_content=False)
    resp.write_stdin("ping\n")
    resp.run_forever(timeout=20)
    assert resp.read_stdout() == "got:ping\n"
    assert resp.returncode == 0


IN_CLUSTER = """
import socket
from kubernetes import client, config
config.load_incluster_config()
namespace = open("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read()
try:  # the default account may not list pods: the refusal names who asked
    client.CoreV1Api().list_namespaced_pod(namespace)
except client.ApiException as exc:
    print(socket.gethostname(), namespace, exc.status, exc.body)
"""


def test_a_service_account_pod_reaches_the_api_with_its_in_cluster_token(
        kube_api: client.ApiClient, kubelet_sim: KubeletSim | None, k8s_namespace: str) -> None:
    core = client.CoreV1Api(kube_api)
    host_had_tokens = Path("/var/run/secrets/kubernetes.io").exists()
    for name, automount in (("in-cluster", True), ("no-token", False)):
        core.create_namespaced_pod(k8s_namespace, body({
            "metadata": {"name": name},
            "spec": {"restartPolicy": "Never", "serviceAccountName": "default",
                     "automountServiceAccountToken": automount,
                     "containers": [{"name": "main", "image": "sim",
                                     "command": [sys.executable, "-c", IN_CLUSTER]}]}}))
    wait_for_pod(core, k8s_namespace, "in-cluster", pod_phase_in("Succeeded"))
    out = core.read_namespaced_pod_log("in-cluster", k8s_namespace)
    assert out.startswith(f"in-cluster {k8s_namespace} 403 ")  # its hostname, its namespace
    assert f'User \\"system:serviceaccount:{k8s_namespace}:default\\"' in out, out
    # automount off: no token, and load_incluster_config says so
    wait_for_pod(core, k8s_namespace, "no-token", pod_phase_in("Failed"))
    assert "Service token file does not exist" in core.read_namespaced_pod_log(
        "no-token", k8s_namespace)
    assert Path("/var/run/secrets/kubernetes.io").exists() == host_had_tokens  # host unchanged


def _exec(core: client.CoreV1Api, namespace: str, pod: str, command: list[str],
          stdin: str | None = None) -> tuple[int | None, str, str]:
    """(exit code, stdout, stderr) of an exec through the API server."""
    resp = stream(exec_core(core.api_client).connect_get_namespaced_pod_exec, pod, namespace,
                  command=command,
                  stdin=stdin is not None, stdout=True, stderr=True, tty=False,
                  _preload_content=False)
    if stdin is not None:
        resp.write_stdin(stdin)
    resp.run_forever(timeout=20)
    return resp.returncode, resp.read_stdout(timeout=0), resp.read_stderr(timeout=0)


def _volume_pod(name: str, command: list[str], volumes: list[Obj],
                mounts: list[Obj]) -> Obj:
    return {"metadata": {"name": name},
            "spec": {"restartPolicy": "Never", "volumes": volumes,
                     "containers": [{"name": "main", "image": "sim", "command": command,
                                     "volumeMounts": mounts}]}}


RUN = "/run/leasekeeper-sim-test"  # not on the host: each pod gets it in its own view
TMPFS = [{"name": "run", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}]
AT_RUN = [{"name": "run", "mountPath": RUN}]


def test_an_empty_dir_is_each_pods_own_at_its_mount_path_and_exec_writes_into_it(
        kube_api: client.ApiClient, kubelet_sim: KubeletSim | None, k8s_namespace: str) -> None:
    if kubelet_sim is None:
        pytest.skip("inspects the kubelet simulator's own pod directories")
    core = client.CoreV1Api(kube_api)
    # given two pods whose containers mount a memory-backed emptyDir at the same path, the
    # first writing into it when it starts
    writes = ["sh", "-c", f"echo from-a > {RUN}/boot; exec sleep 300"]
    core.create_namespaced_pod(k8s_namespace, body(_volume_pod("vol-a", writes, TMPFS, AT_RUN)))
    core.create_namespaced_pod(k8s_namespace, body(_volume_pod(
        "vol-b", ["sleep", "300"], TMPFS, AT_RUN)))
    for name in ("vol-a", "vol-b"):
        wait_for_pod(core, k8s_namespace, name, condition_is("Ready"))
    # when an exec writes a file there from stdin in pod b (6 bytes: the v4 protocol that the
    # simulator speaks, like a 1.20 kubelet, has no end-of-input signal)
    code, _, err = _exec(core, k8s_namespace, "vol-b", [
        "sh", "-c", f"umask 077; head -c 6 > {RUN}/.t && mv {RUN}/.t {RUN}/env"], stdin="KEY=b\n")
    assert code == 0, err
    # then each pod sees its own volume there, and only its own
    assert _exec(core, k8s_namespace, "vol-a", ["ls", "-A", RUN])[1] == "boot\n"
    assert _exec(core, k8s_namespace, "vol-b", ["ls", "-A", RUN])[1] == "env\n"
    assert _exec(core, k8s_namespace, "vol-b", ["cat", f"{RUN}/env"])[1] == "KEY=b\n"
    # a tmpfs of the pod's size limit, mode 0777 as a kubelet makes it
    assert _exec(core, k8s_namespace, "vol-a", ["stat", "-f", "-c", "%T", RUN])[1] == "tmpfs\n"
    assert _exec(core, k8s_namespace, "vol-a", ["stat", "-c", "%a", RUN])[1] == "777\n"
    code, _, err = _exec(core, k8s_namespace, "vol-a", [
        "sh", "-c", f"head -c 2097152 /dev/zero > {RUN}/big"])
    assert code != 0 and "No space left on device" in err
    # the exec ran under the pod's hostname, and the host's /run is unchanged
    assert _exec(core, k8s_namespace, "vol-b", ["hostname"])[1] == "vol-b\n"
    assert not os.path.exists(RUN)
    # a command that is not there answers as before (126), in a pod of its own view too
    assert _exec(core, k8s_namespace, "vol-a", ["no-such-command"])[0] == 126
    # when a pod is deleted, its volume goes with it
    run = kubelet_sim.run_for(k8s_namespace, "vol-b")
    assert run is not None and run.pod_dir is not None
    volume = run.pod_dir / "volumes" / "kubernetes.io~empty-dir" / "run"
    assert os.path.ismount(volume) and (volume / "env").exists()
    core.delete_namespaced_pod("vol-b", k8s_namespace, grace_period_seconds=0)
    wait_for_pod(core, k8s_namespace, "vol-b", gone)
    assert kubelet_sim.wait_volumes_removed(run.uid, 30)
    assert not os.path.ismount(volume) and not volume.exists()
    # while the other pod's is still there
    assert _exec(core, k8s_namespace, "vol-a", ["cat", f"{RUN}/boot"])[1] == "from-a\n"


def test_a_disk_empty_dir_survives_a_container_restart(
        kube_api: client.ApiClient, kubelet_sim: KubeletSim | None, k8s_namespace: str) -> None:
    core = client.CoreV1Api(kube_api)
    # the first run leaves a marker in the volume and fails; the restarted one finds it
    script = "if [ -e /srv/scratch/marker ]; then exit 0; fi; touch /srv/scratch/marker; exit 4"
    pod = _volume_pod("vol-restart", ["sh", "-c", script], [{"name": "s", "emptyDir": {}}],
                      [{"name": "s", "mountPath": "/srv/scratch"}])
    pod["spec"]["restartPolicy"] = "OnFailure"
    core.create_namespaced_pod(k8s_namespace, body(pod))
    done = wait_for_pod(core, k8s_namespace, "vol-restart", pod_phase_in("Succeeded"))
    assert done is not None
    assert done["status"]["containerStatuses"][0]["restartCount"] == 1
    assert not os.path.exists("/srv/scratch")


def test_a_volume_kind_that_is_not_simulated_is_refused_not_ignored(
        kube_api: client.ApiClient, kubelet_sim: KubeletSim | None, k8s_namespace: str) -> None:
    if kubelet_sim is None:
        pytest.skip("checks the kubelet simulator's refusal of volumes it does not simulate")
    core = client.CoreV1Api(kube_api)
    core.create_namespaced_pod(k8s_namespace, body(_volume_pod(
        "vol-cm", ["sleep", "300"], [{"name": "cfg", "configMap": {"name": "missing"}}],
        [{"name": "cfg", "mountPath": "/srv/cfg"}])))

    def refused(pod: Obj | None) -> bool:
        statuses = (pod or {}).get("status", {}).get("containerStatuses") or []
        waiting = statuses[0]["state"].get("waiting", {}) if statuses else {}
        return waiting.get("reason") == "CreateContainerError" and \
            "not simulated" in waiting.get("message", "")

    wait_for_pod(core, k8s_namespace, "vol-cm", refused)


def test_a_pod_is_running_only_once_its_volumes_are_mounted(
        kube_api: client.ApiClient, kubelet_sim: KubeletSim | None, k8s_namespace: str) -> None:
    # as a kubelet reports a container running only once its mounts are in place, an exec
    # the moment a pod is Running already sees its volume (the set-up runs before Running)
    core = client.CoreV1Api(kube_api)
    names = [f"vol-ready-{i}" for i in range(4)]
    for name in names:
        core.create_namespaced_pod(k8s_namespace, body(_volume_pod(
            name, ["sleep", "300"], TMPFS, AT_RUN)))
    for name in names:
        wait_for_pod(core, k8s_namespace, name, pod_phase_in("Running"))
        code, _, err = _exec(core, k8s_namespace, name, ["sh", "-c", f"mountpoint -q {RUN}"])
        assert code == 0, (name, err)
