"""A worker app for test_worker_preload: leasekeeper's own Celery app (its signal handlers
included) plus one task that reports which provider modules its pool process already had
when it ran, before anything in that process asked for a provider."""

from __future__ import annotations

import sys

from workers.app import app
from workers.runtime import PROVIDER_MODULES


@app.task(name="probe.provider_modules_loaded")
def provider_modules_loaded() -> list[str]:
    return sorted(name for name in PROVIDER_MODULES.values() if name in sys.modules)
