"""Layer 3 (Triton interpreter on CPU): `moe.backends.kernels.send_order_triton`, the one-kernel
send order of `symm_mem`'s dispatch, against the torch ops it replaces
(`destination_mask`, the sum of its tokens and `a2a.send_order`): exact equality of the
splits, src_X and slot_TW."""
from __future__ import annotations

import pytest
import torch

from moe.backends.a2a import send_order
from moe.row_layout import destination_mask

pytest.importorskip("triton")
pytestmark = pytest.mark.triton

from moe.backends.kernels import send_order_triton  # noqa: E402  (after the triton skip)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_T = send_order_triton._BLOCK_T  # tokens per program of the kernel


def random_ids(num_tokens: int, top_k: int, num_experts: int, seed: int) -> torch.Tensor:
    """Global ids in [-1, num_experts), about one in five -1."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen)
    none = torch.rand(num_tokens, top_k, generator=gen) < 0.2
    return ids.masked_fill(none, -1)


def check(ids_TK: torch.Tensor, num_local_experts: int, world_size: int) -> None:
    """The kernel's outputs equal the torch ops' bit for bit, over stale output memory."""
    mask_TW = destination_mask(ids_TK, num_local_experts, world_size)
    want_src, want_slot = send_order(mask_TW)
    num_tokens = ids_TK.shape[0]
    splits_W = torch.full((world_size,), 77, dtype=torch.int64, device=DEVICE)
    slot_TW = torch.full((num_tokens, world_size), 55, dtype=torch.int64, device=DEVICE)
    src_X = torch.full((world_size * num_tokens,), 66, dtype=torch.int64, device=DEVICE)
    send_order_triton.launch_send_order(ids_TK.to(DEVICE), num_local_experts=num_local_experts,
                                        splits_W=splits_W, slot_TW=slot_TW, src_X=src_X)
    assert torch.equal(splits_W.cpu(), mask_TW.sum(0))
    assert torch.equal(src_X.cpu(), want_src)
    assert torch.equal(slot_TW.cpu(), want_slot)


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
@pytest.mark.parametrize("top_k", [1, 8])
@pytest.mark.parametrize("num_tokens", [0, 1, 13, BLOCK_T + 44])
def test_matches_the_torch_ops(world_size, top_k, num_tokens):
    num_local_experts = 3
    ids = random_ids(num_tokens, top_k, world_size * num_local_experts,
                     seed=num_tokens + top_k + world_size)
    check(ids, num_local_experts, world_size)


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_tokens_to_one_rank(world_size):
    # Over several blocks: every token to the last rank only (some ids twice there), so
    # rows start past W-1 empty ranks; then every token to every rank, with no tail.
    num_tokens = 2 * BLOCK_T + 5
    last = (world_size - 1) * 2
    check(torch.tensor([[last, last + 1, last, -1]]).expand(num_tokens, 4), 2, world_size)
    check(torch.arange(0, 2 * world_size, 2).expand(num_tokens, world_size), 2, world_size)


def test_no_token_goes_anywhere():
    # All ids -1: zero splits, and src_X is all tail.
    check(torch.full((BLOCK_T + 3, 2), -1), 4, 2)
