"""Layers 1-2 (CPU; one process, then two gloo ranks) and GPU-marked: per-ubatch thread state.

PyTorch keeps inference mode, the torch-function and torch-dispatch mode stacks (where
`with torch.device(...)` lives) and the current CUDA device per OS thread, shared by the
greenlets of a step. Each ubatch must see only what it entered itself, and the caller
must get its own state back after `run`, also when a ubatch raised.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from dbo import UBatchScheduler, dbo_yield
from dbo.config import DBOConfig
from dbo.runner import DBORunner
from tests.dist_utils import run_distributed


def caller_state() -> tuple:
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack(),
            torch._C._dispatch_tls_local_include_set().raw_repr(),
            torch._C._dispatch_tls_local_exclude_set().raw_repr(),
            torch._C._is_fwd_grad_enabled(), torch.get_default_device())


@torch.inference_mode()
def inference_forward(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    dbo_yield()
    y.add_(1)  # in place on an inference tensor: allowed only in inference mode
    return y


# ------------------------------------------------------------------ inference mode
def test_inference_mode_decorator_inplace_after_yield():
    x = torch.arange(4.0)
    out = UBatchScheduler("cpu").run([lambda: inference_forward(x), lambda: inference_forward(x + 1)])
    torch.testing.assert_close(out[0], inference_forward(x), rtol=0, atol=0)
    torch.testing.assert_close(out[1], inference_forward(x + 1), rtol=0, atol=0)


def test_inference_mode_does_not_leak_to_the_other_ubatch():
    seen = {}

    def inferring():
        with torch.inference_mode():
            dbo_yield()
            seen["ub0 after yield"] = torch.is_inference_mode_enabled()
        return 0

    def plain():
        seen["ub1"] = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
        dbo_yield()
        return 1

    UBatchScheduler("cpu").run([inferring, plain])
    assert seen == {"ub1": (False, True), "ub0 after yield": True}


def test_caller_state_after_the_step_and_autograd_works():
    before = caller_state()
    x = torch.arange(4.0)
    UBatchScheduler("cpu").run([lambda: inference_forward(x), lambda: inference_forward(x)])
    assert caller_state() == before
    w = torch.ones(3, requires_grad=True)
    (w * 2).sum().backward()
    assert torch.equal(w.grad, torch.full((3,), 2.0))


@pytest.mark.parametrize("failing", [0, 1])
def test_caller_state_after_an_exception_in_a_ubatch(failing):
    before = caller_state()

    @torch.inference_mode()
    def bad():
        dbo_yield()
        raise KeyError("boom")

    fns = [lambda: inference_forward(torch.ones(2))] * 2
    fns[failing] = bad
    with pytest.raises(KeyError):
        UBatchScheduler("cpu").run(fns)
    assert caller_state() == before


def test_inference_mode_entered_and_left_many_times_across_yields():
    seen = []

    def flipping():
        for _ in range(5):
            with torch.inference_mode():
                dbo_yield()
                seen.append(("in", torch.is_inference_mode_enabled()))
            dbo_yield()
            seen.append(("out", torch.is_inference_mode_enabled()))
        return 0

    def plain():
        for _ in range(12):
            seen.append(("plain", torch.is_inference_mode_enabled()))
            dbo_yield()
        return 1

    before = caller_state()
    UBatchScheduler("cpu").run([flipping, plain])
    assert sorted(set(seen)) == [("in", True), ("out", False), ("plain", False)]
    assert caller_state() == before


@pytest.mark.parametrize("context", ["no_grad", "inference_mode"])
def test_caller_mode_reaches_both_ubatches_and_is_kept(context):
    seen = []

    def fn():
        seen.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
        dbo_yield()
        with torch.enable_grad():
            dbo_yield()
        seen.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
        return 0

    with getattr(torch, context)():
        before = caller_state()
        UBatchScheduler("cpu").run([fn, fn])
        assert caller_state() == before
    assert set(seen) == {(False, context == "inference_mode")}


# ------------------------------------------------------------------ mode stacks
def test_device_context_does_not_leak_between_ubatches():
    seen = {}

    def meta_ub():
        with torch.device("meta"):
            dbo_yield()
            seen["ub0"] = torch.empty(1).device.type
            dbo_yield()
        return 0

    def cpu_ub():
        seen["ub1 first"] = torch.get_default_device().type
        with torch.device("cpu"):
            dbo_yield()
            seen["ub1 inside"] = torch.empty(1).device.type
        return 1

    with torch.device("cpu"):
        pass
    before = caller_state()
    UBatchScheduler("cpu").run([meta_ub, cpu_ub])
    assert seen == {"ub1 first": "cpu", "ub0": "meta", "ub1 inside": "cpu"}
    assert caller_state() == before


def test_device_context_of_a_suspended_ubatch_unwinds_after_a_failure():
    def bad():
        with torch.device("meta"):
            dbo_yield()
            raise KeyError("boom")

    def cpu_ub():
        with torch.device("cpu"):
            dbo_yield()
            dbo_yield()
        return 1

    before = caller_state()
    with pytest.raises(KeyError):
        UBatchScheduler("cpu").run([bad, cpu_ub])
    assert caller_state() == before


class CountingMode(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_dispatch_mode_is_per_ubatch():
    mode = CountingMode()
    x = torch.ones(3)

    def counted():
        with mode:
            x + 1
            dbo_yield()
            x + 1
        return 0

    def uncounted():
        for _ in range(3):
            x * 2
            dbo_yield()
        return 1

    before = caller_state()
    UBatchScheduler("cpu").run([counted, uncounted])
    assert mode.ops == 2
    assert caller_state() == before


# ------------------------------------------------------------- MoETransformer, a2a
def moe_inference_mode_matches(rank: int, world_size: int) -> float:
    """Max |DBO logits - plain logits| for the EP model whose forward is decorated with
    `@torch.inference_mode()` (the caller itself is not in inference mode)."""
    from moe.models.transformer import MoETransformer, get_preset, make_batch

    cfg = get_preset("tiny", max_tokens_per_rank=64, backend="a2a")
    model = MoETransformer(cfg, group=dist.group.WORLD)
    model.init_weights(seed=3)
    model.forward = torch.inference_mode()(model.forward)
    batch = make_batch(cfg, num_tokens=(29, 21)[rank], num_requests=(4, 3)[rank],
                       seed=50 + rank, device="cpu")
    dbo = DBOConfig(split="requests", min_prefill_tokens=1, min_decode_tokens=1,
                    max_imbalance=1.0)
    runner = DBORunner(model, dbo, group=dist.group.WORLD)
    want = model(batch.input_ids_T, batch.positions_T, seq_lens=batch.seq_lens)
    got = runner(batch.input_ids_T, batch.positions_T, seq_lens=batch.seq_lens)
    assert runner.last_decision.split, runner.last_decision.reason
    assert not torch.is_inference_mode_enabled() and torch.is_grad_enabled()
    return (got - want).abs().max().item()


@pytest.mark.distributed
def test_moe_transformer_inference_mode_a2a_two_ranks():
    for rank, err in enumerate(run_distributed(2, moe_inference_mode_matches)):
        assert err <= 1e-5, f"rank {rank}: {err}"


# ------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.multigpu
def test_current_cuda_device_is_per_ubatch_and_restored():
    seen = {}

    def other_device():
        with torch.cuda.device(1):
            dbo_yield()
            seen["ub0"] = torch.cuda.current_device()
        return 0

    def default_device():
        seen["ub1"] = torch.cuda.current_device()
        dbo_yield()
        return 1

    torch.cuda.set_device(0)
    UBatchScheduler("cuda:0").run([other_device, default_device])
    assert seen == {"ub1": 0, "ub0": 1}
    assert torch.cuda.current_device() == 0


@pytest.mark.gpu
def test_caller_stream_is_restored_when_a_ubatch_set_its_own():
    caller = torch.cuda.current_stream()
    side = torch.cuda.Stream()

    def sets_stream():
        torch.cuda.set_stream(side)  # behind the scheduler's back, never undone
        dbo_yield()
        return 0

    UBatchScheduler("cuda").run([sets_stream, lambda: 1])
    assert torch.cuda.current_stream() == caller
