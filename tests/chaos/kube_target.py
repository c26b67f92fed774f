"""The Kubernetes target of the chaos proof: workers on the ``kubernetes`` provider reach the
real API server of tests/cluster through its fault-injecting proxy, in a namespace and
installation of their own; pods run as local processes of the kubelet simulator and
Sandboxes are reconciled by the in-process controller simulator (both outside the workers,
so the attack, which kills workers, leaves them alone; ``check_harness`` proves they still
work afterwards).

- ``spec(i)``: backends alternate in blocks of three runs (a period of six, so each of the
  driver's eight scenarios meets both); Jobs run commands that outlive the driver's
  follow-up or exit by themselves with various codes (``sweep.finish_exited``'s work);
  the runs the local target sends to its pool (``POOL_RUNS``) claim from a warm pool of
  the run's backend instead (``KUBE_POOLS``: one per backend, their members waiting for
  their run's data, drained by age during the attack);
- ``provider_faults()``: until ``clear_faults()``, a share of the workers' creates,
  deletes, reads, lists and watches is answered 500 or 429, has its connection dropped, or
  is held: briefly (slow answers) or beyond the workers' request timeout, so the client
  gives up on a request the API server then carries out (a lost response); and a share of
  the claims' execs (the delivery of a run's data) is answered 500 or dropped;
- ``real_resources()``: Sandboxes, Jobs, Pods and Secrets carrying the installation's label,
  listed with the admin client (not through the proxy, not through ``list_managed``), by
  workload name; a Secret or pod whose workload is gone is a resource of its own.
"""

from __future__ import annotations

import functools
import json
import random
import secrets
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client

from providers.kubernetes.manifests import (
    LABEL_WORKLOAD,
    SANDBOX_GROUP,
    SANDBOX_PLURAL,
    installation_selector,
)
from tests.chaos.targets import POOL_RUNS
from tests.cluster.fault_proxy import Action, FaultProxy, Rule
from tests.cluster.k8s_json import read_json
from tests.cluster.waits import condition_is, gone, wait_for_object

Obj = dict[str, Any]
BACKENDS = ("sandbox-cr", "job")
# A Job's command, by run (a period of five: every scenario meets every command).
JOB_COMMANDS: tuple[list[str], ...] = (
    ["sh", "-c", "sleep 120"],  # outlives the driver: finished, destroyed or expired by it
    ["sh", "-c", "sleep 1; exit 0"],  # completes by itself: finish_exited → completed
    ["sh", "-c", "sleep 2; exit 4"],  # fails by itself: finish_exited → failed
    ["sh", "-c", "exit 42"],  # fails at once, maybe before its acquire returns
    ["sh", "-c", "sleep 6; exit 1"],  # fails after the driver's follow-up
)
# A warm pool per backend, filled and claimed during the attack. Members wait for their run's
# data (README "Warm pools on Kubernetes"), then outlive the driver's follow-up.
WAITING_MEMBER = ["sh", "-c", 'while [ ! -e "$LEASEKEEPER_RUN_DIR/claimed" ]; do sleep 0.2; '
                  'done; set -a; . "$LEASEKEEPER_RUN_DIR/env"; set +a; exec sleep 120']
KUBE_POOLS = {backend: {"name": f"chaos-{backend.split('-')[0]}", "provider": "kubernetes",
                        "backend": backend, "size": 3, "max_size": 4, "fill_batch_size": 2,
                        "max_age_s": 20, "template": {"command": WAITING_MEMBER}}
              for backend in ("sandbox-cr", "job")}
# The workers give up on a request after this; HELD answers come later still.
REQUEST_TIMEOUT_S = 4
HELD_S = REQUEST_TIMEOUT_S + 2.0
SLOW_S = 1.5

_KINDS = "sandboxes|jobs|secrets|pods"
_OBJECT = rf"/(?:{_KINDS})/[^/]+$"  # one object: read, delete
_COLLECTION = rf"/(?:{_KINDS})$"  # create (POST), list and watch (GET)
_EXEC = r"/pods/[^/]+/exec$"  # a claim's delivery (a WebSocket upgrade: a GET)
_WATCH = r"(?i)(?:^|&)watch=(?:true|1)"
_NOT_WATCH = r"(?i)^(?!.*(?:^|&)watch=(?:true|1))"


@dataclass
class Sporadic(Rule):
    """A proxy rule that fires on a share (``chance``) of its matches, until disabled.
    ``matches`` runs under the proxy's lock, so the shared generator needs no lock."""

    chance: float = 0.05
    rng: random.Random = field(default_factory=random.Random)
    enabled: bool = True

    def matches(self, method: str, path: str, query: str) -> bool:
        return (self.enabled and super().matches(method, path, query)
                and self.rng.random() < self.chance)


# (label, method, path, query, action, code, delay, chance). Rules are tried in order; each
# draws on its own, so the shares below are per rule.
FAULTS: tuple[tuple[str, str, str, str | None, Action, int, float, float], ...] = (
    ("create 500", "POST", _COLLECTION, None, "status", 500, 0.0, 0.05),
    ("create 429", "POST", _COLLECTION, None, "status", 429, 0.0, 0.04),
    ("create dropped", "POST", _COLLECTION, None, "drop", 0, 0.0, 0.04),
    ("create answer lost", "POST", _COLLECTION, None, "delay", 0, HELD_S, 0.03),
    ("delete 500", "DELETE", _OBJECT, None, "status", 500, 0.0, 0.05),
    ("delete 429", "DELETE", _OBJECT, None, "status", 429, 0.0, 0.04),
    ("delete dropped", "DELETE", _OBJECT, None, "drop", 0, 0.0, 0.03),
    ("delete answer lost", "DELETE", _OBJECT, None, "delay", 0, HELD_S, 0.02),
    ("read 500", "GET", _OBJECT, None, "status", 500, 0.0, 0.04),
    ("read dropped", "GET", _OBJECT, None, "drop", 0, 0.0, 0.03),
    ("read slow", "GET", _OBJECT, None, "delay", 0, SLOW_S, 0.05),
    ("list 500", "GET", _COLLECTION, _NOT_WATCH, "status", 500, 0.0, 0.04),
    ("list 429", "GET", _COLLECTION, _NOT_WATCH, "status", 429, 0.0, 0.04),
    ("list dropped", "GET", _COLLECTION, _NOT_WATCH, "drop", 0, 0.0, 0.03),
    ("list slow", "GET", _COLLECTION, _NOT_WATCH, "delay", 0, SLOW_S, 0.04),
    ("watch dropped", "GET", _COLLECTION, _WATCH, "drop", 0, 0.0, 0.08),
    ("exec 500", "GET", _EXEC, None, "status", 500, 0.0, 0.12),
    ("exec dropped", "GET", _EXEC, None, "drop", 0, 0.0, 0.08),
)


@dataclass
class KubeTarget:
    """The ``kubernetes`` provider in ``namespace`` under ``installation``, through ``proxy``;
    ``admin`` talks to the API server directly."""

    proxy: FaultProxy
    admin: client.ApiClient
    namespace: str
    installation: str = field(default_factory=lambda: f"chaos-{secrets.token_hex(3)}")
    runs: int = 96
    name: str = "kubernetes"
    seed: int | None = None
    rules: dict[str, Sporadic] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        return {
            "LEASEKEEPER_PROVIDERS": "kubernetes",
            "LEASEKEEPER_PROVIDER": "kubernetes",
            "LEASEKEEPER_KUBE_CONFIG_PATH": str(self.proxy.kubeconfig_path),
            "LEASEKEEPER_KUBE_NAMESPACE": self.namespace,
            "LEASEKEEPER_INSTALLATION_ID": self.installation,
            "LEASEKEEPER_KUBE_REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S),
            "LEASEKEEPER_POOLS": json.dumps(list(KUBE_POOLS.values())),
            "LEASEKEEPER_POOL_BREAKER_BACKOFF_S": "2",
        }

    def spec(self, i: int) -> dict[str, Any]:
        backend = BACKENDS[(i // 3) % 2]
        if i % 8 in POOL_RUNS:
            return {"pool": KUBE_POOLS[backend]["name"]}
        if backend == "job":
            return {"backend": backend, "command": JOB_COMMANDS[i % len(JOB_COMMANDS)]}
        return {"backend": backend}

    # -- faults ---------------------------------------------------------------------------
    def provider_faults(self) -> None:
        rng = random.Random(self.seed)
        for label, method, path, query, action, code, delay, chance in FAULTS:
            rule = Sporadic(method, path, action, code, delay=delay, times=None, query=query,
                            retry_after=1 if code == 429 else None, chance=chance, rng=rng)
            self.rules[label] = rule
            self.proxy.add_rule(rule)

    def clear_faults(self) -> None:
        for rule in self.rules.values():
            rule.enabled = False
        self.proxy.clear_rules()

    def faults_injected(self) -> dict[str, int]:
        return {label: rule.hits for label, rule in self.rules.items()}

    # -- what really exists ---------------------------------------------------------------
    def _lists(self) -> Iterator[tuple[str, Obj]]:
        """(kind, object) for every Sandbox, Job, Pod and Secret with our label."""
        selector = installation_selector(self.installation)
        custom, batch = client.CustomObjectsApi(self.admin), client.BatchV1Api(self.admin)
        core = client.CoreV1Api(self.admin)
        calls: dict[str, Callable[..., Any]] = {
            "sandbox": functools.partial(custom.list_namespaced_custom_object, SANDBOX_GROUP,
                                         "v1alpha1", self.namespace, SANDBOX_PLURAL),
            "job": functools.partial(batch.list_namespaced_job, self.namespace),
            "pod": functools.partial(core.list_namespaced_pod, self.namespace),
            "secret": functools.partial(core.list_namespaced_secret, self.namespace),
        }
        for kind, call in calls.items():
            listed = read_json(call(label_selector=selector, _preload_content=False,
                                    _request_timeout=30))
            for obj in listed.get("items") or []:
                yield kind, obj

    def real_resources(self) -> dict[str, dict[str, bool]]:
        """{"kubernetes": {workload name: alive}}. Alive: the workload exists, is not being
        deleted, and one of its pods still runs (or is about to). Secrets and pods are
        counted under their workload's name, so one left without its workload is a
        resource too (never alive: nothing of ours will use it)."""
        workloads: dict[str, Obj] = {}
        running: set[str] = set()
        others: set[str] = set()
        for kind, obj in self._lists():
            meta = obj["metadata"]
            owner = (meta.get("labels") or {}).get(LABEL_WORKLOAD) or meta["name"]
            if kind in ("sandbox", "job"):
                workloads[owner] = obj
            elif kind == "pod" and not meta.get("deletionTimestamp") and (
                    obj.get("status") or {}).get("phase", "Pending") in ("Pending", "Running"):
                running.add(owner)
            others.add(owner)
        found = {name: name in running and not obj["metadata"].get("deletionTimestamp")
                 for name, obj in workloads.items()}
        for name in others - workloads.keys():
            found[name] = False
        return {self.name: found}

    # -- the harness ----------------------------------------------------------------------
    def check_harness(self, timeout_s: float = 60.0) -> None:
        """The kubelet and Sandbox controller simulators still work: a Sandbox created here
        (outside the installation) becomes Ready on a running pod, then goes, pod and all."""
        custom = client.CustomObjectsApi(self.admin)
        name = f"probe-{secrets.token_hex(3)}"
        template = {"metadata": {"labels": {"chaos-probe": name}},
                    "spec": {"containers": [{"name": "probe", "image": "busybox:1.36",
                                             "command": ["sleep", "600"]}]}}
        custom.create_namespaced_custom_object(
            SANDBOX_GROUP, "v1alpha1", self.namespace, SANDBOX_PLURAL,
            {"apiVersion": f"{SANDBOX_GROUP}/v1alpha1", "kind": "Sandbox",
             "metadata": {"name": name}, "spec": {"podTemplate": template}},
            _preload_content=False)
        sandboxes = functools.partial(custom.list_namespaced_custom_object, SANDBOX_GROUP,
                                      "v1alpha1", self.namespace, SANDBOX_PLURAL)
        wait_for_object(sandboxes, name, condition_is("Ready"), timeout_s, f"probe {name}")
        custom.delete_namespaced_custom_object(
            SANDBOX_GROUP, "v1alpha1", self.namespace, SANDBOX_PLURAL, name,
            body=client.V1DeleteOptions(propagation_policy="Foreground"),
            _preload_content=False)
        wait_for_object(sandboxes, name, gone, timeout_s, f"probe {name} deleted")
        core = client.CoreV1Api(self.admin)
        wait_for_object(functools.partial(core.list_namespaced_pod, self.namespace), name,
                        gone, timeout_s, f"probe pod {name} deleted")


def fault_summary(injected: dict[str, int]) -> dict[str, int]:
    """Hits by fault, busiest first, zeros left out."""
    return dict(Counter({k: v for k, v in injected.items() if v}).most_common())

