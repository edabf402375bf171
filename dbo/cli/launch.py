"""Start the ranks of a job: under torchrun, on every local GPU, or as CPU gloo ranks.

    results = launch(worker, job_config, world_size=None)

`worker(ctx: RankContext, job_config) -> result` runs once per rank inside an initialised
default process group; `launch` returns rank 0's result on rank 0 (None elsewhere under
torchrun). How the ranks start:
- under `torchrun` (RANK/WORLD_SIZE set): this process is one rank; NCCL when CUDA is
  available (device = LOCAL_RANK), else gloo.
- else with CUDA: one spawned process per GPU (or `world_size` of them), NCCL.
- else: `world_size` (default 2) spawned CPU processes over gloo.
"""
from __future__ import annotations

import gc
import os
import queue as queue_mod
import socket
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dbo import destroy_group
from moe.bench.timing import barrier

DEFAULT_CPU_RANKS = 2


@dataclass(frozen=True)
class RankContext:
    """Who this rank is and where it computes."""

    rank: int
    world_size: int
    device: torch.device
    backend: str

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        """The EP group (all ranks), or None for a single rank."""
        return dist.group.WORLD if self.world_size > 1 else None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


Worker = Callable[[RankContext, Any], Any]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def resolve_world_size(world_size: Optional[int] = None) -> int:
    """The number of ranks `launch(..., world_size=world_size)` runs: torchrun's, else
    `world_size` or every visible GPU, else `world_size` or 2 CPU ranks. Call it before
    launching to check a job against its group size. ValueError (with the fix) for a size
    that cannot start here."""
    if world_size is not None and (isinstance(world_size, bool) or world_size < 1):
        raise ValueError(f"--world-size={world_size}: must be >= 1")
    if under_torchrun():
        started = int(os.environ["WORLD_SIZE"])
        if world_size is not None and world_size != started:
            raise ValueError(f"--world-size={world_size} but torchrun started {started} "
                             f"ranks: drop --world-size under torchrun")
        return started
    if torch.cuda.is_available():
        available = torch.cuda.device_count()
        if world_size is not None and world_size > available:
            raise ValueError(f"--world-size={world_size} but only {available} GPUs are "
                             f"visible: use at most {available}")
        return world_size or available
    return world_size or DEFAULT_CPU_RANKS


def launch(worker: Worker, job: Any, *, world_size: Optional[int] = None,
           timeout_s: float = 1800.0) -> Any:
    """Run `worker(ctx, job)` on every rank; return rank 0's result (on rank 0)."""
    world_size = resolve_world_size(world_size)
    if under_torchrun():
        return _run_rank(int(os.environ["RANK"]), world_size,
                         int(os.environ.get("LOCAL_RANK", os.environ["RANK"])), worker, job,
                         init_env=False)
    if world_size == 1:  # in this process: its rendezvous variables are put back after
        saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
        try:
            return _run_rank(0, 1, 0, worker, job, init_env=True, port=free_port())
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    return _spawn(world_size, worker, job, timeout_s)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_rank(rank: int, world_size: int, local_rank: int, worker: Worker, job: Any, *,
              init_env: bool, port: int = 0) -> Any:
    if init_env:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    kwargs = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=timedelta(minutes=10), **kwargs)
    clean = False
    try:
        result = worker(RankContext(rank, world_size, device, backend), job)
        clean = True
        return result
    finally:
        end_process_group(clean=clean)


def end_process_group(*, clean: bool) -> None:
    """Tear down the default group after a rank's last collective. On a clean finish every
    rank gets here: free what the steps left (CUDA graphs that replay kernels into
    DeepEP's or NVSHMEM's memory, models), then run the teardowns registered for the
    group (DeepEP buffers, collective) through `dbo.destroy_group`. A process that left
    them to interpreter exit was seen to segfault there (4 ranks, graphed deepep_ll).
    After an error only torch's local teardown runs: a peer may be gone."""
    if not clean:
        dist.destroy_process_group()
        return
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    destroy_group(dist.group.WORLD)


def _spawned(rank: int, world_size: int, port: int, worker: Worker, job: Any, results: Any) -> None:
    try:
        if not torch.cuda.is_available():
            torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
        out = _run_rank(rank, world_size, rank, worker, job, init_env=True, port=port)
        results.put((rank, True, out if rank == 0 else None))
    except BaseException:  # noqa: BLE001 - sent to the parent with its traceback
        results.put((rank, False, traceback.format_exc()))


def _spawn(world_size: int, worker: Worker, job: Any, timeout_s: float) -> Any:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_spawned, args=(r, world_size, port, worker, job, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    done: dict[int, Any] = {}
    error: Optional[str] = None
    try:
        while len(done) < world_size and error is None:
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    error = f"rank {dead[0]} exited with code {procs[dead[0]].exitcode}"
                continue
            if ok:
                done[rank] = payload
            else:
                error = f"rank {rank} failed:\n{payload}"
    finally:
        for p in procs:
            p.join(timeout=timeout_s if error is None else 5)
            if p.is_alive():
                p.kill()
    if error is not None:
        raise RuntimeError(error)
    return done[0]


def align_ranks(ctx: RankContext) -> None:
    """Wait for this rank's queued device work, then for every rank of the group (a
    barrier), then for the barrier's own kernel: on return, every rank is idle and at the
    same point."""
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    barrier(ctx.group, ctx.device)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
