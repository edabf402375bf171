"""Layers 1 (CPU, one process) and 2 (two gloo processes): DBO with joined experts
(`DBOConfig.joined_experts`): each MoE layer's experts run once per step over both
ubatches' rows, so each expert's weights are read once, not once per ubatch.

Layer 1: one experts call per layer per step, over both ubatches' rows, where a plain DBO
step makes two; the model's output equals the unsplit model's. Layer 2: the tiny model
through `DBORunner` on two ranks (a2a_ll and a2a), a prefill step and decode steps, equals
DBO off within rounding (fp32 1e-5: the joined experts multiply more rows at once, which
may block the GEMMs otherwise), the ranks holding different numbers of requests; every
step split.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from dbo import DBOConfig, DBORunner
from moe.models import KVCache, MoETransformer, get_preset, with_cache_split
from moe.layer import MoELayer
from moe.modular_kernel import ModularKernel
from tests.dist_utils import run_distributed

ATOL = 1e-5


def _model(backend: str, group=None) -> MoETransformer:
    model = MoETransformer(get_preset("tiny", backend=backend, experts="reference",
                                      max_tokens_per_rank=64), group=group)
    model.init_weights(seed=0)
    return model


def _count_expert_calls(monkeypatch) -> list[int]:
    """Rows of every experts call of every MoE layer, in call order."""
    rows: list[int] = []
    run = ModularKernel._run_experts

    def counted(self, x_RH, *args, **kwargs):
        rows.append(x_RH.shape[0])
        return run(self, x_RH, *args, **kwargs)
    monkeypatch.setattr(ModularKernel, "_run_experts", counted)
    return rows


@pytest.mark.filterwarnings("ignore::dbo.NoYieldWarning")  # backend local: no comm
@pytest.mark.parametrize("joined", [False, True])
def test_joined_experts_run_once_per_layer_over_both_ubatches(joined, monkeypatch):
    model = _model("local")
    moe_layers = sum(isinstance(m, MoELayer) for m in model.modules())
    assert moe_layers >= 2
    rows = _count_expert_calls(monkeypatch)
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(24)
    with torch.no_grad():
        expected = model(ids, pos, seq_lens=[6] * 4)
        rows.clear()
        runner = DBORunner(model, DBOConfig(min_prefill_tokens=2, joined_experts=joined))
        out = runner(ids, pos, seq_lens=[6] * 4)
    assert runner.last_decision.split
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    if joined:
        assert rows == [24] * moe_layers  # one call per layer, both ubatches' rows
    else:
        assert rows == [12] * (2 * moe_layers)


def _steps(rank: int, world_size: int, backend: str) -> dict:
    group = dist.group.WORLD
    model = _model(backend, group)
    prompts = (5, 7, 3) if rank == 0 else (4, 6)
    gen = torch.Generator().manual_seed(10 + rank)
    seqs = [torch.randint(0, 256, (n + 3,), generator=gen) for n in prompts]
    results = {}
    for joined in (None, True):  # None: DBO off
        config = DBOConfig(enabled=joined is not None, joined_experts=bool(joined),
                           min_prefill_tokens=2, min_decode_tokens=2)
        runner = DBORunner(model, with_cache_split(config), group=group)
        cache = KVCache.empty(model.config, num_requests=len(prompts),
                              capacity=max(prompts) + 3)
        outs, splits = [], []
        with torch.no_grad():
            outs.append(runner(torch.cat([s[:n] for s, n in zip(seqs, prompts)]),
                               torch.cat([torch.arange(n) for n in prompts]),
                               seq_lens=list(prompts), cache=cache))
            splits.append(runner.last_decision.split)
            for t in range(2):
                outs.append(runner(torch.stack([s[n + t] for s, n in zip(seqs, prompts)]),
                                   cache.next_positions(), seq_lens=[1] * len(prompts),
                                   cache=cache))
                splits.append(runner.last_decision.split)
        results[joined] = (outs, splits)
    (off, _), (on, splits) = results[None], results[True]
    return {"err": max((a - b).abs().max().item() for a, b in zip(off, on)),
            "splits": splits}


@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["a2a_ll", "a2a"])
def test_joined_experts_equal_dbo_off_over_two_ranks(backend):
    for rank, result in enumerate(run_distributed(2, _steps, backend)):
        assert result["err"] <= ATOL, (rank, result)
        assert result["splits"] == [True] * 3, (rank, result)


@pytest.mark.gpu
def test_joined_steps_replay_as_cuda_graphs_on_one_gpu():
    """On one GPU (backend local, the Triton experts, bf16): a graphed joined step replays
    the eager joined step bit for bit (the same kernels on the same shapes), and both are
    close to the unsplit model (bf16: the joined GEMMs see more rows at once, which may
    round otherwise; 2**-6 of the output's scale); a plain DBO step's graph captured
    before it still replays its own result."""
    from dbo import GraphedRunner
    from dbo.cli.bench.layer_stack import LayerStack
    from moe.config import MoEConfig

    device = torch.device("cuda", 0)
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=64,
                    num_shared_experts=1, dtype=torch.bfloat16, max_tokens_per_rank=64,
                    backend="local", experts="triton")
    model = LayerStack(cfg, num_layers=2, attn_context=64, group=None, device=device)
    model.init_weights(seed=5)
    split = DBOConfig(split="tokens", min_decode_tokens=2)
    runner = DBORunner(model, replace(split, joined_experts=True))
    graphed = GraphedRunner(runner)
    # A plain DBO step's graph on the same model, captured first: the joined step's
    # experts then grow the ubatch workspaces it was captured with, which must stay alive
    # for its replays (`moe.workspace`). At this size a replay of freed buffers went
    # unnoticed in our runs; `dbo bench --hf deepseek-v3 --cuda-graph` on one GPU ended
    # in an illegal memory access (tests/moe/test_workspace.py checks the pinning).
    dbo_runner = DBORunner(model, split)
    dbo_graphed = GraphedRunner(dbo_runner)
    gen = torch.Generator(device=device).manual_seed(3)
    x = torch.randn(48, 128, generator=gen, device=device).to(torch.bfloat16)
    with torch.no_grad():
        unsplit = model(x)
        dbo_first = dbo_graphed(x).clone()
        replayed = graphed(x)
        assert graphed.last_decision.overlap == "joined" and graphed.num_captures == 1
        eager = runner(x)
        assert runner.last_decision.overlap == "joined"
        dbo_again = dbo_graphed(x)
        torch.cuda.synchronize()
        assert torch.equal(dbo_again, dbo_first) and torch.equal(dbo_again, dbo_runner(x))
    assert torch.equal(replayed, eager)
    scale = unsplit.float().abs().max().item()
    assert (eager.float() - unsplit.float()).abs().max().item() <= scale * 2 ** -6
