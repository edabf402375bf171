"""What a command run in the test process prints, its spawned ranks' output included, for
fixtures wider than one test (capfd is function-scoped)."""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Iterator


@dataclass
class Printed:
    """stdout and stderr of the block, filled in when it ends."""

    out: str = ""
    err: str = ""


@contextlib.contextmanager
def printed() -> Iterator[Printed]:
    """File descriptors 1 and 2 (which spawned ranks inherit) and sys.stdout / sys.stderr
    write to two temporary files for the block (each file one offset for all its writers);
    yields a `Printed` that holds their text once the block ends."""
    result = Printed()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = [os.dup(1), os.dup(2)]
        try:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            with open(os.dup(1), "w", closefd=True) as text_out, \
                    open(os.dup(2), "w", closefd=True) as text_err, \
                    contextlib.redirect_stdout(text_out), contextlib.redirect_stderr(text_err):
                yield result
        finally:
            for fd, old in zip((1, 2), saved):
                os.dup2(old, fd)
                os.close(old)
            out.seek(0)
            err.seek(0)
            result.out, result.err = out.read().decode(), err.read().decode()
