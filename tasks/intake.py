"""The worker's intake of task messages: a malformed one is refused, never fatal.

Celery builds a request from a protocol 2 message by unpacking its body into ``args,
kwargs, embed``; a body that decodes but has another shape (a JSON object, a 2-element
list, a bare string) raised a ``ValueError`` Celery takes for an unrecoverable error: the
worker exited, the message went back to the queue and killed every restart. Other bad
messages (kwargs not a mapping, malformed JSON, a pickle content type, bytes that are not
UTF-8) were dropped with no result, so a sender polling the task saw PENDING for ever.

``CheckingConsumer`` (the base of the worker's consumer, tasks/redaction.py) runs
``check_message`` before every task's strategy, Celery's built-in tasks too: a body or
headers of the wrong shape raise ``MalformedMessage``. What that refuses, a body that
cannot be decoded or whose content type is not accepted, and anything else a message
makes fail while it is taken (a KeyError too, which kombu's Redis transport counts as a
lost connection) is ``refuse``d: the message is taken off the queue and, when it has a
task id, its result is a FAILURE whose ``InvalidRequest`` says what was wrong and what
shape is expected (``.get()`` raises it); without one it is logged by size, content type
and encoding. Neither shows the body: it may carry secrets.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from typing import Any

from celery import signals
from celery.exceptions import InvalidTaskError
from celery.utils.objects import Bunch
from celery.worker.consumer import Consumer
from kombu.exceptions import ContentDisallowed, DecodeError

from providers.errors import InvalidRequest

log = logging.getLogger("leasekeeper.worker")

EXPECTED = ('a task message is Celery protocol 2: headers "id" and "task", and a JSON body '
            '[args, kwargs, embed] such as [[], {"run_id": "..."}, {}] (what '
            'app.send_task(name, kwargs={...}) sends)')
MAX_ID_CHARS = 255
MAX_NAME_CHARS = 80


class MalformedMessage(InvalidTaskError):  # type: ignore[misc]
    """A task message of the wrong shape; its text says what is wrong, quoting nothing
    of the body."""


def kind(value: object) -> str:
    """What JSON value ``value`` is, as a sender would say it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a JSON boolean"
    if isinstance(value, int | float):
        return "a JSON number"
    if isinstance(value, str):
        return "a JSON string"
    if isinstance(value, list | tuple):
        return "a JSON array"
    if isinstance(value, dict):
        return "a JSON object"
    return f"a {type(value).__name__}"


def body_problem(payload: object) -> str | None:
    """What is wrong with a decoded protocol 2 body, or None when it is well formed."""
    if not isinstance(payload, list | tuple):
        return f"its body is {kind(payload)}, not Celery's [args, kwargs, embed] list"
    if len(payload) != 3:
        return (f"its body is a JSON array of {len(payload)} elements, not Celery's "
                "3-element [args, kwargs, embed]")
    args, kwargs, embed = payload
    if not isinstance(args, list | tuple):
        return f"args (the body's first element) is {kind(args)}, not a JSON array"
    if not isinstance(kwargs, dict):
        return f"kwargs (the body's second element) is {kind(kwargs)}, not a JSON object"
    if embed is not None and not isinstance(embed, dict):
        return f"embed (the body's third element) is {kind(embed)}, not a JSON object or null"
    return None


def headers_problem(headers: dict[str, Any]) -> str | None:
    """What is wrong with a protocol 2 message's headers (its body checked first), or None."""
    if task_id(headers) is None:
        return ("its headers have no task id ('id': a string of 1 to "
                f"{MAX_ID_CHARS} characters)")
    limits = headers.get("timelimit")
    if limits is not None and not (
            isinstance(limits, list | tuple) and len(limits) == 2
            and all(v is None or (isinstance(v, int | float) and not isinstance(v, bool))
                    for v in limits)):
        return "its headers' timelimit is not [hard, soft] (seconds or null each)"
    return None


def name_problem(headers: dict[str, Any]) -> str | None:
    name = headers.get("task")
    return None if isinstance(name, str) else (
        f"its task name (headers 'task') is {kind(name)}, not a string")


def check_message(message: Any) -> None:
    """Refuse a protocol 2 message of the wrong shape (``MalformedMessage``). Decoding
    it may raise kombu's ``DecodeError`` or ``ContentDisallowed``: Celery hands those to
    the consumer's ``on_decode_error`` and ``on_invalid_task``."""
    headers = message.headers
    if not isinstance(headers, dict) or "task" not in headers:
        return  # protocol 1, or no headers: Celery's own paths handle it
    payload = message.payload
    if isinstance(payload, dict) and "args" in payload:
        return  # Celery's hybrid protocol 1/2 body: Celery checks it
    problem = body_problem(payload) or headers_problem(headers)
    if problem is not None:
        raise MalformedMessage(problem)


def checked(strategy: Callable[..., Any]) -> Callable[..., Any]:
    """``strategy`` (a task's message handler), checking a protocol 2 message first."""

    def check_then_handle(message: Any, body: Any, *args: Any, **kwargs: Any) -> Any:
        if body is None:  # protocol 2: Celery decodes nothing before the strategy
            check_message(message)
        return strategy(message, body, *args, **kwargs)

    check_then_handle.checked = True  # type: ignore[attr-defined]
    return check_then_handle


def task_id(headers: object) -> str | None:
    task = headers.get("id") if isinstance(headers, dict) else None
    return task if isinstance(task, str) and 0 < len(task) <= MAX_ID_CHARS else None


def problem_of(exc: BaseException, message: Any) -> str:
    """What ``exc``, raised while the worker took ``message``, says was wrong with it,
    without the body (a DecodeError's repr quotes the bytes it could not decode)."""
    size = body_size(message)
    if isinstance(exc, MalformedMessage):
        return str(exc)
    if isinstance(exc, ContentDisallowed):
        return (f"its content type {_short(message.content_type)} is not accepted: "
                "the worker takes JSON only (application/json)")
    if isinstance(exc, DecodeError):
        cause = exc.args[0] if exc.args else None
        if isinstance(cause, UnicodeError):
            return f"its body ({size} bytes) is not valid {_short(message.content_encoding)} text"
        if "json" in str(message.content_type or ""):
            return f"its body ({size} bytes) is not valid JSON"
        return f"its body ({size} bytes) cannot be decoded as {_short(message.content_type)}"
    if isinstance(exc, InvalidTaskError):  # Celery's own checks (eta, expires, kwargs)
        return f"Celery refused it: {_short(str(exc), 160)}"
    frame = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" at {frame[0].filename.rsplit('/', 1)[-1]}:{frame[0].lineno}" if frame else ""
    return f"the worker could not take it ({type(exc).__name__}{where})"


def body_size(message: Any) -> int:
    body = message.body
    return len(body) if isinstance(body, bytes | str) else 0


def _short(value: object, limit: int = MAX_NAME_CHARS) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


def refuse(consumer: Any, message: Any, exc: BaseException) -> None:
    """Report a message the worker will not run: a FAILURE with an ``InvalidRequest``
    for its task id, or a log line by size. The caller takes it off the queue."""
    problem = problem_of(exc, message)
    headers = message.headers if isinstance(message.headers, dict) else {}
    name = headers.get("task")
    known = isinstance(name, str) and name in consumer.app.tasks
    what = (f"{body_size(message)} bytes, content type {_short(message.content_type)}, "
            f"encoding {_short(message.content_encoding)}")
    task = task_id(headers)
    lead = "Can't decode message body of" if isinstance(exc, DecodeError) else "refused"
    if task is None:
        log.error("%s a task message without a task id (%s): %s; it is dropped",
                  lead, what, problem)
        return
    error = InvalidRequest(f"invalid task message{f' for {name}' if known else ''}: "
                           f"{problem}. {EXPECTED}")
    log.error("%s task message %s (%s): %s; its result is a FAILURE (InvalidRequest)",
              lead, task, what, problem)
    request = Bunch(name=name if known else None, chord=None, root_id=headers.get("root_id"),
                    correlation_id=(message.properties or {}).get("correlation_id"),
                    reply_to=(message.properties or {}).get("reply_to"), errbacks=None)
    try:
        consumer.app.backend.mark_as_failure(task, error, request=request,
                                             call_errbacks=False)
    except Exception as stored:  # the result backend is down: the log line is what is left
        log.error("could not store the refusal of task message %s: %s", task,
                  type(stored).__name__)
    dispatcher = consumer.event_dispatcher
    if dispatcher:
        dispatcher.send("task-failed", uuid=task, exception=f"InvalidRequest({str(error)!r})")


class CheckingConsumer(Consumer):  # type: ignore[misc]
    """A consumer no message can stop: each task's strategy checks the message first
    (``checked``), and what Celery or the check refuses, or what fails while a message
    is taken, is ``refuse``d and taken off the queue. A broker's connection and channel
    errors still reach Celery (it reconnects)."""

    def update_strategies(self) -> None:
        super().update_strategies()
        for name, strategy in list(self.strategies.items()):
            if not getattr(strategy, "checked", False):
                self.strategies[name] = checked(strategy)

    def create_task_handler(self, *args: Any, **kwargs: Any) -> Callable[[Any], Any]:
        handle = super().create_task_handler(*args, **kwargs)

        def on_task_received(message: Any) -> Any:
            headers = message.headers
            problem = name_problem(headers) if isinstance(headers, dict) and (
                "task" in headers) else None
            if problem:  # Celery would look the (maybe unhashable) name up
                return self._refused(message, MalformedMessage(problem))
            try:
                return handle(message)
            except Exception as exc:
                if isinstance(exc, self._broker_errors()):
                    raise  # Celery reconnects
                return self._refused(message, exc)

        return on_task_received

    def _broker_errors(self) -> tuple[type[BaseException], ...]:
        # kombu's Redis transport counts KeyError as a connection error: one raised by a
        # message (Celery's request reads headers['id']) made Celery reconnect and take
        # the same message again, for ever.
        return tuple(e for e in (*self.connection_errors, *self.channel_errors)
                     if e is not KeyError)

    def on_invalid_task(self, body: Any, message: Any, exc: BaseException) -> None:
        self._refused(message, exc)
        signals.task_rejected.send(sender=self, message=message, exc=exc)

    def on_decode_error(self, message: Any, exc: BaseException) -> None:
        self._refused(message, exc)

    def _refused(self, message: Any, exc: BaseException) -> None:
        refuse(self, message, exc)
        if not message.acknowledged:
            message.ack_log_error(log, self.connection_errors)
