"""Warm pools as an installation declares them, and how a run's spec meets its pool.

Pools come from ``LEASEKEEPER_POOLS`` (a JSON list) or ``LEASEKEEPER_POOLS_FILE`` (a JSON
or TOML file: a list, or ``{"pools": [...]}`` / ``[[pools]]`` tables), one of the two, and
are validated when the settings are read (workers/settings.py), so a bad declaration stops
the worker, beat, `leasekeeper up` and every command at start with one message naming the
pool, the field and the fix. Each pool::

    {"name": "py", "provider": "local", "backend": null, "size": 4, "max_size": 6,
     "max_age_s": 3600, "fill_batch_size": 5,
     "template": {"image": "...", "command": [...], "env": {...}, "resources": {...},
                  "labels": {...}, "tenant": "acme"}}

``size`` members are kept ready (``warm``); ``max_size`` (default ``size``) bounds every
member that exists, counting those provisioning and those being drained, so replacements
may start while old members are still being destroyed but never beyond it. The template is
what every member runs: nothing per run (``secret_env``, ``thread_id``, ``sandbox_key``,
``reuse``, lifetimes) belongs in it; a run's own data reaches the member it claims.

A run names a pool with ``spec.pool``. Its spec may leave out what the template decides
(provider, backend, image, command, resources) or repeat it exactly; anything else would
need another sandbox than the one already running, and is refused (``InvalidRequest``).
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from providers.errors import InvalidRequest
from providers.spec import MAX_ENV_VARS, MAX_SPEC_CHARS, POOL_NAME, SandboxSpec, echo

# What the template decides for every member; a run may omit these or repeat them exactly.
SANDBOX_FIELDS = ("provider", "backend", "image", "command", "resources")
TEMPLATE_FIELDS = frozenset({"image", "command", "env", "resources", "labels", "tenant"})
PER_RUN_FIELDS = frozenset({"secret_env", "thread_id", "sandbox_key", "reuse", "ttl_s",
                            "idle_timeout_s", "pool"})
POOLS_DOC = "see the README's \"Warm pools\""


class PoolDeclaration(BaseModel):
    """One pool, as declared. Strict: ``"size": "2"`` is refused, not coerced."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: str
    provider: str
    backend: str | None = Field(default=None, min_length=1, max_length=253)
    template: SandboxSpec = Field(default_factory=SandboxSpec)
    size: int = Field(ge=0, le=10_000)
    max_size: int = Field(ge=0, le=10_000)  # defaults to size
    max_age_s: int = Field(default=3600, gt=0)
    fill_batch_size: int = Field(default=5, gt=0, le=1000)  # members created per fill tick

    @model_validator(mode="before")
    @classmethod
    def _shape(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        template = data.get("template")
        if isinstance(template, dict):
            per_run = sorted(set(template) & PER_RUN_FIELDS)
            if per_run:
                raise ValueError(
                    f"template.{', template.'.join(per_run)}: per-run data has no place in a "
                    "pool's template (a run passes it with its acquire, and the member it "
                    "claims receives it); remove it")
            other = sorted(set(template) - TEMPLATE_FIELDS - PER_RUN_FIELDS)
            if {"provider", "backend"} & set(other):
                raise ValueError("template.provider/backend: set them on the pool itself, "
                                 "beside name and size, not in its template")
        if "max_size" not in data:  # defaults to size (a wrong size is reported once)
            size = data.get("size")
            data = {**data, "max_size": size if isinstance(size, int) else 0}
        return data

    @model_validator(mode="after")
    def _checks(self) -> PoolDeclaration:
        if not POOL_NAME.fullmatch(self.name):
            raise ValueError("name: must be 1-40 lowercase letters, digits or '-', starting "
                             "and ending alphanumeric (a DNS label)")
        if self.max_size < self.size:
            raise ValueError(f"max_size {self.max_size} is below size {self.size}; raise "
                             "max_size or lower size")
        return self

    def member_spec(self) -> SandboxSpec:
        """What every member of the pool is created with."""
        return self.template.model_copy(update={"provider": self.provider,
                                                "backend": self.backend, "pool": self.name})

    def run_spec(self, spec: SandboxSpec) -> SandboxSpec:
        """The run's spec with the template filled in: what a claimed member already runs
        (and a cold start creates), with the run's env and labels over the template's and
        the run's tenant if it named one. Idempotent. InvalidRequest names a field the run
        set to something the template does not run."""
        member = self.member_spec()
        for name in SANDBOX_FIELDS:
            asked, runs = getattr(spec, name), getattr(member, name)
            if asked is not None and asked != runs:
                template = ("sets none (the provider's default)" if runs is None else
                            f"has {echo(runs)}" if isinstance(runs, str) else "has another")
                shown = f" (asked {echo(asked)}; the template {template})" if isinstance(
                    asked, str) else ""
                raise InvalidRequest(
                    f"spec.{name} differs from pool {self.name!r}'s template{shown}: its "
                    f"members are already running the template; leave spec.{name} out to "
                    "claim from the pool, or leave spec.pool out for a sandbox of your own")
        env = {**member.env, **spec.env}
        if len(env) > MAX_ENV_VARS:
            raise InvalidRequest(f"spec.env and pool {self.name!r}'s template env add up to "
                                 f"{len(env)} variables, over the {MAX_ENV_VARS} allowed")
        update: dict[str, Any] = {name: getattr(member, name) for name in SANDBOX_FIELDS}
        update |= {"env": env, "labels": {**member.labels, **spec.labels}}
        if "tenant" not in spec.model_fields_set:
            update["tenant"] = member.tenant
        merged = spec.model_copy(update=update)
        if merged.total_chars() > MAX_SPEC_CHARS:
            raise InvalidRequest(
                f"spec with pool {self.name!r}'s template: command, env and secret_env add "
                f"up to {merged.total_chars()} characters, over the {MAX_SPEC_CHARS} allowed")
        return merged


def find_pool(pools: Iterable[PoolDeclaration], name: str) -> PoolDeclaration:
    """The declared pool ``name``, or InvalidRequest naming the pools there are."""
    declared = list(pools)
    for pool in declared:
        if pool.name == name:
            return pool
    known = ", ".join(p.name for p in declared) or "none"
    raise InvalidRequest(f"unknown pool {name!r}: this installation declares {known} "
                         "(LEASEKEEPER_POOLS / LEASEKEEPER_POOLS_FILE)")


def resolve_spec(pools: Iterable[PoolDeclaration], spec: SandboxSpec) -> SandboxSpec:
    """The spec to acquire with: unchanged without ``pool``, else merged with its pool's
    template (InvalidRequest for an unknown pool or a field the template does not run)."""
    if spec.pool is None:
        return spec
    return find_pool(pools, spec.pool).run_spec(spec)


# -- reading the declarations -------------------------------------------------------------
def read_pools(raw: object, pools_file: object) -> tuple[PoolDeclaration, ...]:
    """The pools from LEASEKEEPER_POOLS (``raw``: JSON text, or already a list) or from
    LEASEKEEPER_POOLS_FILE; ValueError saying which variable, which pool, what and how."""
    if pools_file not in (None, ""):
        if raw not in (None, "", (), []):
            raise ValueError("LEASEKEEPER_POOLS and LEASEKEEPER_POOLS_FILE are both set: "
                             "declare the pools in one of them")
        path = Path(str(pools_file))
        return parse_pools(_load_file(path), f"LEASEKEEPER_POOLS_FILE={path}")
    if raw in (None, ""):
        return ()
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"LEASEKEEPER_POOLS is not valid JSON ({exc.msg} at character "
                             f"{exc.pos}); it takes a list of pools, {POOLS_DOC}") from None
    return parse_pools(raw, "LEASEKEEPER_POOLS")


def _load_file(path: Path) -> object:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"LEASEKEEPER_POOLS_FILE={path}: cannot read it "
                         f"({exc.strerror or exc}); point it at a JSON or TOML file") from None
    try:
        data: object = (tomllib.loads(text) if path.suffix == ".toml" else json.loads(text))
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        kind = "TOML" if path.suffix == ".toml" else "JSON (name it .toml for TOML)"
        raise ValueError(f"LEASEKEEPER_POOLS_FILE={path} is not valid {kind}: {exc}") from None
    if isinstance(data, dict):
        extra = sorted(set(data) - {"pools"})
        if extra or "pools" not in data:
            raise ValueError(f"LEASEKEEPER_POOLS_FILE={path}: expected only a 'pools' list "
                             f"([[pools]] tables in TOML), found {', '.join(extra) or 'none'}")
        return data["pools"]
    return data


def parse_pools(raw: object, source: str) -> tuple[PoolDeclaration, ...]:
    if isinstance(raw, tuple):
        raw = list(raw)
    if not isinstance(raw, list):
        raise ValueError(f"{source}: expected a list of pools, got {type(raw).__name__}; "
                         f"{POOLS_DOC}")
    pools: list[PoolDeclaration] = []
    for i, item in enumerate(raw):
        if isinstance(item, PoolDeclaration):
            pools.append(item)
            continue
        name = item.get("name") if isinstance(item, dict) else None
        label = f"pool {i}" + (f" ({name!r})" if isinstance(name, str) else "")
        try:
            pools.append(PoolDeclaration.model_validate(item))
        except ValidationError as exc:
            problems = "; ".join(_problem(e) for e in exc.errors(include_input=False))
            raise ValueError(f"{source}: {label}: {problems}; fix the declaration "
                             f"({POOLS_DOC})") from None
    seen: set[str] = set()
    for pool in pools:
        if pool.name in seen:
            raise ValueError(f"{source}: pool {pool.name!r} is declared twice; give each "
                             "pool its own name")
        seen.add(pool.name)
    return tuple(pools)


def _problem(error: Any) -> str:
    where = ".".join(str(p) for p in error["loc"])
    message = str(error["msg"]).removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        message = (f"not a template field (a template takes {', '.join(sorted(TEMPLATE_FIELDS))})"
                   if where.startswith("template.") else
                   f"not a pool setting (a pool takes {', '.join(PoolDeclaration.model_fields)})")
    if error["type"] == "missing":
        message = "missing (required)"
    return f"{where}: {message}" if where else message
