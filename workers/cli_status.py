"""`leasekeeper status` (one screen) and `leasekeeper health` (probes)."""

from __future__ import annotations

import typer


def register(cli: typer.Typer) -> None:
    del cli  # status and health are registered here once they exist
