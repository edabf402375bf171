"""Layer 3 (Triton interpreter on CPU): `moe.backends.kernels.slots`: the slot layout of the `a2a_ll` all-to-all, Triton (interpreted
on CPU) against torch and against a loop written out by hand; exact equality."""
from __future__ import annotations

import pytest
import torch

from moe.backends.kernels import slots, slots_triton
from moe.kernels.policy import KernelPolicy
from moe.workspace import Workspace

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PATHS = ["triton", "torch"]
BLOCK_T = slots_triton._BLOCK_T  # tokens per program of the kernel


@pytest.fixture
def path(request):
    return KernelPolicy(implementation=request.param)


def loop_slots(ids_TK: torch.Tensor, num_local_experts: int, world_size: int,
               capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The slot layout one (token, rank) pair at a time."""
    num_tokens = ids_TK.shape[0]
    slot = torch.full((num_tokens, world_size), -1, dtype=torch.int64)
    src = torch.full((world_size * capacity,), -1, dtype=torch.int64)
    used = [0] * world_size
    for t in range(num_tokens):
        ranks = {e // num_local_experts for e in ids_TK[t].tolist() if e >= 0}
        for w in sorted(ranks):
            slot[t, w] = w * capacity + used[w]
            src[slot[t, w]] = t
            used[w] += 1
    return slot, src


def random_ids(num_tokens: int, top_k: int, num_experts: int, seed: int) -> torch.Tensor:
    """Global ids in [-1, num_experts), about one in five -1."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen)
    none = torch.rand(num_tokens, top_k, generator=gen) < 0.2
    return ids.masked_fill(none, -1)


def check(ids_TK: torch.Tensor, num_local_experts: int, world_size: int, capacity: int,
          workspace: Workspace | None = None, *, policy: KernelPolicy) -> None:
    slot_TW, src_X = slots.ll_slots(ids_TK.to(DEVICE), num_local_experts=num_local_experts,
                                    world_size=world_size, capacity=capacity,
                                    workspace=workspace, policy=policy)
    want_slot, want_src = loop_slots(ids_TK, num_local_experts, world_size, capacity)
    assert slot_TW.dtype == src_X.dtype == torch.int64 and slot_TW.is_contiguous()
    assert torch.equal(slot_TW.cpu(), want_slot)
    assert torch.equal(src_X.cpu(), want_src)


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
@pytest.mark.parametrize("top_k", [1, 8])
@pytest.mark.parametrize("num_tokens,capacity", [(0, 4), (1, 1), (1, 6), (13, 13), (40, 57),
                                                 (BLOCK_T + 44, BLOCK_T + 60)])
def test_slots_match_the_loop(path, world_size, top_k, num_tokens, capacity):
    num_local_experts = 3
    ids = random_ids(num_tokens, top_k, world_size * num_local_experts, seed=num_tokens + top_k)
    check(ids, num_local_experts, world_size, capacity, policy=path)


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_full_capacity_over_several_blocks(path):
    # Every token to every rank: each rank's slot is full, no padding row.
    num_tokens, world_size = 2 * BLOCK_T + 5, 3
    ids = torch.tensor([[0, 2, 4, -1]]).expand(num_tokens, 4)
    check(ids, 2, world_size, num_tokens, policy=path)
    # Every token to rank 1 only, with all of its ids there.
    check(torch.full((num_tokens, 2), 3), 2, world_size, num_tokens, policy=path)


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_several_experts_on_one_rank_count_once(path):
    ids = torch.tensor([[4, 5, 4, -1],  # rank 1 three times
                        [-1, -1, -1, -1],  # nowhere
                        [0, 7, 6, 1],  # ranks 0 and 1, twice each
                        [5, -1, 3, 4]])  # ranks 1 and 0
    slot_TW, src_X = slots.ll_slots(ids.to(DEVICE), num_local_experts=4, world_size=2,
                                    capacity=5, policy=path)
    assert slot_TW.tolist() == [[-1, 5], [-1, -1], [0, 6], [1, 7]]
    assert src_X.tolist() == [2, 3, -1, -1, -1, 0, 2, 3, -1, -1]


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_src_from_a_stale_workspace_is_fully_written(path):
    workspace = Workspace()
    workspace.get("ll_slots.src", (64,), torch.int64, DEVICE).fill_(12345)
    check(random_ids(16, 4, 8, seed=3), 2, 4, 16, workspace=workspace, policy=path)
    check(random_ids(9, 4, 8, seed=4), 2, 4, 16, workspace=workspace, policy=path)


def test_too_many_tokens_is_an_error():
    with pytest.raises(ValueError, match="5 tokens exceed the capacity 4"):
        slots.ll_slots(torch.zeros(5, 2, dtype=torch.int64), num_local_experts=2,
                       world_size=2, capacity=4)


def test_triton_past_its_world_size_is_an_error():
    world_size = slots.TRITON_MAX_WORLD_SIZE + 1
    with pytest.raises(ValueError, match=f"at most 64 ranks, got {world_size}"):
        slots.ll_slots(torch.zeros(1, 2, dtype=torch.int64), num_local_experts=2,
                       world_size=world_size, capacity=4,
                       policy=KernelPolicy(implementation="triton"))


def test_unknown_implementation_is_an_error():
    with pytest.raises(ValueError, match=r"implementation='cuda': use one of"):
        KernelPolicy(implementation="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,world_size,top_k,num_local_experts,capacity",
                         [(4096, 2, 8, 32, 4096), (4096, 1, 8, 32, 4096), (8192, 8, 8, 32, 8192),
                          (300, 3, 6, 5, 333)])
def test_triton_matches_torch_on_cuda(num_tokens, world_size, top_k,
                                      num_local_experts, capacity):
    ids = random_ids(num_tokens, top_k, world_size * num_local_experts, seed=0).cuda()
    got, want = [], []
    for impl, out in (("triton", got), ("torch", want)):
        out.extend(slots.ll_slots(ids, num_local_experts=num_local_experts,
                                  world_size=world_size, capacity=capacity,
                                  policy=KernelPolicy(implementation=impl)))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
