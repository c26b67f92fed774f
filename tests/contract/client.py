"""A web backend with only ``celery[redis]`` installed: sends leasekeeper tasks by name.

Run by the contract tests with the Python of a separate virtualenv (``python -I``, so no
leasekeeper module is importable). Reads one JSON request per line on stdin, answers one
JSON line on stdout:

    {"op": "send", "name": "lease.acquire", "kwargs": {...}, "args": [...],
     "countdown": 0, "wait_s": 60}          -> {"id", "state", "result" | "error"}
    {"op": "get", "id": "...", "wait_s": 60} -> the same, for a task sent earlier
    {"op": "inspect", "method": "scheduled"} -> {"reply": {...}}  (celery inspect, as Flower)
    {"op": "raw", "body": "...", "headers": {...}} -> a message published as is

``error`` is ``{"type", "message"}`` of the exception the worker stored.
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any

from celery import Celery
from celery.exceptions import TimeoutError as CeleryTimeout


def answer(result: Any, wait_s: float) -> dict[str, Any]:
    if wait_s:
        with contextlib.suppress(CeleryTimeout):
            result.get(timeout=wait_s, propagate=False)
    state = result.state
    out: dict[str, Any] = {"id": result.id, "state": state}
    if state == "SUCCESS":
        out["result"] = result.result
    elif state in {"FAILURE", "RETRY"}:
        exc = result.result
        out["error"] = {"type": type(exc).__name__, "message": str(exc)}
    return out


def main() -> None:
    broker, queue = sys.argv[1], sys.argv[2]
    app = Celery(broker=broker, backend=broker)
    app.conf.task_default_queue = queue
    for line in sys.stdin:
        request = json.loads(line)
        op = request["op"]
        if op == "send":
            sent = app.send_task(request["name"], args=request.get("args"),
                                 kwargs=request.get("kwargs"),
                                 countdown=request.get("countdown"))
            reply = answer(sent, request.get("wait_s", 60))
        elif op == "get":
            reply = answer(app.AsyncResult(request["id"]), request.get("wait_s", 60))
        elif op == "raw":  # a message as a broken client might publish it
            with app.producer_or_acquire() as producer:
                producer.publish(request["body"], routing_key=queue, exchange="",
                                 headers=request["headers"], content_type="application/json",
                                 content_encoding="utf-8")
            reply = {"id": request["headers"].get("id"), "state": "SENT"}
        elif op == "inspect":
            method = getattr(app.control.inspect(timeout=2), request["method"])
            reply = {"reply": method()}
        else:
            reply = {"error": {"type": "ClientError", "message": f"unknown op {op}"}}
        sys.stdout.write(json.dumps(reply, default=str) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
