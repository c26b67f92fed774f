"""Every ```python block in README.md, copied verbatim into a file and run as a user would
(a new Python process, in an empty directory, with the broker and store a user of this
installation has in the environment) against a real worker. Before: two of them failed
with NameError (`token`, `lease_id`)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.stack import REPO, WorkerStack

BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def readme_blocks() -> list[tuple[int, str]]:
    """(line number, code) of each python block in README.md."""
    text = (REPO / "README.md").read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in BLOCK.finditer(text)]


def test_the_readme_has_python_examples() -> None:
    assert len(readme_blocks()) >= 3


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("line", "code"), readme_blocks(),
                         ids=[f"README.md:{line}" for line, _ in readme_blocks()])
def test_a_readme_example_runs_as_written(stack: WorkerStack, tmp_path: Path, line: int,
                                          code: str) -> None:
    example = tmp_path / "example.py"
    example.write_text(code)
    done = subprocess.run([sys.executable, str(example)], cwd=tmp_path, env=stack.env,
                          capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, f"README.md line {line}:\n{code}\n{done.stderr}"
