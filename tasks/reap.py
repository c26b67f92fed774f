"""Every sweep by its task name, and running them all once: ``leasekeeper reap``.

The beat schedule (workers/beat.py) names the same sweeps; a test keeps the two lists
equal. ``reap_once`` runs each sweep in this process, in order, as a beat tick would (with
its lock, its claims and its follow-up tasks sent to the workers), or, with ``dry_run``,
only decides and reports what each would do now, changing nothing.
"""

from __future__ import annotations

from tasks.finish_exited import finish_exited
from tasks.orphans import orphans
from tasks.pool_fill import fill_pools
from tasks.stuck import stuck_provisioning
from tasks.sweeping import CeleryEffects, Effects, Summary, SweepBody, SweepContext, run_sweep
from tasks.sweeps import expire_leases, reap_runs, retry_cleanup
from workers.runtime import Runtime

# In the order `leasekeeper reap` runs them: runs first (they free sandboxes), then the
# leases, then cleanup, then the reconciliations against the providers, then the warm
# pools' refill (after everything that frees room in them).
SWEEPS: dict[str, SweepBody] = {
    "sweep.finish_exited": finish_exited,
    "sweep.reap_runs": reap_runs,
    "sweep.expire_leases": expire_leases,
    "sweep.stuck_provisioning": stuck_provisioning,
    "sweep.retry_cleanup": retry_cleanup,
    "sweep.orphans": orphans,
    "sweep.fill_pools": fill_pools,
}


def reap_once(rt: Runtime, dry_run: bool, only: list[str] | None = None,
              effects: Effects | None = None) -> list[Summary]:
    return [run_sweep(name, body, SweepContext(rt, effects or CeleryEffects(), dry_run))
            for name, body in SWEEPS.items() if not only or name in only]
