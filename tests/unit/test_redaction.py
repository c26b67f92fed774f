"""tasks/redaction.py on its own: the shapes a secret can take in text Celery logs (reprs
of JSON bodies, headers holding reprs, JSON inside JSON), and the bounds on every record.
The same code runs in the real worker in tests/contract/."""

from __future__ import annotations

import json
import logging
import sys
import uuid
from typing import Any

import pytest

from tasks.redaction import (
    LOG_MAX_CHARS,
    RedactingFilter,
    bounded_repr,
    redact,
    remember,
    scrub_exception,
    scrub_text,
    secret_values,
    shown_reprs,
)

CORE = uuid.uuid4().hex
SECRET = f"tok-{CORE}'\"}}{{\\"  # quotes, braces and a backslash
SPEC = {"secret_env": {"API_TOKEN": SECRET}, "env": {"VISIBLE": "yes"}}
BODY = json.dumps([[], {"run_id": "r-1", "spec": SPEC}, {}]).encode()


@pytest.mark.parametrize("text", [
    repr(BODY),  # Celery's dump of an unknown task's body
    repr({"kwargsrepr": repr({"spec": SPEC})}),  # headers holding a client's repr
    json.dumps({"outer": json.dumps(SPEC)}),  # JSON inside JSON
    repr(SPEC),
    f"secret_env={SECRET} and more",
    f"spec: {{'secret_env': b'{CORE}'}}",
    f"secret_env: [{SECRET!r}]",
], ids=["bytes-repr-of-json", "repr-of-repr", "json-in-json", "repr", "key=value", "bytes",
        "list"])
def test_a_secret_env_value_is_withheld_in_any_shape(text: str) -> None:
    assert CORE in text
    scrubbed = scrub_text(text)
    assert CORE not in scrubbed and "secret_env" in scrubbed


def test_already_redacted_reprs_and_other_lines_are_left_alone() -> None:
    shown = bounded_repr({"run_id": "r-1", "spec": SPEC})
    assert CORE not in shown and "'API_TOKEN': '***'" in shown and "'VISIBLE': 'yes'" in shown
    text = f"received {shown}\nnext line stays"
    assert scrub_text(text) == text


def test_redact_handles_secret_env_of_any_type_and_in_lists() -> None:
    assert redact([{"secret_env": "a-string"}]) == [{"secret_env": "***"}]
    assert redact({"secret_env": [["K", "v"]]}) == {"secret_env": "***"}
    assert redact({"spec": {"secret_env": {"K": "v"}}}) == {"spec": {"secret_env": {"K": "***"}}}


@pytest.mark.parametrize("field", ["secretEnv", "secret-env", "SECRET_ENV", "Secret Env",
                                   "my_secrets", "secret"])
def test_a_misspelt_secret_field_is_redacted_and_its_values_known(field: str) -> None:
    # refused by validation, but reported (events, Flower, logs) with its values hidden
    value = f"misspelt-{uuid.uuid4().hex}"
    spec = {"spec": {field: {"TOKEN": value}, "env": {"VISIBLE": "yes"}}, field: value}
    assert redact(spec) == {"spec": {field: {"TOKEN": "***"}, "env": {"VISIBLE": "yes"}},
                            field: "***"}
    assert value not in bounded_repr(spec)
    assert secret_values(spec) == [value, value]
    assert redact({"envs": {"X": "shown"}}) == {"envs": {"X": "shown"}}


def test_a_known_secret_value_is_scrubbed_from_any_text_and_exception() -> None:
    value = f"known-{uuid.uuid4().hex}"
    remember([value, "short"])
    assert scrub_text(f"provider said {value}!") == "provider said ***!"
    assert scrub_text("a short word") == "a short word"  # too short to search for
    exc = RuntimeError(f"boom: {value}")
    scrub_exception(exc)
    assert str(exc) == "boom: ***" and isinstance(exc, RuntimeError)


def test_a_known_secret_is_scrubbed_from_the_exceptions_an_error_was_raised_from() -> None:
    # Celery's stored and sent traceback shows the whole chain, not just the last error
    import traceback

    value = f"known-{uuid.uuid4().hex}"
    remember([value])
    try:
        try:
            try:
                raise ValueError(f"422: spec echoed {value}")
            except ValueError:
                raise KeyError(f"while handling: {value}") from None
        except KeyError as inner:
            raise RuntimeError("kubernetes: sandbox x: provider bug") from inner
    except RuntimeError as exc:
        scrub_exception(exc)
        shown = "".join(traceback.format_exception(exc))
    assert value not in shown and "while handling: ***" in shown


def test_the_filter_redacts_and_bounds_message_data_and_traceback() -> None:
    try:
        raise KeyError(f"task {BODY!r}")
    except KeyError:
        exc_info = sys.exc_info()
    record = logging.LogRecord("celery.worker.consumer.consumer", logging.ERROR, __file__, 1,
                               "body: %s\n%s", (repr(BODY), "x" * 10 * LOG_MAX_CHARS), exc_info)
    record.data = {"kwargs": repr({"spec": SPEC})}
    assert RedactingFilter().filter(record)
    line = logging.Formatter().format(record)
    assert CORE not in line and CORE not in json.dumps(record.data)
    assert "more characters cut" in record.getMessage()
    assert len(record.getMessage()) < 2 * LOG_MAX_CHARS


@pytest.mark.parametrize("field", ["secretEnv", "Secret-Env", "SECRET_ENV", "Secret Env",
                                   "my_secrets", "secret.env"])
@pytest.mark.parametrize("dump", [json.dumps, repr, lambda s: json.dumps({"o": json.dumps(s)})],
                         ids=["json", "repr", "json-in-json"])
def test_a_misspelt_secret_field_is_withheld_in_free_text_too(field: str, dump: Any) -> None:
    # a log line or an unknown task's body with the field as is_secret_field takes it; the
    # value was never seen by this process (no value-scan), so only the field shows it
    value = f"misspelt-{uuid.uuid4().hex}"
    text = f"body: {dump({'run_id': 'r-1', 'spec': {field: {'TOKEN': value}}})} end"
    assert value not in scrub_text(text) and field in scrub_text(text)
    bare = field.replace(" ", "_").replace(".", "_")  # a bare key is one word: `a.b: ` is a path
    assert value not in scrub_text(f"{bare}={value} and more")


@pytest.mark.parametrize("line", [
    "secret marks: could not read the marks of run r-1",
    "secret_env.TOKEN: Input should be a valid string",
    "spec: secret_env is invalid: invalid environment variable names: 'bad-name'",
    'File "/app/tasks/secret_marks.py", line 29, in load',
    # refusals that quote a name holding the word, then say what to do (a QA pass: these
    # read "'***' [rest of line withheld]" when a worker sent them back)
    "unknown provider 'vault-secret-store': leasekeeper has the providers local",
    "env 'SECRET_X': holds a secret_env value; env is sent in clear: pass it in secret_env",
    'label "team-secret": is not a valid label key',
])
def test_prose_that_names_a_secret_field_stays_readable(line: str) -> None:
    assert scrub_text(line) == line


def test_a_secret_repeated_elsewhere_in_the_payload_is_redacted_there_too() -> None:
    long, short = f"long-{uuid.uuid4().hex}", "42"
    payload = {"run_id": "r-1", "spec": {
        "secret_env": {"TOKEN": long, "PIN": short},
        "env": {"COPY": long, "PIN_COPY": short, "ANSWER": "42 is the answer", long: "key"},
        "command": ["curl", f"-HBearer {long}"], "labels": {"team": "a"}}}
    shown = redact(payload)
    assert shown["spec"]["env"] == {"COPY": "***", "PIN_COPY": "***",
                                    "ANSWER": "42 is the answer", "***": "key"}
    assert shown["spec"]["command"] == ["curl", "-HBearer ***"]
    assert shown["spec"]["secret_env"] == {"TOKEN": "***", "PIN": "***"}
    assert long not in bounded_repr(payload) and "'PIN_COPY': '***'" in bounded_repr(payload)
    assert redact({"env": {"X": "42"}}) == {"env": {"X": "42"}}  # no secret in this payload


def test_a_finish_error_shows_only_its_length_however_it_is_passed() -> None:
    error = f"token {uuid.uuid4().hex} refused"
    by_kw = shown_reprs("run.finish", [], {"run_id": "r-1", "status": "failed",
                                           "error": error})
    assert by_kw.kwargsrepr == ("{'run_id': 'r-1', 'status': 'failed', "
                                f"'error': '<error: {len(error)} chars>'}}")
    by_position = shown_reprs("run.finish", ["r-1", "failed", 1, error], {})
    assert by_position.argsrepr == f"['r-1', 'failed', 1, '<error: {len(error)} chars>']"
    assert "<error: dict>" in shown_reprs("run.finish", [], {"error": {"a": error}}).kwargsrepr
    assert "'error': None" in shown_reprs("run.finish", [], {"error": None}).kwargsrepr
    other = shown_reprs("lease.destroy", [], {"lease_id": "l-1", "error": error})
    assert error in other.kwargsrepr  # only the fields named in HIDDEN_FIELDS


def test_an_invalid_finish_message_is_reported_without_its_error() -> None:
    # what the worker's consumer logs of a message it cannot run: body and headers
    from kombu import Message

    from tasks.redaction import _redacted_message

    error = f"token {uuid.uuid4().hex} refused"
    kwargs = {"run_id": "r-1", "status": "failed", "error": error}
    message = Message(body=json.dumps([["r-1", "failed", 1, error], kwargs, {}]).encode(),
                      headers={"task": "run.finish", "kwargsrepr": repr(kwargs)},
                      content_type="application/json", content_encoding="utf-8")
    with _redacted_message(message):
        shown = f"{message.body!r} {message.headers!r}"
        assert error not in shown and f"<error: {len(error)} chars>" in shown
    assert error in message.body.decode()  # the message itself is left as it came
