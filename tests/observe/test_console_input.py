"""What an operator (or a link someone sent them) can put in the console's URLs: bad filter
values are a 400 naming the fix (never a 500, never a store outage), the banner after an
action is a fixed message chosen by a code, redirects name a path and never the Host
header, and a confirmation page is only offered for what the lease's state allows. Each
against `leasekeeper console` over HTTP with basic auth, on a real SQLite and PostgreSQL
store."""

from __future__ import annotations

import base64
import html
import http.client
import re
import secrets
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from models.migrate import upgrade
from models.schema import LeaseState, utcnow
from models.store import NewLease, Store
from tests.observe.conftest import leasekeeper_process
from tests.services import RedisServer, free_port
from tests.stack import WorkerStack

pytestmark = pytest.mark.timeout(300)


@dataclass
class Console:
    url: str
    auth: tuple[str, str]
    store: Store
    log: Path

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, auth=self.auth, timeout=10, **kwargs)

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        with self.client() as c:
            return c.get(path, **kwargs)

    def raw_get(self, target: str, headers: dict[str, str]) -> http.client.HTTPResponse:
        """GET with the request target exactly as given (httpx reads '//x/' as a host)."""
        conn = http.client.HTTPConnection(self.url.removeprefix("http://"), timeout=10)
        credentials = base64.b64encode(":".join(self.auth).encode()).decode()
        conn.request("GET", target, headers={"Authorization": f"Basic {credentials}",
                                             **headers})
        resp = conn.getresponse()
        resp.read()
        conn.close()
        return resp

    def lease(self, state: LeaseState) -> str:
        """A lease of the store in ``state`` (recorded, then moved there as a worker would)."""
        lease_id = f"ci-{uuid.uuid4().hex[:12]}"
        now = utcnow()
        self.store.create_intent(NewLease(
            lease_id=lease_id, sandbox_key=f"sk-{lease_id}", provider="noop",
            provider_lease_id=f"lk-{lease_id}", reuse=False, tenant="acme", thread_id=None,
            run_id=f"run-{lease_id}", spec={}, acquire_deadline_at=now + timedelta(minutes=1),
            deadline_at=now + timedelta(hours=1), idle_timeout_s=60), task_id=None)
        if state != LeaseState.PROVISIONING:
            assert self.store.transition(lease_id, {LeaseState.PROVISIONING}, state,
                                         "set up by the test") is not None
        return lease_id


@pytest.fixture(scope="module",
                params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def console(request: pytest.FixtureRequest, redis_server: RedisServer,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    """`leasekeeper console` on a fresh store; its tasks (destroy) go to a queue of its own
    that no worker reads."""
    root = tmp_path_factory.mktemp(f"console-{request.param}")
    if request.param == "sqlite":
        store_url = f"sqlite:///{root / 'store.db'}"
    else:
        store_url = request.getfixturevalue("postgres_server").create_database(
            f"lk_{uuid.uuid4().hex[:12]}")
    upgrade(store_url)
    stack = WorkerStack(name="console-input", store_url=store_url, root=root,
                        broker_url=redis_server.url,
                        extra_env={"LEASEKEEPER_TASK_QUEUE": f"console-{uuid.uuid4().hex[:8]}"})
    port, password = free_port(), secrets.token_urlsafe(12)
    env = {"LEASEKEEPER_CONSOLE_PORT": str(port),
           "LEASEKEEPER_FLOWER_BASIC_AUTH": f"ops:{password}"}
    store = Store(store_url)
    try:
        with leasekeeper_process(stack, "console", env, port, root / "console.log"):
            yield Console(f"http://127.0.0.1:{port}", ("ops", password), store,
                          root / "console.log")
    finally:
        store.dispose()


@pytest.fixture
def no_traceback(console: Console) -> Iterator[None]:
    """The console logs nothing unforeseen while the test runs (a 500 logs a traceback)."""
    before = console.log.stat().st_size
    yield
    with open(console.log, "rb") as log:
        log.seek(before)
        assert b"Traceback" not in log.read()


def _error(resp: httpx.Response) -> str:
    found = re.search(r'id="error">(.*?)</p>', resp.text, re.S)
    assert found, resp.text[:500]
    return found.group(1)


def _token(resp: httpx.Response) -> str:
    found = re.search(r'name="csrf" value="([0-9a-f]+)"', resp.text)
    assert found, resp.text[:500]
    return found.group(1)


@pytest.mark.usefixtures("no_traceback")
@pytest.mark.parametrize("value", [
    "\u00b2",  # a superscript two: str.isdigit() says yes, int() says no
    "\u0663",  # an Arabic-Indic three: int() reads it
    "99999999999999", "52560000000", "52560001", "9" * 5000, "-5", "1e3", "5m", " 5", "1.5",
])
def test_an_age_that_is_not_ascii_digits_within_100_years_is_a_400(
        console: Console, value: str) -> None:
    resp = console.get("/leases", params={"older_than_min": value})
    assert resp.status_code == 400, resp.text[:300]
    message = _error(resp)
    assert "older_than_min" in message
    if value.isascii() and value.isdigit():
        assert "at most 52560000" in message  # 100 years, as the CLI's --older-than
    else:
        assert "digits 0-9" in message


@pytest.mark.usefixtures("no_traceback")
def test_the_largest_age_and_none_are_fine(console: Console) -> None:
    old = console.lease(LeaseState.ACTIVE)
    assert console.get("/leases", params={"older_than_min": "52560000"}).status_code == 200
    assert old in console.get("/leases", params={"older_than_min": "0"}).text


@pytest.mark.usefixtures("no_traceback")
@pytest.mark.parametrize(("name", "value"), [
    ("tenant", "\0"), ("tenant", "acme\0"), ("provider", "no\0op"), ("tenant", "\x1b[31m"),
    ("provider", "local\n"), ("state", "\0"), ("older_than_min", "5\0"), ("before", "a\0"),
])
def test_a_control_character_in_a_filter_is_a_400_not_a_store_outage(
        console: Console, name: str, value: str) -> None:
    resp = console.get("/leases", params={name: value})
    assert resp.status_code == 400, resp.text[:300]
    message = _error(resp)
    assert name in message and "store" not in message


@pytest.mark.usefixtures("no_traceback")
def test_the_banner_is_a_fixed_message_chosen_by_a_code(console: Console) -> None:
    lease_id = console.lease(LeaseState.ACTIVE)
    spoof = "Your account is locked: call +1 555 0100"
    page = console.get(f"/leases/{lease_id}", params={"done": spoof})
    assert page.status_code == 200
    assert 'id="done"' not in page.text and "call +1 555" not in page.text

    page = console.get(f"/leases/{lease_id}", params={"done": "retried"})
    assert '<p class="done" id="done">queued for sweep.retry_cleanup</p>' in page.text
    task = str(uuid.uuid4())
    page = console.get(f"/leases/{lease_id}", params={"done": "destroy_sent", "task": task})
    assert f'id="done">lease.destroy sent (task {task})</p>' in page.text
    page = console.get(f"/leases/{lease_id}", params={"done": "destroy_sent", "task": spoof})
    assert 'id="done">lease.destroy sent</p>' in page.text and "call +1 555" not in page.text


@pytest.mark.usefixtures("no_traceback")
def test_redirects_name_a_path_never_the_host_header(console: Console) -> None:
    lease_id = console.lease(LeaseState.ACTIVE)
    evil = {"Host": "evil.example"}
    with console.client(headers=evil) as c:
        for path, location in [("/leases/", "/leases"),
                               ("/leases/?tenant=acme", "/leases?tenant=acme"),
                               (f"/leases/{lease_id}/", f"/leases/{lease_id}"),
                               ("/attention/", "/attention"), ("/", "/leases")]:
            resp = c.get(path)
            assert resp.is_redirect and resp.headers["location"] == location, path
    # a path that is no page is not redirected anywhere
    for target in ("//evil.example/", "//evil.example/leases/", "/\\evil.example/",
                   "/nothing/", "/leases/a/b/c/"):
        resp = console.raw_get(target, evil)
        assert resp.status == 404 and resp.getheader("location") is None, target
    # and a redirect still needs the credentials
    assert httpx.get(f"{console.url}/leases/", headers=evil, timeout=10).status_code == 401


@pytest.mark.usefixtures("no_traceback")
def test_a_confirmation_is_only_offered_for_what_the_state_allows(console: Console) -> None:
    warm, active = console.lease(LeaseState.WARM), console.lease(LeaseState.ACTIVE)
    abandoned, gone = console.lease(LeaseState.ABANDONED), console.lease(LeaseState.DESTROYED)
    with console.client() as c:
        for lease_id, action, state in [(warm, "forget", "a warm"),
                                        (active, "retry", "an active"),
                                        (abandoned, "destroy", "an abandoned"),
                                        (gone, "destroy", "a destroyed")]:
            resp = c.get(f"/leases/{lease_id}/{action}")
            assert resp.status_code == 409, (action, state)
            assert 'id="confirm"' not in resp.text and 'name="csrf"' not in resp.text
            # Before: "a active", "a abandoned"
            assert f"{action} does not apply to {state} lease" in _error(resp)
            # a forged form is still refused first, by its token
            forged = c.post(f"/leases/{lease_id}/{action}", data={"csrf": "forged"})
            assert forged.status_code == 403
        assert console.store.get_lease(warm).state == LeaseState.WARM

        # Allowed: the page, then the action, back to the lease by its path.
        token = _token(c.get(f"/leases/{abandoned}/retry"))
        done = c.post(f"/leases/{abandoned}/retry", data={"csrf": token})
        assert done.status_code == 303
        assert done.headers["location"] == f"/leases/{abandoned}?done=retried"
        assert console.store.get_lease(abandoned).state == LeaseState.PENDING_CLEANUP

        token = _token(c.get(f"/leases/{active}/destroy"))
        done = c.post(f"/leases/{active}/destroy", data={"csrf": token})
        assert done.status_code == 303
        assert re.fullmatch(rf"/leases/{active}\?done=destroy_sent&task=[0-9a-f-]{{36}}",
                            done.headers["location"])
        assert "lease.destroy sent (task " in c.get(done.headers["location"]).text

        # The state changed between the page and the button: the POST says so too.
        again = console.lease(LeaseState.ABANDONED)
        token = _token(c.get(f"/leases/{again}/forget"))
        assert console.store.transition(again, {LeaseState.ABANDONED}, LeaseState.DESTROYED,
                                        "forgotten elsewhere") is not None
        late = c.post(f"/leases/{again}/forget", data={"csrf": token})
        assert late.status_code == 409
        assert "forget does not apply to a destroyed lease" in _error(late)


@pytest.mark.usefixtures("no_traceback")
def test_before_an_unknown_lease_is_a_404_as_the_cli_refuses_it(console: Console) -> None:
    # Before: 200 with the newest leases, as if ?before were not given (the CLI's
    # `leases list --before zzz` exits 4).
    newest = console.lease(LeaseState.ACTIVE)
    resp = console.get("/leases", params={"before": "zzz"})
    assert resp.status_code == 404, resp.text[:300]
    assert newest not in resp.text
    assert "no lease 'zzz' to list leases before" in html.unescape(_error(resp))
    assert console.get("/leases", params={"before": newest}).status_code == 200
