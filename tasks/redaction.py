"""Worker-side redaction: no client, however it sends a task, can make a secret show.

A plain ``celery`` client sends its own ``argsrepr``/``kwargsrepr`` (Celery's default is
the full repr of the arguments, secrets included), and the worker publishes those in its
task events (Flower), ``celery inspect`` answers and log lines. So the worker rebuilds them:

- ``RedactingRequest`` (every leasekeeper task's ``Request`` class) replaces the client's
  reprs with bounded reprs of the arguments with every ``secret_env`` value as ``***``
  (by field, and wherever else the message repeats it), and a ``HIDDEN_FIELDS`` field
  (``run.finish``'s error) as its length, before the task-received event, the logs or
  ``inspect`` see them;
- ``RedactingConsumer`` (the worker's consumer) hands Celery a redacted copy of a message
  whose task name is unknown, so the body and headers Celery logs about it are redacted
  by field, and the name it echoes is cut short; an invalid or undecodable message is
  refused without its body (tasks/intake.py);
- ``redact_sent_messages`` (on leasekeeper's app, workers/app.py: in every process)
  builds the reprs of every task message that process sends, by name too
  (``app.send_task``): the task-sent event (Flower shows it until a worker's task-received
  event replaces it, and for ever when no worker knows the name) never carries a secret;
- ``RedactingFilter`` (on the worker's and beat's log handlers) rewrites every log record:
  text that looks like a ``secret_env`` mapping in any repr or JSON, as Celery logs the
  whole body of a message for an unknown task name (by value-scan), and any secret value
  this process has seen in a message (by value). Every record is cut to a bounded size.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

from celery.utils.saferepr import saferepr
from celery.worker.request import Request

from providers.spec import (
    MIN_SUBSTRING_SECRET_CHARS,
    REDACTED,
    hide_in_text,
    hide_secret_values,
)
from tasks.intake import CheckingConsumer
from tasks.text import storable

SECRET_FIELDS = frozenset({"secret_env"})  # the field a valid spec carries secrets in
REPR_MAX_CHARS = 1024  # what Flower, events and logs show of a task's arguments
SMALL_BODY_BYTES = 16 * 1024  # a message body this small has its reprs built the quick way
LOG_MAX_CHARS = 4000  # one log message (its traceback is cut separately)
TRACEBACK_MAX_CHARS = 16000
# Free-text fields of a task never shown in a repr, only their length: run.finish's error
# quotes whatever the run printed, and lease.destroy's reason whatever its caller wrote,
# secrets of a run this process never saw included (the stored text is scrubbed by the
# secret marks, tasks/secret_marks.py, which a repr built in the worker's main process
# must not wait for). Field name -> position when positional.
HIDDEN_FIELDS: dict[str, dict[str, int]] = {"run.finish": {"error": 3},
                                            "lease.destroy": {"reason": 1}}
_KNOWN_MAX = 1024


@functools.lru_cache(maxsize=1024)
def _secret_name(name: str) -> bool:
    return "secret" in _SEPARATORS.sub("", name.lower())


_SEPARATORS = re.compile(r"[^a-z0-9]")


def is_secret_field(key: object) -> bool:
    """``secret_env``, and any other key whose name says "secret" in any case, with any
    separator (``secretEnv``, ``Secret-Env``): a payload that misspells the field is
    refused, but its values must not show while it is reported."""
    return key in SECRET_FIELDS or (isinstance(key, str) and _secret_name(key))


def redact(value: Any) -> Any:
    """A copy of task arguments with every secret value replaced by ``***``: under a
    secret field, and wherever else in ``value`` it is repeated (``hide_secret_values``)."""
    return _redacted(value)[0]


def _redacted(value: Any) -> tuple[Any, list[str]]:
    """``redact(value)``, and the secret values it found (one walk when there are none)."""
    found: list[str] = []
    shown = _redact(value, found)
    return (hide_secret_values(shown, found) if found else shown), found


def _redact(value: Any, found: list[str]) -> Any:
    if isinstance(value, dict):
        out: dict[Any, Any] = {}
        for k, v in value.items():
            if is_secret_field(k):
                found.extend(_strings(v))
                out[k] = dict.fromkeys(map(str, v), REDACTED) if isinstance(v, dict) else REDACTED
            else:
                out[k] = _redact(v, found)
        return out
    if isinstance(value, list | tuple):
        return [_redact(v, found) for v in value]
    return value


def secret_values(value: Any) -> list[str]:
    """Every string found under a secret field (``is_secret_field``), at any depth."""
    found: list[str] = []
    if isinstance(value, dict):
        for k, v in value.items():
            if is_secret_field(k):
                found.extend(_strings(v))
            else:
                found.extend(secret_values(v))
    elif isinstance(value, list | tuple):
        for v in value:
            found.extend(secret_values(v))
    return found


def _strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)


def bounded_repr(value: Any, small: bool = True) -> str:
    """The redacted repr, at most about REPR_MAX_CHARS long (``_bounded``)."""
    return _bounded(redact(value), small)


def _bounded(redacted: Any, small: bool = True) -> str:
    """For a ``small`` value (every ordinary message) plain ``repr`` when that is short:
    ~15x cheaper than saferepr, and this runs for every message in the producer and in
    the worker; else saferepr, which cuts each long part without building the whole text."""
    if small:
        text = repr(redacted)
        if len(text) <= REPR_MAX_CHARS:
            return text
    return str(saferepr(redacted, maxlen=REPR_MAX_CHARS))


def _placeholder(field: str, value: object) -> str:
    return (f"<{field}: {len(value)} chars>" if isinstance(value, str)
            else f"<{field}: {type(value).__name__}>")


def hide_fields(name: object, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """``args`` and ``kwargs`` of task ``name`` with its HIDDEN_FIELDS as placeholders
    (``'<error: 212 chars>'``); unchanged (the same objects) for every other task."""
    hidden = HIDDEN_FIELDS.get(name) if isinstance(name, str) else None
    if not hidden:
        return args, kwargs
    if isinstance(args, list | tuple):
        at = {position: field for field, position in hidden.items()}
        args = [_placeholder(at[i], a) if i in at and a is not None else a
                for i, a in enumerate(args)]
    if isinstance(kwargs, dict):
        kwargs = {k: _placeholder(k, v) if k in hidden and v is not None else v
                  for k, v in kwargs.items()}
    return args, kwargs


class Shown(NamedTuple):  # a NamedTuple: built for every message, cheaper than a dataclass
    """What events, logs and ``inspect`` may show of a task message's arguments."""

    argsrepr: str
    kwargsrepr: str
    secrets: list[str]  # the secret values found in them (to remember)


def shown_reprs(name: object, args: Any, kwargs: Any, small: bool = True) -> Shown:
    """Bounded reprs of a message's arguments: hidden fields as placeholders, secrets
    redacted (a secret in the kwargs repeated in the args too: one payload)."""
    if name in HIDDEN_FIELDS:
        args, kwargs = hide_fields(name, args, kwargs)
    (shown_args, shown_kwargs), found = _redacted([args, kwargs])
    return Shown(_bounded(shown_args, small), _bounded(shown_kwargs, small), found)


def bounded(text: str, limit: int = LOG_MAX_CHARS) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text) - limit} more characters cut]"


# -- value-scan: secrets seen by this process ------------------------------------------
_known: OrderedDict[str, None] = OrderedDict()
_known_lock = threading.Lock()


def remember(values: Iterable[str]) -> None:
    """Keep the most recent secret values this process handled, to scrub them from text:
    each as given and as :func:`tasks.text.storable` writes it (what a text cleaned of
    control characters holds of it)."""
    with _known_lock:
        for given in values:
            for value in dict.fromkeys((given, storable(given))):
                if len(value) >= MIN_SUBSTRING_SECRET_CHARS:
                    _known[value] = None
                    _known.move_to_end(value)
        while len(_known) > _KNOWN_MAX:
            _known.popitem(last=False)


# -- value-scan: secret_env mappings in free text ------------------------------------------
# A key that says "secret" in any case, as is_secret_field takes it, then `:` or `=`:
# `'secret_env': `, `"secretEnv": `, `\"Secret-Env\": ` (JSON in a string), `SECRET_ENV=`.
# A quoted key may hold spaces; a bare one is one word (so prose such as "secret marks:
# ..." or a path such as "secret_env.TOKEN: ..." is not a key). (is_secret_field also
# takes separators inside the word, "s-e-c-r-e-t": looking for those in every log line
# would cost ~35x the plain search below, for a spelling no client sends.)
_WORD = "secret"
_FIELD = re.compile(
    rf"""(?:\\*['"][^'"\\\n]{{0,64}}?{_WORD}[^'"\\\n]{{0,64}}?\\*['"]"""  # a quoted key
    rf"""|(?<![\w-])[\w-]{{0,64}}?{_WORD}[\w-]{{0,64}}?)\s*([:=])\s*""",  # a bare key
    re.IGNORECASE)
# After `key: `, what a dumped value starts with (a mapping, a list, a tuple, a quoted or
# bytes string). Prose does not: "unknown provider 'vault-secret-store': this ..." or
# "env 'SECRET_X': holds a secret_env value ..." is a message to keep, not a field. After
# `key=` anything is a value (`SECRET_ENV=abc`, an environment dump).
_VALUE = re.compile(r"""b?\\*['"]|[{\[(]""")
# What the field-based redaction already wrote: `{'NAME': '***', ...}` (or JSON quotes).
_Q = r"""\\?['"]"""
_ALREADY = re.compile(rf"\{{(\s*{_Q}[A-Za-z0-9_]*{_Q}:\s*{_Q}\*\*\*{_Q},?)*\s*\}}|{_Q}\*\*\*{_Q}")


def scrub_text(text: str) -> str:
    """``text`` with every ``secret_env`` value and every known secret value redacted.

    A ``secret_env`` value not already in the redacted shape is cut from there to the end
    of its line: reprs of reprs of JSON nest escapes too deeply to find where a value ends
    for sure, and a debug dump losing its tail is better than a secret shown.
    """
    if _WORD in text.lower():
        out: list[str] = []
        pos = 0
        for match in _FIELD.finditer(text):
            if match.start() < pos:
                continue
            if match.group(1) == ":" and not _VALUE.match(text, match.end()):
                continue  # prose naming a key, not a dumped field
            out.append(text[pos:match.end()])
            done = _ALREADY.match(text, match.end())
            if done:
                out.append(done.group(0))
                pos = done.end()
            else:
                line_end = text.find("\n", match.end())
                pos = len(text) if line_end < 0 else line_end
                out.append(f"'{REDACTED}' [rest of line withheld]")
        out.append(text[pos:])
        text = "".join(out)
    with _known_lock:
        known = [v for v in _known if v in text]
    return hide_in_text(text, known) if known else text


def scrub_exception(exc: BaseException) -> None:
    """Scrub known secret values from an exception's arguments, in place (its type stays,
    so Flower, the result backend and the log show the same error, minus the secret), and
    from every exception it was raised from or during: the traceback Celery stores and
    sends shows the whole chain."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if current.args and any(isinstance(a, str) for a in current.args):
            current.args = tuple(scrub_text(a) if isinstance(a, str) else a
                                 for a in current.args)
        current = current.__cause__ or current.__context__


class RedactingRequest(Request):  # type: ignore[misc]
    """A task request whose reprs (events, logs, ``inspect``) never carry a secret."""

    def __init__(self, message: Any, **options: Any) -> None:
        super().__init__(message, **options)
        # whoever sent it: a big body never has its whole repr built
        small = len(message.body or b"") <= SMALL_BODY_BYTES
        shown = shown_reprs(self.name, self._args, self._kwargs, small)
        remember(shown.secrets)
        self._argsrepr, self._kwargsrepr = shown.argsrepr, shown.kwargsrepr
        self._request_dict["argsrepr"] = self._argsrepr
        self._request_dict["kwargsrepr"] = self._kwargsrepr

    def info(self, safe: bool = False) -> dict[str, Any]:
        info: dict[str, Any] = super().info(safe=True)  # never the raw arguments
        return info


def redact_sent_messages(app: Any) -> None:
    """Every task message ``app`` builds gets redacted ``argsrepr``/``kwargsrepr`` (they go
    in its headers and its task-sent event): built here when the sender gave none (Celery
    would write the full repr), scrubbed when it gave its own. Idempotent."""
    amqp = app.amqp
    create = amqp.create_task_message
    if getattr(create, "redacting", False):
        return

    def create_redacted(task_id: Any, name: Any, args: Any = None, kwargs: Any = None,
                        *more: Any, argsrepr: str | None = None,
                        kwargsrepr: str | None = None, **options: Any) -> Any:
        if name in HIDDEN_FIELDS:  # the sender's own reprs may show those: never used
            argsrepr = kwargsrepr = None
        if argsrepr is None or kwargsrepr is None:
            shown = shown_reprs(name, list(args or ()), dict(kwargs or {}))
            argsrepr = shown.argsrepr if argsrepr is None else _scrubbed(argsrepr)
            kwargsrepr = shown.kwargsrepr if kwargsrepr is None else _scrubbed(kwargsrepr)
        else:
            argsrepr, kwargsrepr = _scrubbed(argsrepr), _scrubbed(kwargsrepr)
        return create(task_id, name, args, kwargs, *more, argsrepr=argsrepr,
                      kwargsrepr=kwargsrepr, **options)

    create_redacted.redacting = True  # type: ignore[attr-defined]
    amqp.create_task_message = create_redacted


def _scrubbed(own_repr: str) -> str:
    return bounded(scrub_text(own_repr), REPR_MAX_CHARS)


@contextlib.contextmanager
def _redacted_message(message: Any) -> Iterator[None]:
    """While Celery reports the message, its body and headers are redacted copies."""
    body, headers = message.body, message.headers
    # A reporting path must never fail, whatever the message holds: broad excepts here.
    try:
        args, kwargs, embed = message.decode()
        args, kwargs = hide_fields((headers or {}).get("task"), args, kwargs)
        message.body = json.dumps(redact([args, kwargs, embed])).encode()
        built = shown_reprs(None, args, kwargs)
        reprs = {"argsrepr": built.argsrepr, "kwargsrepr": built.kwargsrepr}
    except Exception:  # not the JSON task protocol: say only how big it was
        message.body = f"<{len(body or b'')} bytes, not shown>".encode()
        reprs = {"argsrepr": "?", "kwargsrepr": "?"}
    try:
        shown = redact(dict(headers or {}))
    except Exception:
        shown = {}
    message.headers = {**shown, **reprs, "task": bounded(str(shown.get("task")), 200)}
    try:
        yield
    finally:
        message.body, message.headers = body, headers


class RedactingConsumer(CheckingConsumer):
    """The worker's consumer: what it reports about a message it cannot run shows no
    secret. An invalid or undecodable message is refused without its body (its task
    fails with an InvalidRequest: tasks/intake.py); Celery's report of one with an unknown
    task name or of an unknown format shows a redacted copy."""

    def on_unknown_message(self, body: Any, message: Any) -> None:
        with _redacted_message(message):
            super().on_unknown_message(None, message)

    def on_unknown_task(self, body: Any, message: Any, exc: BaseException) -> None:
        with _redacted_message(message):
            name = str(exc.args[0]) if exc.args else str(exc)  # KeyError(name), cut short
            super().on_unknown_task(None, message, KeyError(bounded(name, 200)))


class RedactingFilter(logging.Filter):
    """Rewrites every record: secrets redacted, message and traceback bounded."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a record whose args do not fit its format: show the format
            message = str(record.msg)
        record.msg, record.args = bounded(scrub_text(message)), None
        data = getattr(record, "data", None)  # Celery's structured copy of the log args
        if isinstance(data, dict):
            record.data = {k: bounded(scrub_text(v)) if isinstance(v, str) else v
                           for k, v in data.items()}
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = bounded(scrub_text(record.exc_text), TRACEBACK_MAX_CHARS)
            record.exc_info = None
        return True


def install_filter(logger: logging.Logger) -> None:
    """Put the filter on every handler of ``logger`` (records from child loggers reach
    handlers without passing the parent's own filters)."""
    for handler in logger.handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
