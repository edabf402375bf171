"""Layer 0 (static, no import of the packages' modules beyond the backend registry):
backend names are not spelled in the library outside `moe/backends/`.

Every module under dbo/, moe/, streams/, traces/ except moe/backends/ is parsed with
`ast`; every string constant equal to a registered backend name counts (a default, a
comparison, a tuple of names). The library asks the backends instead: traits
(`moe.backends.backends_with`), the named defaults `moe.backends` exports
(`DEFAULT_BACKEND`, ...), a backend's own checks (`PrepareFinalize.check_runs`,
`check_shape`, `check_max_tokens`) and options (`PrepareFinalize.options_type`). A few
strings equal to a name without meaning the backend may stay (traces/classify.py's kernel
name patterns "a2a" and "symm_mem"): at most `MAX_NAMES` in all.
"""
from __future__ import annotations

import ast
from pathlib import Path

from moe.backends.registry import BACKENDS

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dbo", "moe", "streams", "traces")
EXEMPT = "moe/backends/"
MAX_NAMES = 4


def backend_names_in(root: Path = ROOT, names: frozenset[str] = frozenset(BACKENDS)
                     ) -> list[str]:
    """One "path:line: 'name'" per string constant equal to a backend name in the
    library's modules outside moe/backends/, in path order."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            if relative.startswith(EXEMPT):
                continue
            for node in ast.walk(ast.parse(path.read_text(), filename=relative)):
                if isinstance(node, ast.Constant) and node.value in names:
                    found.append(f"{relative}:{node.lineno}: {node.value!r}")
    return sorted(found, key=lambda line: (line.split(":")[0], int(line.split(":")[1])))


def test_at_most_four_backend_names_outside_the_backends():
    found = backend_names_in()
    assert len(found) <= MAX_NAMES, (
        f"{len(found)} backend names spelled outside moe/backends/ (at most {MAX_NAMES}): "
        f"ask a trait, a named default or the backend's own check instead:\n"
        + "\n".join(found))


def test_a_name_is_found_and_its_file_named(tmp_path: Path):
    """The count sees names in defaults, comparisons and tuples, skips moe/backends/ and
    docstrings that only mention a name."""
    (tmp_path / "dbo" / "cli").mkdir(parents=True)
    (tmp_path / "moe" / "backends").mkdir(parents=True)
    (tmp_path / "dbo" / "cli" / "job.py").write_text(
        '"""Runs a2a."""\nBACKEND = "a2a"\n\n\ndef pick(b):\n'
        '    return b == "deepep_ll" or b in ("naive", "other")\n')
    (tmp_path / "moe" / "backends" / "a2a.py").write_text('name = "a2a"\n')
    found = backend_names_in(tmp_path, frozenset({"a2a", "deepep_ll", "naive"}))
    assert found == ["dbo/cli/job.py:2: 'a2a'", "dbo/cli/job.py:6: 'deepep_ll'",
                     "dbo/cli/job.py:6: 'naive'"]
