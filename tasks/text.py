"""Free text the store keeps (a run's error, a lease's destroy reason): only characters
every store can hold, and none a log or terminal would act on.

PostgreSQL text has no NUL; UTF-8 has no lone surrogate (JSON's "\\ud800" decodes to
one); control characters other than newline, tab and carriage return would act on a
terminal that shows them. Each is replaced by U+FFFD, so what was sent stays readable.
"""

from __future__ import annotations

import re

REPLACEMENT = "\N{REPLACEMENT CHARACTER}"
_UNSTORABLE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff]")


def storable(text: str) -> str:
    """``text`` with every character no store can hold (or a terminal would act on)
    replaced by U+FFFD."""
    return _UNSTORABLE.sub(REPLACEMENT, text)
