"""How a claim hands a run's data to a warm pool member: one exec into its sandbox container
with the data on stdin. Pure: the script, its (constant) command line and the stdin payload
are built here; client.py runs the exec, provider.py decides.

The command line is the same for every claim (``sh -c <DELIVERY_SCRIPT>``): the API server
and its audit log see it, so it carries no data at all, not even sizes. stdin carries three
lines, then the rest: the size of ``env`` in bytes; ``run.json`` (one line of JSON: run id,
lease id, tenant, labels; no secrets); the run id (the content of ``claimed``); then ``env``
(``KEY='value'`` lines, sh-quoted: ``env`` then ``secret_env``, so a secret wins over a
plain variable of the same name). The lines are read by the shell's own ``read`` (which on
a pipe never reads past its newline), ``env`` by ``head -c`` and its size checked: the v4
exec protocol has no end-of-input signal, and a cut connection must not leave a short file.
Each file is moved into ``$LEASEKEEPER_RUN_DIR`` by an atomic rename under ``umask 077``,
``claimed`` last: a sandbox waiting for ``claimed`` finds the others complete. A repeated
claim rewrites the same files (each rename replaces the previous one whole). Six processes
in all (sh, head, wc, three mv): each costs milliseconds on a busy node.

The sandbox's side (README: "Warm pools on Kubernetes"): wait for
``$LEASEKEEPER_RUN_DIR/claimed``, then ``. "$LEASEKEEPER_RUN_DIR/env"``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from providers.base import RUN_DIR_ENV, ClaimRequest
from providers.errors import InvalidRequest
from providers.kubernetes.errors import CommandExit
from providers.spec import ENV_NAME, ID_PATTERN

RUN_JSON = "run.json"
ENV_FILE = "env"
CLAIMED_FILE = "claimed"

# Exit codes of the script itself; anything else comes from a tool it runs (sh: 126 / 127
# when a command cannot run; head, wc, mv: 1, e.g. a full run directory).
EXIT_NO_RUN_DIR = 3
EXIT_SHORT_INPUT = 4
EXIT_BAD_HEADER = 5

DELIVERY_SCRIPT = f"""set -eu
umask 077
dir="${{{RUN_DIR_ENV}:-}}"
if [ -z "$dir" ] || [ ! -d "$dir" ]; then
  echo "no run directory ({RUN_DIR_ENV}=${{dir:-unset}}): not a pool member's container" >&2
  exit {EXIT_NO_RUN_DIR}
fi
if ! IFS= read -r n_env || ! IFS= read -r run_json || ! IFS= read -r run_id; then
  echo "input ended before the delivery's header" >&2
  exit {EXIT_SHORT_INPUT}
fi
case "$n_env" in
  ''|*[!0-9]*) echo "malformed delivery header" >&2; exit {EXIT_BAD_HEADER} ;;
esac
tmp="$dir/.claim.$$"
trap 'rm -f "$tmp.run" "$tmp.env" "$tmp.claimed"' EXIT
head -c "$n_env" > "$tmp.env"
got=$(wc -c < "$tmp.env")
if [ "$((got))" -ne "$n_env" ]; then
  echo "input ended after $((got)) of $n_env bytes of env" >&2
  exit {EXIT_SHORT_INPUT}
fi
printf '%s\\n' "$run_json" > "$tmp.run"
printf '%s\\n' "$run_id" > "$tmp.claimed"
mv -f "$tmp.run" "$dir/{RUN_JSON}"
mv -f "$tmp.env" "$dir/{ENV_FILE}"
mv -f "$tmp.claimed" "$dir/{CLAIMED_FILE}"
trap - EXIT
"""
DELIVERY_COMMAND: tuple[str, ...] = ("sh", "-c", DELIVERY_SCRIPT)

# What each exit code of the delivery means (the client raises accordingly; any other
# non-zero code is terminal with the generic hint).
DELIVERY_EXITS: Mapping[int, CommandExit] = MappingProxyType({
    EXIT_NO_RUN_DIR: CommandExit(False, "the pod has no run directory: it was not created as "
                                        "a pool member (AcquireRequest.pool); destroy it"),
    EXIT_SHORT_INPUT: CommandExit(True, "the delivery's input was cut short; the claim is "
                                        "retried (it is idempotent)"),
    EXIT_BAD_HEADER: CommandExit(False, "the delivery's header was garbled; this is a "
                                        "leasekeeper bug"),
    126: CommandExit(False, "the pool's image cannot run the delivery: it needs sh, head, "
                            "wc and mv"),
    127: CommandExit(False, "the pool's image cannot run the delivery: it needs sh, head, "
                            "wc and mv"),
})
DELIVERY_FAILED_HINT = ("the delivery script failed in the pod (is the run directory full? "
                        "its sizeLimit is in manifests.RUN_DIR_SIZE_LIMIT)")



@dataclass(frozen=True)
class Delivery:
    """One claim's exec: the command (no data) and its stdin (holds secrets: never log it)."""

    command: tuple[str, ...]
    stdin: bytes = field(repr=False)
    secrets: tuple[str, ...] = field(repr=False)  # to scrub from anything the pod prints


def sh_quote(value: str) -> str:
    """``value`` as one sh word, single-quoted (``'`` becomes ``'\\''``)."""
    return "'" + value.replace("'", "'\\''") + "'"


def _env_lines(kind: str, env: Mapping[str, str]) -> str:
    lines = []
    for key, value in env.items():
        if not ENV_NAME.fullmatch(key):
            raise InvalidRequest(f"claim: {kind} name {key[:40]!r} is not a valid variable "
                                 "name (letters, digits and '_', not starting with a digit)")
        if "\0" in value:
            raise InvalidRequest(f"claim: the value of {kind} {key} contains a NUL byte, "
                                 "which no environment can hold")
        lines.append(f"{key}={sh_quote(value)}\n")
    return "".join(lines)


def run_json(request: ClaimRequest) -> bytes:
    """What the sandbox may know about its run, as one line of JSON; no secrets."""
    return (json.dumps({"run_id": request.run_id, "lease_id": request.lease_id,
                        "tenant": request.tenant, "labels": dict(request.labels)},
                       sort_keys=True) + "\n").encode()


def env_file(request: ClaimRequest) -> bytes:
    """``env`` then ``secret_env`` as sh assignments (sourced: a secret wins a name clash)."""
    return (_env_lines("env", request.env)
            + _env_lines("secret_env", request.secret_env)).encode()


def build_delivery(request: ClaimRequest) -> Delivery:
    if not ID_PATTERN.fullmatch(request.run_id):
        raise InvalidRequest(f"claim: run id {request.run_id[:40]!r} is not a run id "
                             "(letters, digits, '.', '_', ':' or '-')")
    env = env_file(request)
    stdin = f"{len(env)}\n".encode() + run_json(request) + f"{request.run_id}\n".encode() + env
    return Delivery(DELIVERY_COMMAND, stdin, tuple(v for v in request.secret_env.values() if v))
