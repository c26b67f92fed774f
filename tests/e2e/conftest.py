"""End-to-end helpers: wait for a store condition with a monotonic deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(probe: Callable[[], T | None], timeout_s: float = 30.0, what: str = "") -> T:
    """Return probe()'s first truthy value; fail with ``what`` once the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)
