"""Owns the tests of a claim's delivery outside any cluster: the script of delivery.py run by
this machine's real ``sh`` (dash) exactly as an exec runs it in a container (same command,
stdin, environment variable), the reading of an exec's status channel (status.py), and the
error helpers the exec's outcome goes through (errors.py)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import websocket
from kubernetes.client.exceptions import ApiException

from providers.base import RUN_DIR_ENV, ClaimRequest
from providers.errors import (
    InvalidRequest,
    TerminalProviderError,
    TransientProviderError,
    is_transient,
)
from providers.kubernetes.delivery import (
    DELIVERY_COMMAND,
    DELIVERY_EXITS,
    DELIVERY_FAILED_HINT,
    EXIT_NO_RUN_DIR,
    EXIT_SHORT_INPUT,
    build_delivery,
    sh_quote,
)
from providers.kubernetes.errors import (
    KubeCommandFailed,
    KubeCommandInterrupted,
    Permission,
    command_exit_error,
    kube_errors,
    scrub,
    translate_api_exception,
    translate_status,
)
from providers.kubernetes.status import ExecEnd, exec_status

pytestmark = pytest.mark.timeout(30)

TRICKY = ["it's", "a\nb", "$HOME `id` $(id) ${X}", "back\\slash", "é☃", "", "'", "''x''",
          " lead and trail ", "-n", "*"]


def claim(**overrides: object) -> ClaimRequest:
    fields: dict[str, object] = {
        "lease_id": "01jpool", "run_id": "run-42", "tenant": "acme",
        "labels": {"team": "core"}, "env": {"GREETING": "hi", "SHARED": "plain"},
        "secret_env": {"API_KEY": "s3cret-value", "SHARED": "from-secret"}}
    fields.update(overrides)
    return ClaimRequest(**fields)  # type: ignore[arg-type]


# An image's sh is dash (Debian), bash, or busybox (Alpine, with busybox's head, wc and mv
# too): the delivery runs under each. All three are on every machine `make test` prepared
# (scripts/system-deps.sh): a missing one fails its tests rather than dropping them.
SHELLS = ["sh", "bash", "busybox"]


@dataclass(frozen=True)
class Shell:
    argv0: str
    path: str  # PATH: where head, wc and mv come from


@pytest.fixture(params=SHELLS)
def shell(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Shell:
    if request.param != "busybox":
        return Shell(request.param, os.environ["PATH"])
    applets = tmp_path_factory.mktemp("busybox")
    for tool in ("sh", "head", "wc", "mv", "rm"):
        (applets / tool).symlink_to(shutil.which("busybox") or "busybox")
    return Shell(str(applets / "sh"), str(applets))


def deliver(run_dir: Path | None, stdin: bytes,
            shell: Shell | None = None) -> subprocess.CompletedProcess[bytes]:
    """The delivery as an exec runs it: the same argv (under ``shell``), data on stdin."""
    shell = shell or Shell("sh", os.environ["PATH"])
    env = {"PATH": shell.path}
    if run_dir is not None:
        env[RUN_DIR_ENV] = str(run_dir)
    argv = [shell.argv0, *DELIVERY_COMMAND[1:]]
    return subprocess.run(argv, input=stdin, env=env, capture_output=True, check=False,
                          timeout=20)


def sourced(run_dir: Path, names: list[str]) -> list[str]:
    """What a sandbox's sh sees after sourcing ``env``: each variable's value."""
    script = '. "$1/env"; shift; for n in "$@"; do eval "printf \'%s\\0\' \\"\\$$n\\""; done'
    out = subprocess.run(["sh", "-c", script, "sh", str(run_dir), *names], capture_output=True,
                         check=True, timeout=20).stdout
    return out.decode().split("\0")[:-1]


def test_the_command_line_carries_no_data() -> None:
    # what the API server and its audit log see is the same for every claim
    request = claim(secret_env={"API_KEY": "s3cret-value"})
    delivery = build_delivery(request)
    assert delivery.command == build_delivery(claim(run_id="other", env={})).command
    assert "s3cret" not in " ".join(delivery.command) and "run-42" not in repr(delivery)
    assert b"s3cret-value" in delivery.stdin  # stdin is where the data goes
    assert "s3cret" not in repr(delivery) and "s3cret" not in repr(request)


def test_the_delivery_writes_run_json_env_and_claimed_readable_by_the_sandbox(
        tmp_path: Path, shell: Shell) -> None:
    # given a run directory and a claim whose values need quoting
    env = {f"PLAIN_{i}": value for i, value in enumerate(TRICKY)}
    secret_env = {f"SECRET_{i}": value for i, value in enumerate(TRICKY)}
    request = claim(env={**env, "SHARED": "plain"}, secret_env={**secret_env,
                                                                "SHARED": "from-secret"})
    # when the delivery runs with its stdin
    done = deliver(tmp_path, build_delivery(request).stdin, shell)
    # then it succeeded, and wrote exactly the three files, owner-only
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["claimed", "env", "run.json"]
    for path in tmp_path.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert json.loads((tmp_path / "run.json").read_text()) == {
        "run_id": "run-42", "lease_id": "01jpool", "tenant": "acme",
        "labels": {"team": "core"}}
    assert (tmp_path / "claimed").read_text() == "run-42\n"
    # and sourcing env gives every value back exactly; a secret wins a name clash
    names = [*env, *secret_env, "SHARED"]
    assert sourced(tmp_path, names) == [*env.values(), *secret_env.values(), "from-secret"]


def test_a_repeated_delivery_rewrites_the_same_files_and_leaves_nothing_else(
        tmp_path: Path, shell: Shell) -> None:
    stdin = build_delivery(claim()).stdin
    assert deliver(tmp_path, stdin, shell).returncode == 0
    first = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert deliver(tmp_path, stdin, shell).returncode == 0
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == first


def test_input_cut_short_is_refused_before_any_file_changes(tmp_path: Path,
                                                             shell: Shell) -> None:
    stdin = build_delivery(claim()).stdin
    header = stdin.index(b"\n", stdin.index(b"\n", stdin.index(b"\n") + 1) + 1) + 1
    for cut in (stdin[:-1], stdin[:header], stdin[:header - 1], stdin[:3], b""):
        done = deliver(tmp_path, cut, shell)
        assert done.returncode == EXIT_SHORT_INPUT, done.stderr
        assert list(tmp_path.iterdir()) == []  # no temporary file left either
    assert DELIVERY_EXITS[EXIT_SHORT_INPUT].transient


def test_a_container_without_a_run_directory_is_refused(tmp_path: Path) -> None:
    stdin = build_delivery(claim()).stdin
    assert deliver(None, stdin).returncode == EXIT_NO_RUN_DIR
    missing = deliver(tmp_path / "missing", stdin)
    assert missing.returncode == EXIT_NO_RUN_DIR
    assert b"not a pool member" in missing.stderr and b"s3cret" not in missing.stderr
    assert not DELIVERY_EXITS[EXIT_NO_RUN_DIR].transient


@pytest.mark.parametrize(("env", "secret_env"), [
    ({"1BAD": "x"}, {}), ({"A-B": "x"}, {}), ({}, {"NUL": "a\0b"}), ({}, {"": "x"}),
])
def test_names_and_values_no_shell_can_hold_are_refused(env: dict[str, str],
                                                        secret_env: dict[str, str]) -> None:
    with pytest.raises(InvalidRequest) as info:
        build_delivery(claim(env=env, secret_env=secret_env))
    assert "a\0b" not in str(info.value)


@pytest.mark.parametrize("run_id", ["", "two words", "line\nbreak", "-lead"])
def test_a_run_id_that_is_no_run_id_is_refused(run_id: str) -> None:
    with pytest.raises(InvalidRequest, match="is not a run id"):
        build_delivery(claim(run_id=run_id))


def test_labels_and_tenant_with_any_characters_stay_one_json_line(tmp_path: Path) -> None:
    request = claim(labels={"note": "two\nlines \\ and 'quotes' %s", "é": "☃"})
    assert deliver(tmp_path, build_delivery(request).stdin).returncode == 0
    assert json.loads((tmp_path / "run.json").read_text())["labels"] == dict(request.labels)


def test_sh_quote() -> None:
    assert sh_quote("it's") == "'it'\\''s'"
    assert sh_quote("") == "''"


# -- status.exec_status ---------------------------------------------------------------------

def test_exec_status_readings() -> None:
    assert exec_status('{"metadata":{},"status":"Success"}').end is ExecEnd.SUCCEEDED
    exited = exec_status(json.dumps({
        "metadata": {}, "status": "Failure", "reason": "NonZeroExitCode",
        "message": "command terminated with non-zero exit code: exit status 4",
        "details": {"causes": [{"reason": "ExitCode", "message": "4"}]}}))
    assert (exited.end, exited.exit_code) == (ExecEnd.EXITED, 4)
    failed = exec_status(json.dumps({"status": "Failure", "reason": "InternalError",
                                     "code": 500, "message": "container not running"}))
    assert failed.end is ExecEnd.FAILED and failed.status is not None
    assert exec_status("").end is ExecEnd.MISSING
    assert exec_status("not json").end is ExecEnd.MISSING


# -- errors.py ------------------------------------------------------------------------------

def test_a_command_exit_is_transient_or_terminal_as_its_table_says_and_scrubbed() -> None:
    secret = "s3cret-value"
    short = command_exit_error("exec into Pod ns/p", EXIT_SHORT_INPUT, "input ended early",
                               DELIVERY_EXITS, DELIVERY_FAILED_HINT, [secret])
    assert isinstance(short, KubeCommandInterrupted) and is_transient(short)
    assert short.exit_code == EXIT_SHORT_INPUT
    other = command_exit_error("exec into Pod ns/p", 1, f"mv: cannot write {secret}x",
                               DELIVERY_EXITS, DELIVERY_FAILED_HINT, [secret, ""])
    assert isinstance(other, KubeCommandFailed) and not is_transient(other)
    assert secret not in str(other) and "***x" in str(other)
    assert "exited 1" in str(other) and "sizeLimit" in str(other)
    assert scrub("ab abc", ["ab", "abc"]) == "*** ***"


def test_a_403_on_exec_names_the_verb_the_api_server_refused() -> None:
    # before Kubernetes 1.31 a WebSocket exec (an HTTP GET) is authorized as "get"
    exc = ApiException(status=403, reason="Forbidden")
    exc.body = json.dumps({
        "kind": "Status", "status": "Failure", "reason": "Forbidden", "code": 403,
        "message": 'pods "p" is forbidden: User "system:serviceaccount:ns:w" cannot get '
                   'resource "pods/exec" in API group "" in the namespace "ns"'})
    error = translate_api_exception("exec into Pod ns/p", exc, sensitive=False, namespace="ns",
                                    permission=Permission("create", "pods/exec"))
    assert isinstance(error, TerminalProviderError) and not is_transient(error)
    assert 'lacks the RBAC permission to "get" "pods/exec"' in str(error)
    assert 'add verb "get" on resource "pods/exec"' in str(error)
    # a refusal about another resource does not change the verb named
    assert Permission("create", "pods/exec").refused(
        'cannot list resource "pods"').verb == "create"


def test_a_failure_status_on_the_exec_channel_is_classified_by_its_code() -> None:
    error = translate_status("exec into Pod ns/p", {"status": "Failure", "code": 500,
                                                    "reason": "InternalError",
                                                    "message": "container not running"})
    assert is_transient(error) and error.status == 500
    assert "container not running" in str(error)
    assert not is_transient(translate_status("exec", {"status": "Failure", "code": 400}))


@pytest.mark.parametrize("raised", [
    socket.gaierror(-2, "Name or service not known"), ConnectionRefusedError(111, "refused"),
    websocket.WebSocketConnectionClosedException("socket is already closed."),
    websocket.WebSocketTimeoutException("timed out"), TimeoutError("timed out"),
])
def test_an_exec_streams_transport_failures_are_transient(raised: BaseException) -> None:
    with pytest.raises(TransientProviderError) as info, kube_errors("exec into Pod ns/p"):
        raise raised
    assert str(info.value).startswith("kubernetes: exec into Pod ns/p failed")
