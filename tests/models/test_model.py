"""Layers 1-2 (CPU; one process, then two gloo ranks): the reference MoE transformer.

One process: shapes, determinism, RMSNorm against its fp32 formula, grouped kv heads,
causal attention inside a request and no leakage across requests, DBO (split by requests) against the plain forward, input checks,
presets and `make_batch`. Two ranks: the model with EP over both ranks (a2a, a2a_ll)
against the one-process model on each rank's own batch, DBO on and off.

Tolerance (fp32) 1e-5: the compared runs do the same maths, but on CPU a matmul's
result can depend on how many rows it gets (blocking), and the MoE experts see
different row counts whenever the token set changes (a ubatch, an EP rank's received
tokens, a changed token that routes elsewhere); logits are O(1).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from dbo.config import DBOConfig
from dbo.runner import DBORunner
from moe.config import MoEConfig
from moe.models.attention import causal_attention
from moe.models.transformer import (PRESETS, Batch, ModelConfig, MoETransformer, RMSNorm,
                       get_preset, make_batch)
from moe.models.presets import estimate_param_bytes
from tests.dist_utils import run_distributed

ATOL = RTOL = 1e-5
DBO = DBOConfig(split="requests", min_prefill_tokens=1, min_decode_tokens=1, max_imbalance=1.0)


def tiny_model(seed: int = 0, **overrides) -> MoETransformer:
    model = MoETransformer(get_preset("tiny", **overrides))
    model.init_weights(seed)
    return model


def logits(model: MoETransformer, batch: Batch) -> torch.Tensor:
    with torch.no_grad():
        return model(batch.input_ids_T, batch.positions_T, seq_lens=batch.seq_lens)


def with_ids(batch: Batch, input_ids_T: torch.Tensor) -> Batch:
    return dataclasses.replace(batch, input_ids_T=input_ids_T)


def decode_batch(config: ModelConfig, num_requests: int, seed: int) -> Batch:
    """One token per request at scattered positions (a decode step without KV cache)."""
    gen = torch.Generator().manual_seed(seed)
    return Batch(input_ids_T=torch.randint(0, config.vocab_size, (num_requests,), generator=gen),
                 positions_T=torch.randint(0, 500, (num_requests,), generator=gen),
                 seq_lens=(1,) * num_requests)


# ------------------------------------------------------------------ one process
def test_forward_shapes_dtype_and_empty_batch():
    model = tiny_model()
    cfg = model.config
    batch = make_batch(cfg, num_tokens=29, num_requests=4, seed=1, device="cpu")
    out = logits(model, batch)
    assert out.shape == (29, cfg.vocab_size) and out.dtype == cfg.dtype
    assert torch.isfinite(out).all() and 0.1 < out.std() < 10
    empty = make_batch(cfg, num_tokens=0, num_requests=3, seed=1, device="cpu")
    assert logits(model, empty).shape == (0, cfg.vocab_size)
    assert [m.layer_id for m in model.moe_layers] == list(range(cfg.num_dense_layers,
                                                                cfg.num_layers))
    assert all(m.shared_experts is not None for m in model.moe_layers)


def test_seq_lens_as_tensor_list_or_tuple_agree():
    model = tiny_model()
    batch = make_batch(model.config, num_tokens=20, num_requests=3, seed=2, device="cpu")
    ref = logits(model, batch)
    for seq_lens in (list(batch.seq_lens), torch.tensor(batch.seq_lens)):
        with torch.no_grad():
            out = model(batch.input_ids_T, batch.positions_T, seq_lens=seq_lens)
        torch.testing.assert_close(out, ref, atol=0, rtol=0)


def test_init_is_deterministic_in_the_seed():
    a, b, c = tiny_model(seed=5), tiny_model(seed=5), tiny_model(seed=6)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name
    batch = make_batch(a.config, num_tokens=16, num_requests=2, seed=0, device="cpu")
    assert torch.equal(logits(a, batch), logits(b, batch))


@pytest.mark.parametrize("seq_lens", [(6, 6, 6), (5, 3, 5, 1)])  # a reshape; a row gather
def test_grouped_kv_heads_read_as_if_repeated(seq_lens):
    """k and v with fewer heads are read without copies: query head n uses kv head
    n // (N / Nk), the same as repeating each kv head N / Nk times."""
    gen = torch.Generator().manual_seed(3)
    num_tokens = sum(seq_lens)
    q = torch.randn(num_tokens, 6, 8, generator=gen)
    k, v = (torch.randn(num_tokens, 2, 8, generator=gen) for _ in range(2))
    out = causal_attention(q, k, v, seq_lens)
    repeated = causal_attention(q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1),
                                seq_lens)
    torch.testing.assert_close(out, repeated, atol=ATOL, rtol=RTOL)
    # Head groups differ: a wrong head mapping would not pass the check above.
    assert not torch.allclose(out[:, 0], out[:, 3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_its_fp32_formula(dtype):
    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(96, eps=1e-6, dtype=dtype, device="cpu")
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96, generator=gen) + 0.5)
    x = (torch.randn(11, 96, generator=gen) * 3).to(dtype)
    xf = x.float()
    expected = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
                * norm.weight.float()).to(dtype)
    assert torch.equal(norm(x), expected)


@pytest.mark.gpu
def test_cuda_rms_norm_close_to_its_fp32_formula():
    """The fused CUDA kernel sums in another order than the formula: bf16 results may
    differ by one rounding step, never more."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    norm = RMSNorm(7168, eps=1e-6, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        norm.weight.copy_(torch.rand(7168, generator=gen, device="cuda") + 0.5)
    x = torch.randn(512, 7168, generator=gen, device="cuda").to(torch.bfloat16)
    xf = x.float()
    expected = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
                * norm.weight.float()).to(torch.bfloat16)
    torch.testing.assert_close(norm(x), expected, atol=0, rtol=2 ** -7)


def test_attention_is_causal_within_a_request():
    model = tiny_model()
    batch = Batch(input_ids_T=torch.arange(30) * 7 % 256, positions_T=torch.arange(30),
                  seq_lens=(30,))
    ids = batch.input_ids_T.clone()
    ids[20] = (ids[20] + 1) % 256
    before, after = logits(model, batch), logits(model, with_ids(batch, ids))
    torch.testing.assert_close(after[:20], before[:20], atol=ATOL, rtol=RTOL)
    assert (after[20:] - before[20:]).abs().max() > 1e-2


def test_no_leakage_across_requests():
    model = tiny_model()
    batch = make_batch(model.config, num_tokens=36, num_requests=3, seed=3, device="cpu")
    start, end = batch.seq_lens[0], batch.seq_lens[0] + batch.seq_lens[1]
    ids = batch.input_ids_T.clone()
    ids[start:end] = (ids[start:end] + 101) % model.config.vocab_size
    before, after = logits(model, batch), logits(model, with_ids(batch, ids))
    torch.testing.assert_close(after[:start], before[:start], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(after[end:], before[end:], atol=ATOL, rtol=RTOL)
    assert (after[start:end] - before[start:end]).abs().max() > 1e-2


@pytest.mark.parametrize("seq_lens", [(8, 8, 8), (8, 5, 8, 1, 3, 1), (6,)])
def test_request_logits_do_not_depend_on_packing(seq_lens):
    """A request alone equals the same request packed among others: equal lengths back
    to back (one reshaped SDPA call), apart (a row gather), or a length of its own."""
    model = tiny_model()
    num_tokens = sum(seq_lens)
    batch = Batch(input_ids_T=torch.randint(0, 256, (num_tokens,),
                                            generator=torch.Generator().manual_seed(4)),
                  positions_T=torch.cat([torch.arange(n) for n in seq_lens]), seq_lens=seq_lens)
    packed = logits(model, batch)
    start = 0
    for n in seq_lens:
        rows = slice(start, start + n)
        alone = Batch(input_ids_T=batch.input_ids_T[rows], positions_T=torch.arange(n),
                      seq_lens=(n,))
        torch.testing.assert_close(packed[rows], logits(model, alone), atol=ATOL, rtol=RTOL)
        start += n


def test_attention_phase_ranges_per_ubatch_and_layer(monkeypatch):
    import dbo.phases
    opened = []
    real = dbo.phases.start_phase  # what every phase_scope opens its trace range with

    def recording_start_phase(phase, *, ubatch_id, layer=None):
        if phase == "attention":
            opened.append((phase, ubatch_id, layer))
        return real(phase, ubatch_id=ubatch_id, layer=layer)

    monkeypatch.setattr(dbo.phases, "start_phase", recording_start_phase)
    model = tiny_model()
    batch = make_batch(model.config, num_tokens=20, num_requests=4, seed=0, device="cpu")
    with torch.no_grad():
        DBORunner(model, DBO)(batch.input_ids_T, batch.positions_T, seq_lens=batch.seq_lens)
    layers = range(model.config.num_layers)
    assert sorted(opened) == sorted(("attention", ub, i) for ub in (0, 1) for i in layers)


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_dbo_requests_split_equals_plain_forward(kind):
    model = tiny_model()
    if kind == "prefill":
        batch = make_batch(model.config, num_tokens=45, num_requests=5, seed=7, device="cpu")
    else:
        batch = decode_batch(model.config, 13, seed=7)
    runner = DBORunner(model, DBO)
    with torch.no_grad():
        out = runner(batch.input_ids_T, batch.positions_T, seq_lens=batch.seq_lens)
    assert runner.last_decision.split, runner.last_decision.reason
    torch.testing.assert_close(out, logits(model, batch), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("seq_lens", [(40,), (33, 7)])
def test_dbo_default_config_keeps_every_request_whole(seq_lens):
    """The default `max_imbalance` never cuts a request of a model without a KV cache:
    the tail of a cut request would attend without its head's keys (wrong logits)."""
    model = tiny_model()
    batch = make_batch(model.config, num_tokens=sum(seq_lens), num_requests=1, seed=3)
    batch = dataclasses.replace(batch, seq_lens=seq_lens, positions_T=torch.cat(
        [torch.arange(n) for n in seq_lens]))
    runner = DBORunner(model, DBOConfig(split="requests", min_prefill_tokens=1))
    with torch.no_grad():
        out = runner(batch.input_ids_T, batch.positions_T, seq_lens=batch.seq_lens)
    torch.testing.assert_close(out, logits(model, batch), atol=ATOL, rtol=RTOL,
                               msg=lambda m: f"{runner.last_decision.reason}: {m}")
    d = runner.last_decision
    assert not d.split and "MoETransformer.dbo_can_split_inside_request() is False" in d.reason
    with pytest.raises(ValueError, match="split_inside_requests=True"):
        DBORunner(model, DBOConfig(split="requests", split_inside_requests=True))


def test_bad_inputs_name_the_problem():
    model = tiny_model()
    ids, pos = torch.zeros(6, dtype=torch.int64), torch.arange(6)
    cases = [
        ((ids, pos), dict(seq_lens=[2, 3]), "sum to 5"),
        ((ids, pos[:5]), dict(seq_lens=[6]), "positions_T has 5"),
        ((ids.view(2, 3), pos.view(2, 3)), dict(seq_lens=[6]), "1-D integer tensor"),
        ((ids.float(), pos), dict(seq_lens=[6]), "1-D integer tensor"),
        ((ids, pos), dict(seq_lens=[7, -1]), "ints >= 0"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            model(*args, **kwargs)


# ------------------------------------------------------- a new user's first calls
def test_a_runner_with_the_default_config_splits_the_model_by_requests():
    """`DBORunner(model)`: the default split mode is the model's ("requests", from
    `dbo_split_mode`), so each ubatch gets its own seq_lens. ("tokens", the mode the
    default once was, halved the rows and handed both ubatches every length: a crash.)"""
    model = tiny_model()
    batch = make_batch(model.config, num_tokens=64, num_requests=4, seed=5, device="cpu")
    runner = DBORunner(model)
    with torch.no_grad():
        out = runner(batch.input_ids_T, batch.positions_T, seq_lens=batch.seq_lens)
    torch.testing.assert_close(out, logits(model, batch), atol=ATOL, rtol=RTOL)
    assert "split=None chose 'requests': MoETransformer.dbo_split_mode says so" in \
        runner.last_decision.reason
    # Thresholds lowered, so that the step splits.
    runner = DBORunner(model, DBOConfig(min_prefill_tokens=2, max_imbalance=1.0))
    with torch.no_grad():
        out = runner(batch.input_ids_T, batch.positions_T, seq_lens=batch.seq_lens)
    d = runner.last_decision
    assert d.split and d.ubatches[0].seq_lens == batch.seq_lens[:d.ubatches[0].num_requests]
    torch.testing.assert_close(out, logits(model, batch), atol=ATOL, rtol=RTOL)


def test_a_call_without_seq_lens_says_how_to_pass_them():
    model = tiny_model()
    ids, pos = torch.zeros(6, dtype=torch.int64), torch.arange(6)
    for call in (model, DBORunner(model), DBORunner(model, DBOConfig(split="requests"))):
        with pytest.raises(TypeError) as info, torch.no_grad():
            call(ids, pos)
        assert str(info.value) == (
            "MoETransformer.forward needs the keyword seq_lens=, the tokens per request in "
            "order, summing to T=6: pass e.g. seq_lens=[6] for one request of all 6 tokens "
            "(make_batch gives batch.seq_lens).")
        # One process: nothing about a process group, which there is none of.
        assert not getattr(info.value, "__notes__", []), info.value.__notes__


@pytest.mark.parametrize("backend", ["a2a", "a2a_ll", "naive"])
def test_a_communicating_backend_without_a_process_group_says_to_make_one(backend):
    assert not dist.is_initialized()
    model = tiny_model(backend=backend, max_tokens_per_rank=64)
    batch = make_batch(model.config, num_tokens=16, num_requests=2, seed=0, device="cpu")
    for call in (model, DBORunner(model)):
        with pytest.raises(ValueError) as info, torch.no_grad():
            call(batch.input_ids_T, batch.positions_T, seq_lens=batch.seq_lens)
        assert str(info.value) == (
            f"backend {backend!r} exchanges tokens between ranks through torch.distributed, "
            f"but no process group is initialized: call torch.distributed."
            f"init_process_group(...) on every rank and build the model with the EP group "
            f"(group=...), or use backend 'local' for one process")
        notes = "\n".join(getattr(info.value, "__notes__", []))
        assert "process group" not in notes, notes  # no "re-create" it, no "intact"


def test_the_local_backend_is_warned_about_as_never_yielding():
    from dbo.runner import NoYieldWarning

    model = tiny_model(backend="local")
    batch = make_batch(model.config, num_tokens=32, num_requests=4, seed=0, device="cpu")
    runner = DBORunner(model, DBO)
    with pytest.warns(NoYieldWarning, match="over MoETransformer: the model never yielded"), \
            torch.no_grad():
        runner(batch.input_ids_T, batch.positions_T, seq_lens=batch.seq_lens)
    assert runner.last_decision.split and "never yielded" in runner.last_decision.reason


# -------------------------------------------------------------- presets, config
def test_get_preset_errors_list_the_valid_names():
    with pytest.raises(ValueError, match="tiny") as info:
        get_preset("gpt-oss")
    assert all(name in str(info.value) for name in PRESETS)
    with pytest.raises(ValueError, match="num_layer"):
        get_preset("tiny", num_layer=2)


def test_get_preset_overrides_reach_the_nested_moe_config():
    cfg = get_preset("deepseek-v3-like", num_layers=2, max_tokens_per_rank=128,
                     dtype=torch.float16, hidden_size=1024)
    assert cfg.num_layers == 2 and cfg.moe.max_tokens_per_rank == 128
    assert cfg.dtype == cfg.moe.dtype == torch.float16
    assert cfg.hidden_size == cfg.moe.hidden_size == 1024
    assert PRESETS["deepseek-v3-like"].num_layers == 4  # the preset itself is unchanged
    moe = MoEConfig(num_experts=4, top_k=1, hidden_size=64, intermediate_size=8)
    assert get_preset("tiny", moe=moe, top_k=2).moe == dataclasses.replace(moe, top_k=2)


@pytest.mark.parametrize("overrides, message", [
    (dict(num_dense_layers=5), "num_dense_layers=5"),
    (dict(num_kv_heads=3), "num_kv_heads=3"),
    (dict(head_dim=15), "head_dim=15"),
    (dict(rope_theta=0.0), "rope_theta"),
    (dict(moe=MoEConfig(num_experts=8, top_k=2, hidden_size=32, intermediate_size=8)),
     "hidden_size=64 differs"),
    (dict(moe=MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=8,
                        dtype=torch.bfloat16)), "dtype=torch.float32 differs"),
])
def test_model_config_rejects_inconsistent_fields(overrides, message):
    with pytest.raises(ValueError, match=message):
        get_preset("tiny", **overrides)


def test_presets_shapes_and_parameter_estimate():
    ds = PRESETS["deepseek-v3-like"]
    assert (ds.hidden_size, ds.moe.num_experts, ds.moe.top_k, ds.moe.intermediate_size) == (
        7168, 256, 8, 2048)
    assert ds.moe.n_group == 8 and ds.moe.topk_group == 4 and ds.moe.routed_scaling_factor == 2.5
    for name, cfg in PRESETS.items():
        assert cfg.dtype == cfg.moe.dtype and 2 <= cfg.num_layers <= 4, name
        assert all(cfg.moe.num_experts % w == 0 for w in (2, 4, 8)), name
        model = MoETransformer(cfg, device="meta")  # shapes only, no memory
        num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        assert estimate_param_bytes(cfg) == num_bytes, name
        expert_bytes = sum(m.w13.numel() + m.w2.numel() for m in model.moe_layers) * \
            cfg.dtype.itemsize
        assert estimate_param_bytes(cfg, ep_size=2) == num_bytes - expert_bytes // 2, name


# --------------------------------------------------------------------- make_batch
@settings(max_examples=60, deadline=None)
@given(num_tokens=st.integers(0, 300), num_requests=st.integers(1, 40), seed=st.integers(0, 99))
def test_make_batch_properties(num_tokens, num_requests, seed):
    cfg = PRESETS["tiny"]
    batch = make_batch(cfg, num_tokens=num_tokens, num_requests=num_requests, seed=seed,
                       device="cpu")
    assert isinstance(batch.seq_lens, tuple) and sum(batch.seq_lens) == num_tokens
    assert len(batch.seq_lens) == min(num_requests, num_tokens)
    assert all(isinstance(n, int) and n >= 1 for n in batch.seq_lens)
    assert batch.input_ids_T.shape == batch.positions_T.shape == (num_tokens,)
    assert batch.input_ids_T.dtype == batch.positions_T.dtype == torch.int64
    if num_tokens:
        assert 0 <= batch.input_ids_T.min() and batch.input_ids_T.max() < cfg.vocab_size
    expected = [torch.arange(n) for n in batch.seq_lens]
    assert torch.equal(batch.positions_T, torch.cat(expected) if expected else batch.positions_T)
    again = make_batch(cfg, num_tokens=num_tokens, num_requests=num_requests, seed=seed,
                       device="cpu")
    assert again.seq_lens == batch.seq_lens and torch.equal(again.input_ids_T, batch.input_ids_T)


def test_make_batch_rejects_bad_counts():
    with pytest.raises(ValueError, match="num_tokens=-1"):
        make_batch(PRESETS["tiny"], num_tokens=-1, num_requests=1, seed=0, device="cpu")
    with pytest.raises(ValueError, match="num_requests=0"):
        make_batch(PRESETS["tiny"], num_tokens=4, num_requests=0, seed=0, device="cpu")


# ------------------------------------------------------------------ two gloo ranks
EP_VARIANTS = {
    "tiny": dict(),
    "sigmoid_grouped_bias": dict(scoring="sigmoid", n_group=4, topk_group=2,
                                 use_correction_bias=True, routed_scaling_factor=2.5),
}


def ep_matches_single_process(rank: int, world_size: int, backend: str) -> dict[str, float]:
    """Max |EP logits - one-process logits| per (variant, step, DBO off/on)."""
    errors: dict[str, float] = {}
    for variant, overrides in EP_VARIANTS.items():
        cfg = get_preset("tiny", max_tokens_per_rank=64, **overrides)
        single = MoETransformer(cfg)
        single.init_weights(seed=11)
        ep_cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, backend=backend))
        ep = MoETransformer(ep_cfg, group=dist.group.WORLD)
        ep.init_weights(seed=11)
        for full, mine in zip(single.moe_layers, ep.moe_layers):
            sl = slice(mine.first_expert, mine.first_expert + mine.num_local_experts)
            assert torch.equal(full.w13[sl], mine.w13) and torch.equal(full.w2[sl], mine.w2)
        runner = DBORunner(ep, DBO, group=dist.group.WORLD)
        steps = {
            "prefill": make_batch(cfg, num_tokens=(37, 23)[rank], num_requests=(4, 3)[rank],
                                  seed=100 + rank, device="cpu"),
            "decode": decode_batch(cfg, (9, 14)[rank], seed=200 + rank),
            "rank0_empty": make_batch(cfg, num_tokens=(0, 17)[rank], num_requests=3,
                                      seed=300 + rank, device="cpu"),
        }
        for step, batch in steps.items():
            want = logits(single, batch)
            for dbo_on in (False, True):
                with torch.no_grad():
                    if dbo_on:
                        got = runner(batch.input_ids_T, batch.positions_T,
                                     seq_lens=batch.seq_lens)
                        # every rank split or none did (the vote); rank 0 empty -> none
                        assert runner.last_decision.split == (step != "rank0_empty")
                    else:
                        got = ep(batch.input_ids_T, batch.positions_T, seq_lens=batch.seq_lens)
                assert got.shape == want.shape
                err = (got - want).abs().max().item() if got.numel() else 0.0
                errors[f"{variant}/{step}/dbo={dbo_on}"] = err
    return errors


def split_step_warnings(rank: int, world_size: int) -> list[str]:
    """The warnings of two split DBO steps over a2a (every layer yields at its dispatch)."""
    import warnings

    model = MoETransformer(get_preset("tiny", backend="a2a"), group=dist.group.WORLD)
    model.init_weights(seed=0)
    batch = make_batch(model.config, num_tokens=24, num_requests=3, seed=rank, device="cpu")
    runner = DBORunner(model, DBO, group=dist.group.WORLD)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for _ in range(2):
            runner(batch.input_ids_T, batch.positions_T, seq_lens=batch.seq_lens)
            assert runner.last_decision.split
    return [f"{w.category.__name__}: {w.message}" for w in caught]


@pytest.mark.distributed
def test_a_model_that_yields_is_not_warned_about():
    for rank, caught in enumerate(run_distributed(2, split_step_warnings)):
        assert not [w for w in caught if w.startswith("NoYieldWarning")], (rank, caught)


@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["a2a", "a2a_ll"])
def test_ep_two_ranks_matches_single_process(backend):
    for rank, errors in enumerate(run_distributed(2, ep_matches_single_process, backend)):
        bad = {k: v for k, v in errors.items() if not v <= ATOL}
        assert not bad, f"rank {rank}: {bad}"


# ---------------------------------------------------------------- attention in graphs
def _qkv(tokens: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(tokens, 4, 64, generator=gen, device="cuda").to(dtype)
                 for _ in range(3))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_replayed_from_a_graph_reads_its_host_indices_unchanged(dtype):
    from moe.models.attention import causal_attention

    seq_lens = [3, 5, 3, 5, 2]  # equal lengths apart: SDPA needs a row index
    q, k, v = _qkv(sum(seq_lens), dtype)
    eager = causal_attention(q, k, v, seq_lens)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        causal_attention(q, k, v, seq_lens)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = causal_attention(q, k, v, seq_lens)
    # Churn the pinned-memory cache: blocks freed after the capture may be handed out again.
    for i in range(16):
        for size in range(1, 9):
            for idtype in (torch.int64, torch.int32):
                junk = torch.full((size,), 1000 + i, dtype=idtype).pin_memory()
                torch.empty(size, dtype=idtype, device="cuda").copy_(junk, non_blocking=True)
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
