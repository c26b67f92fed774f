"""Owns the kubelet simulator: one Node (``sim-node``, InternalIP 127.0.0.1) whose pods run as
LOCAL processes of the test session.

It binds unscheduled pods to its node (binding subresource), runs each pod's first container
command (``command`` + ``args``; ``sleep infinity`` when there is none) with the pod's env,
reports Running/Ready, then Succeeded or Failed with the real exit code (restartPolicy Always /
OnFailure restart the process with a short backoff, as a kubelet would), finishes graceful
deletions (SIGTERM to the process group, SIGKILL after the grace period, then delete with grace
0) and serves exec and logs through ``exec_server.KubeletServer``. ``stop()`` kills every
process it started. A pod that names a ServiceAccount (automount not off) gets its token at
the in-cluster path; a container with emptyDir volume mounts sees them at their mount paths
(``pod_volumes``: a tmpfs for ``medium: Memory``, removed when the pod object goes); either
way the pod runs in its own mount and UTS namespaces with its own hostname
(``pod_namespaces``), and an exec into it runs in those namespaces, so it reads and writes
that pod's volumes and no other's. ``KUBERNETES_SERVICE_HOST`` / ``PORT`` point at the API
server.

Images are the one seam: ``images`` maps an image name to the environment its container
starts from (as a Dockerfile's ``ENV``, e.g. a host virtualenv's ``bin`` first on ``PATH``);
an image not in it runs with the host's. Not simulated: init containers, probes (a started
process is Ready), volumes other than emptyDir and the token (a container mounting one waits
with CreateContainerError), users, resource limits. Only the first container runs; an exec
into another container of the pod runs in the first one's namespaces.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any

from kubernetes import client

from tests.cluster import k8s_json, pod_namespaces, pod_volumes
from tests.cluster.certs import make_ca, make_server_cert
from tests.cluster.exec_server import ContainerTarget, KubeletServer
from tests.cluster.informer import Informer, Obj
from tests.cluster.pod_env import ConfigError, EnvResolver, container_command

log = logging.getLogger(__name__)
NODE_IP = "127.0.0.1"
CONTAINER_SETUP_S = 10.0  # the longest a pod's namespace set-up may take before it runs


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class PodRun:
    """The local process backing one pod (by uid)."""

    namespace: str
    name: str
    uid: str
    containers: list[str]
    envs: dict[str, dict[str, str]]
    command: list[str]
    cwd: Path
    log_path: Path
    restart_policy: str
    pod_dir: Path | None = None
    namespaced: bool = False  # runs in its own mount / UTS namespaces (pod_namespaces)
    popen: subprocess.Popen[bytes] | None = None
    started_at: str = ""
    restart_count: int = 0
    last_state: Obj = field(default_factory=dict)
    terminating: bool = False
    finished: bool = False
    kill_timer: threading.Timer | None = None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


class KubeletSim:
    """A kubelet for one simulated Node; context manager. ``api`` is an admin ``ApiClient``."""

    def __init__(self, api: client.ApiClient, *, node_name: str = "sim-node",
                 cert_dir: Path | None = None, workdir: Path | None = None,
                 bind_pods: bool = True, max_backoff: float = 10.0,
                 images: dict[str, dict[str, str]] | None = None) -> None:
        self.api = api
        self.images: dict[str, dict[str, str]] = dict(images or {})
        self.core = client.CoreV1Api(api)
        self.node_name = node_name
        self._own_workdir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="lk-kubelet-"))
        self.cert_dir = cert_dir or self.workdir / "pki"
        self.bind_pods = bind_pods
        self.max_backoff = max_backoff
        self.env_resolver = EnvResolver(api)
        self.runs: dict[str, PodRun] = {}          # by pod uid
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._timers: set[threading.Timer] = set()
        self._config_wait: set[str] = set()
        self._pod_dirs: dict[str, Path] = {}  # by pod uid: whose volumes to remove when it goes
        self._volumes_removed = threading.Condition(self._lock)
        self._removed_uids: set[str] = set()
        self.server: KubeletServer | None = None
        self.informer: Informer | None = None
        self._worker: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------
    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.port

    def start(self) -> KubeletSim:
        ca = make_ca(self.cert_dir)
        self.server = KubeletServer(self._resolve, make_server_cert(ca, self.cert_dir, "kubelet"))
        self.server.start()
        self._register_node()
        self._worker = threading.Thread(target=self._work, name="kubelet-worker", daemon=True)
        self._worker.start()
        self.informer = Informer("pods", self.core.list_pod_for_all_namespaces,
                                 lambda kind, pod: self._queue.put(("pod", (kind, pod))))
        self.informer.start()
        if not self.informer.synced.wait(30):
            raise TimeoutError("kubelet simulator: initial pod list did not complete in 30s")
        return self

    def stop(self) -> None:
        """Stop watching and kill every process this simulator started."""
        self._stopping.set()
        if self.informer is not None:
            self.informer.stop()
        self._queue.put(("stop", None))
        if self._worker is not None:
            self._worker.join(10)
        with self._lock:
            for timer in list(self._timers):
                timer.cancel()
            for run in self.runs.values():
                if run.kill_timer is not None:
                    run.kill_timer.cancel()
                _signal_group(run, signal.SIGKILL)
                if run.popen is not None:
                    run.popen.wait(5)
            for pod_dir in self._pod_dirs.values():
                pod_volumes.remove(pod_dir)
            self._pod_dirs.clear()
        if self.server is not None:
            self.server.stop()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> KubeletSim:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def run_for(self, namespace: str, name: str) -> PodRun | None:
        """The local run of pod ``namespace/name`` (the newest one), if any."""
        with self._lock:
            found = [r for r in self.runs.values() if (r.namespace, r.name) == (namespace, name)]
        return found[-1] if found else None

    def wait_volumes_removed(self, uid: str, timeout_s: float) -> bool:
        """Until the simulator has handled the deletion of pod ``uid`` (its volumes
        unmounted and removed); False if that did not happen within ``timeout_s``."""
        with self._volumes_removed:
            return self._volumes_removed.wait_for(lambda: uid in self._removed_uids, timeout_s)

    def alive_in(self, namespace: str) -> list[PodRun]:
        """The runs of ``namespace`` whose process is still alive."""
        with self._lock:
            return [r for r in self.runs.values() if r.namespace == namespace and r.alive()]

    def kill_namespace(self, namespace: str) -> None:
        """SIGKILL every process still running for a pod of ``namespace`` (a test's last
        resort after deleting it: the pods' grace periods may be long)."""
        for run in self.alive_in(namespace):
            _signal_group(run, signal.SIGKILL)
            if run.popen is not None:
                run.popen.wait(5)

    # -- node -----------------------------------------------------------------------------
    def _register_node(self) -> None:
        status = {
            "addresses": [{"type": "InternalIP", "address": NODE_IP},
                          {"type": "Hostname", "address": self.node_name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.port}},
            "capacity": {"cpu": "8", "memory": "32Gi", "pods": "110"},
            "allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "kubelet simulator is ready",
                            "lastHeartbeatTime": now(), "lastTransitionTime": now()}],
            "nodeInfo": {"kubeletVersion": "v1.20.2-sim", "kubeProxyVersion": "v1.20.2-sim",
                         "operatingSystem": "linux", "architecture": "amd64",
                         "containerRuntimeVersion": "sim://1", "osImage": "sim",
                         "kernelVersion": "", "machineID": "", "systemUUID": "", "bootID": ""},
        }
        node = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": self.node_name,
                             "labels": {"kubernetes.io/hostname": self.node_name,
                                        "kubernetes.io/os": "linux"}},
                "status": status}
        try:
            self.core.create_node(k8s_json.body(node), _preload_content=False)
        except client.ApiException as exc:
            if exc.status != 409:
                raise
        self.core.patch_node_status(self.node_name, {"status": status}, _preload_content=False)

    # -- worker ---------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            kind, payload = self._queue.get()
            if kind == "stop" or self._stopping.is_set():
                return
            try:
                if kind == "pod":
                    self._on_pod(*payload)
                elif kind == "exited":
                    self._on_exit(payload)
                elif kind == "retry":
                    self._retry(*payload)
                elif kind == "retry-launch":
                    run = self.runs.get(payload)
                    if run is not None and not run.terminating and not run.finished:
                        self._launch(run)
            except client.ApiException as exc:
                if exc.status not in (404, 409):
                    log.warning("kubelet simulator: API error %s on %s", exc.status, kind)
            except Exception:
                log.exception("kubelet simulator: failed handling %s", kind)

    def _later(self, delay: float, item: tuple[str, Any]) -> None:
        def fire() -> None:
            with self._lock:
                self._timers.discard(timer)
            self._queue.put(item)
        timer = threading.Timer(delay, fire)
        timer.daemon = True
        with self._lock:
            self._timers.add(timer)
        timer.start()

    def _retry(self, namespace: str, name: str) -> None:
        response = self.core.read_namespaced_pod(name, namespace, _preload_content=False)
        pod = k8s_json.read_json(response)
        self._config_wait.discard(pod["metadata"]["uid"])
        self._on_pod("MODIFIED", pod)

    def _on_pod(self, kind: str, pod: Obj) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        uid = meta["uid"]
        run = self.runs.get(uid)
        if uid in self._config_wait and kind != "DELETED" and not meta.get("deletionTimestamp"):
            return  # waiting for a missing Secret / ConfigMap: the retry timer re-checks
        if kind == "DELETED":
            if run is not None:
                run.terminating = True
                _signal_group(run, signal.SIGKILL)
            with self._lock:
                pod_dir = self._pod_dirs.pop(uid, None)
            if pod_dir is not None:
                pod_volumes.remove(pod_dir)  # emptyDir volumes live as long as the pod object
            with self._volumes_removed:
                self._removed_uids.add(uid)
                self._volumes_removed.notify_all()
            return
        node = spec.get("nodeName")
        if not node:
            if self.bind_pods and not meta.get("deletionTimestamp") and \
                    spec.get("schedulerName", "default-scheduler") == "default-scheduler":
                self._bind(meta["namespace"], meta["name"])
            return
        if node != self.node_name:
            return
        if meta.get("deletionTimestamp"):
            self._terminate(pod, run)
            return
        phase = pod.get("status", {}).get("phase", "Pending")
        if run is None and phase == "Pending":
            self._start_pod(pod)

    def _bind(self, namespace: str, name: str) -> None:
        body = client.V1Binding(
            metadata=client.V1ObjectMeta(name=name),
            target=client.V1ObjectReference(api_version="v1", kind="Node", name=self.node_name))
        self.core.create_namespaced_pod_binding(name, namespace, body, _preload_content=False)

    # -- running --------------------------------------------------------------------------
    def _start_pod(self, pod: Obj) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        containers = spec["containers"]
        pod_dir = self.workdir / "pods" / f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"
        pod_dir.mkdir(parents=True, exist_ok=True)
        base = {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"), "HOME": str(pod_dir),
            "HOSTNAME": meta["name"], "KUBERNETES_SERVICE_HOST": NODE_IP,
            "KUBERNETES_SERVICE_PORT": str(self.api.configuration.host.rsplit(":", 1)[-1]),
        }
        account = pod_namespaces.service_account(spec)
        try:
            envs = {c["name"]: self.env_resolver.environment(
                pod, c, {**base, **self.images.get(c.get("image", ""), {})})
                for c in containers}
            token = None if account is None else pod_namespaces.token_files(
                self.core, meta["namespace"], account)
            command = container_command(containers[0], envs[containers[0]["name"]])
            with self._lock:
                self._pod_dirs[meta["uid"]] = pod_dir
            mounts = pod_volumes.mounts(containers[0], spec,
                                        pod_volumes.prepare(spec, pod_dir))
            if token is not None:
                mounts.append(pod_namespaces.token_mount(pod_dir, token))
            namespaced = token is not None or bool(mounts)
            if namespaced:
                command = pod_namespaces.wrap(command, pod_dir, meta["name"], mounts)
        except ConfigError as exc:
            self._config_wait.add(meta["uid"])
            self._patch_waiting(pod, "CreateContainerConfigError", str(exc))
            self._later(1.0, ("retry", (meta["namespace"], meta["name"])))
            return
        except pod_volumes.UnsupportedVolume as exc:
            self._config_wait.add(meta["uid"])  # no retry: the pod's spec will not change
            self._patch_waiting(pod, "CreateContainerError", str(exc))
            return
        first = containers[0]
        workdir = Path(first["workingDir"]) if first.get("workingDir") else pod_dir
        run = PodRun(
            namespace=meta["namespace"], name=meta["name"], uid=meta["uid"],
            containers=[c["name"] for c in containers], envs=envs,
            command=command,
            cwd=workdir if workdir.is_dir() else pod_dir,
            log_path=pod_dir / f"{first['name']}.log",
            restart_policy=spec.get("restartPolicy", "Always"),
            pod_dir=pod_dir, namespaced=namespaced)
        with self._lock:
            self.runs[run.uid] = run
        self._launch(run, pod)

    def _launch(self, run: PodRun, pod: Obj | None = None) -> None:
        run.started_at = now()
        env = run.envs[run.containers[0]]
        ready_r, ready_w = os.pipe() if run.namespaced else (-1, subprocess.DEVNULL)
        if run.namespaced:  # the wrapper says on its stdin when its mounts are in place
            env = {**env, pod_namespaces.READY_ENV: "1"}
        try:
            with open(run.log_path, "ab") as out:
                run.popen = subprocess.Popen(
                    run.command, env=env, cwd=run.cwd, stdin=ready_w, stdout=out,
                    stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            run.popen = None
            self._patch(run, self._terminated_status(run, 128, "StartError", str(exc)))
            self._queue.put(("exited", (run.uid, 128)))
            return
        finally:
            if run.namespaced:
                os.close(ready_w)
        popen = run.popen
        threading.Thread(target=lambda: self._queue.put(("exited", (run.uid, popen.wait()))),
                         name=f"wait-{run.name}", daemon=True).start()
        # Running only once the container's command runs with its volumes mounted, as a
        # kubelet reports it; a wrapper that failed exits, and its exit is reported instead.
        if run.namespaced and not pod_namespaces.await_ready(ready_r, CONTAINER_SETUP_S):
            return
        self._patch(run, self._running_status(run))

    def _on_exit(self, payload: tuple[str, int]) -> None:
        uid, code = payload
        run = self.runs.get(uid)
        if run is None or run.finished:
            return
        if code < 0:
            code = 128 - code  # killed by a signal: 137 for SIGKILL, 143 for SIGTERM
        if run.popen is not None:
            _kill_pgid(run.popen.pid)  # like a container: its other processes die with it
        if run.kill_timer is not None:
            run.kill_timer.cancel()
        if run.terminating:
            run.finished = True
            self._patch(run, self._terminated_status(run, code))
            self.core.delete_namespaced_pod(
                run.name, run.namespace, grace_period_seconds=0,
                body=client.V1DeleteOptions(grace_period_seconds=0,
                                            preconditions=client.V1Preconditions(uid=run.uid)),
                _preload_content=False)
            return
        restart = run.restart_policy == "Always" or (run.restart_policy == "OnFailure" and code)
        if not restart:
            run.finished = True
            self._patch(run, self._terminated_status(run, code))
            return
        run.restart_count += 1
        run.last_state = self._terminated_state(run, code)
        delay = min(self.max_backoff, 0.5 * 2 ** (run.restart_count - 1))
        self._patch(run, self._waiting_status(run, "CrashLoopBackOff",
                                              f"back-off {delay:.1f}s restarting failed container"))
        self._later(delay, ("retry-launch", run.uid))

    def _terminate(self, pod: Obj, run: PodRun | None) -> None:
        meta = pod["metadata"]
        if run is None or not run.alive():
            if run is not None:
                run.finished = True
            self.core.delete_namespaced_pod(
                meta["name"], meta["namespace"], grace_period_seconds=0,
                body=client.V1DeleteOptions(grace_period_seconds=0,
                                            preconditions=client.V1Preconditions(uid=meta["uid"])),
                _preload_content=False)
            return
        if run.terminating:
            return
        run.terminating = True
        grace = meta.get("deletionGracePeriodSeconds")
        grace = 30 if grace is None else int(grace)
        _signal_group(run, signal.SIGTERM if grace > 0 else signal.SIGKILL)
        run.kill_timer = threading.Timer(max(grace, 0), _signal_group, (run, signal.SIGKILL))
        run.kill_timer.daemon = True
        run.kill_timer.start()

    # -- status ---------------------------------------------------------------------------
    def _conditions(self, ready: bool, reason: str | None = None) -> list[Obj]:
        stamp = now()
        conditions = [{"type": "Initialized", "status": "True", "lastTransitionTime": stamp}]
        for kind in ("Ready", "ContainersReady"):
            cond: Obj = {"type": kind, "status": "True" if ready else "False",
                         "lastTransitionTime": stamp}
            if reason:
                cond["reason"] = reason
            conditions.append(cond)
        return conditions

    def _container_statuses(self, run: PodRun, first_state: Obj, ready: bool) -> list[Obj]:
        statuses = []
        for index, name in enumerate(run.containers):
            status: Obj = {
                "name": name, "image": "sim", "imageID": "sim://image",
                "containerID": f"sim://{run.uid[:8]}-{index}-{run.restart_count}",
                "ready": ready, "started": ready, "restartCount": run.restart_count,
                "state": first_state if index == 0 else {"running": {"startedAt": run.started_at}},
            }
            if index == 0 and run.last_state:
                status["lastState"] = run.last_state
            statuses.append(status)
        return statuses

    def _base_status(self) -> Obj:
        return {"hostIP": NODE_IP, "podIP": NODE_IP, "podIPs": [{"ip": NODE_IP}]}

    def _running_status(self, run: PodRun) -> Obj:
        return {**self._base_status(), "phase": "Running", "startTime": run.started_at,
                "conditions": self._conditions(True),
                "containerStatuses": self._container_statuses(
                    run, {"running": {"startedAt": run.started_at}}, True)}

    def _terminated_state(self, run: PodRun, code: int, reason: str | None = None,
                          message: str | None = None) -> Obj:
        state: Obj = {"exitCode": code, "reason": reason or ("Completed" if code == 0 else "Error"),
                      "startedAt": run.started_at, "finishedAt": now(),
                      "containerID": f"sim://{run.uid[:8]}-0-{run.restart_count}"}
        if message:
            state["message"] = message
        return {"terminated": state}

    def _terminated_status(self, run: PodRun, code: int, reason: str | None = None,
                           message: str | None = None) -> Obj:
        phase = "Succeeded" if code == 0 else "Failed"
        return {**self._base_status(), "phase": phase,
                "conditions": self._conditions(False, "PodCompleted"),
                "containerStatuses": self._container_statuses(
                    run, self._terminated_state(run, code, reason, message), False)}

    def _waiting_status(self, run: PodRun, reason: str, message: str) -> Obj:
        return {**self._base_status(), "phase": "Running",
                "conditions": self._conditions(False, "ContainersNotReady"),
                "containerStatuses": self._container_statuses(
                    run, {"waiting": {"reason": reason, "message": message}}, False)}

    def _patch_waiting(self, pod: Obj, reason: str, message: str) -> None:
        meta = pod["metadata"]
        statuses = [{"name": c["name"], "image": c.get("image", "sim"), "imageID": "",
                     "ready": False, "restartCount": 0,
                     "state": {"waiting": {"reason": reason, "message": message}}}
                    for c in pod["spec"]["containers"]]
        body = {"status": {"phase": "Pending", "hostIP": NODE_IP,
                           "conditions": self._conditions(False, "ContainersNotReady"),
                           "containerStatuses": statuses}}
        self.core.patch_namespaced_pod_status(meta["name"], meta["namespace"], body,
                                              _preload_content=False)

    def _patch(self, run: PodRun, status: Obj) -> None:
        try:
            self.core.patch_namespaced_pod_status(run.name, run.namespace, {"status": status},
                                                  _preload_content=False)
        except client.ApiException as exc:
            if exc.status != 404:
                raise

    # -- exec / logs ----------------------------------------------------------------------
    def _resolve(self, namespace: str, pod: str, container: str) -> ContainerTarget | None:
        run = self.run_for(namespace, pod)
        if run is None or container not in run.containers:
            return None
        popen = run.popen
        if run.namespaced and popen is not None:
            pid = popen.pid  # an exec joins the namespaces of the process running now
            return ContainerTarget(env=run.envs[container], cwd=run.cwd, log_path=run.log_path,
                                   running=run.alive, root=pod_namespaces.root_of(pid),
                                   enter=lambda command: pod_namespaces.enter(pid, command))
        return ContainerTarget(env=run.envs[container], cwd=run.cwd, log_path=run.log_path,
                               running=run.alive)


def _signal_group(run: PodRun, sig: signal.Signals) -> None:
    if run.popen is None or run.popen.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(run.popen.pid, sig)


def _kill_pgid(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
