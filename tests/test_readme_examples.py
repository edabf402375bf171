"""Layer 2 (CPU, subprocesses): every fenced Python block of README.md runs as written.

Each block is written to its own file and run with a fresh interpreter from the
repository root, as a reader who copies it would run it; a block that spawns ranks does
so itself. A block fails the test if it exits non-zero or prints a traceback.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks() -> list[str]:
    return FENCE.findall(README.read_text())


def test_readme_has_python_examples() -> None:
    assert len(python_blocks()) >= 2, "the README shows a one-process and a two-rank example"


@pytest.mark.distributed
@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_example_runs(index: int, tmp_path: Path) -> None:
    code = python_blocks()[index]
    script = tmp_path / f"readme_example_{index}.py"
    script.write_text(code)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"README example {index} failed:\n{code}\n---\n{output}"
    assert "Traceback" not in output, output
