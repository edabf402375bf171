"""Overlap analysis of a trace: busy time, overlapped and exposed comm, phase times.

Commands::

    python -m traces.analyze trace.json                    # table, then one JSON line
    python -m traces.analyze trace.json.gz --png timeline.png --json report.json
    python -m traces.analyze report.sqlite --comm-pattern my_a2a_kernel
    python -m traces.analyze cpu_trace.json                 # no GPU kernels: CPU ops per thread
    dbo inspect trace.json                                  # the same main()

Per device (all in microseconds, within the device's window):
- ``wall_us``: the window: the extent of the step labels (``ProfilerStep#N`` or
  ``step/N``) when the trace has them, else first kernel start to last kernel end.
- ``compute_busy_us``: measure of the union of compute kernels (overlapping kernels, on one
  stream or across streams, count once); ``comm_us``: the same for comm kernels.
- ``comm_overlapped_us``: measure of (comm union) ∩ (compute union);
  ``comm_exposed_us`` = ``comm_us - comm_overlapped_us``.
- ``overlap_fraction`` = overlapped / comm, and 0.0 when there is no comm.
- ``streams``: busy time (union) and kernel count per stream.
- ``phases``: per ubatch (``ub0``, ``ub1``, ``none``), per phase: the sum of the phase
  label durations (device-side labels when the device has any, else CPU-side labels);
  spans of one label name are merged first, so a range Kineto split over two streams
  counts once. CPU-side labels count their active time only: the time their ubatch was
  paused (the other ubatch held the thread) is left out (``traces.active``); ``run`` is
  the time each ubatch held the thread.
- ``compute_idle``: the compute stream's idle time, split into waiting for the host,
  for a peer (CPU traces: blocked on a collective, `traces.waits`), held back by a
  cross-stream wait, and before/after its kernels, with the largest gaps (`traces.idle`).

With several devices (one Nsight report holds every rank of a launch), ``capture_windows``
gives each device's window and whether they agree (`traces.alignment`): the ranks of one
step share its collectives, so a device whose window starts (or ends) far from the
others' entered the capture early and waited for them inside it. Its overlap counts that
wait: the table and `dbo inspect` then warn of a misaligned capture.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

from traces.active import RunKey, run_spans, split_active
from traces.alignment import capture_windows
from traces.classify import ClassifyConfig, Classifier, Kind
from traces.file_checks import MAX_UNPACKED_OPTION
from traces.idle import compute_idle, compute_stream
from traces.intervals import Span, clip, intersect, merge, subtract, total
from traces.model import KernelInterval, Label, ReadConfig, Trace, parse_label_name
from traces.report import DEFAULT_STEP_PATTERN, AnalyzeConfig, DeviceReport, Report, StreamReport
from traces.timeline import draw_timeline
from traces.waits import peer_waits


def _extent(spans: list[Span]) -> Span | None:
    return Span(min(s.start for s in spans), max(s.end for s in spans)) if spans else None


def _window(
    device: int, kernels: list[KernelInterval], labels: list[Label], step_re: re.Pattern[str] | None
) -> tuple[Span, str, Span | None]:
    """(GPU window, its source, CPU step window or None) of one device."""
    whole = _extent([Span(k.start_us, k.end_us) for k in kernels]) or Span(0.0, 0.0)
    if step_re is None:
        return whole, "kernels", None
    steps = [lb for lb in labels if step_re.match(lb.name)]
    gpu = _extent([Span(lb.start_us, lb.end_us) for lb in steps if lb.device == device])
    cpu = _extent([Span(lb.start_us, lb.end_us) for lb in steps if lb.device is None])
    launched = None
    if cpu is not None:
        launched = _extent([Span(k.start_us, k.end_us) for k in kernels
                            if k.launch_us is not None and cpu.start <= k.launch_us <= cpu.end])
    if gpu is not None:
        # The profiler ties a kernel to the innermost range open on its thread when it
        # was queued; kernels queued from a ubatch's greenlet go to the ubatch's ranges,
        # and the step's GPU label can cover only its first few kernels (a DBO step that
        # queues nothing before its ubatches start). Widen it by what the step launched.
        return _extent([gpu, launched] if launched else [gpu]), "gpu step labels", cpu
    if launched is not None:
        return launched, "cpu step labels", cpu
    return whole, "kernels", cpu


def labels_of_device(labels: list[Label], kernels: list[KernelInterval]) -> list[Label]:
    """The labels that describe one device: its device-side labels, and the CPU-side
    labels of the threads that launched its kernels.

    One trace can hold several processes (an Nsight Systems report of a `torchrun`
    launcher holds every rank): each rank's CPU-side ranges belong to its own GPU only.
    When no CPU-side label was opened on a launching thread (launch threads unknown, or
    ids that do not match), every CPU-side label is kept.
    """
    launchers = {k.launch_tid for k in kernels if k.launch_tid is not None}
    if not any(lb.device is None and lb.tid in launchers for lb in labels):
        return labels
    return [lb for lb in labels if lb.device is not None or lb.tid in launchers]


def label_spans(labels: list[Label]) -> dict[str, list[Span]]:
    """Merged spans per label name: the pieces one range leaves on several streams (or
    any same-name overlap) count once."""
    by_name: dict[str, list[Span]] = defaultdict(list)
    for lb in labels:
        by_name[lb.name].append(Span(lb.start_us, lb.end_us))
    return {name: merge(spans) for name, spans in by_name.items()}


def _phases(labels: list[Label], window: Span | None,
            runs: dict[RunKey, list[Span]]) -> dict[str, dict[str, float]]:
    if window is not None:
        labels = [lb for lb in labels if lb.end_us > window.start and lb.start_us < window.end]
    active: dict[str, list[Span]] = defaultdict(list)
    for lb in labels:
        active[lb.name] += split_active(lb, runs).active
    sums: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for name, spans in active.items():
        parts = parse_label_name(name)
        ub = "none" if parts.ubatch is None else f"ub{parts.ubatch}"
        sums[ub][parts.phase or ""] += total(merge(spans))
    return {ub: dict(ph) for ub, ph in sums.items()}


def _device_report(
    device: int,
    kernels: list[KernelInterval],
    labels: list[Label],
    classifier: Classifier,
    step_re: re.Pattern[str] | None,
) -> DeviceReport:
    # gloo records its collectives on its own threads, which launch no ops: peer waits
    # read every label (a CPU trace holds one process).
    all_labels, labels = labels, labels_of_device(labels, kernels)
    window, source, cpu_window = _window(device, kernels, labels, step_re)
    by_kind: dict[Kind, list[Span]] = defaultdict(list)
    by_stream: dict[int, dict[Kind, list[Span]]] = defaultdict(lambda: defaultdict(list))
    for k in kernels:
        kind = classifier.kind(k)
        span = Span(k.start_us, k.end_us)
        by_kind[kind].append(span)
        by_stream[k.stream][kind].append(span)
    compute = clip(merge(by_kind[Kind.COMPUTE]), window)
    comm = clip(merge(by_kind[Kind.COMM]), window)
    copy = clip(merge(by_kind[Kind.COPY]), window)
    comm_us = total(comm)
    overlapped = total(intersect(comm, compute))

    streams = {}
    for stream, kinds in by_stream.items():
        all_spans = [s for spans in kinds.values() for s in spans]
        in_window = [s for s in all_spans if s.end > window.start and s.start < window.end]
        streams[stream] = StreamReport(
            busy_us=total(clip(merge(all_spans), window)),
            compute_us=total(clip(merge(kinds[Kind.COMPUTE]), window)),
            comm_us=total(clip(merge(kinds[Kind.COMM]), window)),
            num_kernels=len(in_window),
        )

    idle_stream = compute_stream({s: st.compute_us for s, st in streams.items()})
    waits = [] if idle_stream is None else peer_waits(kernels, all_labels, window,
                                                       classifier=classifier, stream=idle_stream)
    phase_labels = [lb for lb in labels if lb.phase is not None and lb.device == device]
    phase_source, phase_window = "device", (window if source == "gpu step labels" else None)
    if not phase_labels:
        phase_labels = [lb for lb in labels if lb.phase is not None and lb.device is None]
        phase_source, phase_window = ("cpu" if phase_labels else "none"), cpu_window
    return DeviceReport(
        device=device,
        window=window,
        window_source=source,
        wall_us=window.length,
        compute_busy_us=total(compute),
        comm_us=comm_us,
        comm_overlapped_us=overlapped,
        comm_exposed_us=comm_us - overlapped,
        overlap_fraction=overlapped / comm_us if comm_us > 0 else 0.0,
        copy_us=total(copy),
        num_kernels=sum(s.num_kernels for s in streams.values()),
        streams=streams,
        phases=_phases(phase_labels, phase_window, run_spans(labels)),
        phase_source=phase_source,
        exposed_comm=subtract(comm, compute),
        peer_waits=waits,
        idle=None if idle_stream is None else compute_idle(kernels, labels, window, device=device,
                                                           stream=idle_stream, peer_waits=waits),
    )


def analyze(trace: Trace, config: AnalyzeConfig | None = None) -> Report:
    """Overlap numbers per device of ``trace`` (see the module docstring)."""
    config = config or AnalyzeConfig()
    classifier = Classifier(config.classify)
    step_re = re.compile(config.step_pattern) if config.step_pattern is not None else None
    per_device: dict[int, list[KernelInterval]] = defaultdict(list)
    for k in trace.kernels:
        per_device[k.device].append(k)
    devices = {
        d: _device_report(d, ks, trace.labels, classifier, step_re)
        for d, ks in sorted(per_device.items())
    }
    notes = list(trace.notes)
    if not devices:
        notes.append("0 devices: nothing to analyze")
    windows = capture_windows({f"device {d}": rep.window for d, rep in devices.items()})
    return Report(source=trace.source, devices=devices, notes=notes, config=config,
                  windows=windows)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dbo inspect",
        description="Busy, overlapped and exposed comm time per device of a torch.profiler "
                    "Chrome trace (.json/.json.gz) or an 'nsys export --type sqlite' file.")
    p.add_argument("file", type=Path, help="trace file")
    p.add_argument("--json", type=Path, metavar="OUT", help="also write the JSON report here")
    p.add_argument("--png", type=Path, metavar="OUT", help="draw a timeline PNG here")
    p.add_argument("--comm-pattern", action="extend", nargs="+", default=[], metavar="P",
                   help="extra case-insensitive regex of comm kernel names (repeatable)")
    p.add_argument("--only-comm-patterns", action="store_true",
                   help="use only the --comm-pattern patterns, not the defaults")
    p.add_argument("--step-pattern", default=DEFAULT_STEP_PATTERN,
                   help=f"regex of step label names bounding the window (default {DEFAULT_STEP_PATTERN!r})")
    p.add_argument("--whole-trace", action="store_true", help="ignore step labels: window = all kernels")
    p.add_argument("--cpu-ops", action="store_true",
                   help="Chrome traces: analyze CPU ops, one stream per thread, also in a trace "
                        "with GPU kernels (a trace without GPU kernels gets this by default)")
    p.add_argument("--no-memcpy", action="store_true", help="drop memcpy/memset intervals")
    p.add_argument(MAX_UNPACKED_OPTION, type=_positive_int, metavar="MB",
                   default=ReadConfig().max_unpacked_bytes >> 20,
                   help="the most MiB a gzip-compressed trace may unpack to; a larger one is "
                        "refused, not read (default %(default)s)")
    return p


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be an int >= 1")
    return value


def _check_outputs(args: argparse.Namespace) -> list[str]:
    """Refuse (ValueError, one line) an output that is a folder, lies under a file, or is
    the trace being read (or both outputs one file); returns a note for each existing
    file that will be replaced."""
    notes = []
    outputs = [(option, path) for option, path in (("--json", args.json), ("--png", args.png))
               if path is not None]
    if len(outputs) == 2 and outputs[0][1].resolve() == outputs[1][1].resolve():
        raise ValueError(f"--json and --png name one file, {args.json}: name two")
    for option, path in outputs:
        if path.is_dir():
            raise ValueError(f"{option} {path}: is a folder: name a file")
        above = next((p for p in path.parents if p.exists()), None)
        if above is not None and not above.is_dir():
            raise ValueError(f"{option} {path}: {above} is a file, not a folder: name a file "
                             f"in a folder")
        if path.exists():
            if args.file.exists() and path.samefile(args.file):
                raise ValueError(f"{option} {path}: is the trace being read: name another "
                                 f"file for the output")
            notes.append(f"note: {option} {path}: replaced the existing file")
    return notes


def main(argv: list[str] | None = None) -> int:
    """CLI: print a table, then one JSON line; optionally write JSON and a PNG. Returns 0,
    1 when the trace has nothing to analyze, or 2 when the file cannot be read or an
    output cannot be written (one error line). An existing output file is replaced, with
    a note on stderr; the trace itself never is."""
    from traces.readers import read_trace  # noqa: PLC0415 (readers import sqlite3, gzip)

    args = _parser().parse_args(argv)
    patterns = tuple(args.comm_pattern)
    try:
        classify = (ClassifyConfig(comm_patterns=patterns) if args.only_comm_patterns
                    else ClassifyConfig().with_extra(*patterns))
        config = AnalyzeConfig(classify=classify,
                               step_pattern=None if args.whole_trace else args.step_pattern)
        read_config = ReadConfig(include_memcpy=not args.no_memcpy, include_memset=not args.no_memcpy,
                                 cpu_ops_as_kernels=True if args.cpu_ops else None,
                                 max_unpacked_bytes=args.max_unpacked_mb << 20)
        replaced = _check_outputs(args)
        trace = read_trace(args.file, config=read_config)
    except (OSError, ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = analyze(trace, config)
    print(report.format_table())
    if report.misaligned:
        print(f"warning: {args.file}: {report.windows.verdict()}", file=sys.stderr)

    payload = report.to_json()
    try:
        if args.png is not None:
            draw_timeline(trace, args.png, report=report)
            print(f"timeline: {args.png}")
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(payload, indent=2) + "\n")
    except (OSError, ValueError, ImportError) as exc:  # e.g. a --png suffix matplotlib lacks
        print(f"error: cannot write the output: {exc}", file=sys.stderr)
        return 2
    for note in replaced:
        print(note, file=sys.stderr)
    print(json.dumps(payload, sort_keys=True))
    if not report.devices:
        print(f"error: {args.file}: nothing to analyze: the trace holds no kernels and no CPU ops",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
