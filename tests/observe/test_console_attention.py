"""The console's "needs attention" page when more leases need attention than a page holds:
each state says how many there are ("3 newest of 5") and links to the rest, in the leases
list's keyset pages; a state that fits its page shows its count and no link. Against
`leasekeeper console` over HTTP with basic auth, on a real SQLite store."""

from __future__ import annotations

import re
import secrets
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest

from models.migrate import upgrade
from models.schema import LeaseState, utcnow
from models.store import NewLease, Store
from tasks.leases import new_lease_id
from tests.observe.conftest import leasekeeper_process
from tests.services import RedisServer, free_port
from tests.stack import WorkerStack

pytestmark = pytest.mark.timeout(180)
PAGE = 3


def a_lease(store: Store, state: LeaseState) -> str:
    """A lease moved to ``state`` as a worker would; ids are time-ordered, like real ones."""
    lease_id, now = new_lease_id(), utcnow()
    store.create_intent(NewLease(
        lease_id=lease_id, sandbox_key=f"sk-{lease_id}", provider="noop",
        provider_lease_id=f"lk-{lease_id[:20]}", reuse=False, tenant="acme",
        thread_id=None, run_id=f"run-{lease_id}", spec={},
        acquire_deadline_at=now + timedelta(minutes=1), deadline_at=now + timedelta(hours=1),
        idle_timeout_s=60), task_id=None)
    assert store.transition(lease_id, {LeaseState.PROVISIONING}, state,
                            "set up by the test") is not None
    return lease_id


@pytest.fixture
def console(redis_server: RedisServer, tmp_path: Path) -> Iterator[tuple[httpx.Client, Store]]:
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    upgrade(store_url)
    stack = WorkerStack(name="console-attention", store_url=store_url, root=tmp_path,
                        broker_url=redis_server.url,
                        extra_env={"LEASEKEEPER_TASK_QUEUE": f"attn-{uuid.uuid4().hex[:8]}"})
    port, password = free_port(), secrets.token_urlsafe(12)
    env = {"LEASEKEEPER_CONSOLE_PORT": str(port), "LEASEKEEPER_CONSOLE_PAGE_SIZE": str(PAGE),
           "LEASEKEEPER_FLOWER_BASIC_AUTH": f"ops:{password}"}
    store = Store(store_url)
    try:
        with leasekeeper_process(stack, "console", env, port, tmp_path / "console.log"), \
                httpx.Client(base_url=f"http://127.0.0.1:{port}", auth=("ops", password),
                             timeout=10) as client:
            yield client, store
    finally:
        store.dispose()


def shown_ids(html: str, table: str) -> list[str]:
    body = html.split(f'id="{table}"', 1)[1].split("</table>", 1)[0]
    return re.findall(r'<a href="/leases/([0-9a-f]+)">', body)


def test_more_leases_than_a_page_say_how_many_and_link_to_the_rest(
        console: tuple[httpx.Client, Store]) -> None:
    client, store = console
    # given 5 abandoned leases and 2 pending_cleanup ones, on pages of 3
    abandoned = [a_lease(store, LeaseState.ABANDONED) for _ in range(5)]
    pending = [a_lease(store, LeaseState.PENDING_CLEANUP) for _ in range(2)]

    page = client.get("/attention")
    assert page.status_code == 200
    html = page.text
    # the newest 3 abandoned, how many there are, and a link to the older ones
    assert shown_ids(html, "attention-abandoned") == abandoned[:1:-1]
    assert re.search(r'id="count-abandoned">3 newest of 5<', html), html
    (more,) = re.findall(r'id="more-abandoned" href="([^"]+)"', html)
    assert more == f"/leases?state=abandoned&amp;before={abandoned[2]}"
    # the pending_cleanup ones fit: their count, no link
    assert shown_ids(html, "attention-pending_cleanup") == pending[::-1]
    assert re.search(r'id="count-pending_cleanup">2<', html), html
    assert 'id="more-pending_cleanup"' not in html

    # the link lists the other two, oldest last, and nothing else
    rest = client.get(more.replace("&amp;", "&"))
    assert rest.status_code == 200
    assert shown_ids(rest.text, "leases") == abandoned[1::-1]
