"""What text leasekeeper keeps and shows, in one place: free text the store keeps (a run's
error, a lease's destroy reason) holds only characters every store can hold and none a
log, terminal or browser would act on; names and filters are one line of visible text.

PostgreSQL text has no NUL; UTF-8 has no lone surrogate (JSON's "\\ud800" decodes to
one); C0 control characters other than newline, tab and carriage return, DEL, and the C1
controls U+0080-U+009F (CSI, OSC, ... on a terminal that reads 8-bit controls) would act
on a terminal that shows them; the bidi embeddings, overrides and isolates (U+202A-U+202E,
U+2066-U+2069) reorder what is shown around them ("Trojan Source"). Each is replaced by
U+FFFD, so what was sent stays readable. Newline, tab and carriage return stay in what is
stored (a multi-line error); what shows stored text on one line (a CLI table's cell)
writes them as ``\\n``, ``\\t`` and ``\\r`` (:func:`one_line`).

A filter or a name (the console's and the CLI's filters, a task id) must be
:func:`printable`: no character :func:`storable` replaces, no newline, tab or carriage
return, and no other invisible format or separator character (``str.isprintable``).
"""

from __future__ import annotations

import re

REPLACEMENT = "\N{REPLACEMENT CHARACTER}"
_UNSTORABLE = re.compile(
    "[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_LINE_BREAKS = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_BREAK = re.compile("[\n\r\t]")


def storable(text: str) -> str:
    """``text`` with every character no store can hold (or a terminal would act on)
    replaced by U+FFFD; newline, tab and carriage return kept."""
    return _UNSTORABLE.sub(REPLACEMENT, text)


def one_line(text: str) -> str:
    """Stored text to show on one line (a table's cell): :func:`storable` (a row stored
    before a character was replaced shows it replaced), and newline, carriage return and
    tab written as ``\\n``, ``\\r`` and ``\\t``, as a repr would."""
    return _BREAK.sub(lambda m: _LINE_BREAKS[m.group()], storable(text))


def printable(text: str) -> bool:
    """Whether ``text`` may be a filter or a name: one line of visible text. Refuses every
    character :func:`storable` replaces and more (``str.isprintable``)."""
    return text.isprintable() and not _UNSTORABLE.search(text)
