"""What every lifecycle task shares: the payload contract, secret redaction, the retry policy.

Payload contract, checked before a task's body runs (so before any lookup): keyword
arguments only, no missing or unknown ones, every ``lease_id``/``run_id`` in the id format,
the whole payload at most ``max_payload_bytes``. A refusal is ``InvalidRequest`` naming the
field, quoting at most a short prefix of what was sent.

Retry policy (the README has it as a table): errors in ``providers.errors.TRANSIENT_ERRORS``
are retried with exponential backoff and equal jitter (``retry_backoff_s``: between half
the step and the step, so no run of retries waits next to nothing), the step capped at
``retry_backoff_max_s``, at most ``task_max_retries`` times; anything else fails
at once with its reason. Secrets in task arguments never reach Flower, events or logs:
every message leasekeeper's app builds (``apply_async``, ``retry``, and ``send_task`` by
name: workers/app.py) carries redacted ``argsrepr``/``kwargsrepr`` (its task-sent event
too), and the worker redacts whatever a client sent (tasks/redaction.py).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import random
from collections.abc import Callable, Iterator
from typing import Any

from celery import Task
from celery.exceptions import Retry

from providers.errors import (
    InvalidRequest,
    LeasekeeperError,
    is_transient,
)
from providers.spec import check_id, echo
from tasks.redaction import (
    RedactingRequest,
    redact,
    remember,
    scrub_exception,
    secret_values,
)
from workers.runtime import Runtime, get_runtime

log = logging.getLogger("leasekeeper.tasks")
ID_FIELDS = frozenset({"lease_id", "run_id"})
__all__ = ["LeaseTask", "check_payload", "redact"]


@functools.lru_cache(maxsize=64)
def _parameters(run: Callable[..., Any]) -> tuple[tuple[str, ...], frozenset[str]]:
    """A task's keyword parameters, and the required ones among them (read once per
    task: every message is checked)."""
    params = inspect.signature(run).parameters
    return tuple(params), frozenset(p.name for p in params.values()
                                    if p.default is inspect.Parameter.empty)


SMALL_PAYLOADS = "send ids and small specs"
# What a sender does about a payload over the limit, where that is not "send less".
OVER_THE_LIMIT = {
    "run.finish": "the run is not finished: cut its error before sending, ending it in "
                  "'... [N characters; the rest cut before sending]' (N: the whole error's "
                  "length), as producer.finish_run does, and send it again",
}


def check_payload(name: str, run: Callable[..., Any], args: tuple[Any, ...],
                  kwargs: dict[str, Any], max_bytes: int) -> None:
    """Refuse a payload the task cannot take, before anything is looked up."""
    if args:
        raise InvalidRequest(
            f"invalid {name} payload: {len(args)} positional argument(s); send keyword "
            f"arguments only, e.g. send_task({name!r}, kwargs={{...}}) (see the README)"
        )
    size = len(json.dumps(kwargs, default=str).encode())
    if size > max_bytes:
        raise InvalidRequest(
            f"invalid {name} payload: {size} bytes, over the {max_bytes}-byte limit "
            f"(LEASEKEEPER_MAX_PAYLOAD_BYTES); {OVER_THE_LIMIT.get(name, SMALL_PAYLOADS)}"
        )
    params, required = _parameters(run)
    unknown = [k for k in kwargs if k not in params]
    missing = [p for p in params if p in required and p not in kwargs]
    if unknown or missing:
        problems = ([f"missing field(s) {', '.join(missing)}"] if missing else []) + (
            [f"unknown field(s) {', '.join(echo(k) for k in unknown[:5])}"] if unknown else [])
        raise InvalidRequest(f"invalid {name} payload: {'; '.join(problems)} (it takes "
                             f"{', '.join(params) or 'no arguments'})")
    for field in ID_FIELDS & kwargs.keys():
        try:
            check_id(field, kwargs[field])
        except ValueError as exc:
            raise InvalidRequest(f"invalid {name} payload: {exc}") from None


def retry_backoff_s(retries: int, base_s: float, max_s: float,
                    draw: Callable[[], float] = random.random) -> float:
    """The wait before retry ``retries + 1``: the step ``base_s * 2**retries`` (at most
    ``max_s``), with equal jitter: between half the step and the step (``draw`` in [0, 1]).
    Full jitter (0 to the step) lets every retry of a run wait next to nothing, so a
    store restart of a few seconds would outlast them all; this keeps the total at least
    half the steps' sum (31 s for five retries at the defaults, 2 s doubling)."""
    step = min(max_s, base_s * 2.0 ** min(retries, 64))
    return step / 2 + step / 2 * draw()


class LeaseTask(Task):  # type: ignore[misc]
    """Base class of every leasekeeper task."""

    abstract = True
    typing = True
    Request = RedactingRequest  # the worker's reprs of every message: secrets redacted

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        remember(secret_values(kwargs))
        try:
            check_payload(self.name, self.run, args, kwargs,
                          self.runtime.settings.max_payload_bytes)
            return super().__call__(*args, **kwargs)
        except Retry:
            raise
        except Exception as exc:
            scrub_exception(exc)  # value-scan: a secret echoed by anything below
            raise

    @property
    def runtime(self) -> Runtime:
        return get_runtime()

    @property
    def may_retry(self) -> bool:
        return bool(self.request.retries < self.runtime.settings.task_max_retries)

    def backoff_s(self) -> float:
        settings = self.runtime.settings
        return retry_backoff_s(self.request.retries, settings.retry_backoff_base_s,
                               settings.retry_backoff_max_s)

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
                # max_retries: the setting, not the task's attribute (Celery's default, 3),
                # which Task.retry would otherwise enforce under may_retry's check.
                raise self.retry(exc=exc, countdown=countdown,
                                 max_retries=self.runtime.settings.task_max_retries) from None
            if is_transient(exc) and isinstance(exc, LeasekeeperError):
                final = exc.given_up(self.request.retries)  # says it gave up, not "will retry"
                if final is not exc:
                    raise final from None
            raise
