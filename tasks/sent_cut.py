"""A caller's free text that a sender may have cut to fit a message: ``run.finish``'s
error and ``lease.destroy``'s reason.

A message's payload is bounded (``LEASEKEEPER_MAX_PAYLOAD_BYTES``), so a sender may have
to cut such a text; it never cuts it to what the store keeps, because only the worker
has the run's secret marks and its scrub matches only a secret it sees whole.
:func:`sendable` (the producer's) sends the text whole when it fits, else as much as fits
ending in :data:`SENT_CUT_NOTE`; :func:`received` (the worker's) scrubs it and, of a text
so cut, never keeps the last :data:`SENT_CUT_UNSEEN_CHARS` characters before that cut:
a secret the cut split is there, and no scrub can match part of one (unless the run and
its thread were given no secret).
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

from providers.spec import MAX_ENV_VALUE_CHARS
from tasks import secret_marks
from tasks.redaction import scrub_text
from tasks.text import storable

# How a sender that had to cut a text ends what it sends: N is the length of the whole
# text. What the worker keeps then counts what was not sent (cut_note).
SENT_CUT_NOTE = "... [{} characters; the rest cut before sending]"
# What of a text its sender cut is never kept, before that cut: the most of a secret it
# can end in (scrubs may write a redaction note there: the slack)
SENT_CUT_UNSEEN_CHARS = MAX_ENV_VALUE_CHARS + 64
_SENT_CUT = re.compile(r"\.\.\. \[(\d{1,12}) characters; the rest cut before sending\]\Z")


def cut_note(total_chars: int) -> str:
    """How a kept text that was cut ends (``total_chars``: the whole text's length)."""
    return f"... [{total_chars} characters; the rest cut]"


def sendable(text: str, kwargs: dict[str, Any], field: str, max_bytes: int) -> str:
    """``text`` as a sender sends it in ``kwargs[field]``: whole when the payload fits
    ``max_bytes`` (as tasks/base.py check_payload measures it: JSON, where a character may
    take 12 bytes), else as much of it as fits, ending in SENT_CUT_NOTE (the whole
    length). Never cut to what the store keeps: the sender has no secret marks."""
    def size(value: str) -> int:
        return len(json.dumps({**kwargs, field: value}, default=str).encode())

    if size(text) <= max_bytes:
        return text
    note = SENT_CUT_NOTE.format(len(text))
    fits, over = 0, min(len(text), max_bytes) + 1  # at least a byte a character
    while over - fits > 1:
        mid = (fits + over) // 2
        fits, over = (mid, over) if size(text[:mid] + note) <= max_bytes else (fits, mid)
    return text[:fits] + note


def _split(text: str) -> tuple[str, int]:
    """The text a sender sent, and how many characters it cut off its end (0: none)."""
    found = _SENT_CUT.search(text)
    if found is None or int(found.group(1)) <= found.start():
        return text, 0
    return text[:found.start()], int(found.group(1)) - found.start()


class Received(NamedTuple):
    """What a worker may keep of a text: ``text`` (not yet cut to what it keeps),
    ``total_chars`` the whole text's length as sent and scrubbed, ``sender_cut`` whether
    the sender cut it (then ``text`` lacks what could end in a split secret)."""

    text: str
    total_chars: int
    sender_cut: bool


def received(text: str, marks: secret_marks.Marks | None, keep_chars: int) -> Received:
    """``text`` as a worker received it, scrubbed: every secret this process knows of and
    every ``secret_env`` dump (tasks/redaction.py), then with ``marks`` every secret of
    the run and its thread (tasks/secret_marks.py, searched as far as ``keep_chars`` of
    the result reach), before any cut, so no part of a secret a cut would split
    survives; characters no store holds replaced by U+FFFD. A text ending in
    SENT_CUT_NOTE loses its last SENT_CUT_UNSEEN_CHARS characters before it, unless
    ``marks`` say its run and thread were given no secret (no acquire recorded any): then
    no secret of theirs can be split, and all that was sent is kept."""
    sent, unsent = _split(text)
    sent = scrub_text(sent)
    if marks is not None:
        sent = secret_marks.scrub(sent, marks, limit_chars=keep_chars)
    sent = storable(sent)
    total = len(sent) + unsent
    if unsent and (marks is None or marks.recorded):
        # what became of a secret's start that the sender's cut split is at the end
        sent = sent[:max(0, len(sent) - SENT_CUT_UNSEEN_CHARS)]
    return Received(sent, total, bool(unsent))
