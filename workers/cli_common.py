"""What every `leasekeeper` command shares: exit codes, the error boundary, the runtime,
aligned tables, JSON output, durations and times.

Exit codes mean the same for every command:

    0    ok
    1    something needs a person (status, health, a failed or unconfirmed destroy, a
         failed demo)
    2    bad input or settings (a read-only store too: its URL is the setting to fix)
    3    a service (broker, store) is unreachable
    4    no such lease or run
    141  stdout was closed (`leasekeeper leases list | head -1`): stopped quietly, with
         the status a shell reports for a Unix tool SIGPIPE stopped (128 + 13)
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import typer

from models.schema import utcnow
from providers.errors import (
    BrokerUnavailable,
    LeasekeeperError,
    NotFound,
    StoreReadOnly,
    StoreUnavailable,
)
from tasks.text import one_line, printable, storable

if TYPE_CHECKING:
    from models.reports import Page
    from workers.runtime import Runtime


class ExitCode(IntEnum):
    OK = 0
    NEEDS_ATTENTION = 1
    USAGE = 2
    UNAVAILABLE = 3
    NOT_FOUND = 4
    PIPE_CLOSED = 141  # 128 + SIGPIPE: what a shell reports for a tool SIGPIPE stopped


def exit_code_for(exc: LeasekeeperError) -> ExitCode:
    if isinstance(exc, NotFound):
        return ExitCode.NOT_FOUND
    if isinstance(exc, StoreReadOnly):  # it answers: a setting to fix (the primary's URL)
        return ExitCode.USAGE
    if isinstance(exc, StoreUnavailable | BrokerUnavailable):
        return ExitCode.UNAVAILABLE
    return ExitCode.USAGE


def run_cli(app: Callable[[], Any]) -> None:
    """Run the root app, turning the errors leasekeeper raises on purpose into one line;
    first warn about LEASEKEEPER_* variables no setting reads."""
    import logging
    import os

    from workers.logs import configure_cli_logging
    from workers.settings import unknown_variables

    configure_cli_logging(os.environ.get("LEASEKEEPER_LOG_FORMAT", "text"))
    log = logging.getLogger("leasekeeper.cli")
    for warning in unknown_variables():
        log.warning("%s", warning)
    stdout = sys.stdout
    try:
        app()
    except SystemExit:
        # Click stops a command whose stdout was closed (EPIPE: `leasekeeper leases list |
        # head -1`) quietly, swapping in a stdout that swallows the last flush, and exits
        # 1, which says "something needs a person": exit as SIGPIPE's status instead.
        if sys.stdout is not stdout:
            sys.exit(ExitCode.PIPE_CLOSED)
        raise
    except BrokenPipeError:  # a write outside the command's own (Click's) boundary
        _quiet_stdout()
        sys.exit(ExitCode.PIPE_CLOSED)
    except LeasekeeperError as exc:
        log.error("%s", cli_message(exc))
        sys.exit(exit_code_for(exc))
    except Exception as exc:
        # A case no check foresaw: one line still, the traceback on request.
        if os.environ.get("LEASEKEEPER_TRACEBACK"):
            raise
        log.error("unexpected %s: %s. This is a leasekeeper bug: please report it, with "
                  "the traceback LEASEKEEPER_TRACEBACK=1 shows", type(exc).__name__,
                  str(exc).strip().splitlines()[0][:300] if str(exc).strip() else "")
        sys.exit(ExitCode.NEEDS_ATTENTION)


def _quiet_stdout() -> None:
    """Point stdout at /dev/null: the interpreter's last flush then finds no closed pipe
    (and prints no "Exception ignored ... BrokenPipeError")."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def cli_message(exc: LeasekeeperError) -> str:
    """How a command says ``exc``: without what a task would do about it; a store that
    refused a write for being read-only, as `status` and `health --store` say it (their
    check, workers/preflight.check_store_writable, names the store and the fix)."""
    if isinstance(exc, StoreReadOnly):
        from workers.preflight import check_store_writable
        from workers.settings import get_settings

        try:
            check_store_writable(get_settings().effective_store_url)
        except LeasekeeperError as checked:
            if exit_code_for(checked) == exit_code_for(exc):
                return checked.outside_a_task()
    return exc.outside_a_task()


_store_checked: set[str] = set()


def runtime() -> Runtime:
    """The runtime, once the store is known to exist and be migrated (workers/preflight)."""
    from workers.preflight import check_store
    from workers.runtime import get_runtime
    from workers.settings import get_settings

    url = get_settings().effective_store_url
    if url not in _store_checked:
        check_store(url)
        _store_checked.add(url)
    return get_runtime()


def require_broker() -> str:
    """The broker URL, once Redis answers there (else BrokerUnavailable, exit code 3)."""
    from workers.preflight import check_broker
    from workers.settings import get_settings

    url = get_settings().effective_broker_url
    check_broker(url)
    return url


def emit_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=2, default=_json_default))


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return iso(value)
    raise TypeError(f"not JSON: {type(value).__name__}")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """An aligned plain-text table with a header line; empty cells show as '-'. A cell is
    one line: a newline, carriage return or tab in it shows as ``\\n``, ``\\r``, ``\\t``
    (tasks/text.py ``one_line``), so stored text never breaks or fakes a row."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.upper().ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(line.rstrip() for line in lines)


def _cell(value: Any) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, datetime):
        return iso(value) or "-"
    return one_line(str(value))


def show_fields(pairs: Sequence[tuple[str, Any]]) -> str:
    """A `show` command's ``key: value`` lines, values aligned; empty values show as '-'.
    A multi-line value (an error) stays multi-line, each further line indented to the
    value's column, so none reads as a field of its own; a carriage return or tab shows
    as ``\\r`` or ``\\t``, and what a terminal would act on as U+FFFD (tasks/text.py)."""
    width = max(len(k) for k, _ in pairs) + 1
    lines = []
    for key, value in pairs:
        text = "-" if value is None or value == "" else str(value)
        shown = [one_line(line) for line in storable(text).split("\n")]
        lines.append(f"{key + ':':<{width}} " + ("\n" + " " * (width + 1)).join(shown))
    return "\n".join(lines)


def iso(moment: datetime | None) -> str | None:
    """Naive-UTC store times as ISO 8601 with a Z, to the second."""
    if moment is None:
        return None
    return moment.replace(microsecond=0).isoformat() + "Z"


def age(moment: datetime | None, now: datetime | None = None) -> str:
    if moment is None:
        return "-"
    return human_duration(((now or utcnow()) - moment).total_seconds())


def human_duration(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            whole, rest = divmod(seconds, size)
            return f"{whole}{unit}" + (f"{rest // (size // 60)}{_next(unit)}"
                                       if unit != "m" and rest >= size // 60 else "")
    return f"{seconds}s"


def _next(unit: str) -> str:
    return {"d": "h", "h": "m"}[unit]


_DURATION = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([smhd]?)\s*")  # ASCII digits only
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_DURATION_D = 36500  # 100 years: older than any lease, and still a date


def parse_duration(text: str, option: str) -> timedelta:
    """'90s', '15m', '2h', '1d', at most MAX_DURATION_D days. A bare number is refused, as
    the help asks for a unit: '10' could be meant as minutes as well as seconds."""
    match = _DURATION.fullmatch(text)
    if match is None:
        raise typer.BadParameter(f"{text!r} is not a duration; use e.g. 90s, 15m, 2h or 1d",
                                 param_hint=option)
    if not match.group(2):
        raise typer.BadParameter(f"{text.strip()[:40]!r} has no unit; add s, m, h or d "
                                 "(e.g. 90s, 15m, 2h or 1d)", param_hint=option)
    seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if seconds > MAX_DURATION_D * 86400:
        raise typer.BadParameter(f"{text.strip()[:40]!r} is more than 100 years; give at most "
                                 f"{MAX_DURATION_D}d", param_hint=option)
    return timedelta(seconds=seconds)


def not_empty(value: Any) -> Any:
    """An option's callback: a filter given an empty value is refused, never dropped (which
    would match everything: `destroy --tenant ''` would pick every tenant's leases); one
    that is not text (undecodable bytes) is refused too, saying so."""
    values = value if isinstance(value, list) else [value]
    if any(v is not None and not v.strip() for v in values):
        raise typer.BadParameter("must not be empty; leave the option out to match every value")
    for v in values:  # bytes the locale cannot decode arrive as lone surrogates
        if v is not None and re.search("[\ud800-\udfff]", v):
            raise typer.BadParameter(f"{v[:40]!r} is not valid text (bytes that are not "
                                     "UTF-8); give the value as text")
        if v is not None and not printable(v):  # as the console's filters (a 400)
            raise typer.BadParameter(f"{v[:40]!r} must be printable text, without control "
                                     "characters")
    return value


def error_line(message: str) -> None:
    """One line on stderr as run_cli prints errors (`leasekeeper: ...`, JSON with
    LEASEKEEPER_LOG_FORMAT=json); the caller chooses the exit code."""
    import logging

    logging.getLogger("leasekeeper.cli").error("%s", message)


def check_option_id(option: str, value: str) -> str:
    """An id given on the command line (a lease or run id), in the id format."""
    from providers.spec import check_id

    try:
        return check_id(option.lstrip("-"), value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=option) from None


def check_id_argument(kind: str, value: str, hint: str) -> str:
    """An id given as an argument (a lease or run id, or a lease id's prefix) in the id
    format, else InvalidRequest (exit 2) saying why: a malformed id, or bytes that are not
    text, is bad input, not an id that is missing."""
    from providers.errors import InvalidRequest
    from providers.spec import check_id

    try:
        return check_id(kind, value)
    except ValueError as exc:
        raise InvalidRequest(f"{exc}; {hint}") from None


def page_json(kind: str, rows: list[dict[str, Any]], page: Page[Any]) -> dict[str, Any]:
    """A listing page as JSON: its rows, the (capped) total and the next page's cursor."""
    return {kind: rows, "limit": page.limit, "total": page.total,
            "total_capped": page.total_capped, "next_before": page.next_before}


def page_footer(page: Page[Any], noun: str) -> str:
    """'50 of 10,000+ lease(s); next page: --before <id>'."""
    more = f"; next page: --before {page.next_before}" if page.next_before else ""
    return f"{len(page.rows)} of {page.total_text} {noun}{more}"


def command_name() -> str:
    """How to type the running `leasekeeper` command in this directory: plain `leasekeeper`
    when PATH finds this same entry point; else its path (relative to the current
    directory when inside it, e.g. `.venv/bin/leasekeeper` after `make run`); `python -m
    workers.cli` when run that way."""
    import os
    import shutil
    from pathlib import Path

    def shown(path: Path) -> str:
        absolute = Path(os.path.abspath(path))
        try:
            return str(absolute.relative_to(Path.cwd()))
        except ValueError:
            return str(absolute)

    entry = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if entry is None or entry.name in {"cli.py", "__main__.py", "-m", "-c"}:
        return f"{shown(Path(sys.executable))} -m workers.cli"
    on_path = shutil.which(entry.name)
    if on_path is not None and os.path.samefile(on_path, os.path.abspath(entry)):
        return entry.name
    return shown(entry)
