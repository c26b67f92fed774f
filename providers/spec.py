"""The sandbox spec a caller asks for, validated before anything is enqueued or created.

Secret values live only in ``secret_env`` (``SecretStr``): they reach the provider, and
leasekeeper writes them nowhere else (the broker holds a task's message, arguments and
all, until the task is done: README "Secrets"). ``redacted()`` is what logs, Flower and
task results may show.
Types are strict (the JSON contract: ``"yes"`` is not a boolean, ``"60"`` not an integer)
and every size is bounded (below), so nothing too big for a process's argv and environment
(or a Kubernetes object) is ever stored or sent to a provider.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from decimal import Decimal
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)

# Whole-string patterns, always used with fullmatch (a .match with $ lets a final newline
# through: "run-1\n"); the Kubernetes provider's delivery checks with the same ones.
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A Kubernetes label key: an optional DNS-subdomain prefix and '/', then a name
LABEL_KEY = re.compile(r"([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?"
                       r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
RESERVED_LABEL_PREFIX = "leasekeeper.dev/"  # the labels that say which lease owns what
# Set on every Kubernetes object leasekeeper makes (=leasekeeper); a spec's would be lost
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
# Variables leasekeeper sets in every sandbox (the providers': local's workspace marker,
# the lease id, Kubernetes' bootstrap token for a pool's deliveries)
RESERVED_ENV = frozenset({"LEASEKEEPER_LEASE_ID", "LEASEKEEPER_WORKSPACE",
                          "LEASEKEEPER_BOOTSTRAP_TOKEN"})
LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")
TENANT = re.compile(r"[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?")
POOL_NAME = TENANT  # a DNS label of at most 40 characters (it becomes a label value)
REDACTED = "***"
# A secret value at least this long is hidden wherever it appears inside other text (and
# searched for in logs and errors, and marked for run.finish: tasks/redaction.py,
# tasks/secret_marks.py); a shorter one only where a whole value equals it (searching
# text for "42" would garble every line, and hide nothing a reader could not guess).
MIN_SUBSTRING_SECRET_CHARS = 6
ECHO_MAX_CHARS = 40  # how much of a refused value an error message may quote

# Bounds of a spec (Linux caps one argv/env string at 128 KiB and all of them at ~2 MiB;
# a Kubernetes object at 1 MiB).
MAX_COMMAND_ARGS = 256
MAX_COMMAND_ARG_CHARS = 8192
MAX_ENV_VARS = 256
MAX_ENV_NAME_CHARS = 256
MAX_ENV_VALUE_CHARS = 32768
MAX_LABELS = 64
MAX_NAME_CHARS = 253  # image, provider, backend, resource quantities
MAX_SPEC_CHARS = 128 * 1024  # command, env and secret_env together
MAX_DURATION_S = 366 * 24 * 3600  # a lease's ttl and idle timeout: a year (and a day)


def described(value: object) -> str:
    """What a refused payload value was, for an error message, without any of it: its type,
    and a string's length ("a string of 16 characters"). A value may be another run's
    secret (a caller that mixed up its variables): validation errors never echo values."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return f"a string of {len(value)} characters" if value else "an empty string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    kind = type(value).__name__
    return f"{'an' if kind[:1] in 'aeiou' else 'a'} {kind}"


def echo(value: object) -> str:
    """A short quote of a refused *name* for an error message: a field's, a label key's, an
    environment variable's, a task's; never of a value a payload carries
    (:func:`described`)."""
    text = repr(value) if isinstance(value, str) else type(value).__name__
    if len(text) <= ECHO_MAX_CHARS:
        return text
    # the length is the value's own (its repr adds quotes and escapes)
    size = len(value) if isinstance(value, str) else len(text)
    return f"{text[:ECHO_MAX_CHARS]}... ({size} chars)"


def holds_secret(text: str, secrets: Collection[str]) -> bool:
    """Whether ``text`` is or holds a secret value long enough to be one (at least
    MIN_SUBSTRING_SECRET_CHARS): what a field sent in clear is refused for. A shorter
    "secret" equal to an env value or a label ("1", "true") is no reason to refuse a
    payload; it is still hidden wherever a whole value equals it (hide_secret_values)."""
    return any(len(s) >= MIN_SUBSTRING_SECRET_CHARS and s in text for s in secrets)


def hide_secret_values(value: Any, secrets: Collection[str]) -> Any:
    """A copy of ``value`` (JSON-like: dicts, lists, strings) where every string (key or
    value) equal to one of ``secrets`` is ``***``, and every secret of at least
    MIN_SUBSTRING_SECRET_CHARS inside a string is replaced by ``***`` (the longest first)."""
    whole = frozenset(secrets) - {""}
    if not whole:
        return value
    inner = sorted((s for s in whole if len(s) >= MIN_SUBSTRING_SECRET_CHARS), key=len,
                   reverse=True)
    return _hide(value, whole, inner)


def _hide(value: Any, whole: frozenset[str], inner: list[str]) -> Any:
    if isinstance(value, str):
        if value in whole:
            return REDACTED
        present = [secret for secret in inner if secret in value]
        return hide_in_text(value, present) if present else value
    if isinstance(value, dict):
        return {_hide(k, whole, inner): _hide(v, whole, inner) for k, v in value.items()}
    if isinstance(value, (list, tuple)):  # a tuple of types: cheaper than a union
        return [_hide(v, whole, inner) for v in value]
    return value


def hide_in_text(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every occurrence of every one of ``secrets`` hidden, those inside
    or overlapping another too (one secret's end may be another's start): each run of
    overlapping or touching occurrences is one ``***`` (:func:`hide_spans`)."""
    spans: list[tuple[int, int]] = []
    for secret in secrets:
        if secret:
            at = text.find(secret)
            while at >= 0:
                spans.append((at, at + len(secret)))
                at = text.find(secret, at + 1)
    return hide_spans(text, spans)


def hide_spans(text: str, spans: list[tuple[int, int]]) -> str:
    """``text`` with each run of overlapping or touching ``spans`` (``(start, end)``
    slices, in any order) replaced by one ``***``: no character of any span is left.
    Replacing one secret after another would leave the part of a second secret that
    overlaps a first one past its end (``***IJKLmnop99``)."""
    if not spans:
        return text
    spans = sorted(spans)
    out: list[str] = []
    copied = 0
    start, end = spans[0]
    for at, to in spans:
        if at <= end:
            end = max(end, to)
        else:
            out += (text[copied:start], REDACTED)
            copied, start, end = end, at, to
    out += (text[copied:start], REDACTED, text[end:])
    return "".join(out)


def check_id(kind: str, value: object) -> str:
    if not isinstance(value, str) or not ID_PATTERN.fullmatch(value):
        raise ValueError(
            f"{kind} must be 1-128 characters of letters, digits, '.', '_', ':' or '-', "
            f"starting with a letter or digit; got {described(value)}"
        )
    return value


_SURROGATE = re.compile("[\ud800-\udfff]")


def _exec_safe(value: str) -> str:
    # execve() and every container runtime end a string at its first NUL, and take bytes:
    # a lone surrogate (what JSON's unpaired \uXXXX escape decodes to) has no UTF-8 form.
    # Refused here, not found out by the provider after the lease intent is written.
    if "\0" in value:
        raise ValueError("must not contain a NUL character (\\0)")
    if _SURROGATE.search(value):
        raise ValueError("must be valid Unicode text: a lone surrogate (\\ud800-\\udfff, "
                         "an unpaired \\u escape in JSON) cannot be passed to a process")
    return value


def _secret(value: SecretStr) -> SecretStr:
    """A secret's bounds, checked without its value in any message."""
    raw = value.get_secret_value()
    if len(raw) > MAX_ENV_VALUE_CHARS:
        raise ValueError(f"a secret value may be at most {MAX_ENV_VALUE_CHARS} characters; "
                         f"this one has {len(raw)}")
    _exec_safe(raw)
    return value


def _no_blank_ends(value: str) -> str:
    # Kubernetes refuses an image with leading or trailing whitespace when it creates the
    # pod, long after the Job or Sandbox was accepted
    if value != value.strip():
        raise ValueError("must not start or end with whitespace")
    return value


# A Kubernetes quantity (resource.Quantity's syntax): a decimal number and a suffix
QUANTITY = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)(([KMGTPE]i)|[numkMGTPE]|[eE][+-]?\d+)?",
                      re.ASCII)  # ASCII digits: the API server takes no other
_SUFFIX: dict[str, Decimal] = {
    "": Decimal(1), "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
    **{s: Decimal(10) ** (3 * i) for i, s in enumerate("kMGTPE", start=1)},
    **{f"{s}i": Decimal(2) ** (10 * i) for i, s in enumerate("KMGTPE", start=1)}}


def _quantity(value: str) -> str:
    if not QUANTITY.fullmatch(value):
        raise ValueError(f"{echo(value)} is not a Kubernetes quantity (e.g. 500m, 2, 512Mi, "
                         "4Gi)")
    return value


def quantity_value(text: str) -> Decimal:
    """A quantity's value (``QUANTITY`` syntax), to compare two of them."""
    match = QUANTITY.fullmatch(text)
    if match is None:
        raise ValueError(f"not a quantity: {text!r}")
    number, suffix = match.group(1), match.group(2) or ""
    sign = -1 if text.startswith("-") else 1
    if suffix[:1] in ("e", "E"):
        return sign * Decimal(number + suffix)
    return sign * Decimal(number) * _SUFFIX[suffix]


Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS), AfterValidator(_exec_safe)]
Image = Annotated[Name, AfterValidator(_no_blank_ends)]
Quantity = Annotated[str, Field(min_length=1, max_length=32), AfterValidator(_quantity)]
EnvValue = Annotated[str, Field(max_length=MAX_ENV_VALUE_CHARS), AfterValidator(_exec_safe)]
SecretValue = Annotated[SecretStr, AfterValidator(_secret)]
Arg = Annotated[str, Field(max_length=MAX_COMMAND_ARG_CHARS), AfterValidator(_exec_safe)]
Duration = Annotated[int, Field(gt=0, le=MAX_DURATION_S)]


class Resources(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    cpu_request: Quantity | None = None
    memory_request: Quantity | None = None
    cpu_limit: Quantity | None = None
    memory_limit: Quantity | None = None

    @model_validator(mode="after")
    def _requests_within_limits(self) -> Resources:
        for kind in ("cpu", "memory"):
            request, limit = getattr(self, f"{kind}_request"), getattr(self, f"{kind}_limit")
            if request and limit and quantity_value(request) > quantity_value(limit):
                raise ValueError(f"{kind}_request {request} is more than {kind}_limit {limit} "
                                 "(Kubernetes refuses such a pod)")
        return self


DEFAULT_TENANT = "default"


class SandboxSpec(BaseModel):
    """What a run needs. Every field is optional; defaults come from settings."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    provider: Name | None = None
    backend: Name | None = None
    tenant: str = DEFAULT_TENANT
    thread_id: str | None = None
    sandbox_key: str | None = None
    reuse: bool = False
    image: Image | None = None
    command: list[Arg] | None = Field(default=None, min_length=1, max_length=MAX_COMMAND_ARGS)
    env: dict[str, EnvValue] = Field(default_factory=dict, max_length=MAX_ENV_VARS)
    secret_env: dict[str, SecretValue] = Field(default_factory=dict, max_length=MAX_ENV_VARS)
    labels: dict[str, str] = Field(default_factory=dict, max_length=MAX_LABELS)
    ttl_s: Duration | None = None
    idle_timeout_s: Duration | None = None
    resources: Resources | None = None
    # A warm pool to claim a ready sandbox from (workers/pool_settings.py); the pool's
    # template fills in provider, backend, image, command and resources.
    pool: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_left_out(cls, data: Any) -> Any:
        # A JSON client serialises an absent optional as null: for every field, null is
        # the default, exactly as if the field were left out (also out of
        # model_fields_set, which a pool's template reads for the tenant), so a spec with
        # nulls is the same spec (payload, stored spec, sandbox key) as one without them.
        # Only known fields: an unknown one is refused, null or not (extra="forbid").
        if isinstance(data, dict) and None in data.values():
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data

    @field_validator("tenant")
    @classmethod
    def _tenant(cls, value: str) -> str:
        if not TENANT.fullmatch(value):
            raise ValueError("tenant must be 1-40 lowercase letters, digits or '-' (DNS-safe)")
        return value

    @field_validator("command")
    @classmethod
    def _program(cls, value: list[str] | None) -> list[str] | None:
        if value and not value[0]:
            raise ValueError("command.0 is empty: the first argument names the program to run "
                             "(a name on the worker's PATH, or an absolute path)")
        return value

    @field_validator("pool")
    @classmethod
    def _pool(cls, value: str | None) -> str | None:
        if value is not None and not POOL_NAME.fullmatch(value):
            raise ValueError("pool must be a pool name: 1-40 lowercase letters, digits or "
                             "'-' (DNS-safe)")
        return value

    @field_validator("thread_id", "sandbox_key")
    @classmethod
    def _ids(cls, value: str | None) -> str | None:
        return None if value is None else check_id("id", value)

    @field_validator("env", "secret_env")
    @classmethod
    def _env_names(cls, value: dict[str, Any]) -> dict[str, Any]:
        bad = [k for k in value if len(k) > MAX_ENV_NAME_CHARS or not ENV_NAME.fullmatch(k)]
        if bad:
            raise ValueError(f"invalid environment variable names: "
                             f"{', '.join(map(echo, bad[:5]))} (letters, digits and '_', "
                             f"not starting with a digit, at most {MAX_ENV_NAME_CHARS})")
        return value

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        for key, val in value.items():
            if not LABEL_KEY.fullmatch(key) or not LABEL_VALUE.fullmatch(val):
                raise ValueError(
                    f"label {echo(key)} is not a valid Kubernetes label key/value (keys: "
                    "[prefix/]name, a name of up to 63 alphanumerics, '-', '_', '.', a prefix "
                    "a lowercase DNS subdomain; values up to 63 characters)"
                )
            if key.startswith(RESERVED_LABEL_PREFIX):
                raise ValueError(
                    f"label {echo(key)}: the {RESERVED_LABEL_PREFIX} prefix is leasekeeper's "
                    "own (its labels say which lease owns a resource); use another prefix")
            if key == MANAGED_BY_LABEL:
                raise ValueError(
                    f"label {echo(key)}: leasekeeper sets it on everything it makes "
                    "(=leasekeeper); use another label key")
        return value

    def total_chars(self) -> int:
        """The size of command, env and secret_env together (bounded by MAX_SPEC_CHARS)."""
        total = sum(len(a) for a in self.command or [])
        total += sum(len(k) + len(v) for k, v in self.env.items())
        return total + sum(len(k) + len(v.get_secret_value())
                           for k, v in self.secret_env.items())

    @model_validator(mode="after")
    def _env_names_once(self) -> SandboxSpec:
        both = sorted(self.env.keys() & self.secret_env.keys())
        if both:
            raise ValueError(f"{', '.join(map(echo, both[:5]))} set in both env and secret_env; "
                             "give each variable once (a secret in secret_env only)")
        ours = sorted((self.env.keys() | self.secret_env.keys()) & RESERVED_ENV)
        if ours:
            raise ValueError(f"{', '.join(map(echo, ours))}: leasekeeper sets "
                             f"{'this variable' if len(ours) == 1 else 'these variables'} in "
                             "every sandbox itself; use another name")
        return self

    @model_validator(mode="after")
    def _no_secret_sent_in_clear(self) -> SandboxSpec:
        # Labels and ids are sent in clear (Kubernetes labels, resource names, the store's
        # columns, task results): a secret there is a mistake. Named by key, never value.
        if not self.secret_env:
            return self
        secrets = self.secret_values().values()
        if any(holds_secret(k, secrets) for k in self.labels):
            raise ValueError("a label key holds a secret_env value; labels are sent to "
                             "Kubernetes in clear: pass the secret in secret_env only")
        bad = [k for k, v in self.labels.items() if holds_secret(v, secrets)]
        if bad:
            raise ValueError(f"label {', '.join(map(echo, bad[:5]))}: the value holds a "
                             "secret_env value; labels are sent to Kubernetes in clear: "
                             "pass the secret in secret_env only")
        ids = [f for f in ("tenant", "thread_id", "sandbox_key", "pool")
               if (v := getattr(self, f)) is not None and holds_secret(v, secrets)]
        if ids:
            raise ValueError(f"{', '.join(ids)} holds a secret_env value; it is stored and "
                             "shown in clear: use another id")
        if self.image is not None and holds_secret(self.image, secrets):
            raise ValueError("image holds a secret_env value; an image reference is sent in "
                             "clear (the pod's spec, the kubelet's pull): give registry "
                             "credentials through the namespace's imagePullSecrets")
        # env and the command are the sandbox's spec in clear (a Kubernetes pod's spec,
        # readable by whoever may read pods; a local process's argv and environ): a
        # secret there would reach the sandbox outside secret_env's per-run Secret.
        env = [k for k, v in self.env.items() if holds_secret(k, secrets)
               or holds_secret(v, secrets)]
        if env:
            raise ValueError(f"env {', '.join(map(echo, env[:5]))}: holds a secret_env "
                             "value; env is sent in clear (the pod's or process's spec): "
                             "pass the secret in secret_env only")
        args = [str(i) for i, a in enumerate(self.command or []) if holds_secret(a, secrets)]
        if args:
            raise ValueError(f"command argument {', '.join(args[:5])} (counted from 0) holds "
                             "a secret_env value; a command is sent in clear (the pod's "
                             "spec, a process list): read the secret from its variable")
        return self

    @model_validator(mode="after")
    def _reuse_needs_a_key(self) -> SandboxSpec:
        # Without either, the reuse key would be the tenant's alone: every reusing run of
        # the tenant would share one sandbox, holding the first run's env and secrets.
        if self.reuse and self.thread_id is None and self.sandbox_key is None:
            raise ValueError("reuse needs thread_id or sandbox_key: without either, every "
                             "reusing run of the tenant would share one sandbox (and the "
                             "first run's env and secrets); pass the thread's id, or set "
                             "reuse to false")
        return self

    @model_validator(mode="after")
    def _total_size(self) -> SandboxSpec:
        total = self.total_chars()
        if total > MAX_SPEC_CHARS:
            raise ValueError(
                f"command, env and secret_env add up to {total} characters, over the "
                f"{MAX_SPEC_CHARS} allowed; pass large inputs as files or through the image"
            )
        return self

    def secret_values(self) -> dict[str, str]:
        return {k: v.get_secret_value() for k, v in self.secret_env.items()}

    def redacted(self) -> dict[str, Any]:
        """A JSON-safe copy where every secret value is replaced by ``***``, wherever else
        in the spec it is repeated too (``hide_secret_values``: an ``env`` value, a command
        argument)."""
        if self is DEFAULT_SPEC:  # most acquires: its dump, without pydantic's walk
            return {"tenant": DEFAULT_TENANT, "reuse": False, "env": {}, "secret_env": {},
                    "labels": {}}
        data = self.model_dump(mode="json", exclude_none=True)
        if self.secret_env:
            data["secret_env"] = dict.fromkeys(self.secret_env, REDACTED)
            data = hide_secret_values(data, self.secret_values().values())
        return data

    def to_payload(self) -> dict[str, Any]:
        """The JSON payload for a task message (secrets in clear: only for the broker): the
        fields that differ from their defaults, so a default spec is ``{}`` (the worker
        fills the defaults in; messages, task events and Flower's views stay small)."""
        if self is DEFAULT_SPEC:
            return {}
        data = self.model_dump(mode="json", exclude_none=True, exclude_defaults=True)
        if self.secret_env:
            data["secret_env"] = self.secret_values()
        if "tenant" in self.model_fields_set and "tenant" not in data:
            # Given, even as the default: with a pool, a tenant left out takes the
            # template's (workers/pool_settings.py), so the worker must see it was given.
            data["tenant"] = self.tenant
        return data


# The spec of an empty payload (``{}`` or none): the one most acquires send. Shared, never
# rebuilt: the model is frozen and nothing changes its (empty) mappings.
DEFAULT_SPEC = SandboxSpec()


def parse_spec(spec: object) -> SandboxSpec:
    """A payload's spec as a SandboxSpec (ValueError: what is wrong with it)."""
    if isinstance(spec, SandboxSpec):
        return spec
    if spec is None or (type(spec) is dict and not spec):
        return DEFAULT_SPEC
    return SandboxSpec.model_validate(spec)
