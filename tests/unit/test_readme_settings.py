"""Every setting workers/settings.py reads is named in README.md, the promise to users:
as `LEASEKEEPER_<NAME>`, or as `<NAME>` in a table whose header says they all take the
prefix (the Kubernetes provider's). (Before: LEASEKEEPER_RESULT_BACKEND_URL, which the
producer's errors name, LEASEKEEPER_LOCAL_DESTROY_GRACE_S and
LEASEKEEPER_METRICS_EVENTS_BATCH_SIZE were read but never named.)"""

from __future__ import annotations

import re

from tests.stack import REPO
from workers.settings import Settings

# For leasekeeper's own tests: the `faulty` provider no message offers.
NOT_FOR_USERS = {"faults_file"}


def test_every_setting_is_named_in_the_readme() -> None:
    text = (REPO / "README.md").read_text()
    unnamed = [
        f"LEASEKEEPER_{name.upper()}" for name in Settings.model_fields
        if name not in NOT_FOR_USERS
        and not re.search(rf"`(LEASEKEEPER_)?{name.upper()}(?![A-Z0-9_])", text)
    ]
    assert not unnamed, f"README.md never names: {', '.join(unnamed)}"
