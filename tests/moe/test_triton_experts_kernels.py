"""The fused-MoE GEMMs' load paths and tiles (layer 3: the Triton interpreter on CPU;
GPU-marked on CUDA): tensor-descriptor (TMA) loads and the pre-sorted x, the persistent
kernel and its tile table, half tiles, GEMM2 tails, short GEMM1 tiles, each against the
reference and the plain pointer-load kernel; the row gather; the policy's choices.

Cost under the interpreter: every program runs in Python, and the Triton align sorts
more than 64 routed rows as one 1024-key chunk (seconds). So the GEMM tests route at
most 64 rows through `fused_moe`, or take the torch align (the same buffers, as
`test_triton_align_matches_torch` checks) where a layout needs more rows.
"""
from __future__ import annotations

from typing import Callable

import pytest
import torch

from moe.experts.reference import ReferenceExperts
from moe.experts.triton import TritonExperts
from moe.kernels.fused_moe.align import align_routing, max_padded_rows
from moe.kernels.fused_moe.align_triton import align_routing_triton
from moe.kernels.policy import KernelPolicy
from moe.workspace import Workspace
from tests.moe.triton_problems import DEVICE, TOLERANCES, make_problem, needs_triton  # noqa: F401

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("needs_triton")]


Problem = tuple[torch.Tensor, ...]
# (problem, reference, plain output) of a problem and BLOCK_M: the `pointer_loads` fixture.
PointerLoads = Callable[..., tuple[Problem, torch.Tensor, torch.Tensor]]


@pytest.fixture(scope="module")
def pointer_loads() -> PointerLoads:
    """(problem, reference, plain output) of an fp16 `make_problem` and BLOCK_M, each made
    once per module: the plain kernel (pointer loads, one program per tile) is what every
    load variant and the persistent kernel must equal bit for bit, and the interpreter's
    costliest call here; the tests of one problem share it instead of making it again."""
    from moe.kernels.fused_moe.host import fused_moe

    made: dict[tuple[object, ...], tuple[Problem, torch.Tensor, torch.Tensor]] = {}

    def get(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int, *,
            block_m: int, drop_frac: float) -> tuple[Problem, torch.Tensor, torch.Tensor]:
        key = (num_tokens, hidden, inter, num_experts, top_k, block_m, drop_frac)
        if key not in made:
            problem = make_problem(num_tokens, hidden, inter, num_experts, top_k,
                                   dtype=torch.float16, drop_frac=drop_frac)
            plain = fused_moe(*problem, block_m=block_m,
                              policy=KernelPolicy(tma=False, sorted_x=False))
            made[key] = (problem, ReferenceExperts().apply(*problem), plain)
        return made[key]

    return get


@pytest.mark.parametrize("tma, sorted_x", [(True, False), (True, True)])
@pytest.mark.parametrize(
    "num_tokens, hidden, inter, num_experts, top_k, block_m",
    [
        (9, 32, 24, 3, 2, 16),  # I = 24: a weight tile runs past the gate into the up rows
        (7, 24, 40, 8, 8, 16),  # many experts, the last tile reads past the last expert
        (40, 16, 8, 1, 1, 32),  # one expert, two blocks
    ],
)
def test_load_variants_match_reference(
    tma: bool, sorted_x: bool, num_tokens: int, hidden: int, inter: int, num_experts: int,
    top_k: int, block_m: int, pointer_loads: PointerLoads,
) -> None:
    """Tensor-descriptor (TMA) loads and the pre-sorted x, emulated by the interpreter on
    CPU (the GPU picks them by itself): same results as the pointer loads."""
    from moe.kernels.fused_moe.host import fused_moe

    problem, ref, plain = pointer_loads(num_tokens, hidden, inter, num_experts, top_k,
                                        block_m=block_m, drop_frac=0.2)
    out = fused_moe(*problem, block_m=block_m, policy=KernelPolicy(tma=tma, sorted_x=sorted_x))
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCES[torch.float16])
    # The same tiles in the same order: only the load path differs.
    assert torch.equal(out, plain)
    # From a workspace (the sorted x and GEMM2's rows share one buffer), twice.
    ws = Workspace()
    for _ in range(2):
        out_ws = fused_moe(*problem, block_m=block_m, workspace=ws,
                           policy=KernelPolicy(tma=tma, sorted_x=sorted_x))
        assert torch.equal(out_ws, plain)


@pytest.mark.parametrize("sorted_x", [False, True])
@pytest.mark.parametrize(
    "num_tokens, hidden, inter, num_experts, top_k, block_m, drop_frac",
    [
        (7, 24, 40, 8, 8, 16, 0.2),  # many tiles over 3 programs; no half tiles (16 rows)
        (40, 16, 8, 1, 1, 32, 0.0),  # one expert: a full block, then a half-used one
        (16, 32, 24, 3, 4, 32, 0.3),  # 1 full and 2 half tiles, ids -1 (no tiles for them)
        (20, 16, 8, 4, 2, 64, 1.0),  # every id elsewhere: an empty tile table
    ],
)
def test_persistent_matches_reference(
    sorted_x: bool, num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int,
    block_m: int, drop_frac: float, pointer_loads: PointerLoads,
) -> None:
    """The persistent GEMMs (tile table, round-robin programs, half tiles), emulated by the
    interpreter: the reference's result, and the one-program-per-tile kernel's bit for bit
    (same k order per row). That kernel's is the same with any loads (TMA or not, x sorted
    or not: test_load_variants_match_reference), so both variants compare with its
    pointer loads, made once."""
    from moe.kernels.fused_moe.host import fused_moe

    problem, ref, plain = pointer_loads(num_tokens, hidden, inter, num_experts, top_k,
                                        block_m=block_m, drop_frac=drop_frac)
    out = fused_moe(*problem, block_m=block_m,
                    policy=KernelPolicy(tma=True, sorted_x=sorted_x, persistent=True))
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCES[torch.float16])
    assert torch.equal(out, plain)


def _counted_ids(counts: dict[int, int], seed: int = 3) -> torch.Tensor:
    """[N, 1] ids with `counts[e]` rows for each expert e (-1: elsewhere), shuffled."""
    ids = torch.cat([torch.full((n,), e) for e, n in counts.items()])
    return ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(seed))]


def test_persistent_half_tiles_and_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Half-used blocks compute only their upper half (the lower stays unwritten) and
    every used row equals the full-height result; the host's choice of kernel."""
    import moe.kernels.fused_moe.host as fm
    from moe.kernels.fused_moe import rules as policy
    from moe.kernels.fused_moe.host import launch_persistent

    block_m, hidden, inter = 32, 32, 8
    ids = _counted_ids({0: 40, 1: 20, 2: 16, -1: 5}).view(-1, 1).to(DEVICE)  # as above
    x, w13, *_ = make_problem(ids.shape[0], hidden, inter, 4, 1, dtype=torch.float16)
    routing = align_routing(ids, 4, block_m)  # the Triton align's buffers (see above)
    assert routing.num_tiles.tolist() == [2, 2]  # full: 0's first, 1's; half: 0's last, 2's
    lower_halves = list(range(48, 64)) + list(range(112, 128))
    used = (routing.sorted_ids_P[:128] < routing.num_routed).nonzero().view(-1)
    acts = {}
    for half in (True, False):
        act = torch.full((routing.sorted_ids_P.numel(), inter), float("nan"), dtype=x.dtype,
                         device=DEVICE)
        launch_persistent(x, w13, act, None, routing, n=inter, k=hidden, a_rows_div=1,
                          a_sorted=False, half_tail=half)
        assert torch.isnan(act[lower_halves]).all() == half, f"half_tail={half}"
        assert not torch.isnan(act[used]).any()
        acts[half] = act
    torch.testing.assert_close(acts[True][used], acts[False][used], rtol=0, atol=0)

    # The policy applies its named limits: GEMM2 by rows per expert, GEMM1 by rows and
    # depth, both only on 128-row blocks.
    prefer = policy.prefer_persistent
    rows2, rows1, deep = (policy.PERSISTENT_GEMM2_MIN_ROWS, policy.PERSISTENT_GEMM1_MIN_ROWS,
                          policy.PERSISTENT_GEMM1_MIN_K)
    assert prefer(128, gated=False, k=16, rows_per_expert=rows2)
    assert not prefer(128, gated=False, k=deep, rows_per_expert=rows2 - 1)
    assert prefer(128, gated=True, k=deep, rows_per_expert=rows1)
    assert not prefer(128, gated=True, k=deep, rows_per_expert=rows1 - 1)
    assert not prefer(128, gated=True, k=deep - 1, rows_per_expert=10 * rows1)
    for block_m in (16, 32, 64):
        assert not prefer(block_m, gated=False, k=deep, rows_per_expert=10 * rows2)
        assert not prefer(block_m, gated=True, k=deep, rows_per_expert=10 * rows1)
    # x is sorted first only for the one-program-per-tile GEMM1, and only when large.
    monkeypatch.setattr(policy, "SORTED_X_MIN_BYTES", x.numel() * x.element_size())
    assert policy.prefer_sorted_x(x, persistent_gemm1=False)
    assert not policy.prefer_sorted_x(x[1:], persistent_gemm1=False)
    assert not policy.prefer_sorted_x(x, persistent_gemm1=True)
    fp32 = make_problem(4, 16, 8, 2, 1)
    with pytest.raises(ValueError, match=r"persistent=True.*16-bit"):
        fm.fused_moe(*fp32, policy=KernelPolicy(persistent=True))


def test_tma_and_sorted_x_reject_what_they_cannot_load() -> None:
    from moe.kernels.fused_moe.host import fused_moe, tma_unsupported_reason

    fp32 = make_problem(4, 16, 8, 2, 1)
    assert "16-bit" in tma_unsupported_reason(*fp32[:3])
    with pytest.raises(ValueError, match="16-bit"):
        fused_moe(*fp32, policy=KernelPolicy(tma=True))
    odd = make_problem(4, 20, 8, 2, 1, dtype=torch.float16)  # 40-byte rows
    with pytest.raises(ValueError, match="16-byte aligned"):
        fused_moe(*odd, policy=KernelPolicy(tma=True))
    x, w13, w2, ids, weights = make_problem(4, 16, 8, 2, 1, dtype=torch.float16)
    strided = w13.transpose(0, 1).contiguous().transpose(0, 1)  # rows contiguous, experts not
    with pytest.raises(ValueError, match="contiguous"):
        fused_moe(x, strided, w2, ids, weights, policy=KernelPolicy(tma=True))
    with pytest.raises(ValueError, match="needs tma"):
        fused_moe(x, w13, w2, ids, weights, policy=KernelPolicy(tma=False, sorted_x=True))


def test_gather_rows_copies_routed_rows_and_zeros_padding() -> None:
    from moe.kernels.fused_moe.host import gather_rows

    num_tokens, top_k, hidden = 10, 2, 24
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    ids = torch.tensor([[0, 2], [1, -1], [2, 0], [0, 1], [2, 2]] * 2).to(DEVICE)
    routing = align_routing_triton(ids, 3, 16)
    dst = torch.full((routing.sorted_ids_P.numel(), hidden), float("nan"), device=DEVICE)
    gather_rows(x, dst, routing, rows_div=top_k)
    used = int(routing.num_padded_rows)
    sorted_ids = routing.sorted_ids_P[:used].long()
    real = sorted_ids < ids.numel()
    assert torch.equal(dst[:used][real], x[sorted_ids[real] // top_k])
    assert torch.equal(dst[:used][~real], torch.zeros_like(dst[:used][~real]))
    assert torch.isnan(dst[used:]).all(), "rows past num_padded_rows are not touched"


@pytest.mark.parametrize("tma", [False, True])
def test_half_tail_tiles(tma: bool) -> None:
    """GEMM1 with half tiles: a block whose lower half is padding computes only its upper
    half (those activation rows stay unwritten); every used row is as with full tiles."""
    from moe.kernels.fused_moe.host import _launch, kernel_launch
    from moe.kernels.fused_moe.rules import GemmTiles

    block_m, hidden, inter = 32, 32, 8
    # Expert 0: 40 rows (a full block, then 8: half); expert 1: 20 (more than half used:
    # full); expert 2: 16 (exactly half: half); expert 3: none; 5 rows elsewhere.
    ids = _counted_ids({0: 40, 1: 20, 2: 16, -1: 5}).view(-1, 1).to(DEVICE)
    x, w13, *_ = make_problem(ids.shape[0], hidden, inter, 4, 1, dtype=torch.float16)
    # The torch align: the Triton one's buffers (test_triton_align_matches_torch) without
    # its interpreted sort of a 1024-row chunk, which costs seconds.
    routing = align_routing(ids, 4, block_m)
    num_rows = routing.sorted_ids_P.numel()
    # Sorted rows: expert 0 in [0, 64), expert 1 in [64, 96), expert 2 in [96, 128).
    lower_halves = list(range(48, 64)) + list(range(112, 128))
    used = (routing.sorted_ids_P[:128] < routing.num_routed).nonzero().view(-1)  # experts' rows
    acts = {}
    for half in (True, False):
        act = torch.full((num_rows, inter), float("nan"), dtype=x.dtype, device=DEVICE)
        _launch(kernel_launch(x, w13, act, None, routing, n=inter, k=hidden, a_rows_div=1,
                              a_sorted=False, tma=tma, tiles=GemmTiles(half_tail=half)))
        assert torch.isnan(act[lower_halves]).all() == half, f"half_tail={half}"
        assert not torch.isnan(act[64:96]).any(), "expert 1's block is more than half used"
        acts[half] = act
    torch.testing.assert_close(acts[True][used], acts[False][used], rtol=0, atol=0)


@pytest.mark.parametrize("tma", [False, True])
def test_gemm2_tail_rows_ride_on_the_block_before(tma: bool) -> None:
    """GEMM2 tails (`TAIL_M`): an expert's last block with at most 16 used rows is computed
    by the expert's block before it, on its weight loads, in a swapped dot. Every local
    row is written and equals the result without tails, bit for bit; GEMM1 and tiles
    other than whole blocks refuse tails."""
    from moe.kernels.fused_moe.host import _launch, kernel_launch
    from moe.kernels.fused_moe.rules import GemmTiles

    block_m, hidden, inter = 32, 32, 16
    # Sorted 32-row blocks: expert 0: 40 rows in [0, 64), its last 8 ride on block 0;
    # 1: 20 in [64, 96), a lone block; 2: 16 in [96, 128), short but alone; 3: 81 in
    # [128, 224), a last block of 17 (> 16) runs itself; 4: 80 in [224, 320), its last
    # 16 ride on block 8. 5 rows elsewhere (expert -1).
    ids = _counted_ids({0: 40, 1: 20, 2: 16, 3: 81, 4: 80, -1: 5}).view(-1, 1).to(DEVICE)
    x, w13, w2, _, weights = make_problem(ids.shape[0], hidden, inter, 5, 1,
                                          dtype=torch.float16)
    routing = align_routing(ids, 5, block_m)  # as in test_half_tail_tiles
    act = torch.randn(routing.sorted_ids_P.numel(), inter, generator=torch.Generator()
                      .manual_seed(3)).to(x.dtype).to(DEVICE)
    local = (ids.view(-1) >= 0).nonzero().view(-1)
    ys = {}
    for tiles in (GemmTiles(tail_rows=16), GemmTiles(half_tail=True, tail_rows=16),
                  GemmTiles(half_tail=True), GemmTiles()):
        y = torch.full((ids.shape[0], hidden), float("nan"), dtype=x.dtype, device=DEVICE)
        _launch(kernel_launch(act, w2, y, weights, routing, n=hidden, k=inter, a_rows_div=1,
                              a_sorted=True, tma=tma, tiles=tiles))
        assert not torch.isnan(y[local]).any(), f"{tiles}"
        ys[tiles] = y[local]
    for tiles, y in ys.items():
        torch.testing.assert_close(y, ys[GemmTiles()], rtol=0, atol=0, msg=f"{tiles}")
    for bad, why in ((GemmTiles(tail_rows=24), "power of two"),
                     (GemmTiles(rows=16, tail_rows=16), "whole-block"),
                     (GemmTiles(tail_rows=32), "half the block")):
        with pytest.raises(ValueError, match=why):
            kernel_launch(act, w2, y, weights, routing, n=hidden, k=inter, a_rows_div=1,
                          a_sorted=True, tma=tma, tiles=bad)
    with pytest.raises(ValueError, match="GEMM2"):
        kernel_launch(x, w13, act, None, routing, n=inter, k=hidden, a_rows_div=1,
                      a_sorted=False, tma=tma, tiles=GemmTiles(tail_rows=16))


def test_short_tiles_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """On 128-row blocks GEMM1 runs 64-row tiles in its short-tile range (padding-only
    tiles return at once) and GEMM2 128-row tiles with half tails: the padding-only tiles
    of GEMM1 leave their activation rows unwritten, the used rows are those of one tile
    height, bit for bit."""
    import moe.kernels.fused_moe.align_triton as align_triton
    import moe.kernels.fused_moe.host as fm
    from moe.kernels.fused_moe import rules as policy

    tiles = policy.GemmTiles
    short_min, short_max = policy.SHORT_GEMM1_MIN_ROWS, policy.SHORT_GEMM1_MAX_ROWS
    assert policy.gemm_tiles(128, gated=True, rows_per_expert=short_min - 1) == tiles(128)
    assert policy.gemm_tiles(128, gated=True, rows_per_expert=short_min) == tiles(64)
    assert policy.gemm_tiles(128, gated=True, rows_per_expert=short_max) == tiles(64)
    assert policy.gemm_tiles(128, gated=True, rows_per_expert=short_max + 1) == tiles(128)
    gemm2 = policy.gemm_tiles(128, gated=False, rows_per_expert=1)
    assert gemm2 == tiles(128, True, policy.GEMM2_TAIL_ROWS), "any rows: half tiles, tails"
    for block_m in (16, 32, 64):  # shorter blocks: whole-block tiles, no tails
        for gated in (True, False):
            assert policy.gemm_tiles(block_m, gated=gated, rows_per_expert=100) == tiles(block_m)
    # fused_moe aligns these 334 rows in 64-row chunks: the interpreter sorts a chunk of
    # the default 1024 rows in seconds (the align tests cover that chunk).
    monkeypatch.setattr(align_triton, "CHUNK", align_triton.SMALL_CHUNK)
    # ~83 rows per expert is weight-bound (whole tiles): put it in the short-tile range.
    monkeypatch.setattr(policy, "SHORT_GEMM1_MIN_ROWS", 1)
    # Expert 0: 160 rows (blocks [0, 256): rows [192, 256) are padding only); expert 1:
    # 100 (one block, every 64-row tile used); expert 2: 64 (rows [448, 512) padding).
    ids = _counted_ids({0: 160, 1: 100, 2: 64, -1: 10}).view(-1, 1)
    x, w13, w2, _, weights = make_problem(ids.shape[0], 32, 8, 4, 1, dtype=torch.float16)
    problem = (x, w13, w2, ids.to(DEVICE), weights)
    num_rows = max_padded_rows(ids.shape[0], 4, 128)
    ws = Workspace()
    ws.get("triton.act", (num_rows, 8), x.dtype, DEVICE).fill_(float("nan"))
    out = fm.fused_moe(*problem, block_m=128, workspace=ws)
    act = ws.get("triton.act", (num_rows, 8), x.dtype, DEVICE)
    skipped = list(range(192, 256)) + list(range(448, 512))
    assert torch.isnan(act[skipped]).all()
    assert not torch.isnan(act[256:384]).any()
    routing = align_routing_triton(ids.to(DEVICE), 4, 128)
    whole = torch.full_like(act, float("nan"))
    fm._launch(fm.kernel_launch(x, w13, whole, None, routing, n=8, k=32, a_rows_div=1,
                                a_sorted=False, tma=False, tiles=tiles(128)))
    used = (routing.sorted_ids_P[:512] < routing.num_routed).nonzero().view(-1)
    torch.testing.assert_close(act[used], whole[used], rtol=0, atol=0)
    ref = ReferenceExperts().apply(*problem)
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCES[torch.float16])
    with pytest.raises(ValueError, match="divide"):
        fm.kernel_launch(x, w13, x, None, align_routing(ids, 4, 32), n=8, k=32,
                         a_rows_div=1, a_sorted=False, tma=False, tiles=tiles(64))


_BF16 = torch.bfloat16


@pytest.mark.gpu
@pytest.mark.parametrize("tma, sorted_x", [(False, False), (True, False), (True, True)])
def test_gpu_load_variants(tma: bool, sorted_x: bool) -> None:
    """Each load path compiled on CUDA gives the pointer path's result bit for bit."""
    from moe.kernels.fused_moe.host import fused_moe

    if tma and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs compute capability 9.0+")
    problem = make_problem(2048, 1024, 384, 64, 8, dtype=_BF16, drop_frac=0.1)
    ref = ReferenceExperts().apply(*problem)
    out = fused_moe(*problem, policy=KernelPolicy(tma=tma, sorted_x=sorted_x))
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCES[_BF16])


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens, num_experts", [(2048, 64), (4096, 16)])
def test_gpu_persistent(num_tokens: int, num_experts: int) -> None:
    """The persistent kernel compiled and autotuned on CUDA (128-row blocks, half tiles,
    sorted x or not), against the reference and the one-program-per-tile kernel."""
    from moe.kernels.fused_moe.host import fused_moe

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the persistent kernel loads by TMA: compute capability 9.0+")
    problem = make_problem(num_tokens, 1024, 384, num_experts, 8, dtype=_BF16, drop_frac=0.3)
    ref = ReferenceExperts().apply(*problem)
    for sorted_x in (False, True):
        out = fused_moe(*problem, block_m=128,
                        policy=KernelPolicy(tma=True, sorted_x=sorted_x, persistent=True))
        torch.testing.assert_close(out.float(), ref.float(), **TOLERANCES[_BF16])
        plain = fused_moe(*problem, block_m=128,
                          policy=KernelPolicy(tma=True, sorted_x=sorted_x, persistent=False))
        torch.testing.assert_close(out.float(), plain.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
def test_gpu_gemm2_tails() -> None:
    """GEMM2 tails compiled on CUDA (the swapped second dot): at 256 rows per expert, where
    experts end in blocks of at most 32 rows, the same bits as without tails."""
    import moe.kernels.fused_moe.host as fm
    from moe.kernels.fused_moe.rules import GEMM2_TAIL_ROWS, GemmTiles

    problem = make_problem(1024, 1024, 384, 32, 8, dtype=_BF16)
    counts = torch.bincount(problem[3].view(-1), minlength=32)
    assert ((counts > 128) & (counts % 128 > 0) & (counts % 128 <= 32)).any(), "no tails"
    out = fm.fused_moe(*problem, block_m=128, policy=KernelPolicy(persistent=False))
    x, w13, w2, ids, weights = problem
    routing = align_routing_triton(ids, 32, 128)
    act = torch.randn(routing.sorted_ids_P.numel(), 384, device=DEVICE).to(_BF16)
    local = (ids.view(-1) >= 0).nonzero().view(-1)
    ys = []
    for tail in (GEMM2_TAIL_ROWS, 0):
        y = torch.empty(ids.numel(), 1024, dtype=_BF16, device=DEVICE)
        fm._launch(fm.kernel_launch(act, w2, y, weights, routing, n=1024, k=384,
                                    a_rows_div=1, a_sorted=True, tma=True,
                                    tiles=GemmTiles(128, half_tail=True, tail_rows=tail)))
        ys.append(y[local])
    assert torch.equal(ys[0], ys[1])
    ref = ReferenceExperts().apply(*problem)
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCES[_BF16])
