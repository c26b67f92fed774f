"""Overlapping secrets are scrubbed whole, by every scrub that searches text for them.

Before, each scrub replaced one secret at a time (the log filter's and exception scrub's
``str.replace`` per value, the secret marks' first match at each position, then a jump
past it), so of ``OverlapAbcdefgh`` and ``efghIJKLmnop99`` quoted run together as
``OverlapAbcdefghIJKLmnop99`` one was replaced and the rest of the other stayed in clear
(``***IJKLmnop99``, or ``OverlapAbcd***``). Now every match of every secret is found, and
each run of overlapping or touching matches becomes one ``***``.
"""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from providers.spec import MIN_SUBSTRING_SECRET_CHARS, REDACTED, hide_secret_values
from tasks import redaction, secret_marks
from tasks.redaction import remember, scrub_text

A, B = "OverlapAbcdefgh", "efghIJKLmnop99"
TEXT = "overlap OverlapAbcdefghIJKLmnop99 end"
KEY = b"k" * 32


def by_marks(secrets: list[str]) -> Callable[[str], str]:
    marks = secret_marks.Marks.of(KEY, secret_marks.marks_of(KEY, secrets))
    return lambda text: secret_marks.scrub(text, marks)


def by_value(secrets: list[str]) -> Callable[[str], str]:
    with redaction._known_lock:
        redaction._known.clear()  # only these: the process may know others from tests
    remember(secrets)
    return scrub_text


def by_spec(secrets: list[str]) -> Callable[[str], str]:
    return lambda text: str(hide_secret_values(text, secrets))


SCRUBS = {"marks": by_marks, "value": by_value, "spec": by_spec}


def expected(text: str, secrets: list[str]) -> str:
    """Every character inside any occurrence of any secret hidden; each run of hidden
    characters one ``***`` (written the slow, obvious way)."""
    hidden = [False] * len(text)
    for secret in secrets:
        for at in range(len(text) - len(secret) + 1):
            if text.startswith(secret, at):
                hidden[at:at + len(secret)] = [True] * len(secret)
    out: list[str] = []
    for i, ch in enumerate(text):
        if not hidden[i]:
            out.append(ch)
        elif i == 0 or not hidden[i - 1]:
            out.append(REDACTED)
    return "".join(out)


def test_the_qa_passes_overlap_is_hidden_whole_in_either_order() -> None:
    for scrub in SCRUBS.values():
        for secrets in ([A, B], [B, A]):
            assert scrub(secrets)(TEXT) == "overlap *** end"


SECRETS = st.lists(st.text("abc-", min_size=MIN_SUBSTRING_SECRET_CHARS, max_size=12),
                   min_size=1, max_size=4, unique=True)


@st.composite
def texts_of(draw: st.DrawFn) -> tuple[list[str], str]:
    """Secrets, and a text of their whole copies, pieces of them and filler (a small
    alphabet: copies run together and overlap)."""
    secrets = draw(SECRETS)
    parts = st.one_of(st.sampled_from(secrets), st.text("abc-xy", max_size=8),
                      st.builds(lambda s, i: s[i:], st.sampled_from(secrets),
                                st.integers(0, 11)),
                      st.builds(lambda s, i: s[:i], st.sampled_from(secrets),
                                st.integers(0, 11)))
    return secrets, "".join(draw(st.lists(parts, max_size=12)))


@given(texts_of(), st.sampled_from(sorted(SCRUBS)))
@settings(max_examples=600, deadline=None)
def test_no_character_of_any_secret_occurrence_survives(
        case: tuple[list[str], str], how: str) -> None:
    secrets, text = case
    scrubbed = SCRUBS[how](secrets)(text)
    assert scrubbed == expected(text, secrets)
    assert not any(secret in scrubbed for secret in secrets)


@given(texts_of(), st.integers(0, 40))
@settings(max_examples=300, deadline=None)
def test_the_marks_scrub_with_a_limit_hides_every_secret_in_what_it_searched(
        case: tuple[list[str], str], limit: int) -> None:
    # What a caller keeps of a scrub stopped at ``limit`` characters shows no secret.
    secrets, text = case
    kept = secret_marks.scrub(text, by_marks_of(secrets), limit_chars=limit)[:limit]
    assert kept == expected(text, secrets)[:limit]


def by_marks_of(secrets: list[str]) -> secret_marks.Marks:
    return secret_marks.Marks.of(KEY, secret_marks.marks_of(KEY, secrets))
