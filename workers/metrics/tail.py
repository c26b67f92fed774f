"""Reading an append-only table by its increasing id exactly once.

On PostgreSQL ids come from a sequence and are taken before commit, so two workers can
commit ids 10 and 11 in the order 11, 10: a reader that saw 11 and then asked for
``id > 11`` would never count 10. An :class:`IdTail` remembers the ids it skipped over
(gaps) and reads from the oldest one again on the next poll, until the row shows up or
the gap is older than ``gap_grace_s`` (a rolled-back insert leaves a permanent gap).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Protocol, TypeVar


class HasId(Protocol):
    @property
    def id(self) -> int: ...


Row = TypeVar("Row", bound=HasId)


@dataclass
class IdTail:
    next_id: int  # every id below this one is settled: read, or given up as a gap
    gap_grace_s: float = 30.0
    clock: Callable[[], float] = time.monotonic
    _high: int = 0
    _seen: set[int] = field(default_factory=set)
    _gaps: dict[int, float] = field(default_factory=dict)  # id -> when first missed

    def __post_init__(self) -> None:
        self._high = self.next_id - 1

    @property
    def gaps(self) -> list[int]:
        return sorted(self._gaps)

    def poll(self, fetch: Callable[[int, int], list[Row]], limit: int) -> list[Row]:
        """Rows not returned before, in id order; ``fetch(first_id, limit)`` reads
        ``id >= first_id`` ascending."""
        fresh: list[Row] = []
        cursor = self.next_id
        while True:
            rows = fetch(cursor, limit)
            for row in rows:
                if row.id not in self._seen and row.id >= self.next_id:
                    self._seen.add(row.id)
                    fresh.append(row)
            if rows:
                cursor = rows[-1].id + 1
                self._high = max(self._high, rows[-1].id)
            if len(rows) < limit:
                break
        self._settle()
        return fresh

    def _settle(self) -> None:
        now = self.clock()
        for missing in range(self.next_id, self._high + 1):
            if missing not in self._seen:
                self._gaps.setdefault(missing, now)
        for gap, since in list(self._gaps.items()):
            if gap in self._seen or now - since > self.gap_grace_s:
                del self._gaps[gap]
        self.next_id = min(self._gaps) if self._gaps else self._high + 1
        self._seen = {i for i in self._seen if i >= self.next_id}


@dataclass
class ReclaimTail:
    """Reclaim outcomes recorded on runs since ``start``, each counted once. ``reclaimed_at``
    is set before commit, so every poll re-reads ``overlap_s`` before the newest time seen,
    for commits that land late."""

    start: datetime
    overlap_s: float = 30.0
    _newest: datetime | None = None
    _seen: set[tuple[str, datetime]] = field(default_factory=set)

    def poll(self, fetch: Callable[[datetime], list[tuple[str, str, datetime]]]) -> list[str]:
        newest = self._newest or self.start
        outcomes = []
        for run_id, outcome, at in fetch(max(self.start, newest - timedelta(
                seconds=self.overlap_s))):
            if (run_id, at) not in self._seen:
                self._seen.add((run_id, at))
                outcomes.append(outcome)
                newest = max(newest, at)
        self._newest = newest
        horizon = newest - timedelta(seconds=self.overlap_s)
        self._seen = {key for key in self._seen if key[1] >= horizon}
        return outcomes
