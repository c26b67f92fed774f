"""The console's pages and actions (Starlette), rendered with the Jinja2 templates beside it.

    GET  /leases                    filters (state, provider, tenant, age), counts by state,
                                    newest first, keyset pages (?before=<lease id>)
    GET  /leases/{id}               fields, run, whole history (task links to Flower)
    GET  /attention                 abandoned and pending_cleanup leases, their last error
    GET  /leases/{id}/{action}      confirmation page for retry | forget | destroy (409 if
                                    the lease's state does not allow it)
    POST /leases/{id}/{action}      do it (CSRF token required), through tasks/operator.py
    GET  /sweeps                    the last ticks of each sweep with their summaries

Store reads run in a worker thread (the store is synchronous). Nothing secret is rendered:
specs are stored redacted and the page shows only env *names*.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import jinja2
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import QueryParams
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Match, Route
from starlette.templating import Jinja2Templates
from starlette.types import Receive, Scope, Send

from models.observe import LeaseFilter, Observe
from models.schema import Lease, LeaseState, utcnow
from models.store import Store
from providers.errors import LeasekeeperError, NotFound
from providers.spec import check_id
from tasks.operator import (
    OperatorAction,
    console_reason,
    forget_abandoned,
    request_destroy,
    retry_abandoned,
)
from tasks.text import printable, storable
from workers.beat import SWEEPS
from workers.cli_common import MAX_DURATION_D
from workers.console.auth import BasicAuth, Csrf, unauthorized
from workers.settings import Settings

TEMPLATES = Path(__file__).resolve().parent / "templates"
ATTENTION_STATES = (LeaseState.ABANDONED, LeaseState.PENDING_CLEANUP)
# Which buttons a lease in each state offers (the same rules as the CLI's commands).
ACTIONS: dict[str, tuple[OperatorAction, ...]] = {
    LeaseState.ABANDONED: (OperatorAction.RETRY, OperatorAction.FORGET),
    LeaseState.PENDING_CLEANUP: (OperatorAction.DESTROY,),
    LeaseState.ACTIVE: (OperatorAction.DESTROY,),
    LeaseState.WARM: (OperatorAction.DESTROY,),
    LeaseState.PROVISIONING: (OperatorAction.DESTROY,),
}
# The banner after an action (?done=<code>): only these texts, never text from the URL.
DONE = {"retried": "queued for sweep.retry_cleanup",
        "not_retried": "not retried: only abandoned leases retry",
        "forgotten": "forgotten", "not_forgotten": "not forgotten: only abandoned leases",
        "destroy_sent": "lease.destroy sent"}
TICKS_SHOWN = 5
_MAX_FILTER_LEN = 128
_MAX_OLDER_MIN = MAX_DURATION_D * 1440  # 100 years, as the CLI's --older-than
_MINUTES = re.compile(r"[0-9]+")
_TASK_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@dataclass
class CachedCount:
    """The destroyed leases' count: all history, O(rows) to count, so at most once a
    minute (the other states' counts are a small slice of the index, read every time)."""

    count: Callable[[], int]
    max_age_s: float = 60.0
    _value: int = 0
    _at: float = -1e9

    def get(self) -> int:
        if time.monotonic() - self._at > self.max_age_s:
            self._value, self._at = self.count(), time.monotonic()
        return self._value


class BadRequest(Exception):
    """A query or form value the console cannot use; the message says what to change."""


class Conflict(Exception):
    """An action the lease's state does not allow (the same rules as its buttons)."""


def age(moment: datetime | None) -> str:
    if moment is None:
        return "-"
    seconds = int((utcnow() - moment).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def article(word: str) -> str:
    """'an' before a vowel (an active, an abandoned lease), else 'a'."""
    return "an" if word[:1] in "aeiou" else "a"


def ts(moment: datetime | None) -> str:
    return moment.strftime("%Y-%m-%d %H:%M:%S") + "Z" if moment else "-"


def _shown(value: Any) -> Any:
    """Every value a page shows: text as the store would keep it (tasks/text.py), so a row
    stored before a character was replaced (a C1 control, a bidi override) shows it
    replaced too."""
    return storable(value) if isinstance(value, str) else value


def safe_spec(spec: dict[str, Any] | None) -> dict[str, Any]:
    """The spec to show: env values and anything secret left out (names only)."""
    shown: dict[str, Any] = {}
    for key, value in (spec or {}).items():
        if "secret" in key.lower():
            shown[key] = "(never shown)"
        elif key == "env" and isinstance(value, dict):
            shown[key] = sorted(value)
        else:
            shown[key] = value
    return shown


def parse_filter(request: Request) -> LeaseFilter:
    q = request.query_params
    for key, text in q.multi_items():  # before any query (PostgreSQL refuses a NUL)
        if not printable(text):
            raise BadRequest(f"{key[:40]!r} must be printable text, without NUL or other "
                             f"control characters; got {text[:40]!r}")
    state = q.get("state") or None
    if state is not None and state not in set(LeaseState):
        raise BadRequest(f"state must be one of {', '.join(LeaseState)}; got {state[:40]!r}")
    provider, tenant = q.get("provider") or None, q.get("tenant") or None
    for name, value in (("provider", provider), ("tenant", tenant)):
        if value is not None and len(value) > _MAX_FILTER_LEN:
            raise BadRequest(f"{name} is at most {_MAX_FILTER_LEN} characters")
    older = q.get("older_than_min") or None
    if older is not None and not _MINUTES.fullmatch(older):
        raise BadRequest("older_than_min must be a whole number of minutes (digits 0-9); "
                         f"got {older[:20]!r}")
    if older is not None and (len(older) > 20 or int(older) > _MAX_OLDER_MIN):
        raise BadRequest(f"older_than_min is at most {_MAX_OLDER_MIN} (100 years); "
                         f"got {older[:20]}")
    return LeaseFilter(state, provider, tenant, int(older) * 60 if older else None)


def lease_id_of(request: Request) -> str:
    try:
        return check_id("lease_id", request.path_params["lease_id"])
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


def action_of(request: Request) -> OperatorAction:
    value = str(request.path_params["action"])
    try:
        return OperatorAction(value)
    except ValueError:
        raise BadRequest(f"action must be one of {', '.join(OperatorAction)}; "
                         f"got {value[:20]!r}") from None


def done_message(q: QueryParams) -> str:
    """The banner for ?done=<code> (none for a code not in DONE); a destroy's task id is
    shown only if it is a task id (a UUID)."""
    code, task = q.get("done", ""), q.get("task", "")
    if code == "destroy_sent" and _TASK_ID.fullmatch(task):
        return f"{DONE[code]} (task {task})"
    return DONE.get(code, "")


def build_app(settings: Settings, store: Store, user: str, password: str,
              destroy: Callable[[str, str], str] = request_destroy) -> Starlette:
    observe = Observe(store)
    csrf = Csrf()
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True,
                             undefined=jinja2.StrictUndefined, finalize=_shown)
    env.filters["ts"] = ts
    env.globals.update(age=age, flower=settings.console_flower_url.rstrip("/"),
                       states=list(LeaseState))
    templates = Jinja2Templates(env=env)
    page_size = settings.console_page_size
    destroyed_count = CachedCount(lambda: observe.counts_by_state(
        [LeaseState.DESTROYED]).get(LeaseState.DESTROYED, 0))

    def render(request: Request, name: str, status: int = 200, **context: Any) -> Response:
        return templates.TemplateResponse(request, name, context, status_code=status)

    def who(request: Request) -> str:
        return str(request.user.display_name)

    def failed(status: int) -> Callable[[Request, Exception], Any]:
        async def handler(request: Request, exc: Exception) -> Response:
            said = exc.outside_a_task() if isinstance(exc, LeasekeeperError) else str(exc)
            return render(request, "error.html", status, message=said)
        return handler

    async def leases(request: Request) -> Response:
        flt = parse_filter(request)
        before = request.query_params.get("before") or None
        if before is not None:
            try:
                check_id("before", before)
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
            # else the newest page, as if unfiltered: 404, as the CLI's --before exits 4
            if await run_in_threadpool(store.find_lease, before) is None:
                raise NotFound(f"no lease {before[:64]!r} to list leases before; follow "
                               "the page's next link, or open /leases for the newest")
        page = await run_in_threadpool(observe.lease_page, flt, before, page_size)
        counts = await run_in_threadpool(observe.counts_by_state)
        counts[LeaseState.DESTROYED] = await run_in_threadpool(destroyed_count.get)
        params = {k: v for k, v in request.query_params.items() if k != "before" and v}
        next_url = (f"/leases?{urlencode({**params, 'before': page.next_before})}"
                    if page.next_before else None)
        return render(request, "leases.html", leases=page.rows, counts=counts, flt=flt,
                      params=params, next_url=next_url)

    async def lease(request: Request) -> Response:
        lease_id = lease_id_of(request)
        row: Lease = await run_in_threadpool(store.get_lease, lease_id)
        run = await run_in_threadpool(store.get_run, row.run_id) if row.run_id else None
        events = await run_in_threadpool(store.events, lease_id)
        return render(request, "lease.html", lease=row, run=run, events=events,
                      spec=safe_spec(row.spec), actions=ACTIONS.get(row.state, ()),
                      done=done_message(request.query_params))

    async def attention(request: Request) -> Response:
        groups, more = {}, {}
        for state in ATTENTION_STATES:
            page = await run_in_threadpool(observe.lease_page, LeaseFilter(state=state), None,
                                           page_size, True)
            groups[state] = page
            if page.next_before:  # the rest, in the leases list's pages
                more[state] = f"/leases?{urlencode({'state': state, 'before': page.next_before})}"
        return render(request, "attention.html", groups=groups, more=more, actions=ACTIONS)

    async def allowed(lease_id: str, action: OperatorAction) -> Lease:
        row: Lease = await run_in_threadpool(store.get_lease, lease_id)
        if action not in ACTIONS.get(row.state, ()):
            applies = [state for state, actions in ACTIONS.items() if action in actions]
            raise Conflict(f"{action} does not apply to {article(row.state)} {row.state} "
                           "lease (only to "
                           f"{', '.join(applies)} leases); open the lease page to see what "
                           "does")
        return row

    async def confirm(request: Request) -> Response:
        lease_id, action = lease_id_of(request), action_of(request)
        row = await allowed(lease_id, action)
        return render(request, "confirm.html", lease=row, action=action,
                      token=csrf.token(who(request), lease_id, action))

    async def act(request: Request) -> Response:
        lease_id, action = lease_id_of(request), action_of(request)
        form = await request.form()
        if not csrf.valid(str(form.get("csrf", "")), who(request), lease_id, action):
            return render(request, "error.html", 403, message=(
                "this form is stale or did not come from the console (CSRF check "
                "failed); open the lease page and confirm again"))
        await allowed(lease_id, action)
        actor = console_reason(who(request))
        done: dict[str, str]
        if action == OperatorAction.RETRY:  # the transition is guarded: it may lose a race
            ok = await run_in_threadpool(retry_abandoned, store, lease_id, actor)
            done = {"done": "retried" if ok else "not_retried"}
        elif action == OperatorAction.FORGET:
            ok = await run_in_threadpool(forget_abandoned, store, lease_id,
                                         "by operator", actor)
            done = {"done": "forgotten" if ok else "not_forgotten"}
        else:
            task_id = await run_in_threadpool(destroy, lease_id, actor)
            done = {"done": "destroy_sent", "task": task_id}
        return RedirectResponse(f"/leases/{lease_id}?{urlencode(done)}", status_code=303)

    async def sweeps(request: Request) -> Response:
        ticks = {}
        for sweep in SWEEPS:
            ticks[sweep] = await run_in_threadpool(observe.recent_ticks, sweep, TICKS_SHOWN)
        return render(request, "sweeps.html", ticks=ticks)

    async def home(_request: Request) -> Response:
        return RedirectResponse("/leases", status_code=302)

    async def without_slash(scope: Scope, receive: Receive, send: Send) -> None:
        """/leases/ to /leases, as Starlette's own redirect, but by path alone: its Location
        would name the request's Host header."""
        path = str(scope["path"]).rstrip("/")
        if scope["type"] == "http" and path and any(
                route.matches({**scope, "path": path})[0] != Match.NONE for route in routes):
            query = scope["query_string"].decode("latin-1")
            response = RedirectResponse(path + (f"?{query}" if query else ""))
            await response(scope, receive, send)
        else:
            await app.router.not_found(scope, receive, send)

    routes = [
        Route("/", home),
        Route("/leases", leases),
        Route("/attention", attention),
        Route("/sweeps", sweeps),
        Route("/leases/{lease_id}", lease),
        Route("/leases/{lease_id}/{action}", confirm, methods=["GET"]),
        Route("/leases/{lease_id}/{action}", act, methods=["POST"]),
    ]
    middleware = [Middleware(AuthenticationMiddleware, backend=BasicAuth(user, password),
                             on_error=unauthorized)]
    handlers = {BadRequest: failed(400), NotFound: failed(404), Conflict: failed(409),
                LeasekeeperError: failed(503)}
    app = Starlette(routes=routes, middleware=middleware,
                    exception_handlers=handlers)  # type: ignore[arg-type]
    app.router.redirect_slashes, app.router.default = False, without_slash
    return app
