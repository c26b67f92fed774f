"""The sandbox spec a caller asks for, validated before anything is enqueued or created.

Secret values live only in ``secret_env`` (``SecretStr``): they reach the provider and
nothing else. ``redacted()`` is what logs, Flower and task results may show.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
LABEL_KEY = re.compile(r"^[a-z0-9]([-a-z0-9_.]{0,61}[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
TENANT = re.compile(r"^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$")
REDACTED = "***"


def check_id(kind: str, value: object) -> str:
    if not isinstance(value, str) or not ID_PATTERN.match(value):
        raise ValueError(
            f"{kind} must be 1-128 characters of letters, digits, '.', '_', ':' or '-', "
            f"starting with a letter or digit; got {value!r:.80}"
        )
    return value


class Resources(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    cpu_request: str | None = None
    memory_request: str | None = None
    cpu_limit: str | None = None
    memory_limit: str | None = None


class SandboxSpec(BaseModel):
    """What a run needs. Every field is optional; defaults come from settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    provider: str | None = None
    backend: str | None = None
    tenant: str = "default"
    thread_id: str | None = None
    sandbox_key: str | None = None
    reuse: bool = False
    image: str | None = None
    command: list[str] | None = Field(default=None, min_length=1)
    env: dict[str, str] = Field(default_factory=dict)
    secret_env: dict[str, SecretStr] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    ttl_s: int | None = Field(default=None, gt=0)
    idle_timeout_s: int | None = Field(default=None, gt=0)
    resources: Resources | None = None

    @field_validator("tenant")
    @classmethod
    def _tenant(cls, value: str) -> str:
        if not TENANT.match(value):
            raise ValueError("tenant must be 1-40 lowercase letters, digits or '-' (DNS-safe)")
        return value

    @field_validator("thread_id", "sandbox_key")
    @classmethod
    def _ids(cls, value: str | None) -> str | None:
        return None if value is None else check_id("id", value)

    @field_validator("env", "secret_env")
    @classmethod
    def _env_names(cls, value: dict[str, Any]) -> dict[str, Any]:
        bad = [k for k in value if not ENV_NAME.match(k)]
        if bad:
            raise ValueError(f"invalid environment variable names: {', '.join(map(repr, bad))}")
        return value

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        for key, val in value.items():
            if not LABEL_KEY.match(key) or not LABEL_VALUE.match(val):
                raise ValueError(
                    f"label {key!r} is not a valid Kubernetes label key/value "
                    "(keys: lowercase alphanumerics, '-', '_', '.'; values up to 63 characters)"
                )
        return value

    def secret_values(self) -> dict[str, str]:
        return {k: v.get_secret_value() for k, v in self.secret_env.items()}

    def redacted(self) -> dict[str, Any]:
        """A JSON-safe copy where every secret value is replaced by ``***``."""
        data = self.model_dump(mode="json", exclude_none=True)
        if self.secret_env:
            data["secret_env"] = dict.fromkeys(self.secret_env, REDACTED)
        return data

    def to_payload(self) -> dict[str, Any]:
        """The JSON payload for a task message (secrets in clear: only for the broker)."""
        data = self.model_dump(mode="json", exclude_none=True)
        if self.secret_env:
            data["secret_env"] = self.secret_values()
        return data
