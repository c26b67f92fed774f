"""Run bookkeeping: ``run.finish``, ``run.detach``, ``run.attach`` and ``lease.touch``.

A run that finishes in an ephemeral (non-reused) sandbox is due for reclaim at once:
``sandbox.reclaim`` is enqueued, and ``sweep.reap_runs`` catches any reclaim that was lost.
A reused sandbox outlives its runs; the idle and absolute deadlines end it.
Activity is explicit: ``lease.touch`` and a resumable ``lease.resume_check`` move the idle
deadline; nothing else does (background traffic inside a sandbox never keeps it alive).
"""

from __future__ import annotations

from typing import Any

from models.schema import LeaseState, RunStatus
from models.store import RunChange, RunEnd
from providers.errors import InvalidRequest
from providers.spec import check_id, described
from tasks import secret_marks
from tasks.base import LeaseTask
from tasks.leases import EXPIRED, later
from tasks.reclaim import reclaim
from tasks.sent_cut import cut_note, received
from workers.app import app
from workers.runtime import Runtime

# exit_code's range: a container's exit status (Kubernetes: int32); a process's is 0-255,
# or a signal's negative number
EXIT_CODE_MIN, EXIT_CODE_MAX = -(2**31), 2**31 - 1
FINISH_STATUSES = frozenset({RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.ABORTED,
                             RunStatus.INTERRUPTED})
# What a run keeps of the error its finish reports (the cut is said in the text)
ERROR_MAX_CHARS = 2000


def clean_error(error: str | None, marks: secret_marks.Marks | None = None) -> str | None:
    """The error text a run records: scrubbed as :func:`tasks.sent_cut.received` does
    (every secret this process knows of, every ``secret_env`` dump, and with ``marks``
    every secret of the run and its thread, whichever process saw them, before the cut,
    so no part of a secret the cut would split survives; of a text its sender cut, the
    end that may hold a split secret dropped), characters no store holds replaced by
    U+FFFD; at most ERROR_MAX_CHARS, the cut said at its end with the whole text's
    length."""
    if error is None:
        return None
    got = received(error, marks, ERROR_MAX_CHARS)
    if got.total_chars <= ERROR_MAX_CHARS and not got.sender_cut:
        return got.text
    note = cut_note(got.total_chars)
    return got.text[:ERROR_MAX_CHARS - len(note)] + note


def exited_run(code: int | None, reason: str | None) -> RunEnd:
    """How a run ends when its sandbox's command ended by itself (sweep.finish_exited, and
    a resume check that finds it ended): ``completed`` for exit code 0, ``failed``
    otherwise, the code recorded; stopped before it exited (``reason``, e.g. a Job's
    ``DeadlineExceeded``): ``failed``, no exit code. The text holds only the code and the
    provider's fixed stop reason: no secret can be in it."""
    if code is None:
        return RunEnd(RunStatus.FAILED, None, f"the sandbox was stopped before its command "
                                              f"exited ({reason}); no exit code")
    if code == 0:
        return RunEnd(RunStatus.COMPLETED, 0, None)
    return RunEnd(RunStatus.FAILED, code, f"the sandbox command exited with code {code}")


def parse_finish(run_id: object, status: object, exit_code: object, error: object = None
                 ) -> tuple[str, RunStatus]:
    try:
        check_id("run_id", run_id)
    except ValueError as exc:
        raise InvalidRequest(f"invalid run.finish payload: {exc}") from None
    if status not in {s.value for s in FINISH_STATUSES}:
        raise InvalidRequest(
            f"invalid run.finish payload: status must be one of "
            f"{', '.join(sorted(s.value for s in FINISH_STATUSES))}; got {described(status)}"
        )
    # a refused value is described, never quoted (it may be a secret: README, Secrets)
    integer = isinstance(exit_code, int) and not isinstance(exit_code, bool)
    if exit_code is not None and not (isinstance(exit_code, int) and integer
                                      and EXIT_CODE_MIN <= exit_code <= EXIT_CODE_MAX):
        got = "an integer outside that range" if integer else described(exit_code)
        raise InvalidRequest(
            "invalid run.finish payload: exit_code must be an integer from "
            f"{EXIT_CODE_MIN} to {EXIT_CODE_MAX} (a process's, or a container's, exit "
            f"status) or null; got {got}")
    if error is not None and not isinstance(error, str):
        raise InvalidRequest("invalid run.finish payload: error must be a string or null")
    assert isinstance(run_id, str)
    return run_id, RunStatus(str(status))


def finish(
    rt: Runtime, run_id: str, status: RunStatus, exit_code: int | None, error: str | None,
    *, own_text: bool = False,
) -> tuple[RunChange, bool]:
    """Finish the run; return whether it changed and whether a reclaim is now due. The
    error is recorded as :func:`clean_error` makes it (it may come from any caller), with
    the secret marks of the run and its thread: BrokerUnavailable (transient) when they
    cannot be read, and nothing is stored. ``own_text``: the error is leasekeeper's own
    (:func:`exited_run`'s, built from an exit code), never withheld for lost marks."""
    run = rt.store.get_run(run_id)
    lease = rt.store.find_lease(run.lease_id) if run and run.lease_id else None
    if error and own_text:
        error = clean_error(error)
    elif error:
        marks = secret_marks.load(rt, run_id, run.thread_id if run else None)
        if secret_marks.lost(rt, marks, lease.spec if lease is not None else None, run_id,
                             run.lease_id if run is not None else None):
            error = secret_marks.withheld(error, "error")
        else:
            error = clean_error(error, marks)
    reclaim_due = status != RunStatus.INTERRUPTED and not (lease is not None and lease.reuse)
    change = rt.store.finish_run(run_id, status, exit_code, error, reclaim_due=reclaim_due,
                                 claim_until=later(rt.settings.claim_timeout_s))
    return change, reclaim_due and change == RunChange.CHANGED


@app.task(bind=True, base=LeaseTask, name="run.finish")
def finish_run(self: LeaseTask, run_id: str, status: str, exit_code: int | None = None,
               error: str | None = None) -> dict[str, Any]:
    run_id, parsed = parse_finish(run_id, status, exit_code, error)
    with self.retrying():
        change, reclaim_now = finish(self.runtime, run_id, parsed, exit_code, error)
    if reclaim_now:
        reclaim.apply_async(kwargs={"run_id": run_id})
    status_now: str = parsed
    if change != RunChange.CHANGED:  # finished before: say how, not what this call asked
        run = self.runtime.store.get_run(run_id)
        status_now = run.status if run is not None else parsed
    return {"run_id": run_id, "status": status_now, "change": change,
            "reclaim_enqueued": reclaim_now}


@app.task(bind=True, base=LeaseTask, name="run.detach")
def detach_run(self: LeaseTask, run_id: str) -> dict[str, Any]:
    with self.retrying():
        change = self.runtime.store.set_detached(run_id, detached=True)
    return {"run_id": run_id, "change": change}


@app.task(bind=True, base=LeaseTask, name="run.attach")
def attach_run(self: LeaseTask, run_id: str) -> dict[str, Any]:
    with self.retrying():
        change = self.runtime.store.set_detached(run_id, detached=False)
    return {"run_id": run_id, "change": change}


def touch(rt: Runtime, lease_id: str) -> dict[str, Any]:
    """lease.touch's answer: ``reason`` says why nothing moved (the lease is not active,
    or is past its absolute deadline), None when the idle deadline moved."""
    lease = rt.store.touch(lease_id)
    if lease is not None:
        return {"lease_id": lease_id, "touched": True,
                "idle_deadline_at": lease.idle_deadline_at.isoformat() + "Z"
                if lease.idle_deadline_at else None, "reason": None}
    now = rt.store.get_lease(lease_id)
    reason = (f"the lease is {now.state}, not active" if now.state != LeaseState.ACTIVE
              else f"{EXPIRED}; activity does not save it")
    return {"lease_id": lease_id, "touched": False, "idle_deadline_at": None,
            "reason": reason}


@app.task(bind=True, base=LeaseTask, name="lease.touch")
def touch_lease(self: LeaseTask, lease_id: str) -> dict[str, Any]:
    with self.retrying():
        return touch(self.runtime, lease_id)
