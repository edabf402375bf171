"""The `dbo` command.

    dbo run           the main job: a preset MoE model, DBO on and off (dbo.cli.run_job)
    dbo trace         capture DBO steps under torch.profiler and analyze them (dbo.cli.trace_job)
    dbo inspect FILE  analyze a torch.profiler or Nsight Systems trace (dbo.cli.inspect_trace)
    dbo bench         throughput sweep with a measured overlap ceiling (dbo.cli.bench)
    dbo bench-switch  CPU cost of one ubatch hand-off (dbo.cli.bench_switch)
    dbo bench-comm    dispatch + combine of every backend alone (dbo.cli.bench_comm)
    dbo soak          many random-size DBO steps against the reference (dbo.cli.soak)
    dbo plan          predicted gain of each overlap mode on a cluster (dbo.cli.plan)

`python -m dbo.cli <command> ...` does the same (use it under torchrun).

Every command's parser is a `Parser`: each option's help ends with its default, and a
bad value ends the command with one line on stderr and exit code 2, before any rank
starts.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path
from typing import Any, Mapping, NoReturn, Optional, Sequence

COMMANDS = {
    "run": ("dbo.cli.run_job", "the main job: a preset MoE model with DBO on and off"),
    "trace": ("dbo.cli.trace_job", "capture DBO steps under torch.profiler; trace, analysis, timeline"),
    "inspect": ("dbo.cli.inspect_trace", "analyze a Chrome (torch.profiler) or Nsight SQLite trace"),
    "bench": ("dbo.cli.bench", "throughput sweep: backends x tokens x DBO on/off, with ceiling"),
    "bench-switch": ("dbo.cli.bench_switch", "CPU cost per ubatch hand-off vs OS threads"),
    "bench-comm": ("dbo.cli.bench_comm", "dispatch + combine latency, bandwidth, host time, SMs per backend"),
    "soak": ("dbo.cli.soak", "many random-size DBO steps vs the no-DBO reference; memory stays flat"),
    "plan": ("dbo.cli.plan", "predicted step time and gain of each overlap mode on a cluster"),
}


# Kineto (torch.profiler's engine) prints "USDT: ... profiler_start" and "profiler_stop" to
# stderr at every profiler start and stop, unless its log level, read once when the
# profiler first starts in a process, is above USDT (5). No level hides those lines and
# keeps Kineto's errors (ERROR = 4 sits below USDT); `KINETO_LOG_LEVEL=4 dbo ...` brings
# both back.
KINETO_QUIET_LEVEL = "6"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter,
                    argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written; each option's help ends with its default
    (not for flags, whose default is "off", nor for options without one)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or isinstance(action.default, bool):
            return action.help or ""
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (`prog: message`) and exit code 2."""

    def __init__(self, prog: str, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(prog=prog, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")


def check_out_dir(option: str, path: str) -> None:
    """Reject an output folder that cannot be made or written (ValueError with the fix):
    an existing file, a path under a file, a folder this process cannot write in. Found
    now, not when the job writes its results."""
    if Path(path).exists() and not Path(path).is_dir():
        raise ValueError(f"{option}={path}: that is an existing file, and the results go "
                         f"into a folder: name a folder (it is created if missing)")
    existing = Path(path).absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{option}={path}: {existing} is a file, so no folder can be made "
                         f"under it: name a folder elsewhere")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{option}={path}: this process cannot write in {existing}: name a "
                         f"folder it can write in")


def check_int_option(name: str, value: Any, *, low: int, high: Optional[int] = None,
                     why: str = "") -> None:
    """Reject a job setting `name` (the option `--name-with-dashes`) that is not an int >=
    `low`, or is above `high` (ValueError naming the option and the bound, then `why`:
    what makes the bound)."""
    option = f"--{name.replace('_', '-')}={value!r}"
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{option}: must be an int >= {low}")
    if high is not None and value > high:
        raise ValueError(f"{option}: at most {high}{why}")


#: The largest --seed: torch seeds generators with 64-bit ints, and the commands derive
#: further seeds from it (seed + 1000 + rank, seed * 7 + ...); 32 bits leave room for that.
MAX_SEED = 2**32 - 1


def check_seed(value: Any) -> None:
    """Reject a --seed that is not an int in [0, MAX_SEED] (ValueError with the bound)."""
    check_int_option("seed", value, low=0, high=MAX_SEED,
                     why=" (the seeds derived from it must fit torch's 64-bit generator seeds)")


def check_out_file(option: str, path: str) -> None:
    """Reject an output file that cannot be written: a folder, or a missing parent."""
    if Path(path).is_dir():
        raise ValueError(f"{option}={path}: that is a folder: name a file")
    parent = Path(path).parent
    if not parent.is_dir():
        raise ValueError(f"{option}={path}: folder {parent} does not exist: create it first")


def check_backend_runs(backend: str, world_size: int, config: Any = None) -> None:
    """Raise ImportError or ValueError, in one line with the fix, where MoE backend
    `backend` ("auto" allowed) cannot run on `world_size` ranks here: the backend's own
    `PrepareFinalize.check_runs` (a library it needs, a CUDA device, a group size it
    takes; with `config`, a `MoEConfig`, the shapes and dtype its kernels take). Every
    command calls it before starting ranks."""
    from moe.backends import backend_class

    backend_class(backend, world_size).check_runs(world_size, config)


def check_backend_tokens(backend: str, option: str, max_tokens: int, world_size: int, *,
                         backend_option: str,
                         env: Optional[Mapping[str, str]] = None) -> None:
    """Refuse `max_tokens` per rank (`option`, e.g. "--max-tokens") for MoE backend
    `backend` ("auto" allowed; `backend_option`: how the command names it) on
    `world_size` ranks where the backend says it cannot run them here
    (`PrepareFinalize.check_max_tokens`: deepep_ll's capacity against NVSHMEM's queue
    depth), reading its limits from `env` (None: this process's environment, the CLI
    being the one place that reads it). ValueError in one line with the fix."""
    from moe.backends import backend_class

    env = os.environ if env is None else env
    backend_class(backend, world_size).check_max_tokens(
        max_tokens, world_size, option=option, backend_option=backend_option, env=env)


def check_backend_shape(backend: str, hidden_size: int, dtype: Any, world_size: int) -> None:
    """Refuse rows of `hidden_size` `dtype` (a torch.dtype) values for MoE backend
    `backend` ("auto" allowed) on `world_size` ranks where its kernels cannot move them
    (`PrepareFinalize.check_shape`): ValueError in one line with the fix."""
    from moe.backends import backend_class

    backend_class(backend, world_size).check_shape(hidden_size, dtype, world_size)


def format_bytes(num_bytes: float) -> str:
    """`num_bytes` in the largest binary unit that keeps it >= 1 ("1.5 GiB")."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(num_bytes) < 1024 or unit == "PiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def rank_memory(world_size: int, device_type: Optional[str] = None) -> tuple[int, str]:
    """(bytes, where they come from) that one rank of a `world_size`-rank job started
    here can hold at most: on "cuda" (`device_type`; None: "cuda" where it is available),
    its GPU's memory (one GPU per rank); else this machine's memory shared by the ranks
    on it (all of them, or torchrun's LOCAL_WORLD_SIZE)."""
    import torch

    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        props = torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0")))
        return int(props.total_memory), f"the memory of one {props.name}"
    local = world_size
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    local = max(local, 1)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    # Each rank is a process like this one (Python, torch, the job's imports) before it
    # makes any tensor.
    baseline = process_bytes()
    if total // local <= baseline:
        raise ValueError(f"{local} ranks on this machine's {format_bytes(total)} would get "
                         f"{format_bytes(total // local)} each, no more than the "
                         f"{format_bytes(baseline)} a process of Python and torch takes "
                         f"here: start at most {total // (baseline + 1)} (--world-size)")
    shared = f" over {local} ranks" if local > 1 else ""
    return (total // local - baseline,
            f"this machine's {format_bytes(total)}{shared}, less {format_bytes(baseline)} "
            f"for Python and torch")


def process_bytes() -> int:
    """The resident memory of this process (Linux: /proc/self/statm), what a rank takes
    before it makes a tensor; 0 where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def check_fits_memory(option: str, value: int, *, unit: str, per_unit_bytes: int,
                      model: str, fixed_bytes: int = 0, fixed_what: str = "weights",
                      shape_fix: str = "", world_size: int,
                      device_type: Optional[str] = None) -> None:
    """Refuse, before any rank starts, a job whose one rank would hold more than
    `rank_memory` allows: `fixed_bytes` (its `fixed_what`, e.g. weights) plus
    `per_unit_bytes` for each of the `value` units (`unit`: "token") that `option` asks
    for. Both are lower bounds the caller derives from the tensors of `model` (what the
    job runs, named in the message), so nothing that fits is refused. ValueError naming
    what it would need, what a rank has, and the largest `option` that fits; where not
    even one unit fits, `shape_fix` (what to make smaller). `device_type`: where the
    ranks compute (`rank_memory`)."""
    budget, where = rank_memory(world_size, device_type)
    need = fixed_bytes + value * per_unit_bytes
    if need <= budget:
        return
    has = f"more than the {format_bytes(budget)} a rank has here ({where})"
    fixed = f" + {format_bytes(fixed_bytes)} of {fixed_what}" if fixed_bytes else ""
    fits = (budget - fixed_bytes) // per_unit_bytes
    if fits < 1:
        raise ValueError(f"{model} would need about {format_bytes(fixed_bytes + per_unit_bytes)} "
                         f"per rank at a single {unit} ({format_bytes(per_unit_bytes)} per "
                         f"{unit}{fixed}), {has}: {shape_fix}")
    raise ValueError(f"{option}={value}: {model} would need about {format_bytes(need)} per "
                     f"rank ({format_bytes(per_unit_bytes)} per {unit}{fixed}), {has}: use "
                     f"{option} <= {fits}")


def check_graph_backends(backends: Sequence[str], capturable: Sequence[str], *,
                         option: str, hint: str = "") -> None:
    """Refuse, for `--cuda-graph`, the first of `backends` not in `capturable` (it reads
    device values on the host): ValueError naming it as `option` does ("--backend=" or
    "--backends ") and the capturable ones, then `hint` (e.g. what "auto" picks)."""
    for backend in backends:
        if backend not in capturable:
            raise ValueError(f"--cuda-graph with {option}{backend}: that backend reads device "
                             f"values on the host, which a CUDA graph cannot; use one of "
                             f"{', '.join(capturable)}{hint}")


def quiet_profiler_logs() -> None:
    """Hide Kineto's "USDT ... profiler_start/stop" lines in this process and in the
    ranks it starts, unless the user set KINETO_LOG_LEVEL."""
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET_LEVEL)


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
        from dbo import TraceConfig, configure
        configure(TraceConfig(nvtx=True))
    quiet_profiler_logs()
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)

