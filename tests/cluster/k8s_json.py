"""Owns the glue between plain JSON dicts and the typed official client: request bodies given
as dicts, and responses read with ``_preload_content=False`` (urllib3 responses) as dicts."""

from __future__ import annotations

import json
from typing import Any

Obj = dict[str, Any]


def body(obj: Obj) -> Any:
    """A dict request body (the client serialises dicts as they are)."""
    return obj


def read_json(response: object) -> Obj:
    """The JSON document of a raw (``_preload_content=False``) response."""
    data: Obj = json.loads(getattr(response, "data", b"") or b"{}")
    return data
