"""The basic auth `leasekeeper up` gives Flower and the console: LEASEKEEPER_FLOWER_BASIC_AUTH
when set; else ``admin`` with a password generated once and kept in
``$LEASEKEEPER_VAR_DIR/flower-password`` (mode 0600), so the next `up` in the same folder
takes the same login. The password is never logged: `up` names the file it is in.

`up` holds the var dir's lock (workers/up_lock.py) while it calls this, so two `up`s never
generate one each.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from pathlib import Path

from providers.errors import ConfigError
from workers.settings import Settings

GENERATED = "flower-password"
USER = "admin"
# What secrets.token_urlsafe makes (and any password a person could put there by hand
# that basic auth carries as it is): no colon, no space, no control character.
_PASSWORD = re.compile(r"[A-Za-z0-9_\-.~!@#$%^&*+=]{16,200}")


def flower_basic_auth(settings: Settings) -> str:
    """``user:password`` for Flower and the console (see the module's docstring)."""
    if settings.flower_basic_auth is not None:
        return settings.flower_basic_auth.get_secret_value()
    path = settings.var_dir.resolve() / GENERATED
    try:
        text = path.read_text()
    except FileNotFoundError:
        return f"{USER}:{_generate(path)}"
    if stat.S_IMODE(path.stat().st_mode) & 0o077:  # copied or chmod-ed: ours alone again
        path.chmod(0o600)
    password = text.strip()
    if not _PASSWORD.fullmatch(password):
        raise ConfigError(
            f"{path} should hold the Flower password `leasekeeper up` generated (16 to 200 "
            "letters, digits or -_.~!@#$%^&*+=, no colon or space), and holds something "
            "else: delete it for a new one, or set LEASEKEEPER_FLOWER_BASIC_AUTH=user:password")
    return f"{USER}:{password}"


def _generate(path: Path) -> str:
    """A new password, written whole (a temporary file renamed) with mode 0600."""
    password = secrets.token_urlsafe(18)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # O_CREAT's mode only applies to a new file
        os.write(fd, f"{password}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, path)
    return password
