"""Layer 2 (CPU): every command line of the documentation parses with today's CLI.

The command lines of README.md, docs/*.md and BENCHMARKS.md (lines of ```bash/```sh
blocks and inline code spans) that start a `dbo` command or a module of this repository
(`dbo ...`, `python -m dbo.cli ...`, `torchrun ... -m dbo.cli.bench ...`,
`python -m moe.bench.experts ...`, `python -m traces ...`) are parsed by that command's
own argparse parser, without running it: `argparse.ArgumentParser.parse_args` is wrapped
to stop the command right after its arguments parse. Leading environment assignments
(`NCCL_P2P_DISABLE=1`), wrappers (`nsys profile ...`, `ncu ...`, `timeout N`),
launchers (`torchrun --nproc_per_node=2 -m MODULE`, `python -m MODULE`), line
continuations and comments are stripped first. Upper-case words (`N`, `FILE`, `ARCH`)
stand for a value the reader fills in and are parsed as "2". A span that only names a
subcommand (`dbo inspect`) must name one that exists. Other commands (pip, pytest, nsys
export) are skipped.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Optional
from unittest import mock

import pytest

from dbo.cli import COMMANDS

ROOT = Path(__file__).resolve().parent.parent
DOCS = (ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md")))
OUR_PACKAGES = ("dbo", "moe", "traces")
WRAPPERS = {"nsys", "ncu", "timeout", "time", "env"}
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SPAN = re.compile(r"(?<!`)`([^`]+)`(?!`)")


@dataclass(frozen=True)
class DocCommand:
    """One command line found in a document: where, the text, and what it runs."""

    where: str
    text: str
    module: Optional[str]
    """The module whose `main(argv)` parses it; None for a bare `dbo SUBCOMMAND` mention."""
    argv: tuple[str, ...]


class Parsed(Exception):
    """Raised by the wrapped `parse_args` once the arguments parsed: the command stops."""


def _commands_in_text(text: str) -> list[str]:
    """Command candidates of one code line or span: continuations joined, split at
    `&&`, `||` and `;`."""
    text = re.sub(r"\\\n\s*", " ", text).replace("\n", " ")
    return [part.strip() for part in re.split(r"&&|\|\||;", text) if part.strip()]


def _resolve(tokens: list[str]) -> Optional[tuple[Optional[str], tuple[str, ...]]]:
    """(module, argv) of a command of ours, or None when `tokens` run something else."""
    i = 0
    while i < len(tokens) and ENV_ASSIGNMENT.match(tokens[i]):
        i += 1
    if i < len(tokens) and tokens[i] in WRAPPERS:
        launchers = [j for j in range(i, len(tokens))
                     if tokens[j] in ("dbo", "torchrun", "python", "python3")]
        if not launchers:
            return None
        i = launchers[0]
    if i >= len(tokens):
        return None
    head, rest = tokens[i], tokens[i + 1:]
    if head == "dbo":
        if len(rest) <= 1 and not any(r.startswith("-") for r in rest):
            return None, tuple(rest)  # a mention of the command or of a subcommand
        return "dbo.cli", tuple(rest)
    if head in ("python", "python3", "torchrun"):
        if "-m" not in rest:
            return None
        m = rest.index("-m")
        if m + 1 >= len(rest):
            return None
        module = rest[m + 1]
        if module.split(".")[0] not in OUR_PACKAGES:
            return None
        return module, tuple(rest[m + 2:])
    return None


def find_commands(text: str, where: str) -> list[DocCommand]:
    """The command lines of ours in one markdown document."""
    pieces: list[str] = []
    for lang, body in FENCE.findall(text):
        if lang in ("bash", "sh", "shell", "console"):
            for line in re.sub(r"\\\n\s*", " ", body).splitlines():
                pieces.extend(_commands_in_text(line))
    prose = FENCE.sub("", text)
    for span in SPAN.findall(prose):
        pieces.extend(_commands_in_text(span))
    found = []
    for piece in pieces:
        try:
            tokens = shlex.split(piece, comments=True)
        except ValueError:
            tokens = piece.split()
        resolved = _resolve(tokens)
        if resolved is not None:
            module, argv = resolved
            argv = tuple("2" if PLACEHOLDER.match(a) else a for a in argv)
            found.append(DocCommand(where=where, text=piece, module=module, argv=argv))
    return found


def _main_of(module: str):
    """The `main(argv)` that `python -m module` runs."""
    mod = importlib.import_module(module)
    if hasattr(mod, "main"):
        return mod.main
    main_file = Path(mod.__file__).parent / "__main__.py"
    source = main_file.read_text() if main_file.exists() else ""
    found = re.search(r"^from (\S+) import main$", source, re.M)
    if found is None:
        raise AssertionError(f"python -m {module}: no main(argv) found to parse with")
    return importlib.import_module(found.group(1)).main


def parse_error(command: DocCommand) -> Optional[str]:
    """None when `command` parses (or prints its help); else what its parser said."""
    if command.module is None:
        if not command.argv or command.argv[0] in COMMANDS:
            return None
        return f"'dbo {command.argv[0]}' is not a dbo command"
    try:
        main = _main_of(command.module)
    except ImportError as exc:
        return f"python -m {command.module}: {exc}"
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise Parsed(original(self, args, namespace))

    out, err = io.StringIO(), io.StringIO()
    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop), \
            mock.patch.dict(os.environ), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        try:
            code = main(list(command.argv))
        except Parsed:
            return None
        except SystemExit as exc:
            if exc.code in (0, None):
                return None  # --help
            return err.getvalue().strip() or f"exit code {exc.code}"
    if command.module == "dbo.cli" and command.argv[:1] in (("-h",), ("--help",)):
        return None if code == 0 else f"exit code {code}"
    return (f"returned {code} without parsing any arguments: "
            f"{(err.getvalue() or out.getvalue()).strip()}")


def doc_commands() -> list[DocCommand]:
    return [c for doc in DOCS for c in find_commands(doc.read_text(), doc.name)]


def test_the_documents_hold_commands_of_every_kind() -> None:
    commands = doc_commands()
    modules = {c.module for c in commands}
    assert {"dbo.cli", "dbo.cli.bench"} <= modules, modules
    subcommands = {c.argv[0] for c in commands if c.module == "dbo.cli" and c.argv}
    assert {"run", "bench", "bench-comm", "inspect", "plan", "soak", "trace"} <= subcommands


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_command_line_parses(doc: Path) -> None:
    failures = [f"{c.where}: {c.text}\n    -> {error}"
                for c in find_commands(doc.read_text(), doc.name)
                if (error := parse_error(c)) is not None]
    assert not failures, "commands that today's CLI rejects:\n" + "\n".join(failures)


@pytest.mark.parametrize("line, expected", [
    ("dbo run --no-such-flag", "unrecognized arguments: --no-such-flag"),
    ("NCCL_P2P_DISABLE=1 torchrun --nproc_per_node=2 -m dbo.cli.bench --mode nope",
     "invalid choice: 'nope'"),
    ("python -m dbo.cli bench-comm --tokens", "expected one argument"),
    ("nsys profile -o rep torchrun --nproc_per_node=2 -m dbo.cli trace --profiler gdb",
     "invalid choice: 'gdb'"),
    ("python -m dbo.bench --mode layer", "No module named 'dbo.bench'"),
    ("dbo frobnicate --x 1", "unknown command"),
])
def test_a_command_the_cli_rejects_is_reported(line: str, expected: str) -> None:
    [command] = find_commands(f"```bash\n{line}\n```\n", "example")
    error = parse_error(command)
    assert error is not None and expected in error, error


def test_wrappers_continuations_and_mentions_are_read() -> None:
    text = ("```bash\nNCCL_P2P_DISABLE=1 torchrun --nproc_per_node=2 -m dbo.cli.bench \\\n"
            "    --mode layer --tokens 4096   # a comment\npip install -e .\n```\n"
            "Run `dbo inspect` on it, or `dbo plan --out DIR`; `--cuda-graph` alone is no "
            "command, nor is `python -m pytest -q`.\n")
    commands = find_commands(text, "example")
    assert [(c.module, c.argv) for c in commands] == [
        ("dbo.cli.bench", ("--mode", "layer", "--tokens", "4096")),
        (None, ("inspect",)),
        ("dbo.cli", ("plan", "--out", "2")),
    ]
    assert all(parse_error(c) is None for c in commands)
