"""`leasekeeper leases list|show|destroy|retry|forget`: inspect leases and act on them.

Reads go straight to the store (bounded pages, newest first). ``destroy`` goes through the
normal task path (`lease.destroy` on a worker), so the history, the retries and
`sweep.retry_cleanup` apply exactly as to any other destroy; ``retry`` and ``forget`` are
the operator's guarded transitions on abandoned leases.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, NoReturn

import typer

from models.reports import MAX_LIMIT, LeaseFilter, Page, lease_page
from models.schema import LIVE_STATES, Lease, LeaseEvent, LeaseState, Run, utcnow
from tasks.operator import OPERATOR_REASON
from workers.cli_common import (
    ExitCode,
    age,
    check_id_argument,
    check_option_id,
    emit_json,
    error_line,
    iso,
    not_empty,
    page_footer,
    page_json,
    parse_duration,
    require_broker,
    runtime,
    show_fields,
    table,
)

leases_cli = typer.Typer(no_args_is_help=True,
                         help="Inspect leases; destroy, retry or forget them.")
STATES = [s.value for s in LeaseState]

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
StateOpt = Annotated[list[str] | None, typer.Option(
    "--state", callback=not_empty,
    help=f"Only leases in this state (repeatable): {', '.join(STATES)}.")]
ProviderOpt = Annotated[str | None, typer.Option(callback=not_empty,
                                                 help="Only leases of this provider.")]
TenantOpt = Annotated[str | None, typer.Option(callback=not_empty,
                                               help="Only leases of this tenant.")]
PoolOpt = Annotated[str | None, typer.Option(
    callback=not_empty,
    help="Only leases of this warm pool (its members, and the leases runs asked it for).")]
OlderOpt = Annotated[str | None, typer.Option(
    "--older-than", callback=not_empty,
    help="Only leases created longer ago than this (90s, 15m, 2h, 1d; at most 36500d).")]
LimitOpt = Annotated[int, typer.Option(min=1, max=1000, help="At most this many rows.")]
BeforeOpt = Annotated[str | None, typer.Option(
    "--before", metavar="ID",
    help="The next page: rows listed after this id (what the previous page printed).")]


def register(cli: typer.Typer) -> None:
    cli.add_typer(leases_cli, name="leases")


def _filter(state: list[str] | None, provider: str | None, tenant: str | None,
            older_than: str | None, pool: str | None = None) -> LeaseFilter:
    unknown = sorted(set(state or []) - set(STATES))
    if unknown:
        raise typer.BadParameter(f"unknown state(s) {', '.join(unknown)}; known: "
                                 f"{', '.join(STATES)}", param_hint="--state")
    _check_provider(provider)
    before = (utcnow() - parse_duration(older_than, "--older-than")
              if older_than is not None else None)
    return LeaseFilter(tuple(state or ()), provider, tenant, before, pool)


def _check_provider(provider: str | None) -> None:
    """A provider leasekeeper has (enabled here or not: a disabled provider's old leases
    stay listable), else bad input naming them: a typo would match nothing, silently."""
    from workers.settings import OFFERED_PROVIDERS, PROVIDER_NAMES

    if provider is not None and provider not in PROVIDER_NAMES:
        raise typer.BadParameter(f"unknown provider {provider[:40]!r}; known: "
                                 f"{OFFERED_PROVIDERS}", param_hint="--provider")


def _filters_text(state: list[str] | None, provider: str | None, tenant: str | None,
                  older_than: str | None) -> str:
    """The filters as they were typed: `--state active --tenant acme`."""
    given = [*(("--state", s) for s in state or []), ("--provider", provider),
             ("--tenant", tenant), ("--older-than", older_than)]
    return " ".join(f"{option} {value}" for option, value in given if value is not None)


def lease_json(lease: Lease) -> dict[str, Any]:
    return {c: getattr(lease, c) for c in Lease.__table__.columns.keys()  # noqa: SIM118
            if c != "live_key"}


def run_json(run: Run) -> dict[str, Any]:
    return {c: getattr(run, c) for c in Run.__table__.columns.keys()}  # noqa: SIM118


def event_json(event: LeaseEvent) -> dict[str, Any]:
    return {"at": event.at, "from_state": event.from_state, "to_state": event.to_state,
            "reason": event.reason, "task_id": event.task_id}


@leases_cli.command("list")
def leases_list(state: StateOpt = None, provider: ProviderOpt = None, tenant: TenantOpt = None,
                older_than: OlderOpt = None, pool: PoolOpt = None, limit: LimitOpt = 50,
                before: BeforeOpt = None, as_json: JsonOpt = False) -> None:
    """List leases, newest first, a page at a time (--before for the next page)."""
    from providers.errors import NotFound

    store = runtime().store
    if before is not None:
        check_option_id("--before", before)
        if store.find_lease(before) is None:  # else the newest, as if unfiltered
            raise NotFound(f"no lease {before[:64]!r} to list leases before; pass the lease "
                           "id the previous page named (--before)")
    page = lease_page(store, _filter(state, provider, tenant, older_than, pool), limit, before)
    if as_json:
        emit_json(page_json("leases", [lease_json(x) for x in page.rows], page))
        return
    now = utcnow()
    typer.echo(table(
        ["lease", "state", "provider", "tenant", "pool", "run", "created", "age",
         "end reason", "attempts"],
        [[x.lease_id, x.state, x.provider, x.tenant, x.pool, x.run_id, x.created_at,
          age(x.created_at, now), x.end_reason, x.cleanup_attempts] for x in page.rows]))
    typer.echo(page_footer(page, "lease(s)"))


MIN_PREFIX = 8


def resolve(lease_id: str) -> Lease:
    """The lease with this id, or the only one whose id starts with it (8+ characters)."""
    from models.reports import lease_ids_starting
    from providers.errors import InvalidRequest, NotFound

    check_id_argument("lease id", lease_id, "`leasekeeper leases list` shows the ids")
    store = runtime().store
    lease = store.find_lease(lease_id)
    if lease is not None:
        return lease
    matches = lease_ids_starting(store, lease_id) if len(lease_id) >= MIN_PREFIX else []
    if len(matches) == 1:
        return store.get_lease(matches[0])
    if matches:  # ambiguous: bad input (exit 2), not a lease that does not exist
        raise InvalidRequest(f"several leases' ids start with {lease_id[:64]!r} (e.g. "
                             f"{', '.join(matches)}): give more of the id")
    if store.get_run(lease_id) is not None:
        raise NotFound(f"no lease {lease_id!r} in the store; {lease_id!r} is a run: "
                       f"`leasekeeper runs show {lease_id}`")
    hint = "`leasekeeper leases list` shows the ids"
    if len(lease_id) < MIN_PREFIX:  # bad input (exit 2), not a lease that does not exist
        raise InvalidRequest(f"a lease id prefix needs at least {MIN_PREFIX} characters; "
                             f"got {lease_id!r}; {hint}")
    raise NotFound(f"no lease {lease_id[:64]!r} in the store; {hint}")


@leases_cli.command("show")
def leases_show(lease_id: str, as_json: JsonOpt = False) -> None:
    """A lease's fields, its run, and its whole history (with the task id of each change).
    The id may be shortened to a unique prefix of 8 or more characters."""
    rt = runtime()
    lease = resolve(lease_id)
    lease_id = lease.lease_id
    run = rt.store.get_run(lease.run_id) if lease.run_id else None
    events = rt.store.events(lease_id)
    if as_json:
        emit_json({"lease": lease_json(lease), "run": run_json(run) if run else None,
                   "events": [event_json(e) for e in events]})
        return
    fields = [("lease", lease.lease_id), ("state", lease.state),
              ("end reason", lease.end_reason), ("tenant", lease.tenant),
              ("thread", lease.thread_id), ("provider", lease.provider),
              ("provider name", lease.provider_lease_id), ("backend", lease.backend),
              ("sandbox key", lease.sandbox_key), ("reuse", lease.reuse),
              ("pool", lease.pool), ("claimed", iso(lease.claimed_at)),
              ("run", f"{lease.run_id} ({_run_text(run)})" if lease.run_id else None),
              ("created", iso(lease.created_at)), ("ready", iso(lease.ready_at)),
              ("acquire deadline", iso(lease.acquire_deadline_at)),
              ("deadline", iso(lease.deadline_at)),
              ("idle deadline", iso(lease.idle_deadline_at)),
              ("idle timeout", f"{lease.idle_timeout_s} s"),
              ("cleanup attempts", lease.cleanup_attempts),
              ("next cleanup", iso(lease.next_cleanup_at)), ("last error", lease.last_error),
              ("updated", iso(lease.updated_at))]
    typer.echo(show_fields(fields))
    typer.echo("\nhistory:")
    typer.echo(table(["at", "from", "to", "reason", "task"],
                     [[e.at, e.from_state, e.to_state, e.reason, e.task_id] for e in events]))


def _run_text(run: Run | None) -> str:
    if run is None:
        return "no run record"
    return run.status + (f", exit {run.exit_code}" if run.exit_code is not None else "")


@leases_cli.command("destroy")
def leases_destroy(
    lease_id: Annotated[str | None, typer.Argument(
        help="The lease to destroy (or a unique prefix of 8+ characters).")] = None,
    state: StateOpt = None, provider: ProviderOpt = None, tenant: TenantOpt = None,
    older_than: OlderOpt = None, limit: LimitOpt = 100,
    yes: Annotated[bool, typer.Option("--yes", help="Really destroy every lease that "
                                                    "matches (without an id).")] = False,
    reason: Annotated[str, typer.Option(help="Recorded in each lease's history.")] =
        OPERATOR_REASON,
    wait_s: Annotated[float, typer.Option("--wait", min=0, help="Seconds to wait for the "
                                                                "workers' answers.")] = 60.0,
    as_json: JsonOpt = False,
) -> None:
    """Destroy one lease, or every lease matching the filters (with --yes), through the
    normal lease.destroy task: history, retries and sweep.retry_cleanup apply."""
    from celery.exceptions import TimeoutError as NoAnswer

    from tasks import producer

    rt = runtime()
    page: Page[Lease] | None = None  # with filters: the page of leases they match
    beyond = 0
    if lease_id is not None:
        if state or provider or tenant or older_than is not None:
            raise typer.BadParameter("give a lease id or filters, not both")
        targets = [resolve(lease_id)]
    else:
        if not state:
            raise typer.BadParameter("give a lease id, or --state (and other filters) with "
                                     "--yes", param_hint="--state")
        _refuse_ended_states(state)
        page = lease_page(rt.store, _filter(state, provider, tenant, older_than), limit)
        targets = page.rows
        beyond = _beyond_limit(page)
        if not targets:  # nothing to do, with --yes or without: do not invite --yes
            if yes:  # a broker it could not have sent to is still said (the next run would)
                require_broker()
            _nothing_matched(state, provider, tenant, older_than, yes, as_json)
        if not yes:  # the preview: it did what was asked, so exit 0
            if as_json:
                emit_json({"dry_run": True, "would_destroy": [lease_json(x) for x in targets],
                           "destroyed": [], "more_matching": beyond})
            else:
                typer.echo(table(["lease", "state", "provider", "created"],
                                 [[x.lease_id, x.state, x.provider, x.created_at]
                                  for x in targets]))
            more = (f" (the newest {len(targets)} of {page.total_text} that match: --limit "
                    f"{page.limit})" if beyond else "")
            typer.echo(f"would destroy {len(targets)} lease(s){more}; nothing was destroyed: "
                       "add --yes to do it", err=True)
            raise typer.Exit(ExitCode.OK)
    require_broker()
    sent = [(x.lease_id, producer.destroy_lease(x.lease_id, reason)) for x in targets]
    results: list[dict[str, Any]] = []
    failed = 0
    deadline = time.monotonic() + wait_s  # for all answers together, not each
    for ident, result in sent:
        try:
            if not wait_s:  # sent, not awaited: nothing says a worker took it
                results.append({"lease_id": ident, "task_id": result.id, "result": "sent"})
                continue
            # a timeout of 0 would wait for ever: once past the deadline, only look
            answer = result.get(timeout=max(deadline - time.monotonic(), 0.01),
                                propagate=True)
            results.append({"lease_id": ident, "task_id": result.id, **answer})
        except NoAnswer:  # still queued, or a worker is still on it
            results.append({"lease_id": ident, "task_id": result.id,
                            "result": "running" if result.state == "STARTED" else "queued"})
        except Exception as exc:  # the task's own error, reported per lease
            failed += 1
            results.append({"lease_id": ident, "task_id": result.id, "result": "failed",
                            "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    queued, running, unawaited = (sum(r["result"] == kind for r in results)
                                  for kind in ("queued", "running", "sent"))
    if as_json:
        emit_json({"destroyed": results, "failed": failed,
                   "unanswered": queued + running + unawaited,
                   **({"more_matching": beyond} if page is not None else {})})
    else:
        typer.echo(table(["lease", "result", "state", "task", "error"],
                         [[r["lease_id"], r.get("result"), r.get("state"), r["task_id"],
                           r.get("error")] for r in results]))
    # Nothing to destroy, and nothing failed now (exit 0): the lease's cleanup gave up
    # earlier, and only retry or forget moves it on.
    abandoned = [r["lease_id"] for r in results
                 if r.get("result") == "already_ended" and r.get("state") == LeaseState.ABANDONED]
    if abandoned:
        one = len(abandoned) == 1
        which = abandoned[0] if one else "<id>"
        subject = f"lease {which} is" if one else f"{len(abandoned)} leases are"
        error_line(f"{subject} abandoned (cleanup gave up; destroy does not try again): "
                   f"`leasekeeper leases retry {which}` gives it fresh cleanup attempts, or "
                   f"`leasekeeper leases forget {which}` once it was removed by hand")
    if queued:
        error_line(f"no worker answered within {wait_s:g} s; the destroy of {queued} "
                   "lease(s) is queued and runs when a worker takes it; check "
                   "`leasekeeper health --worker`")
    if unawaited:
        error_line(f"--wait 0: the destroy of {unawaited} lease(s) was sent, not awaited; "
                   "nothing confirms a worker took it (`leasekeeper health --worker` says "
                   "whether one is up; `leasekeeper leases show <id>` shows each lease's "
                   "state)")
    if running:
        error_line(f"{running} destroy(s) still running on a worker after {wait_s:g} s; "
                   "`leasekeeper leases show <id>` shows when each ends")
    if page is not None and beyond:
        error_line(f"{page.total_text} lease(s) match and --limit {page.limit} took the newest "
                   f"{len(targets)}: {beyond}{'+' if page.total_capped else ''} more "
                   f"{'was' if beyond == 1 and not page.total_capped else 'were'} not "
                   "destroyed; run the same command again for the next ones, or raise --limit "
                   f"(at most {MAX_LIMIT})")
    raise typer.Exit(ExitCode.NEEDS_ATTENTION if failed or queued or running or unawaited
                     or beyond else ExitCode.OK)


def _nothing_matched(state: list[str], provider: str | None, tenant: str | None,
                     older_than: str | None, yes: bool, as_json: bool) -> NoReturn:
    """A filtered destroy that matched no lease: say so, exit 0 (it did what was asked),
    without inviting --yes, which would do nothing more."""
    if as_json:
        emit_json({"destroyed": [], "failed": 0, "unanswered": 0, "more_matching": 0} if yes
                  else {"dry_run": True, "would_destroy": [], "destroyed": [],
                        "more_matching": 0})
    error_line(f"no lease matched {_filters_text(state, provider, tenant, older_than)}; "
               "nothing to destroy")
    raise typer.Exit(ExitCode.OK)


def _refuse_ended_states(states: list[str]) -> None:
    """A destroy never moves a lease on from a final state: a filter on one would answer
    already_ended for the same leases at every run of the command."""
    if LeaseState.DESTROYED in states:
        raise typer.BadParameter("--state destroyed matches leases already destroyed: nothing "
                                 "is left to destroy", param_hint="--state")
    if LeaseState.ABANDONED in states:
        raise typer.BadParameter(
            "--state abandoned matches leases whose cleanup gave up, which a destroy does not "
            "try again: `leasekeeper leases retry <id>` gives one fresh cleanup attempts, or "
            "`leasekeeper leases forget <id>` once it was removed by hand (`leasekeeper leases "
            "list --state abandoned` lists them)", param_hint="--state")


def _beyond_limit(page: Page[Lease]) -> int:
    """How many leases match beyond the page (counted up to the count's cap)."""
    return max(page.total - len(page.rows), 1) if page.next_before else 0


@leases_cli.command("retry")
def leases_retry(lease_id: str) -> None:
    """Give an abandoned lease a fresh set of cleanup attempts."""
    from tasks.operator import retry_abandoned

    lease_id = resolve(lease_id).lease_id
    if not retry_abandoned(runtime().store, lease_id):
        _not_abandoned(lease_id, "retried")
    typer.echo("queued for sweep.retry_cleanup")


@leases_cli.command("forget")
def leases_forget(lease_id: str, reason: Annotated[str, typer.Option()] = "by operator") -> None:
    """Mark an abandoned lease destroyed: the operator removed it by hand. (If it is in
    fact still there, sweep.orphans finds it and cleans it up with fresh attempts.)"""
    from tasks.destroy import clean_reason, without_marked_secrets
    from tasks.operator import forget_abandoned

    lease_id = resolve(lease_id).lease_id
    rt = runtime()
    # the history keeps it, shown by `leases show` and the console: cleaned as a destroy's
    # reason is (the lease's secrets scrubbed, cut to REASON_MAX_CHARS)
    reason = clean_reason(without_marked_secrets(rt, lease_id, reason))
    if not forget_abandoned(rt.store, lease_id, reason):
        _not_abandoned(lease_id, "forgotten")
    typer.echo("forgotten")


def _not_abandoned(lease_id: str, done: str) -> NoReturn:
    """Refuse retry/forget: bad input (exit 2, by run_cli), naming the lease's state and
    what to do."""
    from providers.errors import InvalidRequest

    state = runtime().store.get_lease(lease_id).state
    if state in LIVE_STATES:
        hint = f"to end it, `leasekeeper leases destroy {lease_id}`"
    elif state == LeaseState.DESTROYED:
        hint = "it is gone: nothing to do"
    else:
        hint = (f"its cleanup is under way; `leasekeeper leases show {lease_id}` shows each "
                "attempt")
    raise InvalidRequest(f"lease {lease_id} is {state}: only an abandoned lease can be "
                         f"{done}; {hint}")
