#!/usr/bin/env bash
# Run every test. pytest's exit code 5 ("no tests collected") is a failure here: a suite
# that runs nothing must never pass.
set -uo pipefail
py="${1:-.venv/bin/python}"
"$py" -m pytest "${@:2}"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: treating that as a failure" >&2
  exit 1
fi
exit "$rc"
