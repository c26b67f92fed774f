"""What leasekeeper says about its broker's Redis when a send, a read or a check fails:
one line naming the URL (no password), the setting and the fix. The producer, the
preflight checks, the CLI's `status` and `health`, the sweeps, the secret marks and the
worker's consumer all say it in these words.

    BROKER_ERRORS / broker_error   which failures are a lost broker (nothing was sent)
    broker_unreachable             unreachable, not Redis, a refused password, no such DB
    broker_full                    up but out of memory (maxmemory under noeviction)
    out_of_memory, database_missing, auth_failure
                                   what a (kombu-wrapped) error is, the cause chain walked
"""

from __future__ import annotations

import os
from collections.abc import Callable

import redis
from kombu.exceptions import OperationalError

from models.shown_url import shown_url
from workers.settings import env_file_path
from workers.up_lock import broker_hint

# InvalidResponse: what answers at the broker's address is not Redis.
BROKER_ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.InvalidResponse,
                 OperationalError)
# redis-py's error for a write a full Redis refuses (a ResponseError); redis-stubs lacks it.
OutOfMemoryError: type[redis.ResponseError] = (
    redis.exceptions.OutOfMemoryError)  # type: ignore[attr-defined]
_CHAIN_MAX = 5  # how far down an error's causes to look (kombu wraps redis-py's)


def broker_error(exc: BaseException) -> BaseException | None:
    """The lost broker connection behind a failed send, or None if it was not one.

    Celery subscribes to the task's result before it publishes; when that subscription's
    connection is dead and its reconnect fails too, the result consumer raises a
    RuntimeError ("must be restarted") caused by the connection error. Nothing was sent
    then either, and the consumer reconnects on a later send."""
    if isinstance(exc, BROKER_ERRORS):
        return exc
    if isinstance(exc, RuntimeError) and isinstance(exc.__cause__, BROKER_ERRORS):
        return exc.__cause__
    return None


def _in_chain(exc: BaseException | None, found: Callable[[BaseException], bool]
              ) -> BaseException | None:
    """The first of ``exc`` and its causes (or contexts) that is ``found``."""
    seen = 0
    while exc is not None and seen < _CHAIN_MAX:
        if found(exc):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def out_of_memory(exc: BaseException | None) -> bool:
    """Redis refused a write for want of memory ("OOM command not allowed when used
    memory > 'maxmemory'"): redis-py's OutOfMemoryError, which kombu may wrap (its
    OperationalError keeps the text)."""
    return _in_chain(exc, lambda e: isinstance(e, OutOfMemoryError)
                     or "used memory > 'maxmemory'" in str(e)) is not None


def database_missing(exc: BaseException | None) -> bool:
    """Redis refused the URL's database number (SELECT: "DB index is out of range"): a
    setting to fix, not a broker to wait for."""
    return _in_chain(exc, lambda e: "DB index is out of range" in str(e)) is not None


def auth_failure(exc: BaseException | None) -> str | None:
    """Redis's reason when ``exc`` (or what caused it) is a refused password (WRONGPASS,
    NOAUTH, a password this Redis does not have), else None."""
    refused = _in_chain(exc, lambda e: isinstance(e, redis.exceptions.AuthenticationError))
    if refused is None:
        return None
    return str(refused).strip(". ")[:120] or "the password was refused"


def broker_unreachable(url: str, exc: BaseException, sending: bool = True,
                       setting: str = "LEASEKEEPER_BROKER_URL") -> str:
    """The one-line message for a broker that cannot be reached (no password shown);
    ``sending``: a send failed, and the message says nothing was sent; ``setting``: the
    one that names ``url`` (the result backend's, when it is set apart)."""
    if out_of_memory(exc):
        return broker_full(url, sending)
    what = "broker" if setting == "LEASEKEEPER_BROKER_URL" else "result backend"
    where = f"the {what} at {shown_url(url)} ({setting})"
    unsent = "; nothing was sent." if sending else "."
    if database_missing(exc):
        return (f"{where} answers but has no such database (DB index is out of range){unsent} "
                f"Use a database number this Redis has in {setting} "
                "(redis://host:6379/0; 0 to 15 unless its `databases` setting says more)")
    refused = auth_failure(exc)
    if refused is not None:
        return f"{where} answers but authentication failed ({refused}){unsent} " + (
            f"Fix the password in {setting} (redis://:PASSWORD@host:port/db; "
            "or remove it if this Redis needs none)" if _has_password(url) else
            f"This Redis needs a password: put it in {setting} "
            "(redis://:PASSWORD@host:port/db)")
    if isinstance(exc, redis.exceptions.InvalidResponse):  # an HTTP server, say
        return (f"{where} is not Redis: what answers there speaks another protocol "
                f"({str(exc)[:80]}){unsent} Point the URL at Redis, then retry")
    reason = str(exc).split(". ")[-1].strip(". ") or type(exc).__name__
    return (f"{where} is unreachable ({reason}){unsent} Start Redis there or fix the URL, "
            f"then retry.{broker_hint(os.environ, env_file_path())}")


def broker_full(url: str, sending: bool = True, then: str = "then retry") -> str:
    """The one-line message for a broker's Redis that is up but full (maxmemory reached
    under noeviction: it answers reads and refuses writes); no password shown."""
    unsent = "; nothing was sent: " if sending else ": "
    return (f"the broker's Redis at {shown_url(url)} is out of memory (used memory "
            f"> maxmemory){unsent}raise its maxmemory or free memory (leasekeeper needs "
            f"maxmemory-policy noeviction), {then}")


def _has_password(url: str) -> bool:
    from urllib.parse import urlsplit

    try:
        return bool(urlsplit(url).password)
    except ValueError:
        return False
