"""Layer 3 (CPU; two gloo processes; Triton interpreted; GPU-marked): the reference model
and a converted Hugging Face model compiled with `torch.compile` under `DBORunner`, DBO
off and on, against the same models run eagerly (`docs/compile.md`).

Inductor compiles the one-process model (its CPU code generation is what takes the time
here: C++ compiles, kept to one MoE layer and one input shape, the DBO step's ubatches
being the unsplit step's size). The two-rank and Hugging Face runs trace with dynamo and
AOT autograd and run the graphs as traced ("aot_eager"): the graph breaks, fake-tensor
shapes and custom ops all pass through there, and they give the eager model's bits.
"""
from __future__ import annotations

import warnings
from typing import Optional

import pytest
import torch
import torch.distributed as dist

from dbo.config import DBOConfig
from dbo.runner import DBORunner
from dbo.scheduler import UBatchScheduler
from moe.models import MoETransformer, get_preset
from tests.dist_utils import run_distributed

# Every step with tokens is split (the thresholds are 0); four requests of eight tokens
# split 16 + 16, the size of the unsplit steps of two requests.
DBO_ON = DBOConfig(min_prefill_tokens=0, min_decode_tokens=0)
DBO_OFF = DBOConfig(enabled=False)
DBO_JOINED = DBOConfig(min_prefill_tokens=0, min_decode_tokens=0, joined_experts=True)
HALF, WHOLE = [8, 8], [8, 8, 8, 8]


def one_moe_layer(group: Optional[dist.ProcessGroup] = None,
                  **overrides: object) -> MoETransformer:
    """The tiny preset with one layer, an MoE one; the same weights on every rank."""
    config = get_preset("tiny", num_layers=1, num_dense_layers=0, **overrides)
    model = MoETransformer(config, group=group)
    model.init_weights(seed=0)
    return model.eval()


def inputs(model: MoETransformer, seq_lens: list[int], seed: int
           ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (sum(seq_lens),), generator=gen)
    positions = torch.cat([torch.arange(n) for n in seq_lens])
    return ids, positions, seq_lens


def record_yields(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The running ubatch at every hand-off of the scheduler, in order."""
    order: list[int] = []
    yield_ = UBatchScheduler.yield_

    def recorded(self: UBatchScheduler) -> None:
        order.append(self.running.ubatch_id)
        yield_(self)

    monkeypatch.setattr(UBatchScheduler, "yield_", recorded)
    return order


def test_inductor_compiles_the_model_dbo_off_and_on():
    import torch._inductor.config as inductor

    model = one_moe_layer()
    compiled = torch.compile(model, dynamic=False)
    # One compile thread and scalar C++ code: the same graphs, built in a third of the
    # time on a small CPU.
    with torch.no_grad(), inductor.patch({"compile_threads": 1, "cpp.vec_isa_ok": False}):
        for config, seq_lens in ((DBO_OFF, HALF), (DBO_ON, WHOLE)):
            ids, positions, lens = inputs(model, seq_lens, seed=len(seq_lens))
            expected = model(ids, positions, seq_lens=lens)
            runner = DBORunner(compiled, config)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # backend 'local' never yields: NoYieldWarning
                got = runner(ids, positions, seq_lens=lens)
            assert runner.last_decision.split == config.enabled
            # Inductor fuses the norms, softmax and activations and reorders their fp32
            # sums: differences of ~1e-6 of the logits' scale were measured; 1e-4 leaves
            # room for other CPUs' vector widths, far below what a wrong row would give.
            scale = expected.abs().max().item()
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * scale)
    experts = model.moe_layers[0]._kernels[torch.device("cpu")].experts
    assert experts.last_path == "grouped_mm"  # the compiled graph's grouped GEMM op


def two_ranks_compiled(rank: int, world_size: int) -> dict[str, object]:
    """Per DBO setting: whether the compiled model's logits equal the eager model's, and
    the ubatch of every hand-off of both."""
    model = one_moe_layer(backend="a2a_ll", max_tokens_per_rank=32, group=dist.group.WORLD)
    compiled = torch.compile(model, backend="aot_eager", dynamic=False)
    order = record_yields(pytest.MonkeyPatch())
    result: dict[str, object] = {}
    with torch.no_grad():
        for config, seq_lens in ((DBO_OFF, HALF), (DBO_ON, WHOLE), (DBO_JOINED, WHOLE)):
            ids, positions, lens = inputs(model, seq_lens, seed=10 * rank + len(seq_lens))
            outs, yields = [], []
            for m in (model, compiled):
                runner = DBORunner(m, config, group=dist.group.WORLD)
                order.clear()
                outs.append(runner(ids, positions, seq_lens=lens))
                yields.append(list(order))
                assert runner.last_decision.split == config.enabled
            key = "joined" if config.joined_experts else f"dbo={config.enabled}"
            result[key] = (torch.equal(*outs), *yields)
    return result


@pytest.mark.distributed
def test_two_ranks_compiled_match_eager_and_the_ubatches_interleave():
    """DBO off, on, and with joined experts: compiled (aot_eager) equal to eager, with the
    same hand-offs."""
    for rank, result in enumerate(run_distributed(2, two_ranks_compiled)):
        # a2a_ll yields once in the dispatch and once in the combine: 0, 1, 0, 1 in the
        # one layer, compiled as eagerly; no hand-off without DBO.
        assert result["dbo=False"] == (True, [], []), rank
        assert result["dbo=True"] == (True, [0, 1, 0, 1], [0, 1, 0, 1]), rank
        # Joined experts: both dispatches (0, 1), ubatch 0 waits at the meeting (0), ubatch
        # 1 runs the experts for both and sends its combine (1), then ubatch 0 (0).
        assert result["joined"] == (True, [0, 1, 0, 1, 0], [0, 1, 0, 1, 0]), rank


def test_a_converted_hugging_face_model_compiles_dbo_off_and_on(monkeypatch):
    pytest.importorskip("transformers")
    import moe.hf
    from tests.hf_utils import assert_logits_close, batch, logits, tiny_model

    model = tiny_model("qwen3_moe", num_hidden_layers=1)
    ids, mask = batch(4, 8, seed=0)
    expected = logits(model, ids, mask)
    compiled = torch.compile(moe.hf.convert(model), backend="aot_eager", dynamic=False)
    order = record_yields(monkeypatch)
    with torch.no_grad():
        for config, rows in ((DBO_OFF, slice(0, 2)), (DBO_ON, slice(0, 4))):
            runner = DBORunner(compiled, DBOConfig(split="batch", enabled=config.enabled,
                                                   min_prefill_tokens=0))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # backend 'local' never yields
                got = runner(input_ids=ids[rows], attention_mask=mask[rows],
                             use_cache=False).logits
            assert runner.last_decision.split == config.enabled
            assert_logits_close(got, expected[rows])
    assert order == []  # one process: backend 'local', nothing to hand off around


@pytest.mark.triton
def test_triton_experts_are_one_op_of_a_compiled_graph():
    """The fused-MoE host code cannot be traced: a compiled graph holds it as one op
    (`moe::fused_experts`), so the whole graph compiles (fullgraph) and gives the eager
    kernel's output. On CPU the kernel runs under the Triton interpreter."""
    from moe.experts import make_experts

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 32, generator=gen)
    w13 = torch.randn(4, 32, 32, generator=gen) / 6
    w2 = torch.randn(4, 32, 16, generator=gen) / 4
    ids = torch.randint(-1, 4, (8, 2), generator=gen)
    weights = torch.rand(8, 2, generator=gen)
    try:
        experts = make_experts("triton", x.device)
    except ValueError as exc:  # triton not installed, or not interpreted on this CPU
        pytest.skip(str(exc))

    def step(x: torch.Tensor) -> torch.Tensor:
        return experts.apply(torch.tanh(x), w13, w2, ids, weights) * 2

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=False)
    # The same kernel on the same rows, called from the graph: the same bits.
    torch.testing.assert_close(compiled(x), step(x), rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_inductor_triton_experts_dbo_and_cuda_graphs():
    """One GPU: the compiled model with the Triton experts (an op of the graph) and the
    torch versions of the router's and rotary's kernels, DBO on, eagerly and replayed
    from a CUDA graph of the compiled step, against the eager model (bfloat16)."""
    from dbo.graphs import GraphedRunner

    model = MoETransformer(get_preset("tiny", num_layers=2, experts="triton",
                                      dtype=torch.bfloat16), device="cuda")
    model.init_weights(seed=0)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (64,), generator=gen).cuda()
    positions = torch.cat([torch.arange(16)] * 4).cuda()
    lens = [16, 16, 16, 16]
    compiled = torch.compile(model.eval(), dynamic=False)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one GPU: backend 'local' never yields
        expected = model(ids, positions, seq_lens=lens).float()
        runner = DBORunner(compiled, DBO_ON)
        got = runner(ids, positions, seq_lens=lens).float()
        assert runner.last_decision.split
        graphed = GraphedRunner(DBORunner(compiled, DBO_ON))
        replayed = [graphed(ids, positions, seq_lens=lens).float() for _ in range(3)]
    # bfloat16 keeps 8 bits of mantissa: compiled fusions round at other places than
    # the eager kernels, a few roundings of 2^-8 through two layers; 5% of the logits'
    # scale bounds those and is far below what a wrong row or ubatch would give.
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=0.05, atol=0.05 * scale)
    for out in replayed:
        torch.testing.assert_close(out, got, rtol=0.05, atol=0.05 * scale)
