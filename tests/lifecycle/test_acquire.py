"""lease.acquire's logic: intent first, idempotent retries, cleanup on failure, reuse."""

from __future__ import annotations

import json
import os
import signal
from decimal import Decimal

import pytest

from models.schema import LeaseState, RunStatus
from providers.base import ResumeOutcome
from providers.errors import (
    AcquireCleanupIncomplete,
    InvalidRequest,
    ProviderConflict,
    TerminalProviderError,
    TransientProviderError,
)
from providers.faulty import FaultPlan
from providers.spec import DEFAULT_SPEC, SandboxSpec, quantity_value
from tasks.acquire import AcquireResult, acquire_lease, parse_acquire
from tasks.leases import handle
from tasks.redaction import scrub_text
from tests.e2e.conftest import until_gone
from workers.runtime import Runtime


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_acquire_records_intent_then_activates(rt: Runtime) -> None:
    done = acquire_lease(rt, "run-1", SandboxSpec(tenant="acme"), "task-1", may_retry=False)
    assert done.result == AcquireResult.ACQUIRED
    lease = rt.store.get_lease(done.lease_id)
    assert lease.state == LeaseState.ACTIVE and lease.ready_at is not None
    assert lease.idle_deadline_at is not None and lease.deadline_at > lease.created_at
    assert alive(lease.provider_meta["pid"])
    events = [(e.from_state, e.to_state) for e in rt.store.events(done.lease_id)]
    assert events == [(None, "provisioning"), ("provisioning", "active")]
    run = rt.store.get_run("run-1")
    assert run.lease_id == done.lease_id and run.status == RunStatus.RUNNING


def test_redelivered_acquire_returns_the_same_lease(rt: Runtime) -> None:
    first = acquire_lease(rt, "run-1", SandboxSpec(), None, may_retry=False)
    again = acquire_lease(rt, "run-1", SandboxSpec(), None, may_retry=False)
    assert again.result == AcquireResult.ALREADY_ACQUIRED and again.lease_id == first.lease_id
    assert len(rt.provider("local").list_managed()) == 1


def test_transient_failure_after_create_keeps_intent_and_retry_adopts(
    rt: Runtime, faults: FaultPlan
) -> None:
    faults.write({"acquire": [{"fault": "transient", "when": "after", "times": 1}]})
    spec = SandboxSpec(provider="faulty")
    with pytest.raises(TransientProviderError):
        acquire_lease(rt, "run-1", spec, None, may_retry=True)
    (lease,) = rt.store.leases()
    assert lease.state == LeaseState.PROVISIONING  # the row exists before and after the fault
    assert len(rt.provider("faulty").list_managed()) == 1
    done = acquire_lease(rt, "run-1", spec, None, may_retry=True)
    assert done.result == AcquireResult.ADOPTED and done.lease_id == lease.lease_id
    assert len(rt.provider("faulty").list_managed()) == 1  # adopted, not created twice


def test_terminal_failure_after_create_destroys_what_exists(
    rt: Runtime, faults: FaultPlan
) -> None:
    faults.write({"acquire": [{"fault": "terminal", "when": "after", "times": 1}]})
    with pytest.raises(TerminalProviderError, match="injected terminal"):
        acquire_lease(rt, "run-1", SandboxSpec(provider="faulty"), None, may_retry=True)
    (lease,) = rt.store.leases()
    assert lease.state == LeaseState.DESTROYED and lease.end_reason == "acquire_failed"
    assert rt.provider("faulty").list_managed() == []
    assert rt.store.get_run("run-1").status == RunStatus.FAILED


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_provider_bug_in_acquire_cleans_up_and_fails_the_run(
    rt: Runtime, faults: FaultPlan, when: str
) -> None:
    # Not a ProviderError (a bug, or a malformed reply): the lease must not stay
    # provisioning with whatever was made still running until the stuck sweep.
    faults.write({"acquire": [{"fault": "value_error", "when": when, "times": 1}]})
    with pytest.raises(TerminalProviderError, match=r"raised ValueError: .*a provider bug"):
        acquire_lease(rt, "run-1", SandboxSpec(provider="faulty"), None, may_retry=True)
    (lease,) = rt.store.leases()
    assert lease.state == LeaseState.DESTROYED and lease.end_reason == "acquire_failed"
    assert rt.provider("faulty").list_managed() == []
    run = rt.store.get_run("run-1")
    assert run.status == RunStatus.FAILED and "ValueError" in (run.error or "")


def test_a_providers_refusal_of_its_input_is_not_called_a_provider_bug(
    rt: Runtime, faults: FaultPlan
) -> None:
    # An InvalidRequest from the provider is its own input check: terminal, cleaned up,
    # named as raised, never as "a provider bug, or a malformed reply".
    faults.write({"acquire": [{"fault": "invalid_request", "when": "after", "times": 1}]})
    with pytest.raises(TerminalProviderError) as refused:
        acquire_lease(rt, "run-1", SandboxSpec(provider="faulty"), None, may_retry=True)
    assert "raised InvalidRequest: injected invalid_request fault" in str(refused.value)
    assert "provider bug" not in str(refused.value)
    (lease,) = rt.store.leases()
    assert lease.state == LeaseState.DESTROYED and lease.end_reason == "acquire_failed"
    assert rt.provider("faulty").list_managed() == []
    assert "provider bug" not in (rt.store.get_run("run-1").error or "")


def test_transient_failure_out_of_retries_cleans_up(rt: Runtime, faults: FaultPlan) -> None:
    faults.write({"acquire": [{"fault": "transient", "when": "after", "times": 1}]})
    with pytest.raises(TransientProviderError):
        acquire_lease(rt, "run-1", SandboxSpec(provider="faulty"), None, may_retry=False)
    assert rt.store.leases()[0].state == LeaseState.DESTROYED
    assert rt.provider("faulty").list_managed() == []


def test_failed_cleanup_leaves_pending_cleanup_never_forgotten(
    rt: Runtime, faults: FaultPlan
) -> None:
    faults.write({"acquire": [{"fault": "terminal", "when": "after", "times": 1}],
                  "destroy": [{"fault": "transient", "times": 1}]})
    with pytest.raises(AcquireCleanupIncomplete, match="cleanup was incomplete") as err:
        acquire_lease(rt, "run-1", SandboxSpec(provider="faulty",
                                               secret_env={"API_TOKEN": "hunter2"}),
                      None, may_retry=False)
    assert "hunter2" not in str(err.value)
    (lease,) = rt.store.leases()
    assert lease.state == LeaseState.PENDING_CLEANUP and lease.cleanup_attempts == 1
    assert len(rt.provider("faulty").list_managed()) == 1  # still reachable for the retry


def test_conflicting_resource_is_refused_not_adopted(rt: Runtime, faults: FaultPlan) -> None:
    faults.write({"acquire": [{"fault": "conflict", "when": "before", "times": 1}]})
    with pytest.raises(ProviderConflict):
        acquire_lease(rt, "run-1", SandboxSpec(provider="faulty"), None, may_retry=True)
    assert rt.store.leases()[0].state == LeaseState.DESTROYED


def test_reuse_binds_the_live_lease(rt: Runtime) -> None:
    spec = SandboxSpec(thread_id="th-1", reuse=True)
    first = acquire_lease(rt, "run-1", spec, None, may_retry=False)
    second = acquire_lease(rt, "run-2", spec, None, may_retry=False)
    assert second.result == AcquireResult.REUSED and second.lease_id == first.lease_id
    assert rt.store.get_lease(first.lease_id).run_id == "run-2"
    assert rt.store.get_run("run-2").lease_id == first.lease_id


def test_reuse_of_a_dead_sandbox_destroys_it_and_acquires_fresh(rt: Runtime) -> None:
    spec = SandboxSpec(thread_id="th-1", reuse=True)
    first = acquire_lease(rt, "run-1", spec, None, may_retry=False)
    os.killpg(rt.store.get_lease(first.lease_id).provider_meta["pid"], signal.SIGKILL)
    # kill() returns before the process is gone: the sandbox is dead once it is
    until_gone(rt, "local", first.lease_id, "the sandbox's process to die")
    second = acquire_lease(rt, "run-2", spec, None, may_retry=False)
    assert second.result == AcquireResult.ACQUIRED and second.lease_id != first.lease_id
    old = rt.store.get_lease(first.lease_id)
    assert old.state == LeaseState.DESTROYED and old.end_reason == "not_resumable"
    check = rt.provider("local").resume_check(handle(rt.store.get_lease(second.lease_id)), 1)
    assert check.outcome == ResumeOutcome.RESUMABLE


def test_an_acquired_local_sandbox_already_leads_its_own_process_group(rt: Runtime) -> None:
    # Before: the launcher printed the pid of a background `setsid`, which had not always
    # run yet when the acquire returned; a kill of the group right after the acquire then
    # failed with ProcessLookupError (seen on a loaded machine in this file's reuse test).
    for n in range(20):
        done = acquire_lease(rt, f"run-{n}", SandboxSpec(), None, may_retry=False)
        pid = int(rt.store.get_lease(done.lease_id).provider_meta["pid"])
        assert os.getpgid(pid) == pid


def test_without_reuse_each_run_gets_its_own_sandbox(rt: Runtime) -> None:
    spec = SandboxSpec(thread_id="th-1")
    a = acquire_lease(rt, "run-1", spec, None, may_retry=False)
    b = acquire_lease(rt, "run-2", spec, None, may_retry=False)
    assert a.lease_id != b.lease_id and a.sandbox_key != b.sandbox_key


def test_explicit_key_clash_without_reuse_is_a_clear_error(rt: Runtime) -> None:
    acquire_lease(rt, "run-1", SandboxSpec(sandbox_key="shared"), None, may_retry=False)
    with pytest.raises(InvalidRequest, match="pass reuse=true"):
        acquire_lease(rt, "run-2", SandboxSpec(sandbox_key="shared"), None, may_retry=False)


def test_unknown_provider_is_refused_before_anything_is_written(rt: Runtime) -> None:
    with pytest.raises(InvalidRequest, match=r"unknown provider 'nomad'.*LEASEKEEPER_PROVIDERS"):
        acquire_lease(rt, "run-1", SandboxSpec(provider="nomad"), None, may_retry=False)
    assert rt.store.leases() == [] and rt.store.get_run("run-1") is None


@pytest.mark.parametrize(("run_id", "spec", "message"), [
    ("", {}, "run_id must be"),
    ("run 1", {}, "run_id must be"),
    ("r", {"tenant": "Not_DNS"}, "tenant must be"),
    ("r", {"env": {"1BAD": "x"}}, "invalid environment variable names"),
    ("r", {"surprise": 1}, "surprise: Extra inputs are not permitted"),
    ("r", {"secret_env": {"TOKEN": 12345}}, "secret_env.TOKEN"),
    ("r", {"env": {"A": "x\0y"}}, r"env.A: .*NUL"),
    ("r", {"secret_env": {"TOKEN": "123\x0045"}}, r"secret_env.TOKEN: .*NUL"),
    ("r", {"secret_env": {"TOKEN": "12345" * 7000}}, r"secret value may be at most 32768 char"),
    ("r", {"command": ["sleep", "1\0"]}, r"command.1: .*NUL"),
    ("r", {"image": "busybox\0"}, r"image: .*NUL"),
    ("r", {"ttl_s": 10**12}, r"ttl_s: .*less than or equal to 31622400"),
    ("r", {"idle_timeout_s": 10**20}, r"idle_timeout_s: .*less than or equal to"),
    ("r", {"secret_env": {"bad-name": "12345"}}, r"secret_env is invalid: .*'bad-name'"),
    ("r", {"secret_env": "12345"}, r"secret_env is invalid: .*valid dictionary"),
    # a misspelt secret field: its reason stays readable through the worker's scrubber
    ("r", {"secretEnv": {"T": "12345"}}, r"secretEnv is invalid: Extra inputs are not"),
    ("r", {"Secret-Env": "12345"}, r"Secret-Env is invalid: Extra inputs are not"),
    ("r", {"labels": {"leasekeeper.dev/lease-id": "x"}}, r"leasekeeper.dev/ prefix is"),
    ("r", {"labels": {"Example.com/team": "x"}}, r"not a valid Kubernetes label"),
    ("r", {"image": " busybox:1.36"}, r"image: .*whitespace"),
    ("r", {"resources": {"cpu_request": "lots"}}, r"'lots' is not a Kubernetes quantity"),
    # a digit that is not ASCII (ARABIC-INDIC TWO): the API server would refuse it later
    ("r", {"resources": {"cpu_request": "\u0662"}}, r"is not a Kubernetes quantity"),
    ("r", {"resources": {"memory_request": "2Gi", "memory_limit": "1Gi"}},
     r"memory_request 2Gi is more than memory_limit 1Gi"),
    ("r", {"env": {"X": "a"}, "secret_env": {"X": "12345"}}, r"'X' set in both env and"),
    ("r", {"env": {"LEASEKEEPER_LEASE_ID": "x"}}, r"leasekeeper sets this variable"),
    # a lone surrogate (JSON's unpaired \u escape) has no UTF-8 form for execve()
    ("r", {"secret_env": {"X": "123\ud80045"}}, r"secret_env\.X: .*lone surrogate"),
    ("r", {"env": {"X": "a\udc00"}}, r"env\.X: .*unicode string"),
    # a label or an id is sent and stored in clear: one holding a secret is refused
    ("r", {"labels": {"team": "123456", "app": "web"}, "secret_env": {"X": "123456"}},
     r"label 'team': the value holds a secret_env value.*pass the secret in secret_env only"),
    ("r", {"labels": {"team": "v-123456-x"}, "secret_env": {"X": "123456"}},
     r"label 'team': the value holds a secret_env value"),
    ("r", {"labels": {"a12345": "x"}, "secret_env": {"X": "a12345"}},
     r"a label key holds a secret_env value"),
    ("r", {"thread_id": "t-123456", "secret_env": {"X": "123456"}},
     r"thread_id holds a secret_env value"),
    # so is env (the pod's or process's spec) and the command (a process list, too)
    ("r", {"env": {"COPY": "123456", "OK": "x"}, "secret_env": {"X": "123456"}},
     r"env 'COPY': holds a secret_env value; env is sent in clear.*secret_env only"),
    ("r", {"env": {"URL": "https://u:a123456@db"}, "secret_env": {"X": "a123456"}},
     r"env 'URL': holds a secret_env value"),
    ("r", {"command": ["sh", "-c", "curl -H 'Bearer a123456'"], "secret_env": {"X": "a123456"}},
     r"command argument 2 \(counted from 0\) holds a secret_env value"),
    ("run-a123456", {"secret_env": {"X": "a123456"}}, r"run_id holds a secret_env value"),
    # and the image reference (the pod's spec, the kubelet's pull); before, accepted
    ("r", {"image": "registry.example/x:a123456", "secret_env": {"X": "a123456"}},
     r"image holds a secret_env value; an image reference is sent in clear"),
])
def test_malformed_payloads_are_clear_and_leak_nothing(run_id: str, spec: dict[str, object],
                                                       message: str) -> None:
    with pytest.raises(InvalidRequest, match=message) as err:
        parse_acquire(run_id, spec)
    assert "12345" not in str(err.value)
    # and the worker's scrubbing of every error (for secrets) leaves the reason readable
    assert scrub_text(str(err.value)) == str(err.value)


def test_an_empty_spec_is_the_default_spec_and_stays_so(rt: Runtime) -> None:
    # An empty payload's spec is one shared instance (no validation per acquire): it
    # must read as a fresh default spec does, and no acquire may change it.
    fresh = SandboxSpec()
    for empty in (None, {}):
        assert parse_acquire("r", empty)[1] is DEFAULT_SPEC
    assert DEFAULT_SPEC.redacted() == fresh.model_dump(mode="json", exclude_none=True)
    assert DEFAULT_SPEC.to_payload() == {}
    assert DEFAULT_SPEC.redacted() is not DEFAULT_SPEC.redacted()  # each caller its own
    for bad in ([], "", 0):
        with pytest.raises(InvalidRequest, match=r"invalid lease\.acquire payload"):
            parse_acquire("r", bad)
    done = acquire_lease(rt, "run-1", parse_acquire("run-1", {})[1], None, may_retry=False)
    assert rt.store.get_lease(done.lease_id).spec == fresh.redacted()
    assert fresh == DEFAULT_SPEC and DEFAULT_SPEC.model_dump() == fresh.model_dump()


def test_a_short_secret_elsewhere_is_accepted_and_hidden_where_whole(rt: Runtime) -> None:
    # "42" is too short to be a secret anyone could find: equal to an env value or a
    # label, or inside other text, it is no reason to refuse; the stored spec hides it
    # where a whole value equals it
    long, short = "hunter2-long", "42"
    spec = SandboxSpec(provider="noop", secret_env={"TOKEN": long, "PIN": short},
                       env={"ANSWER": "42 is it", "PIN_COPY": short},
                       command=["sh", "-c", "echo 42"], labels={"team": short})
    done = acquire_lease(rt, "run-1", spec, None, may_retry=False)
    stored = rt.store.get_lease(done.lease_id).spec
    assert stored["env"] == {"ANSWER": "42 is it", "PIN_COPY": "***"}
    assert stored["command"] == ["sh", "-c", "echo 42"]
    assert stored["labels"] == {"team": "***"}
    assert stored["secret_env"] == {"TOKEN": "***", "PIN": "***"}
    assert long not in json.dumps(stored)


def test_kubernetes_label_keys_with_a_prefix_are_accepted() -> None:
    spec = SandboxSpec(labels={"example.com/team": "a", "app.kubernetes.io/Part_of": "b"})
    assert spec.labels["example.com/team"] == "a"


def test_an_unknown_backend_of_the_local_and_noop_providers_is_refused(rt: Runtime) -> None:
    for provider in ("local", "noop"):
        with pytest.raises(TerminalProviderError, match=r"unknown backend 'bogus'"):
            rt.provider(provider).check_spec(SandboxSpec(backend="bogus"))
    rt.provider("local").check_spec(SandboxSpec(backend="process"))
    rt.provider("noop").check_spec(SandboxSpec(backend="none"))


def test_a_command_not_found_names_whose_path_without_quoting_the_workers(
    rt: Runtime,
) -> None:
    # Before (a QA pass): "... not found on PATH '/root/.cargo/bin:...' (176 chars)", the
    # worker's own PATH in a task result any web client reads.
    local = rt.provider("local")
    with pytest.raises(TerminalProviderError) as err:
        local.check_spec(SandboxSpec(command=["no-such-command-here"]))
    assert "command 'no-such-command-here' not found on the worker's PATH" in str(err.value)
    assert os.environ["PATH"] not in str(err.value) and "/bin" not in str(err.value)
    with pytest.raises(TerminalProviderError, match=r"on the sandbox's PATH \(env\.PATH\)"):
        local.check_spec(SandboxSpec(command=["no-such-command-here"],
                                     env={"PATH": "/nowhere"}))


def test_quantities_compare_by_value() -> None:
    assert quantity_value("500m") == Decimal("0.5") and quantity_value("2") == 2
    assert quantity_value("1Gi") > quantity_value("1000Mi") > quantity_value("1G")
    assert quantity_value("1e3") == quantity_value("1k") == 1000
    assert quantity_value(".5") == quantity_value("0.5")
    SandboxSpec(resources={"cpu_request": "1500m", "cpu_limit": "2", "memory_request": "1Gi",
                           "memory_limit": "1024Mi"})
