"""NVSHMEM's one owner per process: backend `symm_mem` or DeepEP's low-latency buffers,
never both.

NVSHMEM is set up once per process, by its first user. DeepEP's low-latency `Buffer`
(`deepep_ll`, and `deepep_raw_ll`, the yardstick of `dbo bench-comm`) sets NVSHMEM's IBGDA
settings (NVSHMEM_IBGDA_NUM_RC_PER_PE = num_qps_per_rank, ...) before it starts NVSHMEM.
Where `symm_mem` has made its symmetric buffers first (torch's symmetric memory starts
NVSHMEM), those settings do not take effect, and DeepEP's first low-latency kernel aborts
every rank (`internode_ll.cu`: `num_rc_per_pe >= num_local_experts`). The other order is
untested. So each of them claims NVSHMEM (`claim_nvshmem`) just before it would set it
up, and a claim by the other kind raises RuntimeError naming both and the fix; commands
that run several backends in one process refuse such a list before any rank starts
(`check_one_process`).

The record and the rule live here, importing nothing, so that both sides can reach them
without importing each other: `moe.backends.symm_mem_support` (`SymmBuffers.allocate`),
`moe.backends.deepep_support` (`shared_buffer`, mode "ll") and `moe.bench.comm_raw` make
the claims.
"""
from __future__ import annotations

from typing import Sequence

SYMM_MEM = "symm_mem"
#: Backends that make DeepEP low-latency buffers.
LL_BUFFER_BACKENDS: tuple[str, ...] = ("deepep_ll", "deepep_raw_ll")

# The backends that have set NVSHMEM up in this process (or begun to), in order: `symm_mem`
# or low-latency ones, never both. Never emptied: NVSHMEM keeps the set-up of its first
# user until the process ends.
_CLAIMS: list[str] = []


def nvshmem_users() -> tuple[str, ...]:
    """The backends that have claimed NVSHMEM in this process, in order."""
    return tuple(_CLAIMS)


def symm_mem_started_nvshmem() -> bool:
    """Whether backend `symm_mem` has made symmetric buffers in this process (started
    NVSHMEM through torch's symmetric memory): then no DeepEP low-latency buffer may be
    made here."""
    return SYMM_MEM in _CLAIMS


def claim_nvshmem(backend: str) -> None:
    """Call just before `backend` (`symm_mem`, or one of `LL_BUFFER_BACKENDS`) sets NVSHMEM
    up: RuntimeError, in one line with the fix, where the other kind has done so in this
    process; otherwise recorded."""
    assert backend == SYMM_MEM or backend in LL_BUFFER_BACKENDS, backend
    other = [b for b in _CLAIMS if (b == SYMM_MEM) != (backend == SYMM_MEM)]
    if other:
        raise RuntimeError(_clash(first=other[0], then=backend))
    if backend not in _CLAIMS:
        _CLAIMS.append(backend)


def _clash(*, first: str, then: str) -> str:
    if first == SYMM_MEM:
        what = (f"backend {then!r} would make a DeepEP low-latency buffer in a process where "
                f"backend 'symm_mem' has started NVSHMEM (torch symmetric memory): DeepEP's "
                f"IBGDA settings (NVSHMEM_IBGDA_NUM_RC_PER_PE) then do not take effect, and "
                f"its first low-latency kernel would abort the process")
    else:
        what = (f"backend 'symm_mem' would start NVSHMEM (torch symmetric memory) in a "
                f"process where backend {first!r} has made a DeepEP low-latency buffer, which "
                f"set NVSHMEM up its own way (the other order aborts the process; this one "
                f"is untested)")
    return (f"{what}; run {first} and {then} in separate processes (separate runs, e.g. "
            f"--backends {first}, then --backends {then})")


def check_one_process(backends: Sequence[str]) -> None:
    """ValueError, in one line with the fix, where `backends` (run one after another in
    one process, as `dbo bench` and `dbo bench-comm` run theirs) hold `symm_mem` and a
    backend that makes DeepEP low-latency buffers."""
    low_latency = [b for b in backends if b in LL_BUFFER_BACKENDS]
    if SYMM_MEM not in backends or not low_latency:
        return
    rest = [b for b in backends if b not in low_latency]
    raise ValueError(f"--backends {','.join(backends)}: symm_mem cannot run in one process "
                     f"with {', '.join(low_latency)} (once symm_mem's torch symmetric memory "
                     f"has started NVSHMEM, DeepEP's low-latency kernels abort it: their "
                     f"NVSHMEM settings do not take effect); time them in separate runs: "
                     f"--backends {','.join(rest)}, then --backends {','.join(low_latency)}")
