"""What the backends built on NCCL's device API (`deepep_v2`, `nccl_ep`) ask of the NCCL
torch runs: which version is loaded, and a started communicator to build on.

Both libraries need a newer NCCL than torch may ship with, and both reuse the NCCL
communicator of torch's process group (`_comm_ptr()` of its NCCL backend), which a lazily
started group has not made until its first collective.
"""
from __future__ import annotations

import ctypes
import os
from typing import Optional

import torch
import torch.distributed as dist


def decode_nccl_code(code: int) -> tuple[int, int, int]:
    """NCCL's version integer as (major, minor, patch): 23007 is 2.30.7 (NCCL >= 2.9
    encodes major * 10000 + minor * 100 + patch)."""
    return (code // 10000, code // 100 % 100, code % 100)


def loaded_nccl_version() -> Optional[tuple[int, ...]]:
    """The NCCL this process has loaded (`ncclGetVersion` of the `libnccl.so.2` already in
    memory), or None where none is loaded or it cannot be asked. This is the one that
    runs: a newer NCCL put in with `LD_PRELOAD` (or a newer `nvidia-nccl` package) is not
    what `torch.cuda.nccl.version()` reports, which is the version torch was built with."""
    try:
        lib = ctypes.CDLL("libnccl.so.2", mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)
        code = ctypes.c_int(0)
        if lib.ncclGetVersion(ctypes.byref(code)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return decode_nccl_code(code.value)


def torch_nccl_version() -> Optional[tuple[int, ...]]:
    """The NCCL this process runs: the loaded library's own version where torch's CUDA
    libraries have loaded one, else the version torch was built with (as
    (major, minor, patch)); None where torch has no NCCL."""
    try:
        built = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):  # a build without NCCL
        return None
    loaded = loaded_nccl_version()
    if loaded is not None:
        return loaded
    if isinstance(built, int):  # older torch: 2.28.9 as 22809
        return decode_nccl_code(built)
    return tuple(built)


def group_live(group: Optional[dist.ProcessGroup]) -> bool:
    """Whether `group` is still registered with torch (the test `dbo.groups` uses)."""
    return group is None or group in dist.distributed_c10d._world.pg_map


def start_nccl_comm(group: Optional[dist.ProcessGroup]) -> None:
    """Make torch create `group`'s NCCL communicator now, with one tiny all-reduce, where it
    has not yet: DeepEP v2 and NCCL EP reuse it through the group's `_comm_ptr()`, which
    is a null pointer until the first collective of a lazily started group, and building
    on that crashes the process (seen on an H200 with NCCL 2.30.7). A no-op for a group
    that is not NCCL's (the tests' fakes run on gloo)."""
    if group is None or dist.get_backend(group) != "nccl":
        return
    one = torch.ones(1, device=torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(one, group=group)
    torch.cuda.synchronize()


def nccl_comm_ptr(group: dist.ProcessGroup) -> int:
    """The address of `group`'s NCCL communicator (started first, `start_nccl_comm`)."""
    start_nccl_comm(group)
    return int(group._get_backend(torch.device("cuda"))._comm_ptr())
