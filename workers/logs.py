"""Log lines of the worker, beat and the CLI: plain text (the default) or, with
``LEASEKEEPER_LOG_FORMAT=json``, one JSON object a line; and, with ``LEASEKEEPER_LOG_FILE``,
a size-rotated log file instead of stderr (`leasekeeper up` sets it for its worker and
beat, under ``.var/logs``).

A JSON line carries ``ts`` (UTC), ``level``, ``logger``, ``process`` (worker, beat, cli),
``message``, and, on every line logged while a task runs, ``task_id``, ``task_name`` and
the task's ``lease_id`` / ``run_id`` / ``provider`` when it has one (code may also pass them
with ``extra=``). Only those ids are taken from a task's arguments, never anything else,
so a secret in a spec cannot reach a log line this way.

Celery configures its own loggers first; ``after_setup_logger`` and
``after_setup_task_logger`` (connected in workers/app.py) call :func:`adopt_handlers`.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from workers.settings import Settings

CONTEXT_FIELDS = ("lease_id", "run_id", "task_id", "task_name", "provider")
ID_MAX = 128


class TaskContext(logging.Filter):
    """Adds the running task's ids to each record (nothing outside a task)."""

    def filter(self, record: logging.LogRecord) -> bool:
        from celery import current_task

        data = getattr(record, "data", None)  # Celery's own task lines (received, succeeded)
        if isinstance(data, dict):
            _set(record, "task_id", data.get("id"))
            _set(record, "task_name", data.get("name"))
            result = data.get("return_value")
            if isinstance(result, dict):
                for key in ("lease_id", "run_id", "provider"):
                    _set(record, key, result.get(key))
        task = current_task
        request = getattr(task, "request", None) if task else None
        if request is None or not getattr(request, "id", None):
            return True
        _set(record, "task_id", request.id)
        _set(record, "task_name", task.name)
        kwargs = request.kwargs if isinstance(request.kwargs, dict) else {}
        for key in ("lease_id", "run_id"):
            _set(record, key, kwargs.get(key))
        spec = kwargs.get("spec")
        if isinstance(spec, dict):  # an acquire: the spec's provider, else the default one
            from workers.settings import get_settings

            _set(record, "provider", spec.get("provider") or get_settings().provider)
        return True


def _set(record: logging.LogRecord, key: str, value: Any) -> None:
    if isinstance(value, str) and value and getattr(record, key, None) is None:
        setattr(record, key, value[:ID_MAX])


class JsonFormatter(logging.Formatter):
    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname, "logger": record.name, "process": self.process,
            "message": record.getMessage(),
        }
        for key in CONTEXT_FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                line[key] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def rotating_file(path: Path, settings: Settings) -> logging.Handler:
    path.parent.mkdir(parents=True, exist_ok=True)
    return logging.handlers.RotatingFileHandler(
        path, maxBytes=settings.log_file_max_bytes, backupCount=settings.log_file_backups,
        encoding="utf-8")


_file_handlers: dict[Path, logging.Handler] = {}


def adopt_handlers(logger: logging.Logger, process: str, settings: Settings) -> None:
    """Make ``logger``'s handlers follow the settings: the rotating file instead of a
    stream, JSON lines instead of text, task ids on every record."""
    if settings.log_file is not None:
        path = settings.log_file.resolve()
        if path not in _file_handlers:
            handler = rotating_file(path, settings)
            if settings.log_format == "text":  # Celery's own format, as on stderr
                first = next(iter(logger.handlers), None)
                if first is not None and first.formatter is not None:
                    handler.setFormatter(first.formatter)
            _file_handlers[path] = handler
        logger.handlers = [h for h in logger.handlers
                           if not isinstance(h, logging.StreamHandler)
                           or isinstance(h, logging.FileHandler)]
        logger.addHandler(_file_handlers[path])
    for handler in logger.handlers:
        handler.addFilter(TaskContext())
        if settings.log_format == "json":
            handler.setFormatter(JsonFormatter(process))


class CliText(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno >= logging.ERROR else f"{record.levelname.lower()}: "
        return f"leasekeeper: {level}{record.getMessage()}"


def configure_cli_logging(log_format: str) -> None:
    """The CLI logs warnings and errors to stderr: one line each, JSON with log_format=json
    (read from the environment itself: the settings may be what is wrong)."""
    root = logging.getLogger()
    if any(getattr(h, "_leasekeeper", False) for h in root.handlers):
        return
    handler = logging.StreamHandler()
    handler._leasekeeper = True  # type: ignore[attr-defined]
    handler.setFormatter(JsonFormatter("cli") if log_format == "json" else CliText())
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
