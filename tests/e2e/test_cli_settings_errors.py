"""Settings an operator got wrong, each refused by a real `leasekeeper` process at start:
exit 2, one "invalid settings: ..." line naming the variable, what was wrong in the unit the
variable is in, and what to do.

(Each case was first seen by a QA pass: a pair in the wrong order accepted silently, its
base ignored; a value in the wrong unit answered with pydantic's words and no unit.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import cli_env, leasekeeper
from tests.e2e.test_cli_errors import short_error

pytestmark = pytest.mark.timeout(120)


def refused(tmp_path: Path, **settings: str) -> str:
    done = leasekeeper("pools", env=cli_env(LEASEKEEPER_VAR_DIR=str(tmp_path), **settings))
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    return short_error(done, "invalid settings: ")


@pytest.mark.parametrize(("base", "cap"), [
    ("LEASEKEEPER_POOL_BREAKER_BACKOFF_S", "LEASEKEEPER_POOL_BREAKER_BACKOFF_MAX_S"),
    ("LEASEKEEPER_RETRY_BACKOFF_BASE_S", "LEASEKEEPER_RETRY_BACKOFF_MAX_S"),
])
def test_a_backoff_above_its_max_is_refused_naming_both(tmp_path: Path, base: str,
                                                        cap: str) -> None:
    # Before: exit 0, no word; the backoff is min(base * 2**n, max), so 600 was never used.
    err = refused(tmp_path, **{base: "600", cap: "10"})
    assert f"{base}=600" in err and f"{cap}=10" in err, err
    assert "raise" in err and "lower" in err, err


def test_the_cleanup_backoff_above_its_fixed_cap_is_refused(tmp_path: Path) -> None:
    # Before: accepted; sweep.retry_cleanup caps every backoff at 1 h, so 7200 was ignored.
    err = refused(tmp_path, LEASEKEEPER_CLEANUP_BACKOFF_S="7200")
    assert "LEASEKEEPER_CLEANUP_BACKOFF_S" in err and "at most 3600 seconds (1 hour)" in err
    assert "got 7200" in err, err


def test_a_backoff_equal_to_its_max_is_accepted(tmp_path: Path) -> None:
    done = leasekeeper("pools", env=cli_env(
        LEASEKEEPER_VAR_DIR=str(tmp_path), LEASEKEEPER_RETRY_BACKOFF_BASE_S="10",
        LEASEKEEPER_RETRY_BACKOFF_MAX_S="10"))
    assert "invalid settings" not in done.stderr, done.stderr


@pytest.mark.parametrize(("var", "value", "needles"), [
    # Before: "Input should be a valid integer, unable to parse string as an integer"
    ("LEASEKEEPER_LEASE_TTL_S", "1h", ["a whole number of seconds, got '1h'"]),
    # Before: "Input should be a valid integer, got a number with a fractional part"
    ("LEASEKEEPER_RUN_DETACH_TTL_S", "1.5", ["a whole number of seconds, got '1.5'"]),
    ("LEASEKEEPER_ACQUIRE_TIMEOUT_S", "2m", ["a number of seconds, got '2m'"]),
    ("LEASEKEEPER_MAX_PAYLOAD_BYTES", "1MiB", ["a whole number of bytes, got '1MiB'"]),
    # Before: "Input should be less than or equal to 31622400" (the README: 366 days)
    ("LEASEKEEPER_LEASE_TTL_S", "40000000",
     ["at most 31622400 seconds (366 days), got 40000000"]),
    ("LEASEKEEPER_MAX_PAYLOAD_BYTES", "100", ["at least 1024 bytes (1 KiB), got 100"]),
    ("LEASEKEEPER_ACQUIRE_TIMEOUT_S", "0", ["more than 0 seconds, got 0"]),
])
def test_a_value_in_the_wrong_unit_says_the_unit(tmp_path: Path, var: str, value: str,
                                                 needles: list[str]) -> None:
    err = refused(tmp_path, **{var: value})
    assert f"{var}: " in err, err
    for needle in needles:
        assert needle in err, err
    assert "Input should be" not in err, err


@pytest.mark.parametrize(("process", "settings", "says"), [
    ("beat", {"LEASEKEEPER_ORPHANS_INTERVAL_S": "inf"},
     "LEASEKEEPER_ORPHANS_INTERVAL_S: must be a number of seconds, got 'inf'"),
    ("beat", {"LEASEKEEPER_REAP_RUNS_INTERVAL_S": "1e15"},
     "LEASEKEEPER_REAP_RUNS_INTERVAL_S: must be at most 31622400 seconds (366 days)"),
    ("worker", {"LEASEKEEPER_LEASE_TTL_S": "abc"},
     "LEASEKEEPER_LEASE_TTL_S: must be a whole number of seconds, got 'abc'"),
    ("worker", {"LEASEKEEPER_TASK_TIME_LIMIT_S": "nan"},
     "LEASEKEEPER_TASK_TIME_LIMIT_S: must be a number of seconds, got 'nan'"),
])
def test_celery_started_with_a_bad_setting_says_so_in_one_line(
        tmp_path: Path, process: str, settings: dict[str, str], says: str) -> None:
    # Before: `celery -A workers.app beat` with an infinite or huge interval passed the
    # settings check and beat died on an OverflowError traceback naming no variable; and any
    # invalid setting at a worker's or beat's start printed Celery's 38-line "Unable to load
    # celery application" traceback, the message on its last line.
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "workers.app", process, "-s",
         str(tmp_path / "schedule"), "--loglevel", "INFO"] if process == "beat" else
        [sys.executable, "-m", "celery", "-A", "workers.app", process, "-c", "1",
         "--without-gossip", "--without-mingle"],
        env=cli_env(LEASEKEEPER_VAR_DIR=str(tmp_path), **settings), cwd=tmp_path,
        capture_output=True, text=True, timeout=90, check=False)
    said = done.stdout + done.stderr
    assert done.returncode == 2, said[-3000:]
    assert "Traceback" not in said and "Unable to load" not in said, said[-3000:]
    lines = [line for line in said.splitlines() if line.strip()]
    assert len(lines) == 1, said[-3000:]
    assert lines[0].startswith(f"leasekeeper {process} not started: invalid settings: "), lines
    assert says in lines[0], lines[0]


@pytest.mark.parametrize(("env", "needles"), [
    # Before: accepted; every Kubernetes acquire then failed on the API server's 422
    # ("must be less than or equal to cpu limit").
    ({"LEASEKEEPER_KUBE_CPU_REQUEST": "4", "LEASEKEEPER_KUBE_CPU_LIMIT": "2"},
     ["LEASEKEEPER_KUBE_CPU_REQUEST=4 is above LEASEKEEPER_KUBE_CPU_LIMIT=2"]),
    ({"LEASEKEEPER_KUBE_MEMORY_REQUEST": "8Gi"},
     ["LEASEKEEPER_KUBE_MEMORY_REQUEST=8Gi is above LEASEKEEPER_KUBE_MEMORY_LIMIT=4Gi"]),
    # Before: accepted; the API server refused every workload's quantity.
    ({"LEASEKEEPER_KUBE_MEMORY_LIMIT": "4 GB"},
     ["LEASEKEEPER_KUBE_MEMORY_LIMIT: ", "'4 GB'"]),
])
def test_kubernetes_resource_defaults_are_quantities_in_order(
        tmp_path: Path, env: dict[str, str], needles: list[str]) -> None:
    err = refused(tmp_path, **env)
    for needle in needles:
        assert needle in err, err


QUERY_PASSWORD = "QueryPw_Hh5"
PUT_IT_IN_THE_USER_PART = "put it in the user part: redis://:PASSWORD@host:port/db"


@pytest.mark.parametrize("variable", ["LEASEKEEPER_BROKER_URL",
                                      "LEASEKEEPER_RESULT_BACKEND_URL"])
def test_a_redis_password_in_the_query_is_refused_without_showing_it(
        tmp_path: Path, variable: str) -> None:
    # Before (a QA pass): `leasekeeper status` with LEASEKEEPER_BROKER_URL
    # redis://127.0.0.1:PORT/1?password=x said "unexpected TypeError: dict() got multiple
    # values for keyword argument 'password'. This is a leasekeeper bug" (kombu passes the
    # password twice). It is now refused at settings load: exit 2, saying where it goes.
    url = f"redis://127.0.0.1:6390/1?password={QUERY_PASSWORD}"
    done = leasekeeper("status", env=cli_env(LEASEKEEPER_VAR_DIR=str(tmp_path),
                                             **{variable: url}))
    said = done.stdout + done.stderr
    assert done.returncode == 2, said
    err = short_error(done, "invalid settings: ", variable, PUT_IT_IN_THE_USER_PART)
    assert QUERY_PASSWORD not in said, err


@pytest.mark.parametrize("process", ["worker", "beat"])
def test_celery_given_a_query_password_broker_url_refuses_it_in_one_line(
        tmp_path: Path, process: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "workers.app", process, "-s",
         str(tmp_path / "schedule")] if process == "beat" else
        [sys.executable, "-m", "celery", "-A", "workers.app", process, "-c", "1"],
        env=cli_env(LEASEKEEPER_VAR_DIR=str(tmp_path),
                    LEASEKEEPER_BROKER_URL=f"redis://127.0.0.1:6390/1?password={QUERY_PASSWORD}"),
        cwd=tmp_path, capture_output=True, text=True, timeout=90, check=False)
    said = done.stdout + done.stderr
    assert done.returncode == 2, said[-3000:]
    lines = [line for line in said.splitlines() if line.strip()]
    assert len(lines) == 1, said[-3000:]
    assert PUT_IT_IN_THE_USER_PART in lines[0] and QUERY_PASSWORD not in said, lines[0]


@pytest.mark.parametrize("url", ["redis://:Cel/Pw_Cc3@xyz@127.0.0.1:6390/0",
                                 "redis://:12/Pw_Cc3@xyz@127.0.0.1:6390/0"])
def test_a_broker_url_with_an_unencoded_slash_in_its_password_shows_none_of_it(
        tmp_path: Path, url: str) -> None:
    # Before: "not a Redis URL: Port could not be cast to integer value as 'Cel'", or the
    # database number quoted from what followed the '/' (parts of the password).
    err = refused(tmp_path, LEASEKEEPER_BROKER_URL=url)
    assert "must be percent-encoded" in err, err
    assert not any(part in err for part in (":Cel", "Cel/", "Pw_Cc3", "xyz")), err
