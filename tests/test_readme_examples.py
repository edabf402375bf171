"""Layer 2 (CPU, subprocesses): every fenced Python block of README.md and docs/*.md runs
as written.

Each ```python block is written to its own file and run with a fresh interpreter from the
repository root, as a reader who copies it would run it; a block that spawns ranks does
so itself. A block fails the test if it exits non-zero or prints a traceback. Snippets
that are not meant to run on their own are fenced without a language.

The blocks are independent programs that spend most of their time importing torch on
one core: they run two at a time (one module-scoped pool, started by the first test
that needs a block), each test waiting for its own block's result.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks() -> list[tuple[str, str]]:
    """(where, code) of every ```python block, in document order."""
    return [(f"{doc.name}[{i}]", code) for doc in DOCS
            for i, code in enumerate(FENCE.findall(doc.read_text()))]


def test_readme_has_a_python_example() -> None:
    assert any(where.startswith("README.md") for where, _ in python_blocks()), \
        "the README's quick start is a Python example"


def test_docs_show_one_process_two_rank_and_hf_examples() -> None:
    code = "\n".join(c for _, c in python_blocks())
    assert "mp.spawn" in code and "moe.hf.convert" in code and "DBORunner" in code


def run_block(index: int, code: str, folder: Path) -> subprocess.CompletedProcess:
    """Block `index` as a script in `folder`, run by a fresh interpreter from the repository
    root."""
    script = folder / f"doc_example_{index}.py"
    script.write_text(code)
    # A newcomer's shell: no rendezvous address left behind by an earlier test (an
    # example's os.environ.setdefault would take it, and its port may still be bound).
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def block_runs() -> Iterator[list[Future]]:
    """Every block's run (in document order), two at a time (the module doc); the blocks
    that spawn ranks, the longest, start first."""
    blocks = python_blocks()
    order = sorted(range(len(blocks)), key=lambda i: "mp.spawn" not in blocks[i][1])
    with tempfile.TemporaryDirectory() as folder, ThreadPoolExecutor(max_workers=2) as pool:
        runs = {i: pool.submit(run_block, i, blocks[i][1], Path(folder)) for i in order}
        yield [runs[i] for i in range(len(blocks))]


@pytest.mark.distributed
@pytest.mark.parametrize("index", range(len(python_blocks())),
                         ids=[where for where, _ in python_blocks()])
def test_doc_example_runs(index: int, block_runs: list[Future]) -> None:
    where, code = python_blocks()[index]
    proc = block_runs[index].result()
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{where} failed:\n{code}\n---\n{output}"
    assert "Traceback" not in output, output
