"""leasekeeper's Celery signal handlers act for leasekeeper's app only.

Celery's signals are process-wide: a web project's own Celery worker, whose code imports
leasekeeper's producer, sends ``worker_init``, ``celeryd_after_setup``,
``after_setup_logger``... too, and a handler connected without a filter ran for it: the
user's worker was refused over leasekeeper's store or broker, logged "leasekeeper worker:
broker ...", and had its logging set up by leasekeeper. What each signal's sender is in
Celery 5.x, and so how each handler (workers/app.py, workers/sweep_ticks.py) knows the
signal is about leasekeeper's app:

- ``worker_init``: the WorkController; ``beat_init``: beat's Service; both have ``.app``.
- ``celeryd_after_setup``: the worker's hostname, with ``instance=`` the worker (``.app``).
- ``import_modules``: the app itself (connected with ``sender=app``).
- ``worker_process_init``: the hostname (or None); the pool process has made the worker's
  app the current app by then (celery/concurrency/prefork.py, celery/app/trace.py).
- ``task_success`` / ``task_failure``: the task, whose ``.app`` is its app.
- ``after_setup_logger`` / ``after_setup_task_logger``: None, and no app anywhere: they are
  sent from inside ``app.log``'s set-up, so leasekeeper's app has an ``OwnLogging`` as its
  ``app.log`` (``log_cls``) that marks the set-up it runs, and ``setting_up_our_logs`` says so.
"""

from __future__ import annotations

import contextvars
from typing import Any

from celery.app.log import Logging

_OUR_LOG_SETUP: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "leasekeeper_log_setup", default=False)


def is_app(candidate: Any, app: Any) -> bool:
    """``candidate`` (a worker, beat's service, a task) belongs to ``app``."""
    return candidate is not None and getattr(candidate, "app", None) is app


def is_current(app: Any) -> bool:
    """``app`` is this process's current Celery app (what a pool process runs)."""
    from celery import current_app

    return current_app._get_current_object() is app  # type: ignore[no-any-return]


def setting_up_our_logs() -> bool:
    """An ``after_setup_logger`` / ``after_setup_task_logger`` now is leasekeeper's app's."""
    return _OUR_LOG_SETUP.get()


class OwnLogging(Logging):  # type: ignore[misc]  # celery is untyped
    """``app.log`` of leasekeeper's app: Celery's, its set-up marked as leasekeeper's."""

    def setup_logging_subsystem(self, *args: Any, **kwargs: Any) -> Any:
        token = _OUR_LOG_SETUP.set(True)
        try:
            return super().setup_logging_subsystem(*args, **kwargs)
        finally:
            _OUR_LOG_SETUP.reset(token)

    def setup_task_loggers(self, *args: Any, **kwargs: Any) -> Any:
        token = _OUR_LOG_SETUP.set(True)
        try:
            return super().setup_task_loggers(*args, **kwargs)
        finally:
            _OUR_LOG_SETUP.reset(token)
