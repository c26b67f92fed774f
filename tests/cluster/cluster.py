"""Owns the real test cluster: etcd, kube-apiserver (HTTPS, static tokens, AlwaysAllow or RBAC)
and kube-controller-manager (Job controller, garbage collector, ...) on free loopback ports in a
temporary directory, plus kubeconfigs for the admin and for any bearer token.

`KubeCluster` starts and stops exactly its own three processes; `ExternalCluster` wraps a
kubeconfig of a cluster started elsewhere with the same access interface.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import ssl
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Literal

import yaml
from kubernetes import client

from tests.cluster.certs import CertPair, make_ca, make_rsa_key, make_server_cert
from tests.cluster.kubeconfig import api_client_from_kubeconfig, write_kubeconfig
from tests.cluster.procs import ManagedProcess, free_port, wait_until

AuthorizationMode = Literal["AlwaysAllow", "RBAC"]
ADMIN_USER = "leasekeeper-admin"


class ClusterAccess:
    """What tests need to reach a cluster: URL, CA, admin kubeconfig and token, clients."""

    api_url: str
    ca_file: Path | None
    kubeconfig_path: Path
    admin_token: str | None
    workdir: Path

    def api_client(self) -> client.ApiClient:
        """A new admin ``ApiClient``."""
        return api_client_from_kubeconfig(self.kubeconfig_path)

    def kubeconfig_for_token(self, token: str, name: str = "user", namespace: str = "default",
                             server: str | None = None) -> Path:
        """Write a kubeconfig that authenticates with the bearer ``token``; returns its path."""
        path = self.workdir / "kubeconfigs" / f"{name}-{secrets.token_hex(4)}.yaml"
        return write_kubeconfig(path, server or self.api_url, token, self.ca_file, name, namespace)

    def api_client_for_token(self, token: str) -> client.ApiClient:
        return api_client_from_kubeconfig(self.kubeconfig_for_token(token))

    def service_account_token(self, namespace: str, name: str, expiration_seconds: int = 3600,
                              create: bool = True) -> str:
        """A bound token (TokenRequest API) for ServiceAccount ``namespace/name``.

        With ``create`` the namespace and the ServiceAccount are created when missing.
        """
        with self.api_client() as api:
            core = client.CoreV1Api(api)
            if create:
                _create_ignoring_conflict(lambda: core.create_namespace(
                    client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace))))
                _create_ignoring_conflict(lambda: core.create_namespaced_service_account(
                    namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=name))))
            request = client.AuthenticationV1TokenRequest(
                spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=expiration_seconds))
            result = core.create_namespaced_service_account_token(name, namespace, request)
            assert result.status is not None
            return str(result.status.token)

    def kubeconfig_for_service_account(self, namespace: str, name: str,
                                       create: bool = True) -> Path:
        token = self.service_account_token(namespace, name, create=create)
        return self.kubeconfig_for_token(token, name=f"sa-{namespace}-{name}", namespace=namespace)


def _create_ignoring_conflict(create: Callable[[], object]) -> None:
    try:
        create()
    except client.ApiException as exc:
        if exc.status != 409:
            raise


class KubeCluster(ClusterAccess):
    """A real etcd + kube-apiserver + kube-controller-manager on loopback (context manager).

    ``static_users`` maps extra user names to their groups; each gets a random token in the
    API server's token file (``token_for(user)``), so RBAC tests can use non-admin identities.
    The admin user is in ``system:masters``.
    """

    def __init__(
        self,
        bin_dir: Path | str,
        *,
        authorization_mode: AuthorizationMode = "AlwaysAllow",
        static_users: Mapping[str, Sequence[str]] | None = None,
        workdir: Path | str | None = None,
        keep_workdir: bool = False,
        etcd_binary: str | None = None,
        start_controller_manager: bool = True,
        service_account_admission: bool = False,
        extra_apiserver_args: Sequence[str] = (),
        startup_timeout: float = 90.0,
        before_controllers: Callable[[client.ApiClient], None] | None = None,
    ) -> None:
        self.bin_dir = Path(bin_dir)
        self.authorization_mode = authorization_mode
        self.static_users = {ADMIN_USER: ["system:masters"], **{
            user: list(groups) for user, groups in (static_users or {}).items()}}
        self._tokens = {user: secrets.token_hex(16) for user in self.static_users}
        self.admin_token = self._tokens[ADMIN_USER]
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="lk-kube-"))
        self.keep_workdir = keep_workdir
        self.etcd_binary = etcd_binary or shutil.which("etcd") or "/usr/bin/etcd"
        self.start_controller_manager = start_controller_manager
        self.service_account_admission = service_account_admission
        self.extra_apiserver_args = list(extra_apiserver_args)
        self.startup_timeout = startup_timeout
        # Runs once the API server is up, before the controller manager starts: the garbage
        # collector only notices resource types that appear later on its 30 s rediscovery,
        # so CRDs installed here are collected (Foreground deletes finish) from the start.
        self.before_controllers = before_controllers
        self.processes: list[ManagedProcess] = []
        self.api_port = 0
        self.etcd_port = 0
        self.api_url = ""
        self.kubeconfig_path = self.workdir / "admin.kubeconfig"
        self.ca: CertPair | None = None
        self.ca_file = None
        self._started = False

    # -- public ---------------------------------------------------------------------------
    def token_for(self, user: str) -> str:
        """The static token of ``user`` (one of ``static_users``, or the admin)."""
        return self._tokens[user]

    def kubeconfig_for_user(self, user: str) -> Path:
        return self.kubeconfig_for_token(self._tokens[user], name=user)

    @contextlib.contextmanager
    def frozen_controllers(self) -> Iterator[None]:
        """The controller manager stopped (SIGSTOP) inside the block, resumed after it: no
        Job controller and no garbage collector meanwhile, as in a cluster whose GC is stuck.
        It runs with --leader-elect=false, so it picks up where it left off."""
        manager = next(p for p in self.processes if p.name == "kube-controller-manager")
        manager.pause()
        try:
            yield
        finally:
            manager.resume()

    def start(self) -> KubeCluster:
        if self._started:
            return self
        self._started = True
        try:
            self._prepare_files()
            self._start_with_port_retries()
            if self.before_controllers is not None:
                with self.api_client() as api:
                    self.before_controllers(api)
            if self.start_controller_manager:
                self._start_controller_manager()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Terminate exactly the processes this cluster started (newest first)."""
        for proc in reversed(self.processes):
            proc.stop()
        self.processes.clear()
        if self._own_workdir and not self.keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> KubeCluster:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # -- startup --------------------------------------------------------------------------
    def _prepare_files(self) -> None:
        for binary in ("kube-apiserver", "kube-controller-manager"):
            if not (self.bin_dir / binary).is_file():
                raise FileNotFoundError(
                    f"{self.bin_dir / binary} missing: run tests/cluster/build.sh")
        if not Path(self.etcd_binary).is_file():
            raise FileNotFoundError(
                f"etcd not found ({self.etcd_binary}): apt-get install etcd-server")
        pki = self.workdir / "pki"
        self.ca = make_ca(pki)
        self.ca_file = self.ca.cert
        self.serving = make_server_cert(self.ca, pki, "apiserver")
        self.sa_key = make_rsa_key(pki / "sa.key")
        lines = [f'{self._tokens[user]},{user},uid-{user},"{",".join(groups)}"'
                 for user, groups in self.static_users.items()]
        self.token_file = self.workdir / "tokens.csv"
        self.token_file.write_text("\n".join(lines) + "\n")

    def _start_with_port_retries(self, attempts: int = 3) -> None:
        for attempt in range(attempts):
            try:
                self._start_etcd(attempt)
                self._start_apiserver(attempt)
                return
            except RuntimeError as exc:
                in_use = "address already in use" in str(exc)
                for proc in reversed(self.processes):
                    proc.stop()
                self.processes.clear()
                if not in_use or attempt == attempts - 1:
                    raise

    def _start_etcd(self, attempt: int) -> None:
        self.etcd_port, peer = free_port(), free_port()
        data = self.workdir / f"etcd-data-{attempt}"
        url, peer_url = f"http://127.0.0.1:{self.etcd_port}", f"http://127.0.0.1:{peer}"
        proc = ManagedProcess("etcd", [
            self.etcd_binary, "--name", "default", "--data-dir", str(data),
            "--listen-client-urls", url, "--advertise-client-urls", url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"default={peer_url}",
        ], self.workdir / "etcd.log")
        self.processes.append(proc)
        wait_until(lambda: _http_ok(f"{url}/health"), self.startup_timeout, "etcd health",
                   failed=lambda: _exited(proc))

    def _start_apiserver(self, attempt: int) -> None:
        self.api_port = free_port()
        self.api_url = f"https://127.0.0.1:{self.api_port}"
        args = [
            str(self.bin_dir / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
            f"--secure-port={self.api_port}", "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--cert-dir={self.workdir / f'apiserver-certs-{attempt}'}",
            f"--tls-cert-file={self.serving.cert}", f"--tls-private-key-file={self.serving.key}",
            f"--token-auth-file={self.token_file}",
            f"--authorization-mode={self.authorization_mode}",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={self.sa_key}",
            f"--service-account-signing-key-file={self.sa_key}",
            "--service-cluster-ip-range=10.0.0.0/24",
            "--kubelet-preferred-address-types=InternalIP",
            "--allow-privileged=true", "--profiling=false",
        ]
        if not self.service_account_admission:
            args.append("--disable-admission-plugins=ServiceAccount")
        args += self.extra_apiserver_args
        proc = ManagedProcess("kube-apiserver", args, self.workdir / "kube-apiserver.log")
        self.processes.append(proc)
        wait_until(self._apiserver_ready, self.startup_timeout, "kube-apiserver /readyz",
                   failed=lambda: _exited(proc))
        write_kubeconfig(self.kubeconfig_path, self.api_url, self._tokens[ADMIN_USER],
                         self.ca_file, ADMIN_USER)

    def _start_controller_manager(self) -> None:
        assert self.ca_file is not None
        proc = ManagedProcess("kube-controller-manager", [
            str(self.bin_dir / "kube-controller-manager"),
            f"--kubeconfig={self.kubeconfig_path}", "--secure-port=0", "--port=0",
            "--leader-elect=false", "--controllers=*,-nodelifecycle",
            f"--service-account-private-key-file={self.sa_key}",
            f"--root-ca-file={self.ca_file}", "--profiling=false",
        ], self.workdir / "kube-controller-manager.log")
        self.processes.append(proc)
        # The serviceaccount controller creating "default" proves the controllers run.
        wait_until(self._default_service_account_exists, self.startup_timeout,
                   "kube-controller-manager (default ServiceAccount)", interval=0.2,
                   failed=lambda: _exited(proc))

    def _ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))

    def _get(self, path: str) -> tuple[int, bytes]:
        request = urllib.request.Request(
            self.api_url + path, headers={"Authorization": f"Bearer {self.admin_token}"})
        try:
            with urllib.request.urlopen(request, timeout=5, context=self._ssl_context()) as resp:
                return int(resp.status), resp.read()
        except urllib.error.HTTPError as exc:
            return int(exc.code), exc.read()
        except (OSError, ssl.SSLError):
            return 0, b""

    def _apiserver_ready(self) -> bool:
        return self._get("/readyz")[0] == 200

    def _default_service_account_exists(self) -> bool:
        return self._get("/api/v1/namespaces/default/serviceaccounts/default")[0] == 200


class ExternalCluster(ClusterAccess):
    """A cluster started elsewhere, reached through its kubeconfig (nothing is started)."""

    def __init__(self, kubeconfig_path: Path | str, workdir: Path | str | None = None) -> None:
        self.kubeconfig_path = Path(kubeconfig_path)
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="lk-ext-"))
        doc = yaml.safe_load(self.kubeconfig_path.read_text())
        context_name = doc.get("current-context")
        context = next(c["context"] for c in doc["contexts"] if c["name"] == context_name)
        cluster = next(c["cluster"] for c in doc["clusters"] if c["name"] == context["cluster"])
        user = next(u["user"] for u in doc["users"] if u["name"] == context["user"])
        self.api_url = str(cluster["server"])
        self.admin_token = user.get("token")
        self.ca_file = None
        if "certificate-authority" in cluster:
            self.ca_file = Path(cluster["certificate-authority"])
        elif "certificate-authority-data" in cluster:
            import base64

            self.ca_file = self.workdir / "ca.crt"
            self.ca_file.write_bytes(base64.b64decode(cluster["certificate-authority-data"]))

    def stop(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            body = json.loads(resp.read() or b"{}")
            return bool(resp.status == 200 and body.get("health") in ("true", True))
    except (OSError, ValueError):
        return False


def _exited(proc: ManagedProcess) -> str | None:
    if proc.alive():
        return None
    return f"{proc.name} exited with {proc.popen.returncode}; log tail:\n{proc.log_tail()}"
