"""Typed settings for every leasekeeper process, read from ``LEASEKEEPER_*`` variables.

Units live in the names (``_s`` seconds). Invalid values fail at start-up with a message
naming the variable, see :func:`load_settings`. Besides the environment, settings come from
the env file ``leasekeeper up`` writes (``$LEASEKEEPER_VAR_DIR/env``, default ``.var/env``,
relative to the working directory); a variable set in the environment wins over it.
Unknown ``LEASEKEEPER_*`` variables are warned about, with the closest known name.
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from models.shown_url import query_secrets
from providers.errors import ConfigError
from providers.spec import MAX_DURATION_S, Quantity, quantity_value
from workers.pool_settings import PoolDeclaration, read_pools
from workers.setting_words import number, problem

ENV_PREFIX = "LEASEKEEPER_"
DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,40}[a-z0-9])?")
# Store URL schemes leasekeeper runs on (SQLAlchemy dialect names).
STORE_SCHEMES = ("sqlite", "postgresql")
# redis-py takes ?password= as well as the user part, and kombu then passes it twice
# ("dict() got multiple values for keyword argument 'password'"): refused, never echoed
USER_PART_ONLY = (
    "a password in the URL's query (?password=) is not supported; put it in the user "
    "part: redis://:PASSWORD@host:port/db (percent-encode '/', '@', ':' and '#' in it)")
BROKER_SCHEMES = ("redis", "rediss", "unix")
# what workers/runtime.py's PROVIDER_FACTORIES builds (its import checks the two agree)
PROVIDER_NAMES = ("local", "kubernetes", "noop", "faulty")
# What messages offer: faulty (fault injection) is for leasekeeper's own tests
OFFERED_PROVIDERS = ", ".join(p for p in PROVIDER_NAMES if p != "faulty")
# sweep.retry_cleanup's backoff doubles from LEASEKEEPER_CLEANUP_BACKOFF_S up to this
CLEANUP_BACKOFF_MAX_S = 3600.0
# (a base, the max it is capped at): each backoff is min(base * 2**n, max), so a base above
# its max would never be used
_BACKOFF_PAIRS = (("pool_breaker_backoff_s", "pool_breaker_backoff_max_s"),
                  ("retry_backoff_base_s", "retry_backoff_max_s"))


def provider_not_enabled(name: str, enabled: Sequence[str], where: str, enable: str) -> str:
    """Why ``name`` is refused where LEASEKEEPER_PROVIDERS is ``enabled``: a name no
    leasekeeper has is unknown; one it has is only not enabled ``where``, and ``enable``
    says how to change that (an "unknown" provider sends the reader to look for a typo)."""
    if name not in PROVIDER_NAMES:
        return (f"unknown provider {name!r}: this installation enables "
                f"{', '.join(enabled)} (LEASEKEEPER_PROVIDERS)")
    return (f"provider {name!r} is not enabled on {where} (it enables "
            f"{', '.join(enabled)}): {enable}")
log = logging.getLogger("leasekeeper.settings")

# Settings that say one thing two ways: one of them set in the environment wins over the
# env file's declaration of it either way (the file's other one is not read), as any
# variable set in the environment wins over the file.
ALTERNATIVES = (("pools", "pools_file"),)


class _EnvFileUnderTheEnvironment(PydanticBaseSettingsSource):
    """The env file `up` wrote, less what the environment declares another way."""

    def __init__(self, settings_cls: type[BaseSettings],
                 env_file: PydanticBaseSettingsSource) -> None:
        super().__init__(settings_cls)
        self._env_file = env_file

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # __call__ reads the file through its own source

    def __call__(self) -> dict[str, Any]:
        values = dict(self._env_file())
        environ = {name.upper() for name in os.environ}
        for group in ALTERNATIVES:
            if any(f"{ENV_PREFIX}{name.upper()}" in environ for name in group):
                for name in group:
                    values.pop(name, None)
        return values


class Settings(BaseSettings):
    # A duration is finite and at most a year (and a day): "inf" or 1e15 seconds overflows
    # Celery's schedules and countdowns (beat died on an OverflowError naming no variable).
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True,
                                      allow_inf_nan=False)

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings,
                _EnvFileUnderTheEnvironment(settings_cls, dotenv_settings), file_secret_settings)

    # Services. broker_url unset means "embedded": `leasekeeper up` starts a Redis itself.
    broker_url: str | None = None
    result_backend_url: str | None = None
    store_url: str | None = None
    # PostgreSQL: the longest one store statement may run (the server cancels it: one
    # stuck on a lock, say) and, 5 s later, the longest the lifecycle's hot path waits
    # for an answer (a server that stopped answering); the task then retries.
    store_statement_timeout_s: float = Field(default=60.0, gt=0, le=3600)
    # PostgreSQL: the hot path prepares its few statements once per connection. Behind a
    # pooler in transaction mode (PgBouncer before 1.21) a prepared statement may not be on
    # the next server connection: false sends every statement unprepared (README: Behind
    # PgBouncer). Left true, the first statement the server does not know turns preparing
    # off for the process, with one warning, and is sent again unprepared.
    store_prepared_statements: bool = True
    var_dir: Path = Path(".var")
    # Log lines as plain text, or one JSON object a line (workers/logs.py); worker and beat
    # write to log_file instead of stderr when it is set, rotated at log_file_max_bytes.
    log_format: Literal["text", "json"] = "text"
    log_file: Path | None = None
    log_file_max_bytes: int = Field(default=10 * 1024 * 1024, gt=0)
    log_file_backups: int = Field(default=3, ge=0)

    # Flower, as `leasekeeper up` starts it (0 = any free port). Basic auth is always on.
    flower_port: int = Field(default=5555, ge=0, le=65535)
    flower_basic_auth: SecretStr | None = None  # "user:password"; `up` generates one if unset

    # Providers.
    provider: str = "local"
    providers: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["local"])
    installation_id: str = "default"
    # The key of the secret marks' digests (tasks/secret_marks.py); the same on every
    # worker of the installation. Unset: derived from installation_id (no secret).
    secret_marks_key: SecretStr | None = None
    local_root_dir: Path | None = None
    local_destroy_grace_s: float = Field(default=5.0, gt=0, le=MAX_DURATION_S)
    faults_file: Path | None = None  # the `faulty` provider's fault plan (tests only)

    # Kubernetes provider (providers/kubernetes). No kube_config_path: in-cluster config,
    # falling back to $KUBECONFIG / ~/.kube/config.
    kube_config_path: Path | None = None
    kube_context: str | None = None
    kube_namespace: str = "leasekeeper"
    kube_backend: Literal["sandbox-cr", "job"] = "sandbox-cr"
    kube_sandbox_api_version: Literal["v1alpha1", "v1beta1"] = "v1alpha1"
    kube_default_image: str = "busybox:1.36"
    # Kubernetes quantities; each request at most its limit (the API server refuses a
    # workload whose request is above its limit)
    kube_cpu_request: Quantity = "250m"
    kube_memory_request: Quantity = "512Mi"
    kube_cpu_limit: Quantity = "2"
    kube_memory_limit: Quantity = "4Gi"
    kube_job_active_deadline_s: int = Field(default=3600, gt=0, le=MAX_DURATION_S)
    kube_job_ttl_after_finished_s: int = Field(default=900, ge=0, le=MAX_DURATION_S)
    kube_request_timeout_s: float = Field(default=10.0, gt=0, le=MAX_DURATION_S)
    # A Job's acquire waits this long at most for the Job controller's word on its pod
    # (made, or refused by a quota, a LimitRange, a webhook): an Event on the Job.
    # 0: not checked at acquire (the resume check still reads it)
    kube_job_pod_wait_s: float = Field(default=5.0, ge=0, le=300)
    # A workload still terminating (deletionTimestamp set) this long after its deletion
    # began is stuck (a slow or stuck garbage collector): sweep.orphans reports it and
    # destroys it again, which deletes its pods explicitly.
    kube_terminating_limit_s: float = Field(default=600.0, ge=0, le=MAX_DURATION_S)

    # Warm pools (workers/pool_settings.py): LEASEKEEPER_POOLS (JSON) or
    # LEASEKEEPER_POOLS_FILE (JSON or TOML), read and validated with the other settings.
    pools: Annotated[tuple[PoolDeclaration, ...], NoDecode] = ()
    pools_file: Path | None = None
    fill_pools_interval_s: float = Field(default=15.0, gt=0, le=MAX_DURATION_S)
    # A claim tries at most this many members (each found not resumable is destroyed)
    # before the acquire starts a sandbox cold.
    pool_claim_attempts: int = Field(default=3, gt=0, le=20)
    # After this many consecutive failed member creates a pool stops creating for
    # pool_breaker_backoff_s, doubling after each further failure up to the max.
    pool_breaker_threshold: int = Field(default=3, gt=0)
    pool_breaker_backoff_s: float = Field(default=30.0, gt=0, le=MAX_DURATION_S)
    pool_breaker_backoff_max_s: float = Field(default=900.0, gt=0, le=MAX_DURATION_S)

    # Lease lifetimes.
    lease_ttl_s: int = Field(default=3600, gt=0, le=MAX_DURATION_S)
    lease_idle_timeout_s: int = Field(default=900, gt=0, le=MAX_DURATION_S)
    acquire_timeout_s: float = Field(default=120.0, gt=0, le=MAX_DURATION_S)
    resume_timeout_s: float = Field(default=30.0, gt=0, le=MAX_DURATION_S)
    run_detach_ttl_s: int = Field(default=1800, ge=0, le=MAX_DURATION_S)

    # Sweeps (beat intervals and bounded batches).
    reap_runs_interval_s: float = Field(default=60.0, gt=0, le=MAX_DURATION_S)
    expire_leases_interval_s: float = Field(default=60.0, gt=0, le=MAX_DURATION_S)
    retry_cleanup_interval_s: float = Field(default=60.0, gt=0, le=MAX_DURATION_S)
    finish_exited_interval_s: float = Field(default=30.0, gt=0, le=MAX_DURATION_S)
    stuck_provisioning_interval_s: float = Field(default=60.0, gt=0, le=MAX_DURATION_S)
    orphans_interval_s: float = Field(default=300.0, gt=0, le=MAX_DURATION_S)
    sweep_batch_size: int = Field(default=25, gt=0, le=1000)
    cleanup_batch_size: int = Field(default=20, gt=0, le=1000)
    orphan_batch_size: int = Field(default=25, gt=0, le=1000)
    cleanup_backoff_s: float = Field(default=300.0, ge=0, le=CLEANUP_BACKOFF_MAX_S)
    cleanup_max_attempts: int = Field(default=5, gt=0)
    claim_timeout_s: float = Field(default=300.0, gt=0, le=MAX_DURATION_S)
    # A provider resource with no live lease is destroyed only once it is this old.
    orphan_grace_s: float = Field(default=600.0, gt=0, le=MAX_DURATION_S)
    # A sweep's single-flight lock in Redis expires after this, so a dead tick never
    # blocks the next one (row claims keep an overrunning tick safe).
    sweep_lock_ttl_s: float = Field(default=300.0, gt=0, le=MAX_DURATION_S)

    # Task retry policy (exponential backoff with equal jitter, capped: tasks/base.py).
    task_max_retries: int = Field(default=5, ge=0)
    retry_backoff_base_s: float = Field(default=2.0, gt=0, le=MAX_DURATION_S)
    retry_backoff_max_s: float = Field(default=300.0, gt=0, le=MAX_DURATION_S)
    task_soft_time_limit_s: float = Field(default=600.0, gt=0, le=MAX_DURATION_S)
    task_time_limit_s: float = Field(default=900.0, gt=0, le=MAX_DURATION_S)
    # Redis' visibility timeout: a message taken by a worker that then died (SIGKILL, lost
    # host) is handed to another worker only once this has passed since it was taken (the
    # README's "Delivery" has the measured worst case). Lower means faster recovery after a
    # crash but must stay above task_time_limit_s, or a task still running is delivered twice.
    visibility_timeout_s: float = Field(default=3600.0, gt=0, le=MAX_DURATION_S)
    # How long a task's result (and state) stays readable in the result backend; after it,
    # `.get()` and producer.task_status read PENDING, as for a task still queued.
    result_expires_s: float = Field(default=24 * 3600.0, gt=0, le=MAX_DURATION_S)
    # A task message whose arguments are larger than this is refused (InvalidRequest)
    # before any lookup: tasks take ids and small specs.
    max_payload_bytes: int = Field(default=256 * 1024, ge=1024)
    # The Celery queue this installation's tasks are sent to and its workers consume. Two
    # installations (or test stacks) sharing one Redis each need their own.
    task_queue: str = Field(default="celery", pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,99}$")

    # The sweep tick log (workers/sweep_ticks.py): newest ticks kept per sweep.
    sweep_ticks_kept: int = Field(default=200, ge=1, le=100_000)
    # The provider error log (workers/provider_errors.py): newest rows kept (all providers).
    provider_errors_kept: int = Field(default=10_000, ge=1, le=1_000_000)

    # The metrics exporter (`leasekeeper metrics`, workers/metrics/).
    metrics_host: str = "127.0.0.1"
    metrics_port: int = Field(default=9808, ge=0, le=65535)
    metrics_tenant_top_n: int = Field(default=10, ge=0, le=1000)  # the rest is "other"
    metrics_worker_ping_timeout_s: float = Field(default=1.0, gt=0, le=30)
    metrics_events_batch_size: int = Field(default=5000, gt=0, le=100_000)

    # The lease console (`leasekeeper console`, workers/console/); basic auth is
    # LEASEKEEPER_FLOWER_BASIC_AUTH, required.
    console_host: str = "127.0.0.1"
    console_port: int = Field(default=9809, ge=0, le=65535)
    console_page_size: int = Field(default=50, gt=0, le=500)
    console_flower_url: str = "http://127.0.0.1:5555"  # task links point here

    @model_validator(mode="before")
    @classmethod
    def _read_pools(cls, data: Any) -> Any:
        if isinstance(data, dict) and ("pools" in data or "pools_file" in data):
            return {**data, "pools": read_pools(data.get("pools"), data.get("pools_file"))}
        return data

    @field_validator("providers", mode="before")
    @classmethod
    def _split_providers(cls, value: object) -> object:
        if isinstance(value, str):
            return [p.strip() for p in value.split(",") if p.strip()]
        return value

    @field_validator("providers")
    @classmethod
    def _known_providers(cls, value: list[str]) -> list[str]:
        unknown = [p for p in value if p not in PROVIDER_NAMES]
        if unknown or not value:
            raise ValueError(
                (f"unknown provider(s) {', '.join(map(repr, unknown))}" if unknown else
                 "no provider given") + f"; leasekeeper has {OFFERED_PROVIDERS} "
                "(a comma-separated list, e.g. local,kubernetes)")
        return value

    @field_validator("store_url")
    @classmethod
    def _supported_store(cls, value: str | None) -> str | None:
        if value is None:
            return value
        scheme = value.split(":", 1)[0].split("+", 1)[0].lower()
        if scheme not in STORE_SCHEMES:
            raise ValueError(
                f"{scheme or value[:20]!r} is not a store leasekeeper supports; use "
                "sqlite:////path/to/leasekeeper.db or "
                "postgresql+psycopg://user:password@host:5432/db"
            )
        from sqlalchemy import make_url
        from sqlalchemy.exc import ArgumentError

        try:
            make_url(value).port  # noqa: B018  (parsed lazily: a bad port fails here)
        except (ArgumentError, ValueError) as exc:
            raise ValueError(f"not a database URL: {str(exc)[:120]} (the form is "
                             "postgresql+psycopg://user:password@host:5432/db)") from None
        return value

    @field_validator("result_backend_url")
    @classmethod
    def _no_query_password(cls, value: str | None) -> str | None:
        scheme = (value or "").split("://", 1)[0].lower()
        if value is not None and scheme in BROKER_SCHEMES and query_secrets(value):
            raise ValueError(USER_PART_ONLY)
        return value

    @field_validator("broker_url")
    @classmethod
    def _redis_broker(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if query_secrets(value):
            raise ValueError(USER_PART_ONLY)
        scheme = value.split("://", 1)[0].lower() if "://" in value else ""
        if scheme not in BROKER_SCHEMES:
            raise ValueError(
                f"{scheme or value[:12]!r} is not a Redis URL; the broker is Redis: "
                "redis://[:password@]host:6379/0, rediss:// (TLS) or unix:///path/redis.sock")
        from urllib.parse import urlsplit

        try:
            parts = urlsplit(value)
            parts.port  # noqa: B018  (parsed on access: a bad port fails here)
        except ValueError:
            # never the parser's words: they quote the port, which may be part of a password
            raise ValueError("not a Redis URL: its port is not a number (a password holding "
                             "'/', '@', ':' or '#' must be percent-encoded: %2F, %40, %3A, "
                             "%23)") from None
        # The database number: the path of a redis:// URL (`/0`), Celery's transport takes
        # it with int() and fails every send on anything else.
        if "@" in parts.path:  # what follows an unencoded '/' in a password
            raise ValueError("not a Redis URL: '@' after the host (a password holding '/', "
                             "'@', ':' or '#' must be percent-encoded: %2F, %40, %3A, %23)")
        database = parts.path[1:] if scheme != "unix" else ""
        if database and not database.isdigit():
            raise ValueError(f"the database number {database[:20]!r} after the port is not a "
                             "number; use redis://host:6379/0 (0 to 15 on a default Redis)")
        return value

    @field_validator("installation_id")
    @classmethod
    def _dns_safe_installation(cls, value: str) -> str:
        if value != value.strip() and _DNS_LABEL.fullmatch(value.strip()):
            raise ValueError(
                f"{value!r} ends or starts with whitespace (a value read from a file keeps "
                "its trailing newline): set it without, e.g. `tr -d '\\n' < file`"
            )
        if not _DNS_LABEL.fullmatch(value):
            raise ValueError(
                "must be 1-42 lowercase letters, digits or '-', starting and ending "
                "alphanumeric (it becomes a Kubernetes label value)"
            )
        return value

    @model_validator(mode="after")
    def _limits_are_ordered(self) -> Settings:
        if self.provider not in self.providers:
            raise ValueError(
                f"LEASEKEEPER_PROVIDER={self.provider!r} is not among "
                f"LEASEKEEPER_PROVIDERS={','.join(self.providers)!r}; add it there"
            )
        source = (f"LEASEKEEPER_POOLS_FILE={self.pools_file}" if self.pools_file
                  else "LEASEKEEPER_POOLS")
        for pool in self.pools:
            if pool.provider not in self.providers:
                raise ValueError(
                    f"{source}: pool {pool.name!r} uses provider {pool.provider!r}, which is "
                    f"not among LEASEKEEPER_PROVIDERS={','.join(self.providers)!r}; add it "
                    "there, or give the pool one of those")
        if not self.task_soft_time_limit_s < self.task_time_limit_s < self.visibility_timeout_s:
            raise ValueError(
                "need LEASEKEEPER_TASK_SOFT_TIME_LIMIT_S < LEASEKEEPER_TASK_TIME_LIMIT_S < "
                "LEASEKEEPER_VISIBILITY_TIMEOUT_S, or Redis redelivers tasks still running"
            )
        backwards = []
        for base, cap in _BACKOFF_PAIRS:
            base_s, cap_s = getattr(self, base), getattr(self, cap)
            if base_s > cap_s:
                base_var, cap_var = f"{ENV_PREFIX}{base.upper()}", f"{ENV_PREFIX}{cap.upper()}"
                backwards.append(
                    f"{base_var}={number(base_s)} is above {cap_var}={number(cap_s)}: the "
                    f"backoff never exceeds {cap_var}, so {number(base_s)} s would never be "
                    f"used; lower {base_var} or raise {cap_var}")
        for kind in ("cpu", "memory"):
            request = getattr(self, f"kube_{kind}_request")
            limit = getattr(self, f"kube_{kind}_limit")
            if quantity_value(request) > quantity_value(limit):
                request_var = f"{ENV_PREFIX}KUBE_{kind.upper()}_REQUEST"
                limit_var = f"{ENV_PREFIX}KUBE_{kind.upper()}_LIMIT"
                backwards.append(
                    f"{request_var}={request} is above {limit_var}={limit}: the API server "
                    f"refuses a workload whose request is above its limit; lower "
                    f"{request_var} or raise {limit_var}")
        if backwards:
            raise ValueError("; ".join(backwards))
        return self

    @property
    def effective_broker_url(self) -> str:
        return self.broker_url or DEFAULT_BROKER_URL

    @property
    def leaseless_run_grace_s(self) -> float:
        """How long a run may be running with no lease before sweep.reap_runs fails it:
        longer than any acquire can still be alive without having recorded one (its
        message redelivered after the visibility timeout, then every retry: its backoff
        and a whole attempt each), plus a claim timeout."""
        return (self.visibility_timeout_s + self.claim_timeout_s
                + self.task_max_retries * (self.retry_backoff_max_s + self.task_time_limit_s))

    @property
    def effective_store_url(self) -> str:
        if self.store_url:
            return self.store_url
        return f"sqlite:///{(self.var_dir / 'leasekeeper.db').resolve()}"

    @property
    def effective_local_root(self) -> Path:
        """LEASEKEEPER_LOCAL_ROOT_DIR; a relative one is under LEASEKEEPER_VAR_DIR."""
        return (self.var_dir / (self.local_root_dir or "sandboxes")).resolve()

    @property
    def beat_schedule_file(self) -> Path:
        return (self.var_dir / "celerybeat-schedule").resolve()

    def broker_source(self) -> str:
        """Where the broker URL came from, for the worker's start-up line."""
        return (f"{ENV_PREFIX}BROKER_URL" if self.broker_url else
                f"the default, {ENV_PREFIX}BROKER_URL is not set")

    def require_broker_url(self) -> str:
        if not self.broker_url:
            raise ConfigError(
                "LEASEKEEPER_BROKER_URL is not set: point it at Redis "
                "(redis://127.0.0.1:6379/0), or run `leasekeeper up`, which starts one"
            )
        return self.broker_url


def env_file_path() -> Path:
    """Where `leasekeeper up` writes the settings its clients need (broker, store, the rest
    of what it was started with but secrets)."""
    return Path(os.environ.get(f"{ENV_PREFIX}VAR_DIR") or ".var") / "env"


def load_settings(read_env_file: bool = True) -> Settings:
    """Read settings from the environment (and the env file `leasekeeper up` wrote, unless
    ``read_env_file`` is false); raise ConfigError naming each bad variable."""
    env_file = env_file_path() if read_env_file else None
    try:
        return Settings(_env_file=env_file if env_file and env_file.is_file()  # type: ignore[call-arg]
                        else None)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            field = "_".join(str(p) for p in err["loc"]) if err["loc"] else ""
            message = (problem(field, err) if field else None) or err["msg"].removeprefix(
                "Value error, ")
            # A message about the whole settings names its variables itself.
            problems.append(f"{ENV_PREFIX}{field.upper()}: {message}" if field else message)
        raise ConfigError("invalid settings: " + "; ".join(problems)) from None


# LEASEKEEPER_* names that are not settings but are read elsewhere: a sandbox's own
# environment, docker compose, the test and build harnesses.
NOT_SETTINGS = frozenset({"BOOTSTRAP_TOKEN", "LEASE_ID", "WORKSPACE", "POSTGRES_PASSWORD",
                          "KUBE_BIN_DIR", "KUBE_SRC_VERSION", "CACHE_DIR", "TRACEBACK"})
NOT_SETTINGS_PREFIXES = ("TEST_", "CHAOS_")


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """One warning per LEASEKEEPER_* variable no setting reads, with the closest name."""
    known = {name.upper() for name in Settings.model_fields}
    warnings = []
    for var in sorted(os.environ if environ is None else environ):
        if not var.startswith(ENV_PREFIX):
            continue
        name = var.removeprefix(ENV_PREFIX)
        if name in known or name in NOT_SETTINGS or name.startswith(NOT_SETTINGS_PREFIXES):
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = f"; did you mean {ENV_PREFIX}{close[0]}?" if close else ""
        warnings.append(f"{var} is not a leasekeeper setting and is ignored{hint}")
    return warnings


def warn_unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    warnings = unknown_variables(environ)
    for warning in warnings:
        log.warning("%s", warning)
    return warnings


@functools.cache
def get_settings() -> Settings:
    return load_settings()
