"""tasks/secret_marks.py on its own: a mark holds no value, and the window scan finds every
marked value in text, the longest first, and stops where the caller cuts."""

from __future__ import annotations

import uuid

from tasks.secret_marks import Marks, digest, marks_of, scrub

KEY = b"k" * 32
SECRET = f"tok-{uuid.uuid4().hex}"


def test_a_mark_is_the_length_and_a_keyed_digest_never_the_value() -> None:
    (mark,) = marks_of(KEY, [SECRET, "short"])  # under 6 characters: not searched for
    assert mark == f"{len(SECRET)}:{digest(KEY, SECRET)}"
    assert SECRET not in mark and digest(b"other-key", SECRET) not in mark


def test_every_marked_value_is_replaced_the_longest_first() -> None:
    inner = SECRET[:10]
    marks = Marks.of(KEY, marks_of(KEY, [SECRET, inner, "ünï☃-value"]))
    text = f"a {SECRET} b {inner} c ünï☃-value d {SECRET}"
    assert scrub(text, marks) == "a *** b *** c *** d ***"
    assert scrub(text, Marks.of(b"another-key-0000", marks_of(KEY, [SECRET]))) == text


def test_the_scan_stops_past_the_limit_and_marks_of_another_shape_are_ignored() -> None:
    marks = Marks.of(KEY, [*marks_of(KEY, [SECRET]), "garbage", "x:y"])
    text = f"{SECRET} " + "x" * 50 + f" {SECRET}"
    assert scrub(text, marks, limit_chars=20) == "*** " + "x" * 50 + f" {SECRET}"
    assert scrub(text, marks) == "*** " + "x" * 50 + " ***"
