"""How a task's result is shown in its log line and in its task-succeeded event (Flower).

After every task, Celery's tracer renders the result with ``celery.utils.saferepr.saferepr``:
a streaming repr written for any object (recursive, huge, with a ``__repr__`` that
raises). For an acquire's and a destroy's results it executes about 0.6M instructions per
pair, a fifth of all the lifecycle's own work (bench/throughput.py). Our tasks' results
are small JSON values, and for those ``repr`` writes exactly what saferepr writes, at a
twentieth of the cost.

:func:`result_repr` takes that path only when the two texts are the same by construction
(exact built-in types: a dict, list or tuple of at most two levels, of ``str`` keys and of
plain scalars and short strings with no quote, backslash or unprintable character, and
the whole text within the limit); anything else goes to saferepr unchanged. :func:`install`
makes Celery's tracer use it; the worker's main process calls it before the pool forks
(workers/app.py), so every pool process inherits it. tests/unit/test_result_repr.py checks
the texts are saferepr's for generated values and that the tracer still calls it.
"""

from __future__ import annotations

from typing import Any

import celery.app.trace as celery_trace
from celery.utils.saferepr import saferepr

_SCALARS = (int, float, bool, type(None))
_NESTING = 2  # saferepr's own limit is 3 levels: stay well inside it


def _plain_str(text: str) -> bool:
    # saferepr quotes a string as '...' escaping only "'", and writes backslashes and
    # control characters raw; repr escapes those: the texts agree without them.
    return "'" not in text and "\\" not in text and text.isprintable()


def _plain(value: Any, depth: int) -> bool:
    kind = type(value)
    if kind is str:
        return _plain_str(value)
    if kind in _SCALARS:
        return True
    if depth >= _NESTING:
        return False
    if kind is dict:
        return all(type(k) is str and _plain_str(k) and _plain(v, depth + 1)
                   for k, v in value.items())
    if kind is list or kind is tuple:
        return all(_plain(v, depth + 1) for v in value)
    return False


def result_repr(value: Any, maxlen: int | None = None, maxlevels: int = 3,
                seen: Any = None) -> str:
    """saferepr's text of ``value`` (same signature), by ``repr`` when that is the same."""
    if _plain(value, 0):
        text = repr(value)
        # strictly shorter: saferepr cuts a scalar token as long as what is left of maxlen
        # ("...": a top-level 16-digit int at maxlen 16)
        if maxlen is None or len(text) < maxlen:
            return text
    return str(saferepr(value, maxlen, maxlevels, seen))


def install() -> None:
    """Make Celery's tracer render results with :func:`result_repr` (idempotent)."""
    if not hasattr(celery_trace, "saferepr"):
        raise RuntimeError("celery.app.trace no longer renders results with saferepr: "
                           "workers/result_repr.py needs updating for this Celery")
    celery_trace.saferepr = result_repr
