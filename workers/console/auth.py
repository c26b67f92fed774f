"""Basic auth (LEASEKEEPER_FLOWER_BASIC_AUTH, "user:password") for every console page, and
CSRF tokens for its forms: an HMAC, under a key made at start-up, of the user, the lease
and the action, so a cross-site form (which a browser would send with the basic-auth
credentials) cannot act."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets

from starlette.authentication import (
    AuthCredentials,
    AuthenticationBackend,
    AuthenticationError,
    SimpleUser,
)
from starlette.requests import HTTPConnection
from starlette.responses import PlainTextResponse, Response

from providers.errors import ConfigError

REALM = "leasekeeper console"


def parse_basic_auth(value: str) -> tuple[str, str]:
    user, sep, password = value.partition(":")
    if not sep or not user or not password:
        raise ConfigError("LEASEKEEPER_FLOWER_BASIC_AUTH must be user:password (both "
                          "non-empty); the console never runs without basic auth")
    return user, password


class BasicAuth(AuthenticationBackend):
    def __init__(self, user: str, password: str) -> None:
        self._user, self._password = user.encode(), password.encode()

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, SimpleUser]:
        scheme, _, encoded = conn.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "basic":
            raise AuthenticationError("credentials required")
        try:
            user, _, password = base64.b64decode(encoded, validate=True).partition(b":")
        except (binascii.Error, ValueError):
            raise AuthenticationError("malformed credentials") from None
        ok_user = hmac.compare_digest(user, self._user)
        if not (hmac.compare_digest(password, self._password) and ok_user):
            raise AuthenticationError("wrong user or password")
        return AuthCredentials(["operator"]), SimpleUser(user.decode(errors="replace"))


def unauthorized(_conn: HTTPConnection, exc: Exception) -> Response:
    return PlainTextResponse(f"{exc}: use the LEASEKEEPER_FLOWER_BASIC_AUTH user and "
                             "password", status_code=401,
                             headers={"WWW-Authenticate": f'Basic realm="{REALM}"'})


class Csrf:
    def __init__(self, key: bytes | None = None) -> None:
        self._key = key or secrets.token_bytes(32)

    def token(self, user: str, lease_id: str, action: str) -> str:
        message = f"{user}\0{lease_id}\0{action}".encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def valid(self, token: str, user: str, lease_id: str, action: str) -> bool:
        return hmac.compare_digest(token.encode(), self.token(user, lease_id, action).encode())
