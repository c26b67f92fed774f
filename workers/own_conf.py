"""leasekeeper's Celery app keeps to leasekeeper's settings, in a process that has its own.

Two things in Celery 5.x (celery/app/utils.py, celery/app/base.py) let a web project's
own Celery set-up and leasekeeper's app, in one process, interfere:

- Celery's ``Settings.broker_url``, ``broker_read_url``, ``broker_write_url`` and
  ``result_backend`` read ``CELERY_BROKER_URL``, ``CELERY_BROKER_READ_URL``,
  ``CELERY_BROKER_WRITE_URL`` and ``CELERY_RESULT_BACKEND`` from os.environ before the
  app's own configuration. Those variables belong to the user's own Celery app (a Django
  project exports them): leasekeeper's conf is an ``OwnSettings``, whose four properties
  read the configuration only, and the variables stay in os.environ for the user's app.
- ``Celery(...)`` makes itself the process's current app by default, so a project's
  ``@shared_task`` and ``celery.current_app`` went to leasekeeper's broker and queue once
  the producer was imported: ``LeasekeeperCelery`` is created with
  ``set_as_current=False``. leasekeeper's tasks are bound to it alone (``@app.task``
  with ``shared=False``: Celery's default adds a task to every app in the process, and
  the user's own worker listed ``lease.acquire``...); Celery's worker makes its app
  current itself.

``celery --broker X`` sets CELERY_BROKER_URL, which leasekeeper now ignores: a worker or
beat started with a CELERY_* broker or backend that differs from leasekeeper's refuses to
start (``refusal``, on the ``import_modules`` signal of leasekeeper's app: a web project's
own worker, whose code imports the producer, is not refused) instead of running on a
broker it was not asked for.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery
from celery.app.utils import Settings as CelerySettings

from models.shown_url import shown_url
from workers.settings import Settings


class OwnSettings(CelerySettings):  # type: ignore[misc]  # celery is untyped
    """Celery's settings without the os.environ overrides of the broker and backend URLs."""

    @property
    def broker_url(self) -> Any:
        return self.first("broker_url", "broker_host")

    @property
    def broker_read_url(self) -> Any:
        return self.get("broker_read_url") or self.broker_url

    @property
    def broker_write_url(self) -> Any:
        return self.get("broker_write_url") or self.broker_url

    @property
    def result_backend(self) -> Any:
        return self.first("result_backend", "CELERY_RESULT_BACKEND")


def _own(conf: CelerySettings) -> OwnSettings:
    # The very object Celery made (and swaps the loaded configuration into: app.conf may
    # be referenced already), given the subclass: same slots, only the four properties differ.
    # Through object.__setattr__: a Settings stores attributes set on it as settings.
    object.__setattr__(conf, "__class__", OwnSettings)
    return conf  # type: ignore[no-any-return]


class LeasekeeperCelery(Celery):  # type: ignore[misc]  # celery is untyped
    """A Celery app that never becomes the process's current app on creation, whose conf
    is an OwnSettings, before and after Celery loads the configuration, whose tasks are its
    own (never shared with other apps) and whose logging set-up is marked as its own
    (workers/own_signals.py)."""

    log_cls = "workers.own_signals:OwnLogging"

    def __init__(self, main: str, **kwargs: Any) -> None:
        super().__init__(main, set_as_current=False, **kwargs)
        _own(self._conf)

    def task(self, *args: Any, **opts: Any) -> Any:
        # Celery's default shared=True adds a task to every app in the process when that
        # app is finalized: a web project's own worker listed (and would run) lease.*.
        opts.setdefault("shared", False)
        return super().task(*args, **opts)

    def _load_config(self) -> OwnSettings:
        return _own(super()._load_config())


# leasekeeper's setting for each CELERY_* variable Celery would have read, and what it sets.
CELERY_URL_VARIABLES = (("CELERY_BROKER_URL", "broker"),
                        ("CELERY_BROKER_READ_URL", "broker"),
                        ("CELERY_BROKER_WRITE_URL", "broker"),
                        ("CELERY_RESULT_BACKEND", "result backend"))


def refusal(settings: Settings) -> str | None:
    """Why a worker or beat must not start, if a CELERY_* URL variable in its environment
    (one of the user's own app's, or `celery --broker`'s) names another broker or result
    backend than leasekeeper's: it would look as if it ran there, and it does not."""
    broker = settings.effective_broker_url
    for variable, what in CELERY_URL_VARIABLES:
        value = os.environ.get(variable)
        if what == "broker":
            ours, setting, source = broker, "LEASEKEEPER_BROKER_URL", settings.broker_source()
        else:
            ours = settings.result_backend_url or broker
            setting = "LEASEKEEPER_RESULT_BACKEND_URL"
            source = setting if settings.result_backend_url else settings.broker_source()
        if value and value != ours:
            return (f"{variable} is {shown_url(value)} but leasekeeper's {what} is "
                    f"{shown_url(ours)} (from {source}); leasekeeper ignores the "
                    "CELERY_* variables (they are for your own Celery app; `celery --broker` "
                    f"sets CELERY_BROKER_URL): set {setting} instead, and unset {variable} "
                    "for this process")
    return None
