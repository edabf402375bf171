"""Read an Nsight Systems SQLite export (``nsys export --type sqlite``) into a ``Trace``.

Tables used (times in ns; missing optional tables or columns are skipped):
- ``CUPTI_ACTIVITY_KIND_KERNEL``: start, end, deviceId, streamId, demangledName /
  shortName / mangledName (text, or an id into ``StringIds``), correlationId, globalPid.
- ``CUPTI_ACTIVITY_KIND_MEMCPY`` (copyKind; 10 = peer to peer), ``..._MEMSET``: optional.
- ``CUPTI_ACTIVITY_KIND_RUNTIME``: start, globalTid, correlationId: the launch of a kernel.
- ``NVTX_EVENTS``: start, end, text or textId, globalTid, eventType: ranges become labels.
  NVTX timestamps are CPU times, so these labels are CPU-side (``device`` None).
- ``StringIds(id, value)``.

Rows whose times are not finite numbers, that end before they start, or whose ids are not
integers are skipped, and counted in the trace's notes; a gzipped export is unpacked up
to ``ReadConfig.max_unpacked_bytes``. A file that SQLite cannot read, or whose
``StringIds`` has other columns, is refused (ValueError naming the file).
"""
from __future__ import annotations

import sqlite3
import tempfile
from pathlib import Path
from typing import Any

from traces.file_checks import Skips, integer, is_gzip, number, unpack_to
from traces.model import KernelInterval, Label, ReadConfig, Trace

# CUpti_ActivityMemcpyKind, named the way Kineto names copies ("Memcpy PtoP ...").
_COPY_KINDS = {
    1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA", 6: "AtoD", 7: "DtoA",
    8: "DtoD", 9: "HtoH", 10: "PtoP",
}
# NVTX_EVENTS.eventType values that are not ranges: category, mark, thread name, domain.
_NVTX_NOT_RANGES = (33, 34, 39, 75, 76)
# A serialized globalTid/globalPid holds the process id in bits 24..47.
_PID_SHIFT = 24
_PID_MASK = 0xFFFFFF


# The reasons a row is skipped (counted in the trace's notes).
_NOT_FINITE = "with a start or end that is not a finite number"
_NEGATIVE = "with a negative duration"
_NOT_INTEGER = "with an id that is not an integer"
_ID_COLUMNS = ("deviceId", "streamId", "correlationId", "globalPid", "globalTid")


def _pid_of(global_id: int | None) -> int | None:
    return None if global_id is None else (global_id >> _PID_SHIFT) & _PID_MASK


def _checked(row: dict[str, Any], skips: Skips) -> dict[str, Any] | None:
    """`row` with its times as finite floats (start <= end) and its id columns as ints
    (or None), or None (counted in `skips`) where one is not."""
    start, end = number(row["start"]), number(row["end"])
    if start is None or end is None:
        skips.add(_NOT_FINITE)
        return None
    if end < start:
        skips.add(_NEGATIVE)
        return None
    ids = {c: row[c] for c in _ID_COLUMNS if c in row}
    if any(v is not None and integer(v) is None for v in ids.values()):
        skips.add(_NOT_INTEGER)
        return None
    return {**row, "start": start, "end": end,
            **{c: None if v is None else integer(v) for c, v in ids.items()}}


class _Db:
    """A read-only connection plus table/column lookups and StringIds resolution;
    `source` names the file in errors (the .gz a temporary file was unpacked from)."""

    def __init__(self, path: Path, source: Path) -> None:
        self.path = path
        self.conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            rows = self.conn.execute("SELECT name FROM sqlite_master WHERE type='table'").fetchall()
        except sqlite3.DatabaseError as exc:
            self.conn.close()
            raise ValueError(f"{source}: not a readable SQLite database ({exc})") from exc
        self.tables = {r[0] for r in rows}
        self.strings: dict[int, str] = {}
        if "StringIds" in self.tables:
            columns = self.column_list("StringIds")
            if not {"id", "value"} <= set(columns):
                self.conn.close()
                raise ValueError(f"{source}: table StringIds has columns ({', '.join(columns)}), "
                                 f"not (id, value): not an 'nsys export --type sqlite' file; "
                                 f"export the report again")
            self.strings = dict(self.conn.execute("SELECT id, value FROM StringIds"))

    def column_list(self, table: str) -> list[str]:
        return [str(r[1]) for r in self.conn.execute(f'PRAGMA table_info("{table}")')]

    def columns(self, table: str) -> set[str]:
        if table not in self.tables:
            return set()
        return set(self.column_list(table))

    def rows(self, table: str, wanted: list[str]) -> list[dict[str, Any]]:
        """Rows of ``table`` with the ``wanted`` columns it has (absent ones read None)."""
        have = self.columns(table)
        present = [c for c in wanted if c in have]
        if not present:
            return []
        select = ", ".join(f'"{c}"' for c in present)
        out = []
        for values in self.conn.execute(f'SELECT {select} FROM "{table}"'):
            row = dict.fromkeys(wanted)
            row.update(zip(present, values))
            out.append(row)
        return out

    def text(self, value: Any) -> str | None:
        """A name column's text: strings as they are, integers through StringIds."""
        if value is None:
            return None
        if isinstance(value, int):
            return self.strings.get(value, str(value))
        return str(value)


def _launch_map(db: _Db, notes: list[str]) -> dict[tuple[int | None, int], tuple[float, int]]:
    """(pid, correlationId) and (None, correlationId) -> (launch start us, globalTid)."""
    out: dict[tuple[int | None, int], tuple[float, int]] = {}
    table = "CUPTI_ACTIVITY_KIND_RUNTIME"
    skips = Skips(f"rows of {table}")
    rows = db.rows(table, ["start", "end", "globalTid", "correlationId"])
    for raw in rows:
        if raw["correlationId"] is None:
            continue
        if raw["end"] is None:  # older exports: a launch's start is all that is read
            raw = {**raw, "end": raw["start"]}
        row = _checked(raw, skips)
        if row is None:
            continue
        value = (row["start"] / 1000.0, row["globalTid"] or 0)
        out[(_pid_of(row["globalTid"]), row["correlationId"])] = value
        out.setdefault((None, row["correlationId"]), value)
    _add_note(notes, skips, len(rows))
    return out


def _add_note(notes: list[str], skips: Skips, total: int) -> None:
    note = skips.note(total)
    if note is not None:
        notes.append(note)


def _activity(
    db: _Db,
    table: str,
    *,
    category: str,
    launches: dict[tuple[int | None, int], tuple[float, int]],
    notes: list[str],
) -> list[KernelInterval]:
    wanted = ["start", "end", "deviceId", "streamId", "correlationId", "globalPid",
              "demangledName", "shortName", "mangledName", "copyKind"]
    out = []
    skips = Skips(f"rows of {table}")
    rows = db.rows(table, wanted)
    for raw in rows:
        row = _checked(raw, skips)
        if row is None:
            continue
        if category == "kernel":
            name = (db.text(row["demangledName"]) or db.text(row["shortName"])
                    or db.text(row["mangledName"]) or "kernel")
        elif category == "memcpy":
            name = f"Memcpy {_COPY_KINDS.get(row['copyKind'], 'unknown')}"
        else:
            name = "Memset"
        launch = None
        if row["correlationId"] is not None:
            corr = row["correlationId"]
            launch = launches.get((_pid_of(row["globalPid"]), corr)) or launches.get((None, corr))
        out.append(
            KernelInterval(
                device=row["deviceId"] or 0,
                stream=row["streamId"] or 0,
                name=name,
                start_us=row["start"] / 1000.0,
                end_us=row["end"] / 1000.0,
                category=category,
                launch_us=None if launch is None else launch[0],
                launch_tid=None if launch is None else launch[1],
            )
        )
    _add_note(notes, skips, len(rows))
    return out


def _nvtx_labels(db: _Db, notes: list[str]) -> list[Label]:
    out = []
    skips = Skips("NVTX ranges")
    ranges = [row for row in db.rows("NVTX_EVENTS", ["start", "end", "text", "textId",
                                                     "globalTid", "eventType"])
              if row["eventType"] not in _NVTX_NOT_RANGES]
    for raw in ranges:
        if raw["end"] is None and raw["start"] is not None:
            skips.add("never closed (no end)")
            continue
        row = _checked(raw, skips)
        if row is None:
            continue
        name = db.text(row["text"]) or db.text(row["textId"])
        if not name:
            continue
        out.append(
            Label.from_name(
                name,
                start_us=row["start"] / 1000.0,
                end_us=row["end"] / 1000.0,
                device=None,
                tid=row["globalTid"],
            )
        )
    _add_note(notes, skips, len(ranges))
    return out


def read_nsys_sqlite(path: str | Path, *, config: ReadConfig | None = None) -> Trace:
    """Read an ``nsys export --type sqlite`` file (or that file gzipped) into a ``Trace``.

    Kernels come from ``CUPTI_ACTIVITY_KIND_KERNEL`` (required unless the profile had no
    GPU work, which gives zero devices and a note), copies and memsets per ``config``,
    labels from ``NVTX_EVENTS`` ranges (CPU-side).
    """
    config = config or ReadConfig()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    if not is_gzip(path):
        return _read(path, config, source=path)
    # SQLite reads files only: unpack a gzipped export (how traces/data keeps one) first.
    with tempfile.TemporaryDirectory() as tmp:
        unpacked = Path(tmp) / path.name.removesuffix(".gz")
        with unpacked.open("wb") as dst:
            unpack_to(path, dst, limit=config.max_unpacked_bytes)
        return _read(unpacked, config, source=path)


def _read(path: Path, config: ReadConfig, *, source: Path) -> Trace:
    db = _Db(path, source)
    try:
        notes: list[str] = []
        launches = _launch_map(db, notes)
        kernels = _activity(db, "CUPTI_ACTIVITY_KIND_KERNEL", category="kernel",
                            launches=launches, notes=notes)
        if config.include_memcpy:
            kernels += _activity(db, "CUPTI_ACTIVITY_KIND_MEMCPY", category="memcpy",
                                 launches=launches, notes=notes)
        if config.include_memset:
            kernels += _activity(db, "CUPTI_ACTIVITY_KIND_MEMSET", category="memset",
                                 launches=launches, notes=notes)
        labels = _nvtx_labels(db, notes)
        if "CUPTI_ACTIVITY_KIND_KERNEL" not in db.tables:
            notes.append("no CUPTI_ACTIVITY_KIND_KERNEL table (no CUDA trace?): "
                         "kernels from copies only" if kernels else
                         "no CUPTI_ACTIVITY_KIND_KERNEL table (no CUDA trace?): 0 devices")
        if "NVTX_EVENTS" not in db.tables:
            notes.append("no NVTX_EVENTS table: no labels (profile with --trace=cuda,nvtx)")
    except sqlite3.Error as exc:  # e.g. a damaged page, met only when a table is read
        raise ValueError(f"{source}: not a readable SQLite database ({exc})") from exc
    finally:
        db.conn.close()
    return Trace(kernels=kernels, labels=labels, source=str(source), notes=notes)
