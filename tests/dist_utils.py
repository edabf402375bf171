"""Launch a function on several processes (gloo on CPU, NCCL on GPU) for tests.

`run_distributed(world_size, fn, *args)` starts `world_size` processes, each calling
`fn(rank, world_size, *args)` inside an initialised default process group (collective
timeout `init_timeout_s`), and returns the list of their return values (rank order). A
failure on any rank raises here with that rank's traceback. `fn` must be a module-level
function (it is pickled by name). gloo ranks fork from a server process that has imported
torch (and transformers, where installed) once (`_context`), so a test pays ~0.05 s per
process group instead of ~1.5 s (~3 s with transformers).
The ranks see the environment of the test process as it was when the server started
(the first `run_distributed` of the session), not later changes to it, and write to the
server's stdout/stderr: a rank reports through its return value or its traceback.
"""
from __future__ import annotations

import os
import queue as queue_mod
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dbo.cli.launch import free_port


def _worker(rank: int, world_size: int, port: int, backend: str, init_timeout_s: float,
            fn: Callable[..., Any], args: tuple, queue: Any) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=init_timeout_s))
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# transformers' model and generation code (~1.3 s of imports per rank otherwise, in every
# rank of the Hugging Face tests). Without transformers the server skips them: it ignores
# a preload that raises ImportError.
_TRANSFORMERS = ("transformers.modeling_utils", "transformers.generation.utils",
                 "transformers.models.auto.modeling_auto")


def _context(backend: str) -> Any:
    """gloo: ranks fork from one server process that has imported torch, dbo and moe
    already, so a rank starts in a fraction of a second instead of re-importing torch
    (~1.5 s of CPU per rank). The server is single-threaded (nothing ran there but
    imports), so forking it is safe where forking the test process (Triton, OpenMP
    pools) is not. NCCL: spawned ranks, as CUDA cannot be used in a process forked from
    one where an import may have touched the driver."""
    if backend == "nccl":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "dbo", "moe.layer", "pytest",
                                "tests.dist_utils", *_TRANSFORMERS])
    return ctx


def run_distributed(world_size: int, fn: Callable[..., Any], *args: Any,
                    backend: str = "gloo", timeout_s: float = 240.0,
                    init_timeout_s: float = 120.0) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` new ranks; return results."""
    ctx = _context(backend)
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker,
                         args=(r, world_size, port, backend, init_timeout_s, fn, args, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    deadline = time.monotonic() + timeout_s
    while len(results) < world_size and not failures:
        try:
            rank, ok, payload = queue.get(timeout=0.5)
        except queue_mod.Empty:
            dead = [r for r, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and r not in results]
            if dead:
                failures.append(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
            elif time.monotonic() > deadline:
                failures.append(f"timed out after {timeout_s:.0f} s waiting for ranks "
                                f"{sorted(set(range(world_size)) - set(results))}")
            continue
        if ok:
            results[rank] = payload
        else:
            # The other ranks may now hang in a collective: they are stopped below.
            failures.append(f"rank {rank} failed:\n{payload}")
    for p in procs:
        p.join(timeout=timeout_s if not failures else 5)
        if p.is_alive():
            p.kill()
            p.join()
    if failures:
        raise RuntimeError("\n".join(failures))
    return [results[r] for r in range(world_size)]
