"""`dbo trace`: capture N DBO steps of a preset, then analyze them.

    dbo trace                                    # CPU: 2 gloo ranks, tiny preset
    dbo trace --preset qwen3-moe-like --tokens 4096 --steps 2 --out dbo_out/trace
    torchrun --nproc_per_node=2 -m dbo.cli trace --preset deepseek-v3-like --layers 3

Writes per rank (rank r > 0 under `<out>/rank<r>/`): `trace.json` (Chrome trace; open it
at ui.perfetto.dev), `trace_analysis.json` (overlap, exposed comm, per-phase times) and
`trace_timeline.png`, and prints rank 0's analysis table and every rank's capture window.
For your own model, call `traces.capture.capture(step_fn, out_dir, steps=N)` around a
`DBORunner` call.

Before the capture every rank runs --warmup steps (the first ones compile and autotune
kernels), synchronizes its device and meets the others at a barrier; it does the same
before the capture stops. Ranks that entered the capture at different times would show
the early one waiting for the others inside its window (`dbo inspect` warns of such a
misaligned capture).

With `--profiler nsys` (GPUs) the same steps run with dbo's NVTX ranges on and no
torch.profiler, between cudaProfilerStart and cudaProfilerStop, so Nsight Systems records
exactly them (one report holds every rank of a torchrun launch). Pass
--capture-range-end=stop: with nsys's default (stop-shutdown) the end of the capture
range kills the job (exit code 143) before it reports.
    nsys profile -t cuda,nvtx --capture-range=cudaProfilerApi --capture-range-end=stop \\
        -o dbo_trace torchrun --nproc_per_node=2 -m dbo.cli trace --profiler nsys \\
        --preset deepseek-v3-like --layers 2 --tokens 4096
    nsys export --type sqlite -o dbo_trace.sqlite dbo_trace.nsys-rep
    dbo inspect dbo_trace.sqlite
"""
from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from dbo import TraceConfig, configure, current_config, label_range, step_name
from dbo.cli.launch import RankContext, align_ranks, launch
from dbo.cli.run_config import RunConfig
from dbo.cli.run_job import build_parser, parse_job, setup_rank
from traces.alignment import capture_windows
from traces.capture import Capture, capture
from traces.intervals import Span

# Three warm-up steps: the first compiles and autotunes the kernels of each ubatch's
# shapes. On 2x H200 (deepseek-v3-like, 2 layers, 4096 tokens; before the ranks met at a
# barrier) one warm-up step left a rank entering the capture 3.2 s before the other;
# three did not.
DEFAULTS = RunConfig(out="dbo_out/trace", steps=2, warmup=3)
NSYS_COMMAND = ("nsys profile -t cuda,nvtx --capture-range=cudaProfilerApi "
                "--capture-range-end=stop -o REPORT torchrun --nproc_per_node=N -m dbo.cli "
                "trace --profiler nsys ...")


def trace_rank(ctx: RankContext, job: RunConfig) -> Optional[str]:
    setup = setup_rank(ctx, job)
    out = Path(job.out) / f"rank{ctx.rank}" if ctx.rank else Path(job.out)
    if job.profiler == "nsys":
        return nsys_steps(ctx, job, setup.on)
    with torch.no_grad():
        for _ in range(max(job.warmup, 1)):
            setup.on()
        captured = capture(setup.on, out, steps=job.steps, align=lambda: align_ranks(ctx),
                           title=f"dbo trace {job.preset}, rank {ctx.rank}, backend {setup.backend}")
    windows = rank_windows(ctx, captured)
    if not ctx.is_main:
        return None
    lines = [captured.report.format_table(), "", *windows, "",
             f"written: {captured.trace_path}, {captured.analysis_path}, {captured.timeline_path}"]
    return "\n".join(lines)


def rank_windows(ctx: RankContext, captured: Capture) -> list[str]:
    """Every rank's capture window and whether they agree (`traces.alignment`), as lines
    for rank 0 to print (every rank must call it: it gathers). Ranks on several hosts are
    not compared: their profilers' clocks differ."""
    if ctx.world_size < 2:
        return []
    spans = [rep.window for rep in captured.report.devices.values()]
    mine = (socket.gethostname(), min(s.start for s in spans) if spans else 0.0,
            max(s.end for s in spans) if spans else 0.0)
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, mine, group=ctx.group)
    if len({host for host, _, _ in gathered}) > 1:
        return ["ranks' capture windows: not compared (the ranks run on several hosts, "
                "whose profiler clocks differ)"]
    windows = capture_windows({f"rank {r}": Span(start, end)
                               for r, (_, start, end) in enumerate(gathered)})
    return ["ranks' capture windows (from the earliest start):", *windows.format_lines()]


def nsys_steps(ctx: RankContext, job: RunConfig, step: Callable[[], Any]) -> Optional[str]:
    """Warm up, align the ranks, then run `job.steps` steps labelled `step/N` with NVTX
    ranges on, between cudaProfilerStart and cudaProfilerStop (what `nsys
    --capture-range=cudaProfilerApi` records), aligning the ranks again after the start
    (each rank's cudaProfilerStart can return at another time) and before the stop.
    Writes nothing itself: the report is Nsight's."""
    previous = current_config()
    configure(TraceConfig(nvtx=True, domain=previous.domain))
    try:
        with torch.no_grad():
            for _ in range(max(job.warmup, 1)):
                step()
            align_ranks(ctx)
            torch.cuda.profiler.start()
            try:
                align_ranks(ctx)
                for i in range(job.steps):
                    with label_range(step_name(i)):
                        step()
                    torch.cuda.synchronize()
                align_ranks(ctx)
            finally:
                torch.cuda.profiler.stop()
    finally:
        configure(previous)
    if not ctx.is_main:
        return None
    return (f"ran {job.steps} DBO steps on {ctx.world_size} rank(s) with NVTX ranges, inside "
            f"cudaProfilerStart/Stop, after {max(job.warmup, 1)} warm-up steps, the ranks "
            f"aligned. Record them with `{NSYS_COMMAND}`, then export and analyze them with "
            f"`nsys export --type sqlite -o REPORT.sqlite REPORT.nsys-rep && dbo inspect "
            f"REPORT.sqlite`")


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser(prog="dbo trace", description=__doc__, defaults=DEFAULTS,
                          traced=True)
    job, world_size = parse_job(parser, argv)
    text = launch(trace_rank, job, world_size=world_size)
    if text:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
