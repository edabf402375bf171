"""Read profiler traces into one normalized form: kernel intervals and labels.

Sources:
- torch.profiler (Kineto) Chrome JSON (``.json`` or ``.json.gz``): GPU events have
  ``pid`` = device and ``tid`` = stream (CUPTI's stream id, not PyTorch's); ``ts``/``dur``
  are microseconds. Labels come from ``gpu_user_annotation`` (device-side spans) and
  ``user_annotation`` (CPU-side spans, e.g. ``record_function`` / ``dbo.ranges``).
- Nsight Systems SQLite (``nsys export --type sqlite``): ``CUPTI_ACTIVITY_KIND_KERNEL``
  (+ ``MEMCPY``/``MEMSET`` when present), ``NVTX_EVENTS`` ranges, ``StringIds``; times in ns.

Every kernel keeps the CPU time and thread of its launch when the trace links them
(Chrome: ``args.correlation`` to a ``cuda_runtime`` event; nsys: ``correlationId`` to
``CUPTI_ACTIVITY_KIND_RUNTIME``), so CPU-side labels can be mapped onto kernels.
Times in the normalized form are microseconds on the trace's own clock.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from traces.file_checks import Skips, integer, is_gzip, number, read_unpacked, unpacked_head
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
        if found and len(found[-1]) <= 18:  # a longer one is no id: interned below
            return int(found[-1])
        # A name with no number: give it a stable negative id (never a real device).
        return self._interned.setdefault(text, -1 - len(self._interned))


def _load_chrome_events(path: Path, config: ReadConfig) -> list[Any]:
    data = (read_unpacked(path, limit=config.max_unpacked_bytes) if is_gzip(path)
            else path.read_bytes())
    try:
        loaded = json.loads(data)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not a readable Chrome trace JSON ({exc})") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a readable Chrome trace JSON (not UTF-8 text: "
                         f"{exc.reason})") from exc
    except RecursionError as exc:
        raise ValueError(f"{path}: not a readable Chrome trace JSON (nested too deeply to "
                         f"read: not one a profiler wrote)") from exc
    del data
    events = loaded.get("traceEvents") if isinstance(loaded, dict) else loaded
    if not isinstance(events, list):
        raise ValueError(f"{path}: no 'traceEvents' list; is this a torch.profiler Chrome trace?")
    return events


@dataclass(frozen=True, slots=True)
class _Complete:
    """A complete event ("X") whose times and args were checked."""

    event: dict[str, Any]
    start: float
    end: float
    args: dict[str, Any]
    correlation: int | None


def _complete_events(events: list[Any]) -> tuple[list[_Complete], str | None]:
    """The complete events with finite times, a non-negative duration, args that are an
    object and an integer correlation id (if any), and a note counting the others."""
    skips = Skips("complete events")
    out: list[_Complete] = []
    total = 0
    for ev in events:
        if not isinstance(ev, dict) or ev.get("ph") != "X":
            continue
        total += 1
        start, dur = number(ev.get("ts")), number(ev.get("dur", 0.0))
        end = None if start is None or dur is None else number(start + dur)
        args = ev.get("args")
        args = {} if args is None else args
        if start is None or dur is None or end is None:
            skips.add("with a ts or dur that is not a finite number")
        elif dur < 0:
            skips.add("with a negative duration")
        elif not isinstance(args, dict):
            skips.add("with args that are not an object")
        elif "correlation" in args and integer(args["correlation"]) is None:
            skips.add("with a correlation id that is not an integer")
        else:
            corr = args.get("correlation")
            out.append(_Complete(event=ev, start=start, end=end, args=args,
                                 correlation=None if corr is None else integer(corr)))
    return out, skips.note(total)


def read_chrome_trace(path: str | Path, *, config: ReadConfig | None = None) -> Trace:
    """Read a torch.profiler Chrome trace (``.json`` or gzip-compressed) into a ``Trace``.

    Complete events (``ph == "X"``) only. GPU kernels: ``cat`` ``kernel`` (plus
    ``gpu_memcpy``/``gpu_memset`` per ``config``); device from ``args.device`` or ``pid``,
    stream from ``args.stream`` or ``tid`` (ints or strings such as ``"stream 7"``).
    """
    config = config or ReadConfig()
    path = Path(path)
    events, skipped = _complete_events(_load_chrome_events(path, config))
    to_id = _IdMap()
    kernel_cats = {"kernel": "kernel"}
    if config.include_memcpy:
        kernel_cats["gpu_memcpy"] = "memcpy"
    if config.include_memset:
        kernel_cats["gpu_memset"] = "memset"

    launches: dict[int, tuple[float, int]] = {}
    for item in events:
        if str(item.event.get("cat", "")).lower() in ("cuda_runtime", "cuda_driver"):
            if item.correlation is not None:
                launches[item.correlation] = (item.start, to_id(item.event.get("tid", 0)))

    kernels: list[KernelInterval] = []
    labels: list[Label] = []
    cpu_ops: list[KernelInterval] = []
    num_gpu = 0
    for item in events:
        ev, args, start, end = item.event, item.args, item.start, item.end
        cat = str(ev.get("cat", "")).lower()
        name = str(ev.get("name", ""))
        if cat in kernel_cats:
            launch = None if item.correlation is None else launches.get(item.correlation)
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

    notes: list[str] = [] if skipped is None else [skipped]
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
        if unpacked_head(path).startswith(b"SQLite format 3"):
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
