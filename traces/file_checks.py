"""What the trace readers check in a file they are given.

- A gzip-compressed trace is unpacked in chunks, up to a limit
  (`ReadConfig.max_unpacked_bytes`; `dbo inspect --max-unpacked-mb`), so that a small
  file that unpacks to gigabytes is refused instead of filling memory or the disk; a
  truncated or damaged one is refused in one line.
- Times must be finite numbers and ids integers (`number`, `integer`): JSON allows NaN and
  Infinity, SQLite any type in any column.
- Every event or row left out is counted by reason (`Skips`), and the count goes into the
  trace's notes, so the report says what was skipped.
"""
from __future__ import annotations

import gzip
import math
import zlib
from collections import Counter
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["MAX_UNPACKED_OPTION", "Skips", "integer", "is_gzip", "number", "read_unpacked",
           "unpack_to", "unpacked_head"]

MAX_UNPACKED_OPTION = "--max-unpacked-mb"
"""The `dbo inspect` option that sets `ReadConfig.max_unpacked_bytes` (named in errors)."""
_CHUNK = 1 << 20


def is_gzip(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(2) == b"\x1f\x8b"


def unpacked_head(path: Path, size: int = 16) -> bytes:
    """The first `size` unpacked bytes of gzip file `path` (ValueError where damaged)."""
    try:
        with gzip.open(path, "rb") as f:
            return f.read(size)
    except (EOFError, OSError, zlib.error) as exc:
        raise ValueError(f"{path}: a truncated or damaged gzip file ({exc}): copy or "
                         f"export it again") from exc


def read_unpacked(path: Path, *, limit: int) -> bytearray:
    """The whole content of gzip file `path`, unpacked; ValueError (naming the file) where
    it unpacks to more than `limit` bytes (read no further) or is truncated or damaged."""
    data = bytearray()
    _unpack(path, limit=limit, write=data.extend)
    return data


def unpack_to(path: Path, dest: BinaryIO, *, limit: int) -> None:
    """Unpack gzip file `path` into `dest`, with the checks of `read_unpacked`."""
    _unpack(path, limit=limit, write=dest.write)


def _unpack(path: Path, *, limit: int, write: Any) -> None:
    size = 0
    with gzip.open(path, "rb") as f:
        while True:
            try:
                chunk = f.read(_CHUNK)
            except (EOFError, OSError, zlib.error) as exc:  # gzip.BadGzipFile: an OSError
                raise ValueError(f"{path}: a truncated or damaged gzip file ({exc}): copy "
                                 f"or export it again") from exc
            if not chunk:
                return
            size += len(chunk)
            if size > limit:
                raise ValueError(
                    f"{path}: unpacks to more than {_mib(limit)}, the limit on a "
                    f"gzip-compressed trace (ReadConfig.max_unpacked_bytes; "
                    f"{MAX_UNPACKED_OPTION} for dbo inspect); left unread: raise the limit "
                    f"if the trace is really that large")
            write(chunk)


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):g} MiB"


def number(value: Any) -> float | None:
    """`value` as a float where it is a finite int or float (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        result = float(value)
    except OverflowError:  # an int beyond float's range
        return None
    return result if math.isfinite(result) else None


def integer(value: Any) -> int | None:
    """`value` as an int where it is an int or an integral float (not a bool), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


class Skips:
    """Items of a trace left out, counted by reason (e.g. "with a negative duration")."""

    def __init__(self, what: str) -> None:
        self.what = what
        """What the items are, plural ("complete events", "rows of NVTX_EVENTS")."""
        self.counts: Counter[str] = Counter()

    def add(self, reason: str) -> None:
        self.counts[reason] += 1

    def note(self, total: int) -> str | None:
        """"skipped 2 of 10 <what> (1 with ..., 1 with ...)", or None where none was."""
        if not self.counts:
            return None
        reasons = ", ".join(f"{n} {reason}" for reason, n in self.counts.most_common())
        return f"skipped {sum(self.counts.values())} of {total} {self.what} ({reasons})"
