"""What leasekeeper's app writes into a task message it sends, built by Celery's own
message code (no broker needed): the reprs in its headers and in its task-sent event are
redacted however the task is sent (send_task by name, apply_async, a sender's own reprs)."""

from __future__ import annotations

import uuid
from typing import Any

import tasks.base  # noqa: F401  (loading leasekeeper's tasks redacts the app's messages)
from tasks.redaction import redact_sent_messages
from workers.app import app

CORE = uuid.uuid4().hex
SPEC = {"env": {"VISIBLE": "yes"}, "secret_env": {"TOKEN": f"tok-{CORE}\n'\"\\"}}


def message(**options: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    built = app.amqp.create_task_message(
        str(uuid.uuid4()), "lease.acquire", (), {"run_id": "r-1", "spec": SPEC},
        create_sent_event=True, **options)
    return built.headers, built.sent_event


def test_a_message_sent_by_name_has_redacted_reprs_in_headers_and_sent_event() -> None:
    headers, sent = message()
    for text in (headers["kwargsrepr"], sent["kwargs"]):
        assert CORE not in text
        assert "'TOKEN': '***'" in text and "'VISIBLE': 'yes'" in text
    assert sent["args"] == headers["argsrepr"] == "[]"


def test_a_senders_own_reprs_are_scrubbed_and_bounded() -> None:
    own = repr({"run_id": "r-1", "spec": SPEC}) + "x" * 5000
    headers, sent = message(argsrepr=own, kwargsrepr=own)
    for text in (headers["argsrepr"], headers["kwargsrepr"], sent["args"], sent["kwargs"]):
        assert CORE not in text and len(text) < 1200


def test_installing_twice_wraps_once() -> None:
    create = app.amqp.create_task_message
    redact_sent_messages(app)
    assert app.amqp.create_task_message is create


def test_a_finish_error_is_shown_as_its_length_even_in_a_senders_own_reprs() -> None:
    error = f"Bearer tok-{CORE} refused"
    kwargs = {"run_id": "r-1", "status": "failed", "error": error}
    for own in ({}, {"kwargsrepr": repr(kwargs), "argsrepr": repr([error])}):
        built = app.amqp.create_task_message(str(uuid.uuid4()), "run.finish", (), kwargs,
                                             create_sent_event=True, **own)
        for text in (built.headers["kwargsrepr"], built.sent_event["kwargs"]):
            assert f"'error': '<error: {len(error)} chars>'" in text and CORE not in text
        assert CORE not in built.headers["argsrepr"]
