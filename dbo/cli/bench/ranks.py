"""Ranks of a `dbo bench` run: how many, spawning them on this host (outside torchrun),
and one rank's life (its process group, the measurement, rank 0's report). Shared by
the modes (`dbo.cli.bench.launch`) and `--hf` (`dbo.cli.bench.hf_launch`)."""
from __future__ import annotations

import os
import sys
import traceback
import warnings
from datetime import timedelta
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist

from dbo.cli.launch import end_process_group


def world_size_of(world_size: Optional[int], device: str, env: Mapping[str, str]) -> int:
    """The ranks this run will have: torchrun's, else `world_size` (default 2), on
    `device` ("cpu" or "cuda"). ValueError (with the fix) for a size that cannot run here."""
    if world_size is not None and world_size < 1:
        raise ValueError(f"--world-size={world_size}: must be >= 1")
    if "RANK" in env and "WORLD_SIZE" in env:
        started = int(env["WORLD_SIZE"])
        if world_size is not None and world_size != started:
            raise ValueError(f"--world-size={world_size} but torchrun started {started} "
                             f"ranks: drop --world-size under torchrun")
        return started
    world = world_size if world_size is not None else 2
    if device == "cuda" and world > torch.cuda.device_count():
        raise ValueError(f"--world-size={world} needs {world} GPUs, "
                         f"{torch.cuda.device_count()} visible: lower it, or use torchrun "
                         f"on the right machine")
    return world


RankMain = Callable[..., int]
"""`rank_main(cfg, *, rank, world_size, local_rank, init_method) -> exit code`: one rank
of a bench mode (`run_rank`, `dbo.cli.bench.hf_launch.run_hf_rank`); module-level, so
that spawned ranks can unpickle it."""


def spawn_ranks(cfg: Any, world_size: int, rank_main: RankMain) -> int:
    """Start `world_size` ranks of `rank_main` on this host; 0 when all succeed, 1
    otherwise."""
    import torch.multiprocessing as mp

    from dbo.cli.launch import free_port

    try:
        mp.spawn(_spawned_rank, args=(world_size, f"tcp://127.0.0.1:{free_port()}", cfg,
                                      rank_main),
                 nprocs=world_size, join=True)
    except Exception as exc:  # noqa: BLE001 - a rank failed: its traceback is in exc
        print(f"[dbo bench] a rank failed:\n{exc}", file=sys.stderr)
        return 1
    return 0


def _spawned_rank(rank: int, world_size: int, init_method: str, cfg: Any,
                  rank_main: RankMain) -> None:
    code = rank_main(cfg, rank=rank, world_size=world_size, local_rank=rank,
                     init_method=init_method)
    if code != 0:
        raise SystemExit(code)
    # Done and flushed: skip the interpreter's teardown of torch, which takes seconds on
    # small hosts and has nothing left to write. Failures above exit normally.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def measure_on_rank(device_kind: str, *, rank: int, world_size: int, local_rank: int,
                    init_method: str, measure: Callable[[Any, torch.device], Any],
                    report: Any) -> int:
    """Init this rank's process group on `device_kind` ("cpu": gloo, "cuda": NCCL), run
    `measure(group, device)` on every rank, and on rank 0 write and print its result with
    `report` (a module with `write_outputs`, `format_table`, `final_line`)."""
    # torch deprecates the *_tensor collectives the backends call; not the bench's business.
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r".*is deprecated\. Please use .*")
    if device_kind == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=init_method, rank=rank,
                                world_size=world_size, device_id=device,
                                timeout=timedelta(minutes=10))
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, min(4, (os.cpu_count() or 1) // world_size)))
        dist.init_process_group("gloo", init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timedelta(minutes=5))
    clean = False
    try:
        result = measure(dist.group.WORLD, device)
        if rank == 0:
            files = report.write_outputs(result)
            print(report.format_table(result), flush=True)
            print(report.final_line(result, files), flush=True)
        dist.barrier()
        clean = True
    except Exception:
        traceback.print_exc()
        raise
    finally:
        end_process_group(clean=clean)
    return 0


def resolve_device(choice: str) -> str:
    """`--device` as "cpu" or "cuda" ("auto": CUDA where available); ValueError with the
    fix for "cuda" without CUDA."""
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but CUDA is not available here: use --device cpu")
    return choice


def p2p_disabled(env: Mapping[str, str]) -> bool:
    """Whether NCCL_P2P_DISABLE is set (the scale-out emulated regime)."""
    return env.get("NCCL_P2P_DISABLE", "").strip() not in ("", "0")
