"""Secret marks: what lets any worker scrub a run's secrets from the error it stores.

Only the pool process that ran an acquire has seen its ``secret_env`` values (the
per-process value-scan of tasks/redaction.py). ``run.finish`` may run anywhere: the other
pool process, another host, a worker restarted since. So each acquire carrying secrets
leaves *marks* in the broker's Redis, keyed per run and per thread (a later run of the
thread shares the sandbox, and its environment), kept ``MARKS_TTL_S``: for each value, its
length and a keyed BLAKE2b digest of it, never the value. ``run.finish`` loads the marks of
its run and thread and replaces every window of the error text whose digest is a mark
(:func:`scrub`). Marks that cannot be read raise ``BrokerUnavailable`` (transient: the
finish is retried), so an error is never stored unsearched. Each acquire's marks include
:data:`RECORDED`, so marks that Redis lost since (a Redis without persistence restarted,
a flush) are told from marks never left: a run given ``secret_env`` (its lease's spec
says so, or its row in the store: :func:`lost`) whose marks are gone gets its text
withheld (:func:`withheld`), not stored unsearched.

The digest key is ``LEASEKEEPER_SECRET_MARKS_KEY`` when set (every worker of the
installation must have the same); else one derived from the installation id, which keeps
installations apart but is no secret: set the key where Redis is read by anyone who must
not guess a short secret from its mark.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import redis

from providers.errors import BrokerUnavailable
from providers.spec import MIN_SUBSTRING_SECRET_CHARS, REDACTED, hide_spans
from tasks.text import storable
from workers.runtime import Runtime
from workers.settings import Settings

MARKS_TTL_S = 7 * 24 * 3600  # longer than any run is expected to last, then gone
DIGEST_BYTES = 16
_PERSON = b"lk-secret-mark"  # BLAKE2b personalization: these digests are for nothing else
# Left with every acquire's marks, even when no value is long enough to be searched for:
# the marks of a run or thread are there, so their absence means they were lost.
RECORDED = "recorded"


def digest_key(settings: Settings) -> bytes:
    """The BLAKE2b key of this installation's marks (at most 64 bytes)."""
    given = settings.secret_marks_key
    seed = (given.get_secret_value() if given is not None
            else f"leasekeeper installation {settings.installation_id}")
    return hashlib.blake2b(seed.encode(), person=b"lk-marks-key").digest()


def digest(key: bytes, value: str) -> str:
    return hashlib.blake2b(value.encode("utf-8", "surrogatepass"), key=key,
                           digest_size=DIGEST_BYTES, person=_PERSON).hexdigest()


def marks_of(key: bytes, values: Iterable[str]) -> set[str]:
    """``"<length>:<digest>"`` of each value long enough to be searched for in text, as
    given and as :func:`tasks.text.storable` writes it (a control or bidi character as
    U+FFFD, the same length): a text cleaned so before the scrub (by a sender, an older
    producer) still has the secret found."""
    return {f"{len(form)}:{digest(key, form)}" for v in values
            if len(v) >= MIN_SUBSTRING_SECRET_CHARS for form in {v, storable(v)}}


def _run_key(settings: Settings, run_id: str) -> str:
    return f"leasekeeper:{settings.installation_id}:secret-marks:run:{run_id}"


def _thread_key(settings: Settings, thread_id: str) -> str:
    return f"leasekeeper:{settings.installation_id}:secret-marks:thread:{thread_id}"


def _unreachable(rt: Runtime, doing: str, exc: redis.RedisError) -> BrokerUnavailable:
    from tasks.broker_words import broker_unreachable  # the URL, its setting, the fix

    reason = broker_unreachable(rt.settings.effective_broker_url, exc, sending=False)
    return BrokerUnavailable(f"secret marks: could not {doing}: {reason}")


def leave(rt: Runtime, run_id: str, thread_id: str | None, secrets: Mapping[str, str]) -> None:
    """Record the marks of an acquire's secret values for its run and thread (idempotent;
    each write renews the TTL). BrokerUnavailable when Redis cannot take them."""
    if not secrets:
        return
    marks = [RECORDED, *marks_of(digest_key(rt.settings), secrets.values())]
    keys = [_run_key(rt.settings, run_id)]
    if thread_id is not None:
        keys.append(_thread_key(rt.settings, thread_id))
    try:
        with rt.redis().pipeline(transaction=True) as pipe:
            for key in keys:
                pipe.sadd(key, *marks)
                pipe.expire(key, MARKS_TTL_S)
            pipe.execute()
    except redis.RedisError as exc:
        raise _unreachable(rt, f"record the marks of run {run_id}", exc) from None


@dataclass(frozen=True)
class Marks:
    """The digest key and the marks to search for, by length (longest first);
    ``recorded``: an acquire left marks that are still there (any mark, or RECORDED)."""

    key: bytes
    by_length: dict[int, frozenset[str]]
    recorded: bool = False

    @classmethod
    def of(cls, key: bytes, marks: Iterable[str]) -> Marks:
        by_length: dict[int, set[str]] = {}
        recorded = False
        for mark in marks:
            recorded = True
            length, _, hexdigest = mark.partition(":")
            if length.isdigit() and hexdigest:
                by_length.setdefault(int(length), set()).add(hexdigest)
        return cls(key, {n: frozenset(by_length[n]) for n in sorted(by_length, reverse=True)},
                   recorded)



def lost(rt: Runtime, marks: Marks, spec: Mapping[str, object] | None, run_id: str | None,
         lease_id: str | None) -> bool:
    """Secrets were given, and their ``marks`` are gone: a text quoting them cannot be
    searched. Given: the lease's (stored, redacted) ``spec`` has secret_env (a shared
    sandbox's first run's, in its environment), or the store recorded secret_env for the
    run or any run bound to the lease (``runs.secret_env_given``: a reused lease's later
    run brings its own, which its spec does not show). Asked of the store only when the
    marks are gone, so a finish with its marks costs no read."""
    if marks.recorded:
        return False
    return bool((spec or {}).get("secret_env")) or rt.store.secrets_given(run_id, lease_id)


def withheld(text: str, what: str) -> str:
    """What is stored instead of ``text`` (a ``what``) whose secret marks are lost."""
    return (f"[{what} withheld: {len(text)} chars that could not be searched for the run's "
            "secrets; their marks are gone from the broker's Redis since the acquire]")


def load(rt: Runtime, run_id: str, thread_id: str | None) -> Marks:
    """The marks of the run and its thread. BrokerUnavailable when Redis cannot be read:
    the caller must not store the text unsearched."""
    keys = [_run_key(rt.settings, run_id)]
    if thread_id is not None:
        keys.append(_thread_key(rt.settings, thread_id))
    try:
        with rt.redis().pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.smembers(key)
            found: set[bytes] = set().union(*pipe.execute())
    except redis.RedisError as exc:
        raise _unreachable(rt, f"read the marks of run {run_id}", exc) from None
    return Marks.of(digest_key(rt.settings), (m.decode("ascii", "replace") for m in found))


def scrub(text: str, marks: Marks, limit_chars: int | None = None) -> str:
    """``text`` with every window whose digest is a mark hidden: every match of every
    mark is found, those inside another too (one secret's end may be another's start),
    and each run of overlapping or touching matches becomes one ``***``
    (providers/spec.py ``hide_spans``). With ``limit_chars``, the scan stops once that
    much of the result is written: the rest, left as it was, is for a caller that cuts
    it off."""
    if not marks.by_length:
        return text
    spans: list[tuple[int, int]] = []
    end = 0  # where the matches found so far end
    written = 0
    size = len(text)
    for i in range(size):
        # the longest match at i (by_length: longest first); inside the matches found,
        # only one reaching past their end changes what is hidden
        for length, digests in marks.by_length.items():
            if i + length <= end:
                break
            if i + length <= size and digest(marks.key, text[i:i + length]) in digests:
                if i > end or not spans:
                    written += len(REDACTED)
                spans.append((i, i + length))
                end = i + length
                break
        else:
            if i >= end:
                written += 1
                if limit_chars is not None and written > limit_chars:
                    break
    return hide_spans(text, spans)
