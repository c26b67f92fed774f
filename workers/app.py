"""The Celery app (``celery -A workers.app worker|beat|flower``) and its configuration.

Reliability settings: tasks are acknowledged late and requeued when a worker process
dies, so a killed worker loses nothing (every task is idempotent); time limits stay under
Redis' visibility timeout so a running task is never delivered twice; events are on so
Flower shows every lifecycle task. Redaction is worker-side (tasks/redaction.py): the log
filter goes on every handler once Celery has set logging up, in the worker and in beat.
At start the worker logs which broker it uses (password hidden) and where that came from.
The app keeps to leasekeeper's settings (never the CELERY_* variables of a web project's
own Celery app), does not become the process's current app and shares no task with other
apps (workers/own_conf.py); every signal handler here acts for this app only, never for a
web project's own worker in whose process the producer was imported (workers/own_signals.py).
Tasks are routed to lanes (workers/queues.py) so cleanup never waits behind queued acquires.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

from celery import Celery
from celery.signals import (
    after_setup_logger,
    after_setup_task_logger,
    beat_init,
    celeryd_after_setup,
    import_modules,
    worker_init,
    worker_process_init,
)

from models.shown_url import shown_url
from providers.errors import ConfigError
from workers.beat import beat_max_interval_s, beat_schedule
from workers.own_conf import LeasekeeperCelery, refusal
from workers.own_signals import is_app, is_current, setting_up_our_logs
from workers.queues import LaneRouter, task_queues
from workers.settings import Settings, get_settings

TASK_MODULES = ["tasks.acquire", "tasks.resume", "tasks.destroy", "tasks.reclaim",
                "tasks.runs", "tasks.sweeps", "tasks.finish_exited", "tasks.stuck",
                "tasks.orphans", "tasks.pool_fill", "tasks.diag"]
# A broker that accepted the connection and went quiet (frozen, failed over, a dead NAT
# path) fails a call after these, instead of after Celery's 120 s (the result backend) or
# never (kombu's transport): the producer raises BrokerUnavailable. They stay far above
# the transport's 1 s BRPOP and a result wait's 1 s polls, so an idle worker never times out.
BROKER_SOCKET_TIMEOUT_S = 10.0
BROKER_CONNECT_TIMEOUT_S = 5.0


def celery_config(settings: Settings) -> dict[str, Any]:
    broker = settings.effective_broker_url
    # "priority": a worker polls its queues in the order of task_queues (cleanup first),
    # instead of round robin; see workers/queues.py.
    transport = {"visibility_timeout": int(settings.visibility_timeout_s),
                 "queue_order_strategy": "priority",
                 "socket_timeout": BROKER_SOCKET_TIMEOUT_S,
                 "socket_connect_timeout": BROKER_CONNECT_TIMEOUT_S}
    return {
        "broker_url": broker,
        "result_backend": settings.result_backend_url or broker,
        "broker_transport_options": transport,
        "result_backend_transport_options": {"retry_policy": {"timeout": 5.0}},
        "redis_socket_timeout": BROKER_SOCKET_TIMEOUT_S,
        "redis_socket_connect_timeout": BROKER_CONNECT_TIMEOUT_S,
        "broker_connection_retry_on_startup": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "result_extended": False,
        "result_expires": max(1, int(settings.result_expires_s)),  # Redis: whole seconds
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        "task_default_queue": settings.task_queue,
        "task_queues": task_queues(settings.task_queue),
        "task_soft_time_limit": settings.task_soft_time_limit_s,
        "task_time_limit": settings.task_time_limit_s,
        "task_track_started": True,
        "task_send_sent_event": True,
        "worker_send_task_events": True,
        "worker_hijack_root_logger": False,
        # What a worker reports about a message with an unknown task name is redacted, a
        # malformed message is refused with an InvalidRequest (tasks/intake.py), and a
        # broker restart with tasks in flight does not end the worker (workers/consumer.py).
        "worker_consumer": "workers.consumer:BrokerRestartConsumer",
        "beat_schedule": beat_schedule(settings),
        # Under the var dir, not whatever directory beat was started in.
        "beat_schedule_filename": str(settings.beat_schedule_file),
        "beat_scheduler": "workers.beat:HeartbeatScheduler",
        "beat_max_loop_interval": beat_max_interval_s(settings),
        "timezone": "UTC",
        "enable_utc": True,
    }


def create_app(settings: Settings | None = None) -> Celery:
    from tasks.redaction import redact_sent_messages

    app = LeasekeeperCelery("leasekeeper", include=TASK_MODULES)
    app.conf.update(celery_config(settings or get_settings()))
    app.conf.task_routes = (LaneRouter(app.conf),)
    # Every message this app builds, sent by name too, has redacted reprs: its task-sent
    # event is what Flower shows until a worker receives it (tasks/redaction.py).
    redact_sent_messages(app)
    return app


def _started_by_celery() -> str | None:
    """The celery command this process runs (``worker``, ``beat``...), if it is celery's
    and its app (``-A``) is this one; None in any other process, a web project's own
    ``celery -A myweb.celery worker`` that imports the producer too."""
    import sys

    if Path(sys.argv[0]).name != "celery" and Path(sys.argv[0]).parent.name != "celery":
        return None
    if not _celery_loads_this_app():
        return None
    return next((arg for arg in sys.argv[1:] if arg in CELERY_COMMANDS), "celery")


def _celery_loads_this_app() -> bool:
    """celery's ``-A`` / ``--app`` / CELERY_APP (which it is importing this module for, in
    its click context) names this app; true too when celery's context is not at hand."""
    import click

    context = click.get_current_context(silent=True)
    named = context.params.get("app") if context is not None else None
    if not isinstance(named, str):
        return True
    return named.replace(":", ".") in (__name__, f"{__name__}.app")


CELERY_COMMANDS = ("worker", "beat", "flower", "events", "inspect", "control", "status",
                   "purge", "call", "result", "shell", "multi")


def _app_or_exit() -> Celery:
    """The app; under celery's own command, a setting that is invalid ends the process in one
    line (exit 2), as the preflight's refusals do, not in Celery's "Unable to load celery
    application" traceback with the message on its last line."""
    try:
        return create_app()
    except ConfigError as exc:
        process = _started_by_celery()
        if process is None:
            raise  # an importer (a web backend, the CLI) gets the error itself
        import sys

        print(f"leasekeeper {process} not started: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


app = _app_or_exit()


@import_modules.connect(sender=app)
def _refuse_a_celery_broker_that_differs(**_: Any) -> None:
    # A worker or beat of this app whose CELERY_* broker or backend variable names another
    # than leasekeeper's (workers/own_conf.py): exit 2 in one line, before its banner. Sent
    # by Celery's loader when the worker or beat imports its task modules.
    process = _started_by_celery()
    problem = refusal(get_settings()) if process in ("worker", "beat") else None
    if problem:
        import sys

        print(f"leasekeeper {process} not started: {problem}", file=sys.stderr)
        raise SystemExit(2)


@after_setup_logger.connect
@after_setup_task_logger.connect
def _set_up_logs(logger: logging.Logger, **_: Any) -> None:
    if not setting_up_our_logs():
        return  # another app's logging (a web project's own worker): not ours to change
    # JSON lines, task ids, the rotating file (workers/logs.py); then redaction on every
    # handler that results (tasks/redaction.py), so no handler escapes it.
    import sys

    from tasks.redaction import install_filter
    from workers.logs import adopt_handlers

    process = "beat" if "beat" in sys.argv else "worker"
    adopt_handlers(logger, process, get_settings())
    install_filter(logger)
    # The var dir holds beat's schedule file (opened right after logging is set up). If
    # it cannot be made, the process using it reports that itself, naming the path.
    with contextlib.suppress(OSError):
        get_settings().var_dir.mkdir(parents=True, exist_ok=True)


@celeryd_after_setup.connect
def _say_which_broker(instance: Any = None, **_: Any) -> None:
    if not is_app(instance, app):
        return
    settings = get_settings()
    # At WARNING, so it shows at the default log level too: a worker looping on an
    # unreachable broker must say which one and why that one.
    logging.getLogger("leasekeeper.worker").warning(
        "leasekeeper worker: broker %s (from %s), queue %s, store %s",
        shown_url(settings.effective_broker_url), settings.broker_source(),
        settings.task_queue, shown_url(settings.effective_store_url))


@worker_init.connect
@beat_init.connect
def _warn_unknown_settings(sender: Any = None, **_: Any) -> None:
    if not is_app(sender, app):
        return
    from workers.settings import warn_unknown_variables

    warn_unknown_variables()


# A store with no schema, or an older one, or (the worker's) one that refuses writes: exit
# (code 2) saying what to do, instead of failing every task and sweep (workers/preflight.py).
# A broker that refuses the password: exit (code 2) naming the setting, instead of
# retrying for ever (workers/preflight.py).
@worker_init.connect
def _worker_refuses_a_broker_password_refused(sender: Any = None, **_: Any) -> None:
    if not is_app(sender, app):
        return
    from workers.preflight import refuse_a_broker_that_refuses_us

    refuse_a_broker_that_refuses_us("worker")


@beat_init.connect
def _beat_reads_no_results(sender: Any = None, **_: Any) -> None:
    if not is_app(sender, app):
        return
    # Beat sends the sweeps and never reads a result; Celery's Redis backend subscribes
    # the sender to each task's result channel anyway, and while Redis is away it logged
    # CRITICAL "Retry limit exceeded while trying to reconnect to the Celery result store
    # backend. The Celery application must be restarted." for each tick (it need not be).
    backend = app.backend
    backend.on_task_call = lambda producer, task_id: None


@beat_init.connect
def _beat_refuses_a_broker_password_refused(sender: Any = None, **_: Any) -> None:
    if not is_app(sender, app):
        return
    from workers.preflight import refuse_a_broker_that_refuses_us

    refuse_a_broker_that_refuses_us("beat")


@worker_init.connect
def _worker_refuses_a_store_unfit_to_start(sender: Any = None, **_: Any) -> None:
    if not is_app(sender, app):
        return
    from workers.preflight import refuse_a_store_unfit_to_start

    refuse_a_store_unfit_to_start("worker", writes=True)


@beat_init.connect
def _beat_refuses_a_store_unfit_to_start(sender: Any = None, **_: Any) -> None:
    if not is_app(sender, app):
        return
    from workers.preflight import refuse_a_store_unfit_to_start

    refuse_a_store_unfit_to_start("beat", writes=False)  # beat only sends tasks


@worker_init.connect
def _import_providers_before_fork(sender: Any = None, **_: Any) -> None:
    if not is_app(sender, app):
        return
    # In the worker's main process, before the pool forks: see PROVIDER_MODULES.
    from workers.runtime import import_provider_modules

    import_provider_modules(get_settings())


@worker_init.connect
def _cheap_result_reprs(sender: Any = None, **_: Any) -> None:
    if not is_app(sender, app):
        return
    # Before the pool forks, so every pool process renders results the cheap way when
    # that gives saferepr's text (workers/result_repr.py).
    from workers.result_repr import install

    install()


@worker_process_init.connect
def _fresh_runtime_after_fork(**_: Any) -> None:
    if not is_current(app):
        return
    # A prefork child must not reuse the parent's database connections.
    from workers.runtime import set_runtime

    set_runtime(None)


import workers.sweep_ticks  # noqa: E402, F401  (connects the sweep tick log's task signals)
