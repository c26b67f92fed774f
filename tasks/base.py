"""What every lifecycle task shares: secret redaction and the retry policy.

Retry policy (the README has it as a table): errors in ``providers.errors.TRANSIENT_ERRORS``
are retried with exponential backoff and full jitter (Celery's own backoff function),
capped at ``retry_backoff_max_s``, at most ``task_max_retries`` times; anything else fails
at once with its reason. Secrets in task arguments never reach Flower, events or logs:
``apply_async`` (also used by ``retry``) always sends redacted ``argsrepr``/``kwargsrepr``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

from celery import Task
from celery.exceptions import Retry
from celery.utils.time import get_exponential_backoff_interval

from providers.errors import LeasekeeperError, is_transient
from providers.spec import REDACTED
from workers.runtime import Runtime, get_runtime

log = logging.getLogger("leasekeeper.tasks")
SECRET_FIELDS = frozenset({"secret_env"})


def redact(value: Any) -> Any:
    """A copy of task arguments with every secret value replaced by ``***``."""
    if isinstance(value, dict):
        return {
            k: (dict.fromkeys(v, REDACTED) if k in SECRET_FIELDS and isinstance(v, dict)
                else REDACTED if k in SECRET_FIELDS else redact(v))
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [redact(v) for v in value]
    return value


class LeaseTask(Task):  # type: ignore[misc]
    """Base class of every leasekeeper task."""

    abstract = True
    typing = True

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        options.setdefault("argsrepr", repr(redact(list(args or ()))))
        options.setdefault("kwargsrepr", repr(redact(dict(kwargs or {}))))
        return super().apply_async(args, kwargs, **options)

    @property
    def runtime(self) -> Runtime:
        return get_runtime()

    @property
    def may_retry(self) -> bool:
        return bool(self.request.retries < self.runtime.settings.task_max_retries)

    def backoff_s(self) -> float:
        settings = self.runtime.settings
        # Celery's function works in whole units: use milliseconds for sub-second bases.
        millis: int = get_exponential_backoff_interval(
            factor=round(settings.retry_backoff_base_s * 1000), retries=self.request.retries,
            maximum=round(settings.retry_backoff_max_s * 1000), full_jitter=True,
        )
        return millis / 1000.0

    @contextlib.contextmanager
    def retrying(
        self, before_retry: Callable[[float], None] | None = None
    ) -> Iterator[None]:
        """Retry transient errors with backoff while retries last; re-raise the rest.

        ``before_retry(countdown_s)`` runs before the retry is scheduled (best effort: the
        store may be the thing that is down).
        """
        try:
            yield
        except Retry:
            raise
        except Exception as exc:
            if is_transient(exc) and self.may_retry:
                countdown = self.backoff_s()
                if before_retry is not None:
                    with contextlib.suppress(LeasekeeperError):
                        before_retry(countdown)
                log.warning("%s[%s] transient failure, retry %d in %.1fs: %s", self.name,
                            self.request.id, self.request.retries + 1, countdown, exc)
                raise self.retry(exc=exc, countdown=countdown) from None
            raise
