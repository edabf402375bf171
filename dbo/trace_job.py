"""`dbo trace`: capture N DBO steps of a preset under torch.profiler, then analyze them.

    dbo trace                                    # CPU: 2 gloo ranks, tiny preset
    dbo trace --preset qwen3-moe-like --tokens 4096 --steps 2 --out dbo_out/trace
    torchrun --nproc_per_node=2 -m dbo.cli trace --preset deepseek-v3-like --layers 3

Writes per rank (rank r > 0 under `<out>/rank<r>/`): `trace.json` (Chrome trace; open it
at ui.perfetto.dev), `trace_analysis.json` (overlap, exposed comm, per-phase times) and
`trace_timeline.png`, and prints rank 0's analysis table. For your own model, call
`dbo.capture.capture(step_fn, out_dir, steps=N)` around a `DBORunner` call.

For Nsight Systems instead of torch.profiler (where `nsys` is installed):
    DBO_NVTX=1 nsys profile -t cuda,nvtx -o dbo_run dbo run --no-trace
    nsys export --type sqlite dbo_run.nsys-rep && dbo inspect dbo_run.sqlite
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import torch

from dbo.capture import capture
from dbo.launch import RankContext, launch
from dbo.run_job import RunConfig, build_parser, parse_job, setup_rank

DEFAULTS = RunConfig(out="dbo_out/trace", steps=2)


def trace_rank(ctx: RankContext, job: RunConfig) -> Optional[str]:
    setup = setup_rank(ctx, job)
    out = Path(job.out) / f"rank{ctx.rank}" if ctx.rank else Path(job.out)
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
