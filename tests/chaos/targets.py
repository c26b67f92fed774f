"""What the chaos proof needs to know about the provider under attack, so one proof runs
against any of them (``LocalTarget`` here; ``KubeTarget`` in kube_target.py):

- ``env``: the settings its workers need (enabled providers, credentials, ...);
- ``runs``: how many runs the driver plays against it;
- ``spec(i)``: the acquire spec of run ``i`` (which provider, which command);
- ``provider_faults()`` / ``clear_faults()``: attack the provider seam (the ``faulty``
  provider's plan here; the fault-injecting API proxy for Kubernetes), and
  ``faults_injected()``: how many of each fault actually fired, to print;
- ``real_resources()``: what really exists, listed independently of leasekeeper's own
  ``list_managed`` (processes and workspaces here; objects by label on a cluster), as
  {provider: {resource name: alive}};
- ``check_harness()``: whatever the target runs beside the workers (a cluster's simulators)
  survived the attack and still works; raises if not.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from providers.faulty import FaultPlan
from providers.local import MARKER

# Faults at the provider seam, consumed as calls happen: acquires that fail after the
# sandbox exists (transient: retried and adopted; terminal: cleaned up), that kill the
# worker process before or after creating it, destroys that fail (some leases end
# abandoned at the cap) or kill the worker after destroying, and failing listings.
LOCAL_FAULT_PLAN: dict[str, list[dict[str, Any]]] = {
    "acquire": [{"fault": "transient", "when": "after", "times": 6},
                {"fault": "terminal", "when": "after", "times": 4},
                {"fault": "kill_worker", "when": "after", "times": 3},
                {"fault": "kill_worker", "when": "before", "times": 2}],
    "destroy": [{"fault": "terminal", "when": "before", "times": 14},
                {"fault": "transient", "when": "before", "times": 6},
                {"fault": "kill_worker", "when": "after", "times": 2}],
    "resume_check": [{"fault": "transient", "when": "before", "times": 3}],
    "list_managed": [{"fault": "transient", "when": "before", "times": 4}],
    # claims of warm pool members: retried after the delivery, the worker killed after it
    # (a redelivery or sweep.stuck_provisioning finishes or cleans up), one that fails
    "claim": [{"fault": "transient", "when": "after", "times": 3},
              {"fault": "kill_worker", "when": "after", "times": 2},
              {"fault": "terminal", "when": "before", "times": 1}],
}
# A warm pool on the fault-injecting provider, filled and claimed during the attack.
CHAOS_POOL = {"name": "chaos", "provider": "faulty", "size": 4, "max_size": 6,
              "fill_batch_size": 3, "max_age_s": 20}
POOL_RUNS = (1, 3, 5)  # runs i with i % 8 among these claim from the pool (odd: faulty)


class ChaosTarget(Protocol):
    name: str
    runs: int

    @property
    def env(self) -> dict[str, str]: ...

    def spec(self, i: int) -> dict[str, Any]: ...

    def provider_faults(self) -> None: ...

    def clear_faults(self) -> None: ...

    def faults_injected(self) -> dict[str, int]: ...

    def real_resources(self) -> dict[str, dict[str, bool]]: ...

    def check_harness(self) -> None: ...


@dataclass
class LocalTarget:
    """The local provider, half of it through the fault-injecting ``faulty`` provider, with
    a warm pool on that one (some runs claim from it)."""

    root: Path  # the installation's LEASEKEEPER_LOCAL_ROOT_DIR
    faults_file: Path
    runs: int = 240
    name: str = "local"

    @property
    def env(self) -> dict[str, str]:
        return {"LEASEKEEPER_PROVIDERS": "local,faulty", "LEASEKEEPER_PROVIDER": "local",
                "LEASEKEEPER_POOLS": json.dumps([CHAOS_POOL]),
                "LEASEKEEPER_POOL_BREAKER_BACKOFF_S": "2"}

    def spec(self, i: int) -> dict[str, Any]:
        if i % 8 in POOL_RUNS:
            return {"pool": CHAOS_POOL["name"]}
        return {"provider": "faulty" if i % 2 else "local"}

    def provider_faults(self) -> None:
        FaultPlan(self.faults_file).write(LOCAL_FAULT_PLAN)

    def clear_faults(self) -> None:
        FaultPlan(self.faults_file).write({})

    def faults_injected(self) -> dict[str, int]:
        """Faults taken from the plan so far, as "<operation> <fault> <when>": count."""
        if not self.faults_file.exists():
            return {}
        with open(self.faults_file) as handle:
            fcntl.flock(handle, fcntl.LOCK_SH)  # the workers rewrite it under LOCK_EX
            plan = json.loads(handle.read() or "{}")
        taken: Counter[str] = Counter()
        for operation, rules in plan.items():
            for rule in rules:
                taken[f"{operation} {rule['fault']} {rule.get('when', 'before')}"] += \
                    rule.get("taken", 0)
        return dict(taken)

    def check_harness(self) -> None:
        """Nothing runs beside the workers for the local provider."""

    def real_resources(self) -> dict[str, dict[str, bool]]:
        """Workspaces on disk and processes carrying a workspace marker, by provider."""
        roots = {"local": self.root, "faulty": self.root / "faulty"}
        found: dict[str, dict[str, bool]] = {name: {} for name in roots}
        for provider, root in roots.items():
            if root.is_dir():
                for path in root.iterdir():
                    if path.is_dir() and path.name.startswith("lk-"):
                        found[provider][path.name] = False
        for _pid, workspace in _marked_processes():
            for provider, root in roots.items():
                if workspace.parent == root:
                    found[provider][workspace.name] = True
        return found


def _marked_processes() -> list[tuple[int, Path]]:
    """Every live process with a sandbox workspace marker (read straight from /proc)."""
    found = []
    prefix = f"{MARKER}=".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state in ("Z", "X"):
            continue
        for var in environ.split(b"\0"):
            if var.startswith(prefix):
                found.append((int(entry.name), Path(os.fsdecode(var[len(prefix):]))))
    return found
