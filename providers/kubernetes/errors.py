"""The one translation boundary of the Kubernetes provider: ``kube_errors(action)`` turns
``ApiException``, urllib3 and socket errors into the provider exception tree
(providers/errors.py). Nothing else in this package catches an ``ApiException``.

    TransientProviderError  429, 408, 5xx, timeouts, refused / dropped connections, a broken
     │                      exec stream, a 403 for a used-up ResourceQuota
      ├── KubeExpired       410 Gone: a watch's resourceVersion is too old (re-list, re-watch)
      └── KubeCommandInterrupted  an exec'd command exited with a code its caller calls transient
    TerminalProviderError   400, 401, 403, 405, 415, 422 and anything else unexpected
      ├── KubeNotFound      404 (provider.py decides whether that is success)
      └── KubeCommandFailed an exec'd command exited non-zero (``exit_code``)
    ProviderConflict        409 (provider.py adopts on AlreadyExists when the object is ours)
      └── KubeAlreadyExists

Which statuses are transient is data (``TRANSIENT_STATUSES``). Messages carry the HTTP status,
the API's reason and message, and what to do (``error.status`` has the status, for the
metrics); for Secret operations (``sensitive=True``) the API's free-text message is left
out, so no Secret content can reach a log. Every call names
the RBAC ``Permission`` it needs, so a 403 says exactly which verb on which resource to grant;
a 403 the API server gives for another reason (a used-up quota, a namespace being deleted,
an admission webhook) says that instead (``forbidden``).
"""

from __future__ import annotations

import contextlib
import json
import re
import ssl
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import urllib3.exceptions
import websocket
from kubernetes.client.exceptions import ApiException

from providers.errors import (
    TASK_RETRIES,
    ProviderConflict,
    ProviderError,
    TerminalProviderError,
    TransientProviderError,
)


class KubeNotFound(TerminalProviderError):
    """404: the object does not exist. Success for deletes, an answer for reads."""


class KubeAlreadyExists(ProviderConflict):
    """409 AlreadyExists on create: look at the object and adopt it if it is ours."""


class KubeExpired(TransientProviderError):
    """410 Gone / Expired: the watch must restart from a fresh resourceVersion."""


class KubeCommandFailed(TerminalProviderError):
    """A command run by exec exited non-zero; ``exit_code`` says with what."""

    exit_code: int | None = None


class KubeCommandInterrupted(TransientProviderError):
    """A command run by exec exited with a code its caller says a retry can fix."""

    exit_code: int | None = None


@dataclass(frozen=True)
class CommandExit:
    """What an exec'd command's exit code means: whether a retry can help, what to do."""

    transient: bool
    hint: str


TRANSIENT_STATUSES: frozenset[int] = frozenset({408, 429, 500, 502, 503, 504})

_HINTS: dict[int, str] = {
    400: "the request was malformed; this is a leasekeeper bug or an incompatible API server",
    401: "the credentials were rejected; check LEASEKEEPER_KUBE_CONFIG_PATH / "
         "LEASEKEEPER_KUBE_CONTEXT or the ServiceAccount token",
    403: "the worker's identity lacks RBAC permission for this; grant it in the namespace "
         "(see deploy/) and retry",
    404: "the object or its API is not there; for Sandboxes, is the agent-sandbox CRD "
         "installed and LEASEKEEPER_KUBE_SANDBOX_API_VERSION served?",
    409: "an object with this name exists and is not this lease's, or changed meanwhile",
    410: "the watch fell too far behind; it restarts from a fresh read",
    422: "the API server rejected the manifest; check the sandbox spec (image, command, "
         "resources, env names) and quotas",
    429: "the API server is throttling" + TASK_RETRIES,
}


@dataclass(frozen=True)
class Permission:
    """The RBAC rule an API call needs: ``verb`` on ``resource`` of API ``group``."""

    verb: str
    resource: str
    group: str = ""

    def refused(self, api_message: str) -> Permission:
        """This permission with the verb the API server's 403 message names for the same
        resource (``... cannot get resource "pods/exec" ...``), if it names one."""
        match = _REFUSED.search(api_message)
        if match and match.group(2) == self.resource:
            return replace(self, verb=match.group(1))
        return self

    def missing(self, namespace: str, user: str = "") -> str:
        """What to grant. A refused create is the first request of an acquire: the
        commonest cause is a namespace the worker's Role is not bound in at all (no
        RoleBinding there), which the 403 alone does not tell from a Role without the
        verb: both are said, the binding first."""
        group = f'"{self.group}"' if self.group else '"" (core)'
        who = ""
        grant = (f'add verb "{self.verb}" on resource "{self.resource}" to the worker\'s Role '
                 "(deploy/rbac/role.yaml) and retry")
        if self.verb == "create":
            who = f" ({user})" if user else ""
            grant = (f"if the worker's Role is not bound in namespace {namespace}, it may not "
                     "create anything there: bind the Role in that namespace "
                     "(deploy/rbac/rolebinding.yaml), or set LEASEKEEPER_KUBE_NAMESPACE to the "
                     f"namespace it is bound in; if it is bound, {grant}")
        return (f'the worker\'s identity{who} lacks the RBAC permission to "{self.verb}" '
                f'"{self.resource}" (API group {group}) in namespace {namespace}: {grant}')


_REFUSED = re.compile(r'cannot ([a-z]+) resource "([^"]+)"')


def _status_body(exc: ApiException) -> dict[str, Any]:
    body = exc.body
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    if not body:
        return {}
    try:
        parsed = json.loads(body)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def describe_api_exception(action: str, exc: ApiException, *, sensitive: bool,
                           permission: Permission | None = None, namespace: str = "") -> str:
    body = _status_body(exc)
    return _describe(action, int(exc.status or 0), str(body.get("reason") or exc.reason or ""),
                     str(body.get("message") or ""), permission=permission,
                     namespace=namespace, sensitive=sensitive,
                     missing_namespace=missing_namespace(body))


def missing_namespace(body: Mapping[str, Any]) -> str | None:
    """The namespace a 404 Status says does not exist (``details.kind`` "namespaces"),
    else None."""
    details = body.get("details") or {}
    if body.get("code") == 404 and isinstance(details, dict) \
            and details.get("kind") == "namespaces":
        return str(details.get("name") or "")
    return None


_USER = re.compile(r'\bUser "([^"]+)"')


@dataclass(frozen=True)
class Forbidden:
    """A 403 that no RBAC rule explains, recognised by the API server's message."""

    needle: str
    transient: bool
    hint: str


# The API server answers 403 for more than a missing RBAC rule; a missing rule's message
# says `... cannot <verb> resource "<resource>" ...`.
FORBIDDEN_NOT_RBAC: tuple[Forbidden, ...] = (
    Forbidden("exceeded quota", True,
              "the namespace's ResourceQuota is used up: free some of it or raise the quota "
              "(kubectl describe resourcequota)" + TASK_RETRIES),
    Forbidden("is being terminated", False,
              "the namespace is being deleted: point LEASEKEEPER_KUBE_NAMESPACE at another "
              "namespace, or retry once it is recreated"),
    Forbidden("admission webhook", False,
              "an admission webhook of the cluster denied it, not RBAC: its message says why"),
)


def forbidden(status: int, message: str) -> Forbidden | None:
    """What a 403 means when it is not a missing RBAC rule; None when it is one (or may
    be: a 403 nothing here recognises is taken for one)."""
    if status != 403 or _REFUSED.search(message):
        return None
    return next((f for f in FORBIDDEN_NOT_RBAC if f.needle in message), None)


def _describe(action: str, status: int, reason: str, message: str, *,
              permission: Permission | None, namespace: str, sensitive: bool = False,
              missing_namespace: str | None = None) -> str:
    """``message`` is the API server's; with ``sensitive`` it only decides the hint and is
    not quoted (a recognised 403 is named by what it is). ``missing_namespace``: the
    namespace a 404 says does not exist."""
    reason, message = reason.strip(), message.strip()
    hint = _HINTS.get(status) or (
        "the API server failed" + TASK_RETRIES if status >= 500 else
        "unexpected answer from the API server")
    other = forbidden(status, message)
    if status == 404 and missing_namespace is not None:
        hint = (f'namespace "{missing_namespace or namespace}" does not exist: create it, or '
                "set LEASEKEEPER_KUBE_NAMESPACE to the namespace the worker's Role is bound in")
    elif other is not None:
        hint = other.hint
    elif status == 403 and permission is not None:
        user = _USER.search(message)
        hint = permission.refused(message).missing(namespace, user.group(1) if user else "")
    detail = f"HTTP {status} {reason}".strip()
    if message and not sensitive:
        detail += f": {message[:300]}"
    elif other is not None:
        detail += f": {other.needle}"
    return f"kubernetes: {action} failed ({detail}); {hint}"


def translate_api_exception(action: str, exc: ApiException, *, sensitive: bool,
                            permission: Permission | None = None,
                            namespace: str = "") -> ProviderError:
    status = int(exc.status or 0)
    body = _status_body(exc)
    other = forbidden(status, str(body.get("message") or ""))
    text = describe_api_exception(action, exc, sensitive=sensitive, permission=permission,
                                  namespace=namespace)
    error = (TransientProviderError(text) if other is not None and other.transient
             else _classify(status, str(body.get("reason") or ""), text))
    return error.with_status(status or None)  # 0: no HTTP answer at all


def translate_status(action: str, status: Mapping[str, Any], *,
                     permission: Permission | None = None,
                     namespace: str = "") -> ProviderError:
    """A failure ``Status`` that came without an HTTP error (an exec's status channel, where
    the kubelet reports e.g. a container that is not running as InternalError 500)."""
    code = int(status.get("code") or 500)
    reason = str(status.get("reason") or "")
    text = _describe(action, code, reason, str(status.get("message") or ""),
                     permission=permission, namespace=namespace)
    return _classify(code, reason, text).with_status(code)


def command_exit_error(action: str, exit_code: int, output: str,
                       meanings: Mapping[int, CommandExit], default_hint: str,
                       secrets: Collection[str] = ()) -> ProviderError:
    """The error for a command that exited ``exit_code``: transient or terminal as
    ``meanings`` says. ``output`` (what it printed) is quoted with every value of
    ``secrets`` replaced by ``***``."""
    meaning = meanings.get(exit_code, CommandExit(False, default_hint))
    quoted = scrub(output, secrets).strip()[-300:]
    text = (f"kubernetes: {action} failed: the command exited {exit_code}"
            + (f" ({quoted})" if quoted else "") + f"; {meaning.hint}")
    error: KubeCommandInterrupted | KubeCommandFailed = (
        KubeCommandInterrupted(text) if meaning.transient else KubeCommandFailed(text))
    error.exit_code = exit_code
    return error


def scrub(text: str, secrets: Collection[str]) -> str:
    """``text`` with every (non-empty) secret value replaced by ``***``, longest first."""
    for value in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(value, "***")
    return text


def _classify(status: int, reason: str, text: str) -> ProviderError:
    if status == 404:
        return KubeNotFound(text)
    if status == 409:
        if reason == "AlreadyExists":
            return KubeAlreadyExists(text)
        return ProviderConflict(text)
    if status == 410:
        return KubeExpired(text)
    if status in TRANSIENT_STATUSES or status >= 500 or status == 0:
        return TransientProviderError(text)
    return TerminalProviderError(text)


def _is_certificate_error(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return True
        reason = getattr(seen, "reason", None)
        seen = reason if isinstance(reason, BaseException) else seen.__cause__
    return False


def _address(exc: urllib3.exceptions.HTTPError,
             cause: urllib3.exceptions.NewConnectionError) -> str:
    """host:port of the connection that failed (from urllib3's pool or connection)."""
    where = getattr(exc, "pool", None) or getattr(cause, "conn", None)
    host, port = getattr(where, "host", None), getattr(where, "port", None)
    return f"{host}:{port}" if host else "its configured address"


def _why_not_connected(cause: urllib3.exceptions.NewConnectionError) -> str:
    if isinstance(cause, urllib3.exceptions.NameResolutionError):
        return "its host name did not resolve"
    text = str(cause)
    if "refused" in text.lower():
        return "connection refused"
    return text.rsplit(": ", 1)[-1][:120] or type(cause).__name__


@contextlib.contextmanager
def kube_errors(action: str, *, sensitive: bool = False, permission: Permission | None = None,
                namespace: str = "") -> Iterator[None]:
    """Translate every API / transport error raised inside into a ProviderError."""
    try:
        yield
    except ProviderError:
        raise
    except ApiException as exc:
        error = translate_api_exception(action, exc, sensitive=sensitive,
                                        permission=permission, namespace=namespace)
        if sensitive:
            raise error from None
        raise error from exc
    except urllib3.exceptions.HTTPError as exc:
        if _is_certificate_error(exc):
            raise TerminalProviderError(
                f"kubernetes: {action} failed: the API server's TLS certificate was not "
                "trusted; fix the CA in the kubeconfig"
            ) from None
        # urllib3 wraps what happened (after its connect retries) in MaxRetryError.
        cause = exc.reason if isinstance(exc, urllib3.exceptions.MaxRetryError) else exc
        kind = type(cause or exc).__name__
        # NewConnectionError (refused, unresolvable) subclasses ConnectTimeoutError.
        if isinstance(cause, urllib3.exceptions.NewConnectionError):
            raise TransientProviderError(
                f"kubernetes: {action} failed: could not connect to the API server at "
                f"{_address(exc, cause)} ({_why_not_connected(cause)}; is it running, and is "
                f"the kubeconfig/in-cluster address right?){TASK_RETRIES}"
            ) from None
        if isinstance(cause, urllib3.exceptions.TimeoutError | TimeoutError):
            raise TransientProviderError(
                f"kubernetes: {action} failed: the API server did not answer within "
                f"LEASEKEEPER_KUBE_REQUEST_TIMEOUT_S ({kind}){TASK_RETRIES}"
            ) from None
        raise TransientProviderError(
            f"kubernetes: {action} failed: connection to the API server failed "
            f"({kind}){TASK_RETRIES}"
        ) from None
    except websocket.WebSocketException as exc:  # an exec stream, after its handshake
        raise TransientProviderError(
            f"kubernetes: {action} failed: the stream broke ({type(exc).__name__})"
            + TASK_RETRIES
        ) from None
    except (TimeoutError, ConnectionError) as exc:
        raise TransientProviderError(
            f"kubernetes: {action} failed: {type(exc).__name__} talking to the API server"
            + TASK_RETRIES
        ) from None
    except ssl.SSLError as exc:  # a WebSocket's own TLS (the REST calls' come via urllib3)
        if _is_certificate_error(exc):
            raise TerminalProviderError(
                f"kubernetes: {action} failed: the API server's TLS certificate was not "
                "trusted; fix the CA in the kubeconfig"
            ) from None
        raise TransientProviderError(
            f"kubernetes: {action} failed: TLS to the API server failed "
            f"({type(exc).__name__}){TASK_RETRIES}"
        ) from None
    except OSError as exc:  # a WebSocket's own connect: name resolution, unreachable network
        raise TransientProviderError(
            f"kubernetes: {action} failed: {type(exc).__name__} reaching the API server"
            + TASK_RETRIES
        ) from None
