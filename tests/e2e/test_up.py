"""`leasekeeper up`: the embedded backend end to end, as a new user drives it from one
directory: up, a producer call and the operator CLI from another process (through the env
file up writes), Ctrl-C, the demo, a second up, a child that cannot start."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import HIDDEN_PACKAGES, cli_env, eventually, leasekeeper
from tests.services import free_port
from tests.stack import REPO


class Up:
    """A `leasekeeper up` child process whose output is read as it comes."""

    def __init__(self, cwd: Path, env: dict[str, str], *args: str,
                 command: tuple[str, ...] = (sys.executable, "-m", "workers.cli")) -> None:
        self.out = cwd / f"up-{time.monotonic_ns()}.out"
        with open(self.out, "wb") as out:
            self.proc = subprocess.Popen([*command, "up", *args],
                                         cwd=cwd, env=env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def text(self) -> str:
        return self.out.read_text()

    def wait_for(self, needle: str, timeout_s: float = 240) -> str:
        def seen() -> str | None:
            if needle in self.text:
                return self.text
            assert self.proc.poll() is None, f"up exited {self.proc.returncode}:\n{self.text}"
            return None
        return eventually(seen, timeout_s, f"{needle!r} from up")

    def interrupt(self) -> str:
        """Ctrl-C, as in a terminal; up stops its children and says what stays running."""
        os.kill(self.proc.pid, signal.SIGINT)
        self.proc.wait(120)
        return self.text

    def stop(self) -> None:
        if self.proc.poll() is None:  # up stops its own children on SIGTERM
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


@contextlib.contextmanager
def up(cwd: Path, env: dict[str, str], *args: str,
       command: tuple[str, ...] = (sys.executable, "-m", "workers.cli")) -> Iterator[Up]:
    process = Up(cwd, env, *args, command=command)
    try:
        yield process
    finally:
        process.stop()


def user_env(**settings: str) -> dict[str, str]:
    return cli_env(**settings)


def broker_port(text: str) -> int:
    return int(re.search(r"redis://127\.0\.0\.1:(\d+)/", text).group(1))  # type: ignore[union-attr]


def assert_closed(port: int) -> None:
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def flower_status(url: str, auth: str) -> int:
    request = urllib.request.Request(f"{url}/api/workers?refresh=false", headers={
        "Authorization": "Basic " + base64.b64encode(auth.encode()).decode()})
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


@pytest.mark.timeout(400)
def test_up_runs_the_demo_and_leaves_nothing_running(tmp_path: Path) -> None:
    env = user_env(LEASEKEEPER_FLOWER_PORT="0")
    done = subprocess.run([sys.executable, "-m", "workers.cli", "up", "--demo", "5",
                           "--exit-after-demo"], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, check=False)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "demo: every lease reached its expected state" in out
    assert out.count("  ok  lease") == 5
    # Every line is timestamped; ids are whole (what `leases show` takes); the failed run
    # shows its status and exit code.
    assert all(re.match(r"^\d\d:\d\d:\d\d ", line) for line in out.splitlines()
               if line and not line.startswith(("  export", "In another", "Elsewhere"))), out
    assert re.search(r"ok  lease [0-9a-f]{32} destroyed .*run failed exit 3", out), out
    assert "Flower: http://127.0.0.1:" in out
    credentials = (tmp_path / ".var" / "flower-credentials").read_text().strip()
    assert credentials.split(":", 1)[1] not in out  # the password is not printed
    assert not any((tmp_path / ".var" / "sandboxes").iterdir())  # every sandbox is gone
    assert not (tmp_path / ".var" / "env").exists()  # removed when up stops
    observers = re.search(r"metrics: http://127\.0\.0\.1:(\d+)/metrics; lease console: "
                          r"http://127\.0\.0\.1:(\d+)/", out)
    assert observers, out
    # Every child is gone: nothing listens on its Redis, exporter or console port.
    for port in (broker_port(out), *map(int, observers.groups())):
        assert_closed(port)


@pytest.mark.timeout(900)
def test_a_new_users_hour_from_one_directory(tmp_path: Path) -> None:
    """up; a producer call and the CLI in other processes find it through .var/env;
    Ctrl-C says what stays running; the next up's demo counts only its own sandboxes;
    `leases destroy` ends the leftover lease."""
    env = user_env(LEASEKEEPER_FLOWER_PORT="0")
    with up(tmp_path, env) as first:
        first.wait_for("press Ctrl-C to stop")
        assert "export LEASEKEEPER_BROKER_URL=redis://127.0.0.1:" in first.text
        assert (tmp_path / ".var" / "env").is_file()
        acquire = subprocess.run(
            [sys.executable, "-c", "from tasks import producer; import json; print(json.dumps("
             "producer.acquire_lease('kept-1', {'tenant': 'acme'}).get(120)))"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, check=False)
        assert acquire.returncode == 0, acquire.stderr
        kept = json.loads(acquire.stdout)["lease_id"]
        listed = leasekeeper("leases", "list", "--state", "active", "--json", env=env,
                             cwd=tmp_path)
        assert listed.returncode == 0, listed.stderr
        assert [x["lease_id"] for x in json.loads(listed.stdout)["leases"]] == [kept]
        healthy = leasekeeper("health", "--worker", "--store", "--broker", env=env,
                              cwd=tmp_path)
        assert (healthy.returncode, healthy.stdout, healthy.stderr) == (0, "", "")
        said = first.interrupt()
    assert first.proc.returncode == 0, said
    assert "stays running after leasekeeper stops: 1 active lease(s) and 1 sandbox(es)" in said
    assert f"lk-{kept}" in said and " leases destroy --state active --yes" in said
    assert not (tmp_path / ".var" / "env").exists()

    # Before: "BAD 1 sandbox(es) still running: lk-01a23a91…" and exit 1.
    demo = subprocess.run([sys.executable, "-m", "workers.cli", "up", "--demo", "5",
                           "--exit-after-demo"], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, check=False)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "BAD" not in demo.stdout

    with up(tmp_path, env) as third:
        third.wait_for("press Ctrl-C to stop")
        destroyed = leasekeeper("leases", "destroy", "--state", "active", "--yes", "--json",
                                env=env, cwd=tmp_path)
        assert destroyed.returncode == 0, destroyed.stdout + destroyed.stderr
        answer = json.loads(destroyed.stdout)
        assert [(d["lease_id"], d["result"]) for d in answer["destroyed"]] == [
            (kept, "destroyed")]
        said = third.interrupt()
    assert "no lease is live and no sandbox is running" in said


@pytest.mark.timeout(600)
def test_after_the_demo_the_sweeps_run_on_their_normal_intervals(tmp_path: Path) -> None:
    # Before: 1-2 s sweeps kept running after the demo (~4.6 tasks/s in Flower).
    env = user_env(LEASEKEEPER_FLOWER_PORT="0")
    with up(tmp_path, env, "--demo", "1") as running:
        text = running.wait_for("press Ctrl-C to stop")
        assert "sweeps back to their intervals: reap_runs 60 s" in text
        time.sleep(3)  # any tick the restarted beat owed is sent by now
        before = json.loads(leasekeeper("status", "--json", env=env, cwd=tmp_path).stdout)
        time.sleep(4)  # four demo intervals of sweep.reap_runs
        after = json.loads(leasekeeper("status", "--json", env=env, cwd=tmp_path).stdout)
        ticks = {t["sweep"]: t["last_tick_at"] for t in before["sweeps"]}
        assert ticks["sweep.reap_runs"] is not None  # it did tick during the demo
        for tick in after["sweeps"]:
            # A sweep that ticked again did so a whole normal interval later, not 1-2 s.
            if tick["last_tick_at"] != ticks[tick["sweep"]]:
                assert ticks[tick["sweep"]] is not None
                assert tick["last_tick_at"] - ticks[tick["sweep"]] >= 0.9 * tick["interval_s"]
        assert {t["sweep"]: t["interval_s"] for t in after["sweeps"]}["sweep.reap_runs"] == 60
        # and the exporter says the same intervals: it kept the demo's 1-2 s before, so
        # SweepStalled (3 intervals) would have fired for every sweep for the whole session
        port = re.search(r"metrics: http://127\.0\.0\.1:(\d+)/metrics", text)
        assert port, text
        user, password = (tmp_path / ".var" / "flower-credentials").read_text().strip().split(
            ":", 1)
        scraped = httpx.get(f"http://127.0.0.1:{port.group(1)}/metrics", auth=(user, password),
                            timeout=10).text
        assert ('leasekeeper_sweep_interval_seconds{sweep="sweep.reap_runs"} 60.0'
                in scraped), scraped[:3000]


@pytest.mark.timeout(600)
def test_a_second_up_gets_its_own_flower_or_fails_naming_the_port(tmp_path: Path) -> None:
    # Before: the second up's Flower died on "Address already in use" (only in its log)
    # while the banner printed the first one's URL, whose login then failed.
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        refused = leasekeeper("up", env=user_env(LEASEKEEPER_FLOWER_PORT=str(port),
                                                 LEASEKEEPER_VAR_DIR=str(tmp_path / "a")))
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert f"LEASEKEEPER_FLOWER_PORT={port}: 127.0.0.1:{port} is taken" in refused.stderr
        assert "Traceback" not in refused.stderr
        assert "ready" not in refused.stdout  # it failed before starting anything

    # The default port taken (by another up's Flower, or whatever holds 5555 here): this
    # up's Flower moves to a free port, and the URL it prints is its own.
    with contextlib.ExitStack() as stack:
        holder = socket.socket()
        stack.callback(holder.close)
        with contextlib.suppress(OSError):  # 5555 may be taken already: just as good
            holder.bind(("127.0.0.1", 5555))
            holder.listen()
        with up(tmp_path, user_env(LEASEKEEPER_VAR_DIR=str(tmp_path / "b"))) as second:
            text = second.wait_for("press Ctrl-C to stop")
            assert "note: port 5555 is taken (another Flower?), so Flower uses" in text
            url = re.search(r"Flower: (http://127\.0\.0\.1:\d+) ", text).group(1)  # type: ignore[union-attr]
            assert not url.endswith(":5555")
            auth = (tmp_path / "b" / "flower-credentials").read_text().strip()
            assert flower_status(url, auth) == 200
            second.interrupt()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("demo", [[], ["--demo", "0"]], ids=["no-demo", "demo-0"])
def test_exit_after_demo_without_a_demo_is_refused_at_once(tmp_path: Path,
                                                           demo: list[str]) -> None:
    # Before: --exit-after-demo was ignored and up ran until Ctrl-C.
    done = leasekeeper("up", *demo, "--exit-after-demo",
                       env=user_env(LEASEKEEPER_VAR_DIR=str(tmp_path)), timeout_s=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--exit-after-demo needs --demo N (N >= 1)" in done.stderr
    assert "Traceback" not in done.stderr and "starting" not in done.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variable", ["LEASEKEEPER_CONSOLE_PORT", "LEASEKEEPER_METRICS_PORT"])
def test_a_taken_observer_port_says_to_set_0_as_flower_does(tmp_path: Path,
                                                            variable: str) -> None:
    # Before: "unset LEASEKEEPER_CONSOLE_PORT for a free port", while Flower's said
    # "set LEASEKEEPER_FLOWER_PORT=0 for any free port" (and 0 works for both).
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        refused = leasekeeper("up", env=user_env(**{variable: str(port)},
                                                 LEASEKEEPER_VAR_DIR=str(tmp_path)),
                              timeout_s=280)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"{variable}={port}: 127.0.0.1:{port} is taken" in refused.stderr
    assert f"set {variable}=0 for any free port" in refused.stderr
    assert "Traceback" not in refused.stderr


@pytest.mark.timeout(300)
def test_a_child_that_cannot_start_fails_up_with_its_log(tmp_path: Path) -> None:
    # Before: "['.../python3', '-m', 'celery', '-A', 'workers.app', 'flow exited with 2
    # before listening" (cut mid-word; the cause only in flower.log).
    broken = tmp_path / "site"
    (broken / "flower").mkdir(parents=True)
    (broken / "flower" / "__init__.py").write_text(
        "raise ImportError('flower is broken in this environment')\n")
    env = user_env(LEASEKEEPER_FLOWER_PORT="0", LEASEKEEPER_VAR_DIR=str(tmp_path / "var"),
                   PYTHONPATH=f"{broken}:{REPO}")
    done = leasekeeper("up", env=env, timeout_s=280)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "flower exited with code" in done.stderr
    assert "before it was ready; the end of" in done.stderr
    assert "No such command 'flower'" in done.stderr or "flower is broken" in done.stderr
    assert "Traceback (most recent call last)" not in done.stderr.split("the end of")[0]
    assert_closed(broker_port(done.stdout))


@pytest.mark.timeout(120)
def test_up_without_flower_installed_names_the_package(tmp_path: Path) -> None:
    env = user_env(LEASEKEEPER_VAR_DIR=str(tmp_path), LEASEKEEPER_TEST_HIDE_PACKAGES="flower",
                   PYTHONPATH=f"{HIDDEN_PACKAGES}:{REPO}")
    done = leasekeeper("up", env=env)
    assert done.returncode == 2
    assert "needs the Python package 'flower>=2.0', which is not installed" in done.stderr
    assert "-m pip install 'flower>=2.0'" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "logs").exists()  # nothing was started


@pytest.mark.timeout(300)
def test_a_child_that_exits_after_start_stops_up_with_its_log(tmp_path: Path) -> None:
    # Before: up noticed a child's exit only while starting; a beat killed later stayed a
    # zombie and up went on saying nothing, with no sweep running (README: "a child that
    # exits stops `up` with the end of its log").
    import psutil

    with up(tmp_path, user_env(LEASEKEEPER_FLOWER_PORT="0")) as process:
        process.wait_for("press Ctrl-C to stop")
        beat = next(child for child in psutil.Process(process.proc.pid).children()
                    if " beat " in " ".join(child.cmdline()))
        os.killpg(beat.pid, signal.SIGKILL)
        process.proc.wait(60)
        out = process.text
    assert process.proc.returncode == 1, out
    assert re.search(r"beat exited with code -?\d+; stopping everything", out), out
    assert "the end of " in out and "beat.log" in out, out
    assert "Traceback" not in out
    assert not (tmp_path / ".var" / "env").exists()
    assert_closed(broker_port(out))


@pytest.mark.timeout(600)
def test_a_second_up_in_the_same_folder_is_refused_naming_the_first(tmp_path: Path) -> None:
    # Before: the second up started a second backend on the first one's store and
    # overwrote .var/env and the Flower credentials, so the first could not be found.
    env = user_env(LEASEKEEPER_FLOWER_PORT="0")
    with up(tmp_path, env) as first:
        first.wait_for("press Ctrl-C to stop")
        env_before = (tmp_path / ".var" / "env").read_text()
        credentials = (tmp_path / ".var" / "flower-credentials").read_text()
        with up(tmp_path, env) as second:  # stopped by SIGTERM if it does start
            eventually(lambda: second.proc.poll() is not None, 60, "the second up to exit")
            said = second.text
        assert second.proc.returncode == 2, said
        assert f"another `leasekeeper up` (pid {first.proc.pid}) is already running" in said
        assert "Traceback" not in said
        assert "starting" not in said  # refused before it started anything
        assert (tmp_path / ".var" / "env").read_text() == env_before
        assert (tmp_path / ".var" / "flower-credentials").read_text() == credentials
        status = leasekeeper("status", "--json", env=env, cwd=tmp_path)
        assert status.returncode in (0, 1), status.stderr  # the first still answers
        assert first.proc.poll() is None
        said = first.interrupt()
    assert first.proc.returncode == 0, said
    # Once the first has stopped, the folder is free again.
    assert not (tmp_path / ".var" / "env").exists()


def _children(pid: int) -> list[int]:
    import psutil

    return [child.pid for child in psutil.Process(pid).children(recursive=True)]


def _kill_leftovers(pids: list[int]) -> list[int]:
    """Kill (by pid) whatever of up's own children outlived it; return which did."""
    import psutil

    left = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
                os.kill(pid, signal.SIGKILL)
    return left


@pytest.mark.timeout(600)
def test_closing_the_terminal_stops_every_child(tmp_path: Path) -> None:
    # Before: SIGHUP killed up itself and left Redis, worker, beat, Flower, the exporter
    # and the console running, each in its own session.
    env = user_env(LEASEKEEPER_FLOWER_PORT="0")
    with up(tmp_path, env) as process:
        text = process.wait_for("press Ctrl-C to stop")
        children = _children(process.proc.pid)
        assert len(children) >= 6, children
        try:
            os.kill(process.proc.pid, signal.SIGHUP)
            process.proc.wait(120)
        finally:
            left = _kill_leftovers(children)
        said = process.text
    assert left == [], f"still running after SIGHUP: {left}\n{said}"
    assert process.proc.returncode == 0, said
    assert ("stopping worker, beat, Flower, the metrics exporter, the lease console and Redis"
            in said)
    assert not (tmp_path / ".var" / "env").exists()
    assert_closed(broker_port(text))


@pytest.mark.timeout(600)
def test_ctrl_c_during_the_demo_leaves_no_demo_sandbox_unsaid(tmp_path: Path) -> None:
    # Before: "interrupted while starting; everything it started is stopped" while the
    # demo's sandboxes kept running.
    env = user_env(LEASEKEEPER_FLOWER_PORT="0")
    with up(tmp_path, env, "--demo", "5") as process:
        process.wait_for("→ active")  # the demo's first sandbox runs
        said = process.interrupt()
    assert "everything it started is stopped" not in said, said
    assert "interrupted during the demo: destroying the leases it made" in said, said
    sandboxes = tmp_path / ".var" / "sandboxes"
    # each sandbox's directory (its lock file, ".<name>.lock", goes with it)
    left = sorted(p.name for p in sandboxes.iterdir()
                  if not p.name.startswith(".")) if sandboxes.exists() else []
    if left:  # an acquire still under way may finish after the destroys: then it is said
        assert "stays running after leasekeeper stops" in said, said
        assert all(name in said for name in left), (left, said)
    else:  # nothing runs; a destroy still under way (the demo's own reclaim racing the
        # interrupt's destroy: "in_progress") was waited for; past its deadline it is said
        assert ("no lease is live and no sandbox is running" in said
                or "lease(s) being destroyed: the cleanup sweep finishes their destroy"
                in said), said


@pytest.mark.timeout(600)
def test_up_names_the_command_as_it_can_be_typed_here(tmp_path: Path) -> None:
    # Before: "`leasekeeper status`", which is not on PATH after `make run`.
    import shutil

    entry = Path(sys.executable).parent / "leasekeeper"
    if not entry.is_file():
        pytest.skip(f"no `leasekeeper` entry point beside {sys.executable}")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    shutil.copy2(entry, tmp_path / ".venv" / "bin" / "leasekeeper")  # as `make run` makes it
    env = user_env(LEASEKEEPER_FLOWER_PORT="0",
                   PATH=os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                        if not (Path(p) / "leasekeeper").exists()))
    with up(tmp_path, env, command=(".venv/bin/leasekeeper",)) as process:
        text = process.wait_for("press Ctrl-C to stop")
        assert f"In another shell in {tmp_path}, `.venv/bin/leasekeeper status`" in text
        status = subprocess.run([".venv/bin/leasekeeper", "status", "--json"], cwd=tmp_path,
                                env=env, capture_output=True, text=True, timeout=120,
                                check=False)
        assert status.returncode in (0, 1), status.stderr  # the command it names works
        said = process.interrupt()
    assert process.proc.returncode == 0, said


@pytest.mark.timeout(900)
def test_a_runs_secret_stays_scrubbed_after_up_is_restarted(tmp_path: Path) -> None:
    """Before: up's Redis kept nothing, so the secret marks of runs acquired before a
    restart were gone, and a finish's error (and a destroy's reason) quoting the run's
    secret was stored and shown in clear."""
    env = user_env(LEASEKEEPER_FLOWER_PORT="0")
    secret = f"restart-secret-{os.urandom(8).hex()}"
    script = ("import sys; from tasks import producer; {call}.get(120)")
    with up(tmp_path, env) as first:
        first.wait_for("press Ctrl-C to stop")
        acquired = subprocess.run(
            [sys.executable, "-c", script.format(call=(
                "producer.acquire_lease('rs-z', {'thread_id': 'tz', 'secret_env': "
                "{'TOKEN': sys.argv[1]}})")), secret],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, check=False)
        assert acquired.returncode == 0, acquired.stderr
        said = first.interrupt()
    assert "1 active lease(s)" in said, said
    with up(tmp_path, env) as second:
        second.wait_for("press Ctrl-C to stop")
        finished = subprocess.run(
            [sys.executable, "-c", script.format(call=(
                "producer.finish_run('rs-z', 'failed', 1, "
                "error='z crashed TOKEN=' + sys.argv[1])")), secret],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, check=False)
        assert finished.returncode == 0, finished.stderr
        shown = leasekeeper("runs", "show", "rs-z", env=env, cwd=tmp_path)
        assert shown.returncode == 0, shown.stderr
        assert secret not in shown.stdout and "z crashed TOKEN=***" in shown.stdout, \
            shown.stdout
        # Its lease ends with the run (an ephemeral sandbox is reclaimed).
        eventually(lambda: "destroyed" in leasekeeper("runs", "show", "rs-z", env=env,
                                                      cwd=tmp_path).stdout, 120,
                   "the run's sandbox reclaimed")
        said = second.interrupt()
    assert "no lease is live and no sandbox is running" in said, said


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["immutable", "regular-file", "under-proc"])
def test_a_var_dir_up_cannot_use_is_refused_in_one_line(tmp_path: Path, kind: str) -> None:
    # Before: "unexpected PermissionError / FileExistsError / FileNotFoundError: ...
    # This is a leasekeeper bug", exit 1 (`leases list` and `db upgrade` said it in a line).
    var = {"immutable": tmp_path / "v3", "regular-file": tmp_path / "file",
           "under-proc": Path("/proc/nope/var")}[kind]
    with contextlib.ExitStack() as stack:
        if kind == "immutable":
            var.mkdir()
            subprocess.run(["chattr", "+i", str(var)], check=True)
            stack.callback(subprocess.run, ["chattr", "-i", str(var)], check=False)
        elif kind == "regular-file":
            var.write_text("")
        done = leasekeeper("up", env=user_env(LEASEKEEPER_VAR_DIR=str(var)), cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "unexpected" not in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"cannot use the var dir {var}" in done.stderr, done.stderr
    assert "point LEASEKEEPER_VAR_DIR at a directory this user can write" in done.stderr
    assert "starting" not in done.stdout  # refused before it started anything


POOL = '[{"name": "py", "provider": "local", "size": 2, "template": {"command": ["sleep", "600"]}}]'


@pytest.mark.timeout(600)
def test_up_with_a_warm_pool_tells_other_shells_and_says_how_to_end_its_members(
        tmp_path: Path) -> None:
    # Before: .var/env carried only broker, store and queue, so `status` in another shell
    # showed the pool as "(removed)" and judged sweeps by default intervals; and Ctrl-C
    # said "no lease(s) and 2 sandbox(es)", to run `leases destroy --state active --yes`,
    # which leaves the warm members running.
    secrets = {"LEASEKEEPER_FLOWER_BASIC_AUTH": "op:hunter2-flower",
               "LEASEKEEPER_SECRET_MARKS_KEY": "hunter2-marks"}
    env = user_env(LEASEKEEPER_FLOWER_PORT="0", LEASEKEEPER_POOLS=POOL,
                   LEASEKEEPER_FILL_POOLS_INTERVAL_S="1", LEASEKEEPER_ORPHANS_INTERVAL_S="77",
                   **secrets)
    other_shell = user_env()  # the same directory, none of up's variables
    env_file = tmp_path / ".var" / "env"
    with contextlib.ExitStack() as stack:
        stack.callback(_kill_sandboxes, tmp_path / ".var" / "sandboxes")
        said, members = _up_with_a_pool(tmp_path, env, other_shell, secrets)
    assert "stays running after leasekeeper stops: 2 warm lease(s)" in said, said
    assert all(f"lk-{member}" in said for member in members), said
    assert "leases destroy --state warm --yes" in said, said
    assert not env_file.exists()


def _kill_sandboxes(root: Path) -> None:
    """The warm members' processes that `up` leaves running by design."""
    from providers.local import _start_ticks

    for record in root.glob("*/lease.json"):
        meta = json.loads(record.read_text())
        if isinstance(meta.get("pid"), int) and _start_ticks(meta["pid"]) == meta.get(
                "start_ticks"):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(meta["pid"], signal.SIGKILL)


def _up_with_a_pool(tmp_path: Path, env: dict[str, str], other_shell: dict[str, str],
                    secrets: dict[str, str]) -> tuple[str, list[str]]:
    env_file = tmp_path / ".var" / "env"
    with up(tmp_path, env) as running:
        running.wait_for("press Ctrl-C to stop")
        assert env_file.stat().st_mode & 0o777 == 0o600
        written = env_file.read_text()
        for value in secrets.values():
            assert value not in written and value not in running.text
        assert "FLOWER_BASIC_AUTH" not in written and "SECRET_MARKS_KEY" not in written

        def warm() -> list[str] | None:
            listed = leasekeeper("leases", "list", "--state", "warm", "--json",
                                 env=other_shell, cwd=tmp_path)
            assert listed.returncode == 0, listed.stderr
            ids = [x["lease_id"] for x in json.loads(listed.stdout)["leases"]]
            return ids if len(ids) == 2 else None
        members = eventually(warm, 120, "two warm pool members")
        status = leasekeeper("status", "--json", env=other_shell, cwd=tmp_path)
        assert status.returncode in (0, 1), status.stderr
        assert "(removed)" not in leasekeeper("status", env=other_shell, cwd=tmp_path).stdout
        intervals = {t["sweep"]: t["interval_s"] for t in json.loads(status.stdout)["sweeps"]}
        assert intervals["sweep.orphans"] == 77
        assert intervals["sweep.fill_pools"] == 1
        pools = leasekeeper("pools", env=other_shell, cwd=tmp_path)
        assert pools.returncode in (0, 1), pools.stderr
        assert "py" in pools.stdout and "removed" not in pools.stdout, pools.stdout
        said = running.interrupt()
    assert running.proc.returncode == 0, said
    return said, members


def test_up_with_a_broker_url_left_from_an_earlier_up_says_to_unset_it(tmp_path: Path) -> None:
    # Before: in a shell where the user pasted the `export` lines an earlier `up` printed,
    # `up` (as that up's stop message advised) failed "the broker at redis://...
    # is unreachable ... Start Redis there or fix the URL" (exit 3): that Redis stopped
    # with the earlier up, and the fix is to let `up` start its own.
    gone = f"redis://127.0.0.1:{free_port()}/0"
    done = subprocess.run([sys.executable, "-m", "workers.cli", "up"],
                          env=user_env(LEASEKEEPER_BROKER_URL=gone,
                                       LEASEKEEPER_FLOWER_PORT="0"),
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          check=False)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "unreachable" in done.stderr, done.stderr
    assert "unset LEASEKEEPER_BROKER_URL" in done.stderr, done.stderr
