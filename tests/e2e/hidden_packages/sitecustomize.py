"""Put this directory on PYTHONPATH to make the packages named in
LEASEKEEPER_TEST_HIDE_PACKAGES (comma-separated) look not installed, as after a plain
`pip install leasekeeper` without them: importing one raises ModuleNotFoundError."""

import os
import sys

_HIDDEN = {p.strip() for p in os.environ.get("LEASEKEEPER_TEST_HIDE_PACKAGES", "").split(",")
           if p.strip()}


class _Hide:
    @staticmethod
    def find_spec(name, path=None, target=None):  # type: ignore[no-untyped-def]
        if name.split(".")[0] in _HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


if _HIDDEN:
    sys.meta_path.insert(0, _Hide())
