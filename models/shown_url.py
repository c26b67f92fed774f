"""How leasekeeper prints a service URL (the store's, the broker's, a CELERY_* one): never a
password, in any of the places a URL can carry one.

A password may be in the user part (``redis://:PW@host``, ``postgresql://user:PW@host``)
or in the query: libpq reads ``?password=`` and ``?sslpassword=`` (SQLAlchemy passes the
query on), redis-py ``?password=``. Each is shown as ``**`` (as kombu masks one). A URL
that does not parse as one (a password with an unencoded ``/`` or ``@`` cuts it anywhere)
is shown as ``<unparseable URL>``: no part of it, since any part may be the password.
"""

from __future__ import annotations

from urllib.parse import SplitResult, unquote_plus, urlsplit

MASK = "**"
UNPARSEABLE = "<unparseable URL>"
# query parameters that hold a password (libpq's, redis-py's), compared lowercased
SECRET_QUERY_KEYS = frozenset({"password", "sslpassword"})


def query_secrets(url: str) -> list[str]:
    """The names of the password parameters in ``url``'s query (as written)."""
    try:
        query = urlsplit(url).query
    except ValueError:
        return []
    return [key for key, _, _ in (p.partition("=") for p in query.split("&"))
            if unquote_plus(key).strip().lower() in SECRET_QUERY_KEYS]


def has_password(url: str) -> bool:
    """Whether ``url`` holds a password (in its user part or its query); an unparseable
    URL may: True."""
    parts = _parsed(url)
    return parts is None or bool(parts.password) or bool(query_secrets(url))


def shown_url(url: object) -> str:
    """``url`` as it may be printed: every password ``**``; ``<unparseable URL>`` when it
    does not parse. A SQLAlchemy ``URL`` is rendered first (its password too, then
    masked here)."""
    if not isinstance(url, str):
        render = getattr(url, "render_as_string", None)
        if render is None:
            return UNPARSEABLE
        url = str(render(hide_password=False))
    parts = _parsed(url)
    if parts is None:
        return UNPARSEABLE
    if parts.password is not None:  # the user part comes first after "scheme://"
        user, _, host = parts.netloc.rpartition("@")
        url = url.replace(parts.netloc, f"{user.partition(':')[0]}:{MASK}@{host}", 1)
    if parts.query:
        base, _, rest = url.partition("?")
        query, hashed, fragment = rest.partition("#")
        query = "&".join(
            f"{key}={MASK}" if sep and unquote_plus(key).strip().lower() in SECRET_QUERY_KEYS
            else f"{key}{sep}{value}"
            for key, sep, value in (p.partition("=") for p in query.split("&")))
        url = f"{base}?{query}{hashed}{fragment}"
    return url


def _parsed(url: str) -> SplitResult | None:
    """``url`` split, or None when it is no URL to show: a port that is no number (what a
    password's unencoded ``/`` leaves: ``redis://:ab/cd@host:6379``), or an ``@`` after the
    host part (a password's unencoded ``/`` or ``@`` moved the rest of the user part
    there; a file path, which has no host part, may hold one)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (parsed on access: a bad port fails here)
    except ValueError:
        return None
    if parts.netloc and "@" in f"{parts.path}?{parts.query}#{parts.fragment}":
        return None
    return parts
