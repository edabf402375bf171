"""Read profiler traces into one normalized form: kernel intervals and labels.

Sources:
- torch.profiler (Kineto) Chrome JSON (``.json`` or ``.json.gz``): GPU events have
  ``pid`` = device and ``tid`` = stream (CUPTI's stream id, not PyTorch's); ``ts``/``dur``
  are microseconds. Labels come from ``gpu_user_annotation`` (device-side spans) and
  ``user_annotation`` (CPU-side spans, e.g. ``record_function`` / ``traces.ranges``).
- Nsight Systems SQLite (``nsys export --type sqlite``): ``CUPTI_ACTIVITY_KIND_KERNEL``
  (+ ``MEMCPY``/``MEMSET`` when present), ``NVTX_EVENTS`` ranges, ``StringIds``; times in ns.

Every kernel keeps the CPU time and thread of its launch when the trace links them
(Chrome: ``args.correlation`` to a ``cuda_runtime`` event; nsys: ``correlationId`` to
``CUPTI_ACTIVITY_KIND_RUNTIME``), so CPU-side labels can be mapped onto kernels.
Times in the normalized form are microseconds on the trace's own clock.
"""
from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

from traces.model import KernelInterval, Label, LabelName, ReadConfig, Trace, parse_label_name
from traces.nsys import read_nsys_sqlite
from traces.perfetto import ACTIVE_SEGMENT_ARG, THREAD_ARG

__all__ = [
    "KernelInterval",
    "Label",
    "LabelName",
    "ReadConfig",
    "Trace",
    "parse_label_name",
    "read_chrome_trace",
    "read_nsys_sqlite",
    "read_trace",
]

class _IdMap:
    """Integer ids for Kineto pid/tid values: ints, digit strings, 'stream 7', else interned."""

    def __init__(self) -> None:
        self._interned: dict[str, int] = {}

    def __call__(self, value: Any) -> int:
        if isinstance(value, bool):
            return int(value)
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        text = str(value).strip()
        found = re.findall(r"-?\d+", text)
        if found:
            return int(found[-1])
        # A name with no number: give it a stable negative id (never a real device).
        return self._interned.setdefault(text, -1 - len(self._interned))


def _load_chrome_events(path: Path) -> list[dict[str, Any]]:
    with path.open("rb") as raw:
        magic = raw.read(2)
    opener = gzip.open if magic == b"\x1f\x8b" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as exc:
        raise ValueError(f"{path}: not a readable Chrome trace JSON ({exc})") from exc
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError(f"{path}: no 'traceEvents' list; is this a torch.profiler Chrome trace?")
    return events


def read_chrome_trace(path: str | Path, *, config: ReadConfig | None = None) -> Trace:
    """Read a torch.profiler Chrome trace (``.json`` or gzip-compressed) into a ``Trace``.

    Complete events (``ph == "X"``) only. GPU kernels: ``cat`` ``kernel`` (plus
    ``gpu_memcpy``/``gpu_memset`` per ``config``); device from ``args.device`` or ``pid``,
    stream from ``args.stream`` or ``tid`` (ints or strings such as ``"stream 7"``).
    """
    config = config or ReadConfig()
    path = Path(path)
    events = _load_chrome_events(path)
    to_id = _IdMap()
    kernel_cats = {"kernel": "kernel"}
    if config.include_memcpy:
        kernel_cats["gpu_memcpy"] = "memcpy"
    if config.include_memset:
        kernel_cats["gpu_memset"] = "memset"

    launches: dict[int, tuple[float, int]] = {}
    for ev in events:
        if not isinstance(ev, dict) or ev.get("ph") != "X":
            continue
        if str(ev.get("cat", "")).lower() in ("cuda_runtime", "cuda_driver"):
            corr = (ev.get("args") or {}).get("correlation")
            if corr is not None:
                launches[int(corr)] = (float(ev.get("ts", 0.0)), to_id(ev.get("tid", 0)))

    kernels: list[KernelInterval] = []
    labels: list[Label] = []
    cpu_ops: list[KernelInterval] = []
    num_gpu = 0
    for ev in events:
        if not isinstance(ev, dict) or ev.get("ph") != "X" or "ts" not in ev:
            continue
        cat = str(ev.get("cat", "")).lower()
        name = str(ev.get("name", ""))
        start = float(ev["ts"])
        end = start + float(ev.get("dur", 0.0))
        args = ev.get("args") or {}
        if cat in kernel_cats:
            launch = launches.get(int(args["correlation"])) if "correlation" in args else None
            kernels.append(
                KernelInterval(
                    device=to_id(args.get("device", ev.get("pid", 0))),
                    stream=to_id(args.get("stream", ev.get("tid", 0))),
                    name=name,
                    start_us=start,
                    end_us=end,
                    category=kernel_cats[cat],
                    launch_us=None if launch is None else launch[0],
                    launch_tid=None if launch is None else launch[1],
                )
            )
            num_gpu += 1
        elif cat == "cpu_op" and config.cpu_ops_as_kernels is not False:
            tid = to_id(ev.get("tid", 0))
            cpu_ops.append(
                KernelInterval(
                    device=to_id(ev.get("pid", 0)),
                    stream=tid,
                    name=name,
                    start_us=start,
                    end_us=end,
                    category="cpu_op",
                    launch_us=start,
                    launch_tid=tid,
                )
            )
        elif cat == "gpu_user_annotation":
            device = to_id(args.get("device", ev.get("pid", 0)))
            stream = to_id(args.get("stream", ev.get("tid", 0)))
            labels.append(Label.from_name(name, start_us=start, end_us=end, device=device, stream=stream))
        elif cat == "user_annotation":
            if ACTIVE_SEGMENT_ARG in args:
                continue  # a piece of a range that is also stored whole (traces.perfetto)
            tid = to_id(args.get(THREAD_ARG, ev.get("tid", 0)))
            labels.append(Label.from_name(name, start_us=start, end_us=end, device=None, tid=tid))

    notes: list[str] = []
    use_cpu_ops = config.cpu_ops_as_kernels or (config.cpu_ops_as_kernels is None and num_gpu == 0)
    if use_cpu_ops:
        kernels += cpu_ops
    if num_gpu == 0:
        if use_cpu_ops and cpu_ops:
            notes.append("no GPU kernels: CPU ops analyzed instead, one row per thread "
                         "(device = process id, stream = thread id)")
        elif cpu_ops:
            notes.append("no GPU kernels in this trace: 0 devices (its CPU ops are left out "
                         "by ReadConfig(cpu_ops_as_kernels=False))")
        else:
            notes.append("no GPU kernels and no CPU ops in this trace: 0 devices")
    return Trace(kernels=kernels, labels=labels, source=str(path), notes=notes)


def read_trace(path: str | Path, *, config: ReadConfig | None = None) -> Trace:
    """Read a Chrome JSON(.gz) or Nsight Systems SQLite trace, chosen by suffix or content."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    name = path.name.lower()
    if name.endswith(".nsys-rep") or name.endswith(".qdrep"):
        raise ValueError(
            f"{path}: an Nsight Systems report; export it first: "
            f"nsys export --type sqlite -o {path.with_suffix('.sqlite')} {path}"
        )
    with path.open("rb") as f:
        head = f.read(16)
    if head.startswith(b"\x1f\x8b"):  # gzip: a Chrome trace, or an Nsight SQLite file
        with gzip.open(path, "rb") as f:
            if f.read(16).startswith(b"SQLite format 3"):
                return read_nsys_sqlite(path, config=config)
        return read_chrome_trace(path, config=config)
    if head.startswith(b"SQLite format 3"):
        return read_nsys_sqlite(path, config=config)
    if head.lstrip()[:1] in (b"{", b"["):
        return read_chrome_trace(path, config=config)
    raise ValueError(
        f"{path}: unknown trace format (expected a torch.profiler Chrome trace .json/.json.gz "
        f"or an 'nsys export --type sqlite' file)"
    )
