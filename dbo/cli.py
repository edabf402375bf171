"""The `dbo` command.

    dbo run           the main job: a preset MoE model, DBO on and off (dbo.run_job)
    dbo trace         capture DBO steps under torch.profiler and analyze them (dbo.trace_job)
    dbo inspect FILE  analyze a torch.profiler or Nsight Systems trace (traces.analyze)
    dbo bench         throughput sweep with a measured overlap ceiling (dbo.bench)
    dbo bench-switch  CPU cost of one ubatch hand-off (dbo.bench_switch)
    dbo soak          many random-size DBO steps against the reference (dbo.soak)

`python -m dbo.cli <command> ...` does the same (use it under torchrun).
"""
from __future__ import annotations

import importlib
import os
import sys
from typing import Optional

COMMANDS = {
    "run": ("dbo.run_job", "the main job: a preset MoE model with DBO on and off"),
    "trace": ("dbo.trace_job", "capture DBO steps under torch.profiler; trace, analysis, timeline"),
    "inspect": ("traces.analyze", "analyze a Chrome (torch.profiler) or Nsight SQLite trace"),
    "bench": ("dbo.bench", "throughput sweep: backends x tokens x DBO on/off, with ceiling"),
    "bench-switch": ("dbo.bench_switch", "CPU cost per ubatch hand-off vs OS threads"),
    "soak": ("dbo.soak", "many random-size DBO steps vs the no-DBO reference; memory stays flat"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items())
    return f"usage: dbo COMMAND [options]\n\ncommands:\n{rows}\n\n'dbo COMMAND --help' for options"


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"dbo: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    if os.environ.get("DBO_NVTX") == "1":  # the CLI is the one place env vars are read
        from traces.ranges import TraceConfig, configure
        configure(TraceConfig(nvtx=True))
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
