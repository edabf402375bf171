"""Layer 1 (CPU) and Layer 2 (two gloo processes): the soak's bfloat16 check and the
padding its CUDA-graph steps run with (`dbo.cli.soak.padding`, `dbo.cli.soak.reference`),
and the refusals of `dbo soak --dtype / --cuda-graph / --graph-sizes` before any rank
starts. The graphed soak itself needs GPUs: tests/tools/test_soak_gpu.py.
"""
from __future__ import annotations

import importlib.util
from dataclasses import replace
from typing import Any

import pytest
import torch

import dbo.cli.soak.run
from dbo.cli.launch import RankContext
from dbo.cli.soak import SoakConfig, main, run_rank
from dbo.cli.soak.padding import (capture_sweep_tokens, default_graph_sizes, pad_rows,
                                  padded_size)
from dbo.cli.soak.reference import BF16_REL_TOL, DenseReference, relative_error
from dbo.cli.soak.workload import SoakModel, draw_step_input
from moe.config import MoEConfig
from moe.reference import init_moe_weights, reference_moe
from tests.dist_utils import run_distributed
from tests.tools.test_soak import refused_before_any_rank

CPU = torch.device("cpu")


def _local_model(job: SoakConfig) -> SoakModel:
    model = SoakModel(job, group=None, experts="reference", device=CPU, backend="local")
    model.init_weights(job.seed)
    return model


# ------------------------------------------------------------------------------ padding
def test_graph_sizes():
    assert default_graph_sizes(64) == (2, 4, 8, 16, 32, 64)
    assert default_graph_sizes(100) == (2, 4, 8, 16, 32, 64, 100)
    assert default_graph_sizes(2) == (2,)
    sizes = (2, 8, 64)
    assert [padded_size(n, sizes) for n in (0, 1, 2, 3, 8, 9, 64)] == [2, 2, 2, 8, 8, 64, 64]
    # The capture sweep: largest first, every rank alike, then random sizes again.
    job = SoakConfig(pad_steps=True, graph_sizes=sizes, warmup=5, steps=10)
    gen = torch.Generator()
    assert [capture_sweep_tokens(s, sizes) for s in range(4)] == [64, 8, 2, None]
    for rank in (0, 1):
        assert [draw_step_input(job, s, rank, gen).shape[0] for s in range(3)] == [64, 8, 2]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_padding_rows_change_no_real_row(dtype):
    job = SoakConfig(dtype=dtype, layers=2, pad_steps=True)
    model = _local_model(job)
    x_TH = torch.randn(5, job.hidden, generator=torch.Generator().manual_seed(1))
    x_TH = x_TH.to(job.torch_dtype)
    padded = pad_rows(x_TH, padded_size(5, job.capture_sizes))
    assert padded.shape == (8, job.hidden) and torch.equal(padded[:5], x_TH)
    assert not padded[5:].any()
    with torch.no_grad():
        alone, with_pads = model(x_TH), model(padded)
    # The padding rows are routed like any row (at layer 0 their logits are 0: a tie);
    # after a layer they are rows like the others (the Linear's bias).
    logits_pads = with_pads[2][5:]
    assert logits_pads.shape == (3, 2, job.num_experts) and not logits_pads[:, 0].any()
    assert logits_pads[:, 1].any()
    # Equal up to the GEMMs' blocking by row count (8 rows, not 5): the last bits, the
    # soak's float32 --atol; in bfloat16 a last bit that changes a rounding: one ulp.
    atol = SoakConfig().atol if dtype == "float32" else 2.0 ** -8
    for a, b in zip(alone, with_pads):
        assert b.shape[0] == 8
        torch.testing.assert_close(b[:5], a, rtol=atol, atol=atol)


# ------------------------------------------------------------------------------ bf16 check
def test_dense_reference_is_reference_moe():
    """The vectorised dense layer equals moe.reference.reference_moe (per token and
    expert, float32), routed from the same logits, plus the residual, Linear and GELU."""
    job = SoakConfig(dtype="float32", layers=1, hidden=16, intermediate=8)
    model = _local_model(job)
    reference = DenseReference(model, [SoakModel.expert_seed(job.seed, 0)])
    x_TH = torch.randn(7, job.hidden, generator=torch.Generator().manual_seed(2))
    config: MoEConfig = model.moe_config
    weights = init_moe_weights(config, seed=SoakModel.expert_seed(job.seed, 0))
    with torch.no_grad():
        moe_TH = reference_moe(x_TH, router_weight_EH=weights["router_weight"],
                               w13_EIH=weights["w13"], w2_EHI=weights["w2"], config=config,
                               shared_experts=model.moe[0].shared_experts)
        want_TH = torch.nn.functional.gelu(model.dense[0](x_TH + moe_TH))
        got_TH = reference.layer(0, x_TH, model.moe[0].router(x_TH))
    torch.testing.assert_close(got_TH, want_TH, rtol=1e-5, atol=1e-5)


def test_bf16_error_within_bound_and_catches_a_wrong_row():
    job = SoakConfig(dtype="bfloat16", layers=2)
    model = _local_model(job)
    reference = DenseReference(model, [SoakModel.expert_seed(job.seed, i) for i in range(2)])
    x_TH = torch.randn(40, job.hidden, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out_TH, hidden_TLH, logits_TLE = model(x_TH.to(torch.bfloat16))
        error = reference.error(out_TH, hidden_TLH, logits_TLE)
        assert 0 < error <= BF16_REL_TOL
        # One wrong element of one row, by 0.1 of the output's scale: caught, as is a
        # wrong row of a middle layer's output, and a NaN.
        scale = max(1.0, out_TH.float().abs().max().item())
        bad = out_TH.clone()
        bad[17, 3] += 0.1 * scale
        assert reference.error(bad, hidden_TLH, logits_TLE) > BF16_REL_TOL
        swapped = hidden_TLH.clone()
        swapped[4, 1], swapped[5, 1] = hidden_TLH[5, 1], hidden_TLH[4, 1]
        assert reference.error(out_TH, swapped, logits_TLE) > BF16_REL_TOL
        bad[0, 0] = float("nan")
        assert reference.error(bad, hidden_TLH, logits_TLE) == float("inf")
    assert relative_error(torch.full((2,), 3.0), torch.full((2,), 2.0)) == 0.5


# ------------------------------------------------------------------------------ two ranks
def _soaks(rank: int, world_size: int, jobs: list[SoakConfig]) -> Any:
    ctx = RankContext(rank, world_size, CPU, "gloo")
    return [run_rank(ctx, job) for job in jobs]


def test_bf16_padded_soak_a2a_two_ranks():
    # 20 steps: rank 1 has 0 tokens at steps 6 and 13, rank 0 at step 10; the memory
    # samples at 8 (the baseline, after the 5-size capture sweep), 19 and 20.
    base = SoakConfig(steps=20, backend="a2a", layers=1, warmup=8, report_every=11,
                      trace_window=5, max_tokens=24)
    jobs = [replace(base, dtype="bfloat16"), replace(base, dtype="bfloat16", pad_steps=True),
            replace(base, pad_steps=True)]
    plain, padded, padded_fp32 = run_distributed(2, _soaks, jobs)[0]
    for s in (plain, padded):
        assert s["dtype"] == "bfloat16" and s["rel_tol"] == BF16_REL_TOL
        assert 0 < s["max_rel_err"] <= BF16_REL_TOL and "max_abs_diff" not in s
        assert s["mismatched_steps"]["count"] == 0 and s["memory_ok"] and s["ok"], s
    assert padded_fp32["max_abs_diff"] <= padded_fp32["atol"] and padded_fp32["ok"]
    # Unpadded, a step with a 0- or 1-token rank runs unsplit; padded to >= 2 rows on
    # every rank, every step splits, zero-token steps included.
    assert plain["split_steps"] < 20
    for s in (padded, padded_fp32):
        assert s["padded"] and s["split_steps"] == 20 and min(s["zero_token_steps"]) > 0
        assert s["graphs"] is None  # eager: nothing captured


# ------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("argv, message", [
    (["--dtype", "float16"], "invalid choice: 'float16'"),
    (["--cuda-graph", "--backend", "a2a_ll"], "--cuda-graph needs CUDA GPUs, and none is "
                                              "visible here"),
    (["--cuda-graph", "--backend", "a2a"], "--cuda-graph with --backend=a2a: that backend "
                                           "reads device values on the host"),
    (["--cuda-graph", "--backend", "a2a_ll", "--experts", "reference"],
     "--cuda-graph with --experts=reference"),
    (["--backend", "deepep_ll", "--hidden", "2048"], "--backend=deepep_ll with --dtype "
                                                     "float32: DeepEP's kernels move bfloat16"),
    (["--backend", "deepep_ll", "--dtype", "bfloat16"], "--backend=deepep_ll with "
                                                        "--hidden=32: DeepEP's low-latency"),
    pytest.param(["--backend", "deepep_ll", "--dtype", "bfloat16", "--hidden", "2048"],
                 "backend 'deepep_ll' needs DeepEP (deep_ep.Buffer), which is not installed",
                 marks=pytest.mark.skipif(importlib.util.find_spec("deep_ep") is not None,
                                          reason="deep_ep is installed")),
    (["--backend", "symm_mem"], "backend 'symm_mem' runs NVSHMEM kernels on CUDA GPUs and "
                                "this process has no CUDA device"),
    (["--max-tokens", "99999999999999"], "--max-tokens=99999999999999: the soak model (2 "
                                         "layers of 8 experts over 2 ranks"),
    (["--layers", "99999999"], "the soak model (99999999 layers of 8 experts over 2 ranks, "
                               "--hidden=32, --intermediate=16) would need about"),
    (["--dtype", "bfloat16", "--atol", "0.1"], "--atol bounds float32 steps only"),
    (["--graph-sizes", "2,64"], "--graph-sizes without --cuda-graph"),
    (["--cuda-graph", "--backend", "a2a_ll", "--graph-sizes", "2,8"],
     "--graph-sizes=2,8: the largest must be --max-tokens=64"),
    (["--cuda-graph", "--backend", "a2a_ll", "--graph-sizes", "1,64"],
     "must be strictly increasing and at least 2"),
    (["--cuda-graph", "--backend", "a2a_ll", "--graph-sizes", "2,x"],
     "give comma-separated integers"),
    (["--cuda-graph", "--backend", "a2a_ll", "--warmup", "3"],
     "--warmup=3 is shorter than the capture sweep (6 steps"),
])
def test_bad_args_exit_2(argv, message, capsys, monkeypatch):
    err = refused_before_any_rank(argv, capsys, monkeypatch)
    assert message in err, err


def test_deepep_ll_capacity_refused_before_ranks(capsys, monkeypatch):
    """On a GPU machine (faked here): deepep_ll's capacity must fit NVSHMEM's queue depth;
    on 2 ranks 511 tokens round up to a capacity of 512, one too many."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dbo.cli.soak.run, "run_soak", lambda *a, **k: None)
    monkeypatch.delenv("NVSHMEM_QP_DEPTH", raising=False)
    argv = ["--backend", "deepep_ll", "--dtype", "bfloat16", "--hidden", "2048",
            "--experts", "triton", "--max-tokens"]
    with pytest.raises(SystemExit) as exc:
        main([*argv, "511"])
    assert exc.value.code == 2
    assert ("--max-tokens=511 with --backend=deepep_ll on 2 ranks: DeepEP's capacity 512 "
            "needs an NVSHMEM queue depth of 1026, above NVSHMEM_QP_DEPTH=1024; use "
            "--max-tokens <= 510") in capsys.readouterr().err
    from dbo.cli import check_backend_tokens
    env = {"NVSHMEM_QP_DEPTH": "1024"}
    check_backend_tokens("deepep_ll", "--max-tokens", 510, 2, backend_option="",
                         env=env)  # fits
    check_backend_tokens("deepep_ll", "--max-tokens", 511, 4, backend_option="", env=env)
    check_backend_tokens("a2a", "--max-tokens", 10**6, 2, backend_option="", env=env)  # no limit
