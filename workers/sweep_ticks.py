"""The sweep tick log: every beat tick of a ``sweep.*`` task, as its summary said (or as it
failed), is one row of ``sweep_ticks`` in the store, written by the worker's Celery task
signals. The metrics exporter tails it and the console shows it; no sweep code changes.

Connected when workers/app.py imports this module; a task of another app (a web project's
own, named ``sweep.*`` or not) is no tick. A failure to record is logged and never fails
the tick itself: the tick's work is done by then.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.signals import task_failure, task_success

from models.schema import TickRun
from providers.errors import LeasekeeperError

log = logging.getLogger("leasekeeper.sweep_ticks")
SWEEP_PREFIX = "sweep."
_RESERVED = {"sweep", "run", "took_ms", "items"}




def _ours(task: Any) -> bool:
    from workers.app import app
    from workers.own_signals import is_app

    return is_app(task, app)


def _record(sweep: str, run: str, took_ms: int, counts: dict[str, Any],
            items: dict[str, Any], task_id: str | None) -> None:
    from models.observe import Observe
    from workers.runtime import get_runtime

    rt = get_runtime()
    try:
        Observe(rt.store).record_tick(sweep, run, took_ms, counts, items, task_id,
                                      rt.settings.sweep_ticks_kept)
    except LeasekeeperError as exc:
        log.warning("could not record a %s tick: %s", sweep, exc)


@task_success.connect
def _tick_succeeded(sender: Any = None, result: Any = None, **_: Any) -> None:
    name = str(getattr(sender, "name", ""))
    if not name.startswith(SWEEP_PREFIX) or not isinstance(result, dict) or not _ours(sender):
        return
    counts = {k: v for k, v in result.items() if k not in _RESERVED and isinstance(v, int)}
    _record(name, str(result.get("run", TickRun.RAN)), int(result.get("took_ms", 0)), counts,
            {"items": list(result.get("items", []))[:50]},
            getattr(getattr(sender, "request", None), "id", None))


@task_failure.connect
def _tick_failed(sender: Any = None, task_id: str | None = None, exception: Any = None,
                 **_: Any) -> None:
    name = str(getattr(sender, "name", ""))
    if not name.startswith(SWEEP_PREFIX) or not _ours(sender):
        return
    _record(name, TickRun.FAILED, 0, {},
            {"items": [], "error": f"{type(exception).__name__}: {exception}"[:300]}, task_id)
