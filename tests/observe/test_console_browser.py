"""The lease console in a real browser: headless Chromium (Debian's chromium and
chromium-driver, driven by selenium) logs in, finds a lease made through the producer API,
opens its history, retries an abandoned lease, and the store shows the retry. Screenshots
of each page are saved under the test's tmp dir (screenshots/)."""

from __future__ import annotations

import base64
import secrets
import shutil
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

from models.schema import LeaseState
from tasks import producer
from tests.e2e.conftest import eventually
from tests.observe.conftest import REPO, leasekeeper_process
from tests.services import free_port
from tests.stack import WorkerStack
from workers.app import app

pytestmark = pytest.mark.timeout(300)
SECRET = "s3cr3t-" + uuid.uuid4().hex
CHROME_FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                "--window-size=1400,1000"]


def rid() -> str:
    return f"run-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def console(own_stack: WorkerStack, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A running `leasekeeper console`; yields its URL and its user:password."""
    port, auth = free_port(), f"ops:{secrets.token_urlsafe(12)}"
    env = {"LEASEKEEPER_CONSOLE_PORT": str(port), "LEASEKEEPER_FLOWER_BASIC_AUTH": auth,
           "LEASEKEEPER_CONSOLE_FLOWER_URL": "http://127.0.0.1:5555"}
    with leasekeeper_process(own_stack, "console", env, port, tmp_path / "console.log"):
        yield f"http://127.0.0.1:{port}", auth


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for flag in CHROME_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    service = Service(executable_path=shutil.which("chromedriver") or "/usr/bin/chromedriver",
                      log_output=str(tmp_path / "chromedriver.log"))
    driver = webdriver.Chrome(options=options, service=service)
    # A form's submit may return before the page it posts to has loaded (a loaded machine
    # answers the POST late): an element looked up then is looked for until it shows.
    driver.implicitly_wait(20)
    try:
        yield driver
    finally:
        driver.quit()


def _post(url: str, auth: str, data: dict[str, str]) -> int:
    request = urllib.request.Request(url, data=urllib.parse.urlencode(data).encode(),
                                     headers={"Authorization": "Basic "
                                              + base64.b64encode(auth.encode()).decode()})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_operator_finds_a_lease_reads_its_history_and_retries_an_abandoned_one(
        own_stack: WorkerStack, console: tuple[str, str], browser: webdriver.Chrome,
        tmp_path: Path) -> None:
    url, auth = console
    shots = tmp_path / "screenshots"
    shots.mkdir()
    store = own_stack.runtime().store
    # Given a lease made through the producer API (with a secret) and an abandoned lease.
    tenant = "acme-" + uuid.uuid4().hex[:6]
    lease_id = producer.acquire_lease(rid(), {"tenant": tenant, "env": {"MODE": "x"},
                                              "secret_env": {"API_TOKEN": SECRET}}
                                      ).get(90)["lease_id"]
    own_stack.faults.write({"destroy": [{"fault": "terminal", "times": 1}]})
    doomed = producer.acquire_lease(rid(), {"provider": "faulty", "tenant": tenant}
                                    ).get(90)["lease_id"]
    producer.destroy_lease(doomed)
    eventually(lambda: store.get_lease(doomed).state == LeaseState.ABANDONED, 60,
               "the lease to be abandoned")
    app.send_task("sweep.retry_cleanup").get(60)  # a tick for the sweeps page

    # Without credentials: refused.
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{url}/leases", timeout=10)
    assert refused.value.code == 401

    # Log in (basic auth, as Flower) and filter the leases by the tenant.
    user, password = auth.split(":", 1)
    base = url.replace("http://", f"http://{user}:{password}@")
    browser.get(f"{base}/leases?tenant={tenant}")
    browser.save_screenshot(str(shots / "1-leases.png"))
    assert int(browser.find_element(By.ID, "count-abandoned").text) >= 1
    rows = browser.find_elements(By.CSS_SELECTOR, "#leases a")
    assert {a.text for a in rows} == {lease_id, doomed}

    # Open the lease's history: intent, then active, each with its task in Flower.
    browser.find_element(By.LINK_TEXT, lease_id).click()
    browser.save_screenshot(str(shots / "2-lease.png"))
    assert browser.find_element(By.ID, "state").text == "active"
    history = browser.find_elements(By.CSS_SELECTOR, "#history tr")[1:]
    assert [r.find_elements(By.TAG_NAME, "td")[3].text for r in history] == [
        "provisioning", "active"]
    links = [a.get_attribute("href") for a in browser.find_elements(By.CSS_SELECTOR,
                                                                       "#history a")]
    assert links and all(link.startswith("http://127.0.0.1:5555/task/") for link in links)
    assert SECRET not in browser.page_source and "MODE" in browser.page_source

    # Retry the abandoned lease from "needs attention", through the confirmation page.
    browser.get(f"{base}/attention")
    browser.save_screenshot(str(shots / "3-attention.png"))
    row = browser.find_element(By.XPATH, f"//table[@id='attention-abandoned']//tr[td//a[text()"
                                         f"='{doomed}']]")
    assert "injected terminal fault" in row.text  # its last error
    row.find_element(By.LINK_TEXT, "retry…").click()
    browser.save_screenshot(str(shots / "4-confirm.png"))
    browser.find_element(By.ID, "confirm").click()
    browser.save_screenshot(str(shots / "5-retried.png"))
    assert browser.find_element(By.ID, "done").text == "queued for sweep.retry_cleanup"
    assert browser.find_element(By.ID, "state").text == "pending_cleanup"

    # Then the store has it: pending_cleanup with fresh attempts, the operator recorded.
    lease = store.get_lease(doomed)
    assert lease.state == LeaseState.PENDING_CLEANUP and lease.cleanup_attempts == 0
    assert store.events(doomed)[-1].reason == "operator ops (console): retry cleanup"

    # A form posted without the console's token changes nothing (CSRF).
    assert _post(f"{url}/leases/{lease_id}/destroy", auth, {"csrf": "forged"}) == 403
    assert store.get_lease(lease_id).state == LeaseState.ACTIVE

    browser.get(f"{base}/sweeps")
    browser.save_screenshot(str(shots / "6-sweeps.png"))
    ticks = browser.find_element(By.ID, "ticks-sweep.retry_cleanup").text
    assert "ran" in ticks and "destroys_enqueued" in ticks
    assert all((shots / name).stat().st_size > 0 for name in (
        "1-leases.png", "2-lease.png", "3-attention.png", "4-confirm.png", "5-retried.png",
        "6-sweeps.png"))

    # Destroy the producer's lease from its page: lease.destroy, as `destroy_lease` sends it.
    browser.get(f"{base}/leases/{lease_id}")
    browser.find_element(By.ID, "action-destroy").click()
    browser.find_element(By.ID, "confirm").click()
    assert browser.find_element(By.ID, "done").text.startswith("lease.destroy sent (task ")
    eventually(lambda: store.get_lease(lease_id).state == LeaseState.DESTROYED, 60,
               "the console's destroy")
    assert "destroy: operator ops (console)" in [e.reason for e in store.events(lease_id)]


def test_console_refuses_to_start_without_basic_auth(own_stack: WorkerStack) -> None:
    env = {k: v for k, v in own_stack.env.items() if k != "LEASEKEEPER_FLOWER_BASIC_AUTH"}
    done = subprocess.run([sys.executable, "-m", "workers.cli", "console"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert "LEASEKEEPER_FLOWER_BASIC_AUTH is not set" in done.stderr
    assert "Traceback" not in done.stderr
