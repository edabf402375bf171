"""Fused MoE expert GEMMs in Triton, host side: gathered rows x per-expert weights.

    GEMM1: act[r] = silu(x[r // K] @ gate_e^T) * (x[r // K] @ up_e^T)
    GEMM2: y[r]   = topk_weight[r] * (act[r] @ w2_e^T)
    then   out[n] = sum over k with id[n, k] >= 0 of y[n*K + k]
                    (`sum_routed_rows`, fp32 accumulation, k in order)

where r = n*K + k is a flat routed row and e = topk_ids[n, k] (dbo's default expert; an
expert form changes the epilogues and, with a post-expert norm, the sum: `form`).
`fused_moe` aligns the routing into expert-sorted, padded row blocks (`align_triton`)
and queues the two GEMMs (`gemm_triton.fused_moe_kernel`, or the persistent schedule of
`persistent_triton`; tiles and autotuners in `tiles`) and the k-sum. GEMM1 writes act
in the sorted order ([P, I]), so GEMM2 reads contiguous row blocks. Every output row is
written by exactly one program and the k-sum adds in a fixed order: the result is
deterministic (no atomics). Rows of ids routed to other ranks (-1) are neither
computed, written nor read: under expert parallelism they are half or more of the rows.
(Module names without a package are this package's, `moe.kernels.fused_moe`.)

Per GEMM the host picks, where the `KernelPolicy` leaves the choice open (`rules`,
applied by `rules.choose_paths`; the timings behind each rule are in `KERNELS.md`):
- the load path: pointer loads, or TMA (tensor descriptors, Hopper and newer) for the
  weight tiles and for A when A is in the sorted order; GEMM1 gathers x rows by pointer,
  or reads x copied into the sorted order first (`gather_rows`), which pays only when x
  is much larger than L2 and GEMM1 runs one program per tile;
- the tile heights (`rules.gemm_tiles`, `GemmTiles`): on 128-row blocks GEMM1 may
  run 64-row tiles, GEMM2 half-height tiles for half-used last blocks (`HALF_TAIL`) and
  lets a last block of at most 32 rows ride on the block before it (`TAIL_M`);
- the schedule: one program per tile, or for large batches where no other stream's
  kernels share the SMs (the caller's `sms_shared`) one program per SM over a table of
  the used tiles (`rules.prefer_persistent`).

Legend: N tokens, K top-k, H hidden, I intermediate, E local experts, R = N*K routed
rows, P padded rows. Inside the kernels M/N/K are the GEMM's own sizes.

Import this module only after TRITON_INTERPRET is settled: it imports the kernels.
Nothing is compiled or launched at import.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton

from moe.kernels.fused_moe import rules
from moe.kernels.fused_moe.align import AlignedRouting
from moe.kernels.fused_moe.align_triton import align_routing_triton
from moe.kernels.fused_moe.form import GemmEpilogue, KernelExtras, epilogues, gemm_role
from moe.kernels.fused_moe.gemm_triton import fused_moe_kernel, gather_rows_kernel
from moe.kernels.fused_moe.persistent_triton import fused_moe_persistent_kernel
from moe.kernels.fused_moe.rules import GemmTiles
from moe.kernels.fused_moe.tiles import (INTERPRETER_PERSISTENT_TILE, INTERPRETER_PROGRAMS,
                                         INTERPRETER_TILE, persistent_launcher,
                                         tuned_launcher)
from moe.kernels.launch import FastLauncher, cdiv, next_power_of_2
from moe.kernels.policy import KernelPolicy
from moe.kernels.rows_triton import launch_sum_rows
from moe.kernels.topk_sum import weighted_topk_sum
from moe.workspace import Workspace, empty_from


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def tma_unsupported_reason(*tensors: torch.Tensor) -> str | None:
    """None when tensor-descriptor (TMA) loads can read these operands, else why not.

    TMA needs a Hopper-class GPU (compute capability 9.0 or newer; on CPU the interpreter
    emulates it), 16-bit data, 16-byte aligned base pointers and row strides, and
    expert weights that are contiguous (the kernel views [E, rows, K] as [E*rows, K]).
    """
    device = tensors[0].device
    if device.type == "cuda":
        capability = _capability(device.index)
        if capability < (9, 0):
            return f"TMA needs compute capability 9.0 or newer, {device} has {capability}"
    for t in tensors:
        if t.dtype not in (torch.bfloat16, torch.float16):
            return f"TMA loads are used for 16-bit data only, got {t.dtype}"
        if t.data_ptr() % 16 or any((s * t.element_size()) % 16 for s in t.stride()[:-1]):
            return f"a {tuple(t.shape)} operand is not 16-byte aligned (pointer or row stride)"
        if t.dim() == 3 and not t.is_contiguous():
            return "expert weights are not contiguous: call .contiguous() on w13 / w2 once"
    return None


def fused_moe(
    x_NH: torch.Tensor,
    w13_EIH: torch.Tensor,
    w2_EHI: torch.Tensor,
    topk_ids_NK: torch.Tensor,
    topk_weights_NK: torch.Tensor,
    *,
    workspace: Workspace | None = None,
    block_m: int | None = None,
    policy: KernelPolicy = KernelPolicy(),
    extras: KernelExtras | None = None,
    sms_shared: bool = False,
) -> torch.Tensor:
    """Routed expert MLPs: out[n] = sum_k w[n,k] * W2_e(silu(gate_e x[n]) * up_e x[n]),
    or the expert of `extras`' form (`moe.kernels.fused_moe.form`; `extras` is read
    through the fields `form.KernelExtras` names).

    Args:
        x_NH: [N, H] activations, bf16/fp16/fp32, last dim contiguous.
        w13_EIH: [E, 2I, H] gate rows then up rows, x's dtype, last dim contiguous.
        w2_EHI: [E, H, I], x's dtype, last dim contiguous.
        topk_ids_NK: int64 [N, K] local expert ids in [0, E) or -1 (no contribution); not
            range-checked (that would sync).
        topk_weights_NK: float32 [N, K] routing weights.
        workspace: source of the intermediates (routing, [P, I] activation, [R, H] rows,
            which share memory with the [P, H] sorted x); fresh allocations when None.
            The returned tensor is always a fresh allocation.
        block_m: rows per block; `rules.choose_block_m` when None (tests pin it).
        policy: the load paths, sorted x, persistent kernel (None fields: the host's
            rules, per GEMM) and compiled-handle launches; see `KernelPolicy`. A True
            `tma` or `persistent` raises ValueError where TMA cannot load the operands
            (on CPU the interpreter emulates it, for tests); `sorted_x` needs GEMM1 on TMA.
        extras: the experts' form and its tensors; None: dbo's SwiGLU expert. The biases
            and activation run in the GEMMs' epilogues; with a post-expert norm GEMM2
            writes unweighted fp32 rows, the norm runs on them in torch, then the
            weighted k-sum (`weighted_topk_sum`). ValueError for a "custom" activation.
        sms_shared: the caller runs other streams' kernels beside this call (a DBO step,
            the bench's overlapped probes): no persistent GEMM, whatever `policy` says
            (`rules.choose_paths`).

    Returns:
        [N, H] in x's dtype on x's device, valid on the current stream. GEMMs accumulate in
        fp32; each weighted row is rounded to x's dtype once and the k-sum accumulates in
        fp32. fp32 inputs use TF32 tensor cores on the GPU only when
        `torch.backends.cuda.matmul.allow_tf32` is set, like torch's own matmul.
    """
    epi1, epi2 = epilogues(extras.form) if extras is not None else (None, None)
    _check(x_NH, w13_EIH, w2_EHI, topk_ids_NK, topk_weights_NK, extras)
    num_tokens, hidden = x_NH.shape
    num_experts, inter = w13_EIH.shape[0], w2_EHI.shape[2]
    bias1 = bias2 = post_norm = None
    if extras is not None:
        bias1, bias2, post_norm = extras.bias13_EJ, extras.bias2_EH, extras.post_norm
    top_k = topk_ids_NK.shape[1]
    num_routed = num_tokens * top_k
    device, dtype = x_NH.device, x_NH.dtype
    if num_routed == 0:
        return torch.zeros(num_tokens, hidden, dtype=dtype, device=device)

    compiled = policy.compiled_launches
    paths = rules.choose_paths(policy, x_NH, num_experts=num_experts, inter=inter,
                               num_routed=num_routed, block_m=block_m,
                               tma_reason=tma_unsupported_reason(w13_EIH, w2_EHI, x_NH),
                               sms_shared=sms_shared)
    block_m, tma1, tma2, sorted_x = paths.block_m, paths.tma1, paths.tma2, paths.sorted_x
    persist1, persist2 = paths.persistent1, paths.persistent2
    rows_per_expert = num_routed / num_experts
    routing = align_routing_triton(topk_ids_NK, num_experts, block_m, workspace=workspace,
                                   compiled=compiled)
    max_rows = routing.sorted_ids_P.numel()
    act_PI = empty_from(workspace, "triton.act", (max_rows, inter), dtype, device)

    a_x = x_NH
    if sorted_x:
        a_x = empty_from(workspace, "triton.rows", (max_rows, hidden), dtype, device)
        gather_rows(x_NH, a_x, routing, rows_div=top_k, compiled=compiled)
    weights2 = topk_weights_NK
    if post_norm is not None:  # unweighted fp32 rows; dropped ones stay 0 for the norm
        y_RH, weights2 = torch.zeros(num_routed, hidden, device=device), None
    elif sorted_x:
        # The sorted x is dead once GEMM1 has run (same stream), so GEMM2's rows reuse it.
        y_RH = a_x[:num_routed]
    else:
        y_RH = empty_from(workspace, "triton.rows", (num_routed, hidden), dtype, device)
    form1 = dict(epilogue=epi1, bias=bias1)
    form2 = dict(epilogue=epi2, bias=bias2)
    tiles1 = rules.gemm_tiles(block_m, gated=True, rows_per_expert=rows_per_expert)
    tiles2 = rules.gemm_tiles(block_m, gated=False, rows_per_expert=rows_per_expert)
    half_tail = block_m >= 32  # half tiles of at least 16 rows (tl.dot's minimum)
    if persist1:
        launch_persistent(a_x, w13_EIH, act_PI, None, routing, n=inter, k=hidden,
                          a_rows_div=top_k, a_sorted=sorted_x, half_tail=half_tail,
                          compiled=compiled, **form1)
    else:
        _launch(kernel_launch(a_x, w13_EIH, act_PI, None, routing, n=inter, k=hidden,
                              a_rows_div=top_k, a_sorted=sorted_x, tma=tma1,
                              tiles=tiles1, **form1), compiled=compiled)
    if persist2:
        launch_persistent(act_PI, w2_EHI, y_RH, weights2, routing, n=hidden, k=inter,
                          a_rows_div=1, a_sorted=True, half_tail=half_tail, compiled=compiled,
                          **form2)
    else:
        _launch(kernel_launch(act_PI, w2_EHI, y_RH, weights2, routing, n=hidden,
                              k=inter, a_rows_div=1, a_sorted=True, tma=tma2, tiles=tiles2,
                              **form2), compiled=compiled)
    if post_norm is not None:
        return weighted_topk_sum(post_norm(y_RH).float(), topk_ids_NK, topk_weights_NK,
                                 out_dtype=dtype)

    out_NH = torch.empty(num_tokens, hidden, dtype=dtype, device=device)
    sum_routed_rows(y_RH, topk_ids_NK, out_NH, compiled=compiled)
    return out_NH


def sum_routed_rows(y_RH: torch.Tensor, topk_ids_NK: torch.Tensor, out_NH: torch.Tensor, *,
                    compiled: bool = True) -> None:
    """out[n] = sum over the k with ids[n, k] >= 0 of y[n*K + k] (fp32, k in order); the
    rows of ids -1 are never read (GEMM2 does not write them)."""
    launch_sum_rows(y_RH, topk_ids_NK, out_NH, sel_is_row=False, compiled=compiled)


_GATHER = FastLauncher(gather_rows_kernel)
_GATHER_ROWS = 16  # divides every BLOCK_M (>= 16)
_GATHER_COLS = 512


def gather_rows(src_NH: torch.Tensor, dst_PH: torch.Tensor, routing: AlignedRouting, *,
                rows_div: int, compiled: bool = True) -> None:
    """dst[p] = src[sorted_ids[p] // rows_div] for the used rows; zeros for padding rows."""
    hidden = src_NH.shape[1]
    grid = (dst_PH.shape[0] // _GATHER_ROWS, cdiv(hidden, _GATHER_COLS))
    _GATHER(
        grid,
        src_NH, dst_PH, routing.sorted_ids_P, routing.num_padded_rows, routing.num_routed,
        hidden, src_NH.stride(0), dst_PH.stride(0),
        ROWS_DIV=rows_div, BLOCK_R=_GATHER_ROWS, BLOCK_H=_GATHER_COLS, compiled=compiled,
    )


@dataclass(frozen=True)
class KernelLaunch:
    """Everything but the tile of one `fused_moe_kernel` launch: positional args, the
    constexpr flags, and the routing's row count (the grid is rows x output columns)."""

    args: tuple[Any, ...]
    flags: dict[str, Any]
    max_rows: int
    n: int
    k: int

    def grid(self, block_n: int) -> tuple[int]:
        return (cdiv(self.max_rows, self.flags["BLOCK_M"]) * cdiv(self.n, block_n),)

    def tune_key(self) -> tuple[Any, ...]:
        """Determines the autotuner's key (`_tuned_kernel`): the flags, the GEMM's sizes,
        the row count (finer than its power-of-two bucket) and the operands' dtypes."""
        a, b, c = self.args[:3]
        return (tuple(self.flags.values()), self.n, self.k, self.max_rows, a.dtype, b.dtype,
                c.dtype)


def kernel_launch(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    weights_NK: torch.Tensor | None,
    routing: AlignedRouting,
    *,
    n: int,
    k: int,
    a_rows_div: int,
    a_sorted: bool,
    tma: bool,
    tiles: GemmTiles = GemmTiles(),
    epilogue: GemmEpilogue | None = None,
    bias: torch.Tensor | None = None,
) -> KernelLaunch:
    """The launch of one GEMM of the pair: GEMM1 (`epilogue.first`, writes the sorted
    [P, N] activation) or GEMM2 (writes rows by routed id, none for dropped ids), weighted
    by `weights_NK` when given (float32 [N, K] with a unit last stride, maybe a view into
    packed rows). `epilogue` None: dbo's default GEMM1 (gated) when `weights_NK` is None,
    else its GEMM2 (`moe.kernels.fused_moe.form.gemm_role`); `bias`: the form's [E, rows]
    biases. `a_sorted`: A is [P, K] in the sorted row order. `tiles`: see `GemmTiles`."""
    tile_m = tiles.rows or routing.block_m
    half_tail, tail_m = tiles.half_tail, tiles.tail_rows
    if routing.block_m % tile_m or (half_tail and tile_m < 32):
        raise ValueError(f"{tiles}: tiles must divide the routing's {routing.block_m}-row "
                         "blocks, and half tiles need >= 32 rows")
    role = gemm_role(a, c, weights_NK, a_rows_div=a_rows_div, a_sorted=a_sorted,
                     epilogue=epilogue, bias=bias)
    if tail_m and (role.flags["C_SORTED"] or tile_m != routing.block_m or tail_m < 16
                   or tail_m > tile_m // 2 or tail_m & (tail_m - 1)):
        raise ValueError(f"{tiles} on {routing.block_m}-row blocks: tails are for GEMM2 on "
                         "whole-block tiles, a power of two from 16 to half the block")
    max_rows = routing.sorted_ids_P.numel()
    args = (
        a, b, c, role.weights, role.bias,
        routing.sorted_ids_P, routing.block_expert_ids_B, routing.num_padded_rows,
        n, k, routing.num_routed, max_rows, next_power_of_2(max(max_rows, 1)),
        b.shape[0], role.weights_top_k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        role.stride_wn,
    )
    flags = {
        **role.flags,
        "USE_TMA": tma,
        "HALF_TAIL": half_tail,
        "TAIL_M": tail_m,
        "ROUTE_BLOCK_M": routing.block_m,
        "BLOCK_M": tile_m,
    }
    return KernelLaunch(args=args, flags=flags, max_rows=max_rows, n=n, k=k)


def _launch(launch: KernelLaunch, *, compiled: bool = True) -> None:
    """Queue one GEMM of the pair on the current stream (autotuned tile on the GPU;
    `compiled`: through the compiled handle)."""
    if launch.args[0].device.type == "cpu":  # TRITON_INTERPRET=1
        meta = INTERPRETER_TILE
        fused_moe_kernel[launch.grid(meta["BLOCK_N"])](*launch.args, **launch.flags, **meta)
        return
    if launch.flags["USE_TMA"]:
        use_tma_scratch()
    tuned_launcher()(launch.tune_key(), lambda meta: launch.grid(meta["BLOCK_N"]),
                      *launch.args, compiled=compiled, **launch.flags)


def _check(
    x_NH: torch.Tensor,
    w13_EIH: torch.Tensor,
    w2_EHI: torch.Tensor,
    topk_ids_NK: torch.Tensor,
    topk_weights_NK: torch.Tensor,
    extras: KernelExtras | None,
) -> None:
    """What the kernels need beyond the `Experts.apply` contract (which the caller checks:
    `moe.experts.triton.TritonExperts`): the biases on x's device and unit-stride last
    dims (other strides would be correct but silently slow: the tiles are loaded along
    the last dim)."""
    for name in ("bias13_EJ", "bias2_EH"):
        bias = getattr(extras, name, None)
        if bias is not None and bias.device != x_NH.device:
            raise ValueError(f"fused_moe: {name} is on {bias.device}, x on {x_NH.device}: "
                             f"keep the expert biases with the weights")
    for name, t in (("x", x_NH), ("w13", w13_EIH), ("w2", w2_EHI)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(
                f"fused_moe: {name} has strides {t.stride()}: the last dim must be contiguous "
                f"(call .contiguous())."
            )


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def launch_persistent(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    weights_NK: torch.Tensor | None,
    routing: AlignedRouting,
    *,
    n: int,
    k: int,
    a_rows_div: int,
    a_sorted: bool,
    half_tail: bool = True,
    compiled: bool = True,
    epilogue: GemmEpilogue | None = None,
    bias: torch.Tensor | None = None,
) -> None:
    """Queue one GEMM of the pair on the current stream as the persistent kernel, as
    `kernel_launch` describes it (GEMM1: writes the sorted [P, n] activation; GEMM2:
    writes rows by routed id; `epilogue`, `bias` as there), over `routing`'s tile table.
    `b` must be contiguous [E, rows, k] and the operands TMA-loadable."""
    if not b.is_contiguous():
        raise ValueError("launch_persistent: expert weights must be contiguous")
    max_rows = routing.sorted_ids_P.numel()
    role = gemm_role(a, c, weights_NK, a_rows_div=a_rows_div, a_sorted=a_sorted,
                     epilogue=epilogue, bias=bias)
    args = (
        a, b, c, role.weights, role.bias,
        routing.sorted_ids_P, routing.block_expert_ids_B, routing.tile_rows_B,
        routing.num_tiles,
        n, k, routing.num_routed, max_rows, next_power_of_2(max(max_rows, 1)),
        b.shape[0], role.weights_top_k,
        a.stride(0), a.stride(1), b.stride(1), c.stride(0), c.stride(1), role.stride_wn,
    )
    flags = {**role.flags, "HALF_TAIL": half_tail, "BLOCK_M": routing.block_m}
    use_tma_scratch()
    if a.device.type == "cpu":  # TRITON_INTERPRET=1
        grid = (INTERPRETER_PROGRAMS,)
        fused_moe_persistent_kernel[grid](*args, **flags, NUM_PROGRAMS=grid[0],
                                          **INTERPRETER_PERSISTENT_TILE)
        return
    programs = _num_sms(a.device.index if a.device.index is not None else
                        torch.cuda.current_device())
    flags["NUM_PROGRAMS"] = programs
    tune_key = (tuple(flags.values()), n, k, max_rows, a.dtype, b.dtype, c.dtype)
    persistent_launcher()(tune_key, lambda meta: (programs,), *args, compiled=compiled,
                          **flags)


def tma_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global scratch for in-kernel tensor descriptors, from torch's caching allocator
    (stream-ordered on the current stream, where the kernel runs)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def use_tma_scratch() -> None:
    """Install `tma_scratch` for this thread / greenlet (Triton keeps the allocator in a
    context variable: every DBO ubatch has its own)."""
    triton.set_allocator(tma_scratch)
