"""Read an Nsight Systems SQLite export (``nsys export --type sqlite``) into a ``Trace``.

Tables used (times in ns; missing optional tables or columns are skipped):
- ``CUPTI_ACTIVITY_KIND_KERNEL``: start, end, deviceId, streamId, demangledName /
  shortName / mangledName (text, or an id into ``StringIds``), correlationId, globalPid.
- ``CUPTI_ACTIVITY_KIND_MEMCPY`` (copyKind; 10 = peer to peer), ``..._MEMSET``: optional.
- ``CUPTI_ACTIVITY_KIND_RUNTIME``: start, globalTid, correlationId: the launch of a kernel.
- ``NVTX_EVENTS``: start, end, text or textId, globalTid, eventType: ranges become labels.
  NVTX timestamps are CPU times, so these labels are CPU-side (``device`` None).
- ``StringIds(id, value)``.
"""
from __future__ import annotations

import gzip
import shutil
import sqlite3
import tempfile
from pathlib import Path
from typing import Any

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


def _pid_of(global_id: Any) -> int | None:
    return None if global_id is None else (int(global_id) >> _PID_SHIFT) & _PID_MASK


class _Db:
    """A read-only connection plus table/column lookups and StringIds resolution."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            rows = self.conn.execute("SELECT name FROM sqlite_master WHERE type='table'").fetchall()
        except sqlite3.DatabaseError as exc:
            self.conn.close()
            raise ValueError(f"{path}: not a readable SQLite database ({exc})") from exc
        self.tables = {r[0] for r in rows}
        self.strings: dict[int, str] = {}
        if "StringIds" in self.tables:
            self.strings = dict(self.conn.execute("SELECT id, value FROM StringIds"))

    def columns(self, table: str) -> set[str]:
        if table not in self.tables:
            return set()
        return {r[1] for r in self.conn.execute(f'PRAGMA table_info("{table}")')}

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


def _launch_map(db: _Db) -> dict[tuple[int | None, int], tuple[float, int]]:
    """(pid, correlationId) and (None, correlationId) -> (launch start us, globalTid)."""
    out: dict[tuple[int | None, int], tuple[float, int]] = {}
    for row in db.rows("CUPTI_ACTIVITY_KIND_RUNTIME", ["start", "globalTid", "correlationId"]):
        if row["correlationId"] is None or row["start"] is None:
            continue
        value = (row["start"] / 1000.0, int(row["globalTid"] or 0))
        out[(_pid_of(row["globalTid"]), int(row["correlationId"]))] = value
        out.setdefault((None, int(row["correlationId"])), value)
    return out


def _activity(
    db: _Db,
    table: str,
    *,
    category: str,
    launches: dict[tuple[int | None, int], tuple[float, int]],
) -> list[KernelInterval]:
    wanted = ["start", "end", "deviceId", "streamId", "correlationId", "globalPid",
              "demangledName", "shortName", "mangledName", "copyKind"]
    out = []
    for row in db.rows(table, wanted):
        if row["start"] is None or row["end"] is None:
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
            corr = int(row["correlationId"])
            launch = launches.get((_pid_of(row["globalPid"]), corr)) or launches.get((None, corr))
        out.append(
            KernelInterval(
                device=int(row["deviceId"] or 0),
                stream=int(row["streamId"] or 0),
                name=name,
                start_us=row["start"] / 1000.0,
                end_us=row["end"] / 1000.0,
                category=category,
                launch_us=None if launch is None else launch[0],
                launch_tid=None if launch is None else launch[1],
            )
        )
    return out


def _nvtx_labels(db: _Db) -> list[Label]:
    out = []
    for row in db.rows("NVTX_EVENTS", ["start", "end", "text", "textId", "globalTid", "eventType"]):
        if row["start"] is None or row["end"] is None or row["end"] < row["start"]:
            continue
        if row["eventType"] in _NVTX_NOT_RANGES:
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
                tid=None if row["globalTid"] is None else int(row["globalTid"]),
            )
        )
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
    with path.open("rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    if not gzipped:
        return _read(path, config, source=path)
    # SQLite reads files only: unpack a gzipped export (how traces/data keeps one) first.
    with tempfile.TemporaryDirectory() as tmp:
        unpacked = Path(tmp) / path.name.removesuffix(".gz")
        with gzip.open(path, "rb") as src, unpacked.open("wb") as dst:
            shutil.copyfileobj(src, dst)
        return _read(unpacked, config, source=path)


def _read(path: Path, config: ReadConfig, *, source: Path) -> Trace:
    db = _Db(path)
    try:
        notes: list[str] = []
        launches = _launch_map(db)
        kernels = _activity(db, "CUPTI_ACTIVITY_KIND_KERNEL", category="kernel", launches=launches)
        if config.include_memcpy:
            kernels += _activity(db, "CUPTI_ACTIVITY_KIND_MEMCPY", category="memcpy",
                                 launches=launches)
        if config.include_memset:
            kernels += _activity(db, "CUPTI_ACTIVITY_KIND_MEMSET", category="memset",
                                 launches=launches)
        labels = _nvtx_labels(db)
        if "CUPTI_ACTIVITY_KIND_KERNEL" not in db.tables:
            notes.append("no CUPTI_ACTIVITY_KIND_KERNEL table (no CUDA trace?): "
                         "kernels from copies only" if kernels else
                         "no CUPTI_ACTIVITY_KIND_KERNEL table (no CUDA trace?): 0 devices")
        if "NVTX_EVENTS" not in db.tables:
            notes.append("no NVTX_EVENTS table: no labels (profile with --trace=cuda,nvtx)")
    finally:
        db.conn.close()
    return Trace(kernels=kernels, labels=labels, source=str(source), notes=notes)
