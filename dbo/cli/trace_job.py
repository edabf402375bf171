"""`dbo trace`: capture N DBO steps of a preset, then analyze them.

    dbo trace                                    # CPU: 2 gloo ranks, tiny preset
    dbo trace --preset qwen3-moe-like --tokens 4096 --steps 2 --out dbo_out/trace
    torchrun --nproc_per_node=2 -m dbo.cli trace --preset deepseek-v3-like --layers 3

Writes per rank (rank r > 0 under `<out>/rank<r>/`): `trace.json` (Chrome trace; open it
at ui.perfetto.dev), `trace_analysis.json` (overlap, exposed comm, per-phase times) and
`trace_timeline.png`, and prints rank 0's analysis table. For your own model, call
`traces.capture.capture(step_fn, out_dir, steps=N)` around a `DBORunner` call.

With `--profiler nsys` (GPUs) the same steps run with dbo's NVTX ranges on and no
torch.profiler, between cudaProfilerStart and cudaProfilerStop, so Nsight Systems records
exactly them (one report holds every rank of a torchrun launch):
    nsys profile -t cuda,nvtx --capture-range=cudaProfilerApi -o dbo_trace
        torchrun --nproc_per_node=2 -m dbo.cli trace --profiler nsys     # one command
    nsys export --type sqlite -o dbo_trace.sqlite dbo_trace.nsys-rep
    dbo inspect dbo_trace.sqlite
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from traces.capture import capture
from dbo.cli.launch import RankContext, launch
from dbo.cli.run_config import RunConfig
from dbo.cli.run_job import build_parser, parse_job, setup_rank
from traces.ranges import TraceConfig, configure, current_config, label_range, step_name

DEFAULTS = RunConfig(out="dbo_out/trace", steps=2)


def trace_rank(ctx: RankContext, job: RunConfig) -> Optional[str]:
    setup = setup_rank(ctx, job)
    out = Path(job.out) / f"rank{ctx.rank}" if ctx.rank else Path(job.out)
    if job.profiler == "nsys":
        return nsys_steps(ctx, job, setup.on)
    with torch.no_grad():
        for _ in range(max(job.warmup, 1)):
            setup.on()
        captured = capture(setup.on, out, steps=job.steps,
                           title=f"dbo trace {job.preset}, rank {ctx.rank}, backend {setup.backend}")
    if not ctx.is_main:
        return None
    lines = [captured.report.format_table(), "",
             f"written: {captured.trace_path}, {captured.analysis_path}, {captured.timeline_path}"]
    return "\n".join(lines)


def nsys_steps(ctx: RankContext, job: RunConfig, step: Callable[[], Any]) -> Optional[str]:
    """Warm up, then run `job.steps` steps labelled `step/N` with NVTX ranges on, between
    cudaProfilerStart and cudaProfilerStop (what `nsys --capture-range=cudaProfilerApi`
    records). Writes nothing itself: the report is Nsight's."""
    previous = current_config()
    configure(TraceConfig(nvtx=True, domain=previous.domain))
    try:
        with torch.no_grad():
            for _ in range(max(job.warmup, 1)):
                step()
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            try:
                for i in range(job.steps):
                    with label_range(step_name(i)):
                        step()
                    torch.cuda.synchronize()
            finally:
                torch.cuda.profiler.stop()
    finally:
        configure(previous)
    if not ctx.is_main:
        return None
    return (f"ran {job.steps} DBO steps on {ctx.world_size} rank(s) with NVTX ranges, inside "
            f"cudaProfilerStart/Stop. Under `nsys profile --capture-range=cudaProfilerApi "
            f"-t cuda,nvtx -o REPORT ...`, export and analyze them with `nsys export --type "
            f"sqlite -o REPORT.sqlite REPORT.nsys-rep && dbo inspect REPORT.sqlite`")


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
