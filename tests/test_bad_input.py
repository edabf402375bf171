"""Layer 1 (CPU): every rejected input of the error tables in docs/errors.md, with its
error text, and the inputs that are accepted (zero tokens, non-contiguous tensors, NaN/Inf
router logits by default, a forward with gradients on, out-of-range custom routing ids).
A last test checks those tables and this file agree.

Rejections that need two processes (capacity overflow, experts not divisible by the EP
size, peers' rejected inputs or configurations, a group reused after a failed step) are
tested in tests/dbo/test_failures.py, test_group_reuse.py, test_agreement.py,
test_step_vote.py, tests/moe/test_moe_layer.py and tests/models/test_hf_convert.py; their
rows here point there. The `moe.hf` rows need transformers and skip without it.
"""
from __future__ import annotations

import json
import re
import sys
import types
from unittest import mock
from pathlib import Path
from typing import Optional

import pytest
import torch

from dbo import DBOConfig, DBORunner, UBatchScheduler
from moe import MoEConfig, MoELayer, init_moe_weights
from moe.backends.a2a_ll import A2ALLOptions
from moe.backends.deepep_v2 import DeepEPV2Options
from moe.backends.nccl_ep import NCCLEPOptions
from moe.models.transformer import MoETransformer, get_preset
from tests.hf_utils import rewrite_without, save, tiny_model

ERRORS_DOC = Path(__file__).resolve().parent.parent / "docs" / "errors.md"


def layer(**overrides) -> MoELayer:
    cfg = MoEConfig(**{**dict(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8,
                              experts="reference"), **overrides})
    moe_layer = MoELayer(cfg)
    moe_layer.load_weights(init_moe_weights(cfg, seed=0))
    return moe_layer


def call_layer(x: torch.Tensor, **overrides) -> None:
    with torch.no_grad():
        layer(**overrides)(x)


def layer_without_deep_ep(backend: str) -> None:
    """Construct a layer with `backend` as if `deep_ep` were not installed (a None in
    sys.modules reads as absent)."""
    with mock.patch.dict(sys.modules, {"deep_ep": None}):
        layer(backend=backend)


def symm_mem_layer_without_cuda() -> None:
    """Construct a `symm_mem` layer as if this process had no CUDA device."""
    with mock.patch.object(torch.cuda, "is_available", return_value=False):
        layer(backend="symm_mem", max_tokens_per_rank=8)


def deepep_layer_with_hidden(hidden: int) -> None:
    """Construct a `deepep_ll` layer as if `deep_ep` and CUDA were there (a stand-in
    module): the shape is refused before DeepEP is called."""
    fake = types.ModuleType("deep_ep")
    fake.__spec__ = types.SimpleNamespace(name="deep_ep")
    fake.Buffer = object
    with mock.patch.dict(sys.modules, {"deep_ep": fake}), \
            mock.patch.object(torch.cuda, "is_available", return_value=True):
        layer(backend="deepep_ll", hidden_size=hidden, dtype=torch.bfloat16)


def nccl_ep_layer(*, installed: bool = True, hidden: int = 2048) -> None:
    """`nccl_ep`'s checks of a layer config, as on a GPU machine with NCCL EP and NCCL
    2.30.7 (`installed`: whether nccl-extensions is there)."""
    from moe.backends.nccl_ep_support import check_nccl_ep_rows, require_nccl_ep
    require_nccl_ep(installed=lambda: installed, cuda_available=lambda: True,
                    nccl_version=lambda: (2, 30, 7), find=lambda: types.ModuleType("nccl.ep"))
    check_nccl_ep_rows(hidden, torch.bfloat16, "ll")


def deepep_v2_on(*, nccl: tuple = (2, 30, 4), dtype: torch.dtype = torch.bfloat16) -> None:
    """`deepep_v2`'s check of what DeepEP v2 needs, as on a GPU machine with DeepEP v2
    installed and torch's NCCL at `nccl` (the facts are its keyword arguments)."""
    from moe.backends.deepep_v2 import elastic_buffer_class

    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8, dtype=dtype,
                    backend="deepep_v2", max_tokens_per_rank=8)
    elastic_buffer_class(cfg, "ep_group", find_deep_ep=lambda: mock.Mock(spec=["ElasticBuffer"]),
                         nccl_version=lambda: nccl, cuda_available=lambda: True)


def deepep_ll_buffer_after_symm_mem() -> None:
    """`deepep_ll`'s low-latency buffer in a process where `symm_mem` has made its
    symmetric buffers (the record of that set by hand; a stand-in `deep_ep`): refused
    before DeepEP is called (the reverse order: tests/moe/test_nvshmem_one_owner.py)."""
    import moe.backends.nvshmem_owner as nvshmem_owner
    from moe.backends.deepep_support import shared_buffer

    fake = types.ModuleType("deep_ep")
    fake.Buffer = mock.Mock(side_effect=AssertionError("a DeepEP buffer was made"))
    with mock.patch.object(nvshmem_owner, "_CLAIMS", ["symm_mem"]):
        shared_buffer(fake, mock.Mock(), "ll", num_rdma_bytes=1 << 20)


def nan_logits_input() -> torch.Tensor:
    x = torch.randn(5, 8)
    x[2] = float("nan")
    return x


def float_ids_step() -> None:
    model = MoETransformer(get_preset("tiny", backend="local", experts="reference"))
    runner = DBORunner(model, DBOConfig(split="requests", min_prefill_tokens=1))
    runner(torch.zeros(4), torch.arange(4), seq_lens=[4])


def out_of_vocabulary_step() -> None:
    model = MoETransformer(get_preset("tiny", backend="local", experts="reference"))
    runner = DBORunner(model, DBOConfig(enabled=False))
    runner(torch.tensor([0, 1, model.config.vocab_size, 2]), torch.arange(4), seq_lens=[4])


class BadAgreement:
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def dbo_agreement(self) -> dict[str, object]:
        return {"fn": lambda: 0}


def backward_through_layer() -> None:
    layer()(torch.randn(3, 8)).sum().backward()  # parameters require grad (the default)


def overfull_cache_step() -> None:
    from moe.models.kv_cache import KVCache, with_cache_split

    model = MoETransformer(get_preset("tiny", backend="local", experts="reference"))
    cache = KVCache.empty(model.config, num_requests=2, capacity=8)
    runner = DBORunner(model, with_cache_split(DBOConfig(min_prefill_tokens=1)))
    runner(torch.zeros(10, dtype=torch.long), torch.arange(10), seq_lens=[9, 1], cache=cache)


def requests_runner() -> DBORunner:
    return DBORunner(lambda x, seq_lens: x, DBOConfig(split="requests", min_prefill_tokens=1))


# key: (action raising the error, exception type, error text; docs/errors.md quotes
# part of that text)
REJECTED = {
    "wrong dtype": (lambda: call_layer(torch.randn(3, 8, dtype=torch.float64)), ValueError,
                    "x is torch.float64 but MoEConfig.dtype is torch.float32"),
    "wrong device": (lambda: call_layer(torch.randn(3, 8, device="meta")), ValueError,
                     "x is on meta but the layer's parameters are on cpu"),
    "wrong shape": (lambda: call_layer(torch.randn(3, 9)), ValueError,
                    "expected [T, hidden_size=8]"),
    "NaN/Inf router logits, checked": (
        lambda: call_layer(nan_logits_input(), check_finite_logits=True), ValueError,
        "router logits of 1 of 5 tokens are NaN/Inf"),
    "top_k > num_experts": (
        lambda: MoEConfig(num_experts=4, top_k=5, hidden_size=8, intermediate_size=8),
        ValueError, "top_k=5 exceeds num_experts=4"),
    "n_group does not divide num_experts": (
        lambda: MoEConfig(num_experts=8, top_k=2, hidden_size=8, intermediate_size=8,
                          n_group=3, topk_group=1), ValueError,
        "n_group=3 does not divide num_experts=8"),
    "router weight on input with top_k > 1": (
        lambda: MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8,
                          apply_router_weight_on_input=True), ValueError,
        "apply_router_weight_on_input=True needs top_k=1"),
    "`A2ALLOptions.max_tokens_per_ubatch` above `max_tokens_per_rank`": (
        lambda: MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8,
                          backend="a2a_ll", max_tokens_per_rank=8,
                          backend_options=A2ALLOptions(max_tokens_per_ubatch=9)),
        ValueError, "A2ALLOptions.max_tokens_per_ubatch=9 needs MoEConfig.max_tokens_per_rank "
                    ">= 9 (got 8)"),
    "a backend's options given to another backend": (
        lambda: MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8,
                          backend="a2a", backend_options=A2ALLOptions(combine_chunks=2)),
        ValueError, "MoEConfig.backend_options=A2ALLOptions(...) are the options of backend "
                    "'a2a_ll', not of backend 'a2a' (which takes NoOptions)"),
    "a config boolean that is not a bool": (
        lambda: MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8,
                          renormalize="false"), TypeError,
        "MoEConfig.renormalize='false': must be True or False"),
    "a backward through an MoE layer": (
        backward_through_layer, RuntimeError,
        "MoELayer layer 0 (backend 'local', experts 'reference') is inference-only: it has "
        "no backward"),
    "unknown backend": (lambda: layer(backend="nope"), ValueError,
                        "unknown MoE backend 'nope'"),
    "DeepEP backend without deep_ep": (
        lambda: layer_without_deep_ep("deepep_ht"), ImportError,
        "backend 'deepep_ht' needs DeepEP (deep_ep.Buffer), which is not installed"),
    "`symm_mem` backend without CUDA": (
        symm_mem_layer_without_cuda, ValueError,
        "backend 'symm_mem' runs NVSHMEM kernels on CUDA GPUs and this process has no CUDA "
        "device"),
    "DeepEP backend with a shape or dtype its kernels cannot take": (
        lambda: deepep_layer_with_hidden(1000), ValueError,
        "MoEConfig.hidden_size=1000 is not supported: DeepEP's low-latency kernels are "
        "compiled for hidden sizes"),
    "a DeepEP low-latency buffer (`deepep_ll`, bench-comm's `deepep_raw_ll`) and `symm_mem` "
    "in one process, either order": (
        deepep_ll_buffer_after_symm_mem, RuntimeError,
        "backend 'deepep_ll' would make a DeepEP low-latency buffer in a process where backend "
        "'symm_mem' has started NVSHMEM"),
    "unknown experts kernel": (lambda: layer(experts="nope"), ValueError,
                               "unknown experts kernel 'nope'"),
    "`DBOConfig(split_inside_requests=True)` for a model whose "
    "`dbo_can_split_inside_request()` is False": (
        lambda: DBORunner(MoETransformer(get_preset("tiny", backend="local",
                                                    experts="reference")),
                          DBOConfig(split="requests", split_inside_requests=True)),
        ValueError,
        "DBOConfig(split_inside_requests=True), but "
        "MoETransformer.dbo_can_split_inside_request() is False"),
    "more combine chunks than slot rows": (
        lambda: MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8,
                          backend="a2a_ll", max_tokens_per_rank=8,
                          backend_options=A2ALLOptions(combine_chunks=9)), ValueError,
        "A2ALLOptions.combine_chunks=9 exceeds MoEConfig.max_tokens_per_rank=8"),
    "a field that moved into a backend's options (`combine_chunks`, `max_tokens_per_ubatch`, `deepep`, `deepep_v2_mode`)": (
        lambda: MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8,
                          backend="a2a_ll", max_tokens_per_rank=8, combine_chunks=2),
        TypeError,
        "MoEConfig(combine_chunks=...) is a backend's option now: pass "
        "MoEConfig(backend_options=A2ALLOptions(combine_chunks=...))"),
    "more combine groups than experts, or both groups and chunks": (
        lambda: MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8,
                          backend="a2a_ll", max_tokens_per_rank=8,
                          backend_options=A2ALLOptions(combine_groups=5)), ValueError,
        "A2ALLOptions.combine_groups=5 exceeds MoEConfig.num_experts=4"),
    "unknown `deepep_v2` mode": (
        lambda: DeepEPV2Options(mode="eager"), ValueError,
        "DeepEPV2Options.mode='eager' is not a deepep_v2 mode"),
    "`deepep_v2` with NCCL older than 2.30.4 (DeepEP v2 installed, CUDA present)": (
        lambda: deepep_v2_on(nccl=(2, 28, 9)), ImportError,
        "backend 'deepep_v2' needs NCCL >= 2.30.4 (DeepEP v2 uses NCCL's device API) but "
        "this process runs NCCL 2.28.9"),
    "`deepep_v2` with a dtype other than bfloat16 (also: hidden size not a multiple of 8, "
    "no process group)": (
        lambda: deepep_v2_on(dtype=torch.float32), ValueError,
        "backend 'deepep_v2' moves torch.bfloat16 tokens only"),
    "`nccl_ep` without nccl-extensions": (
        lambda: nccl_ep_layer(installed=False), ImportError,
        "backend 'nccl_ep' needs NCCL EP (nccl.ep), which is not installed: pip install "
        "nccl-extensions"),
    "`nccl_ep` in its low-latency form with a hidden size not a multiple of 512": (
        lambda: nccl_ep_layer(hidden=2880), ValueError,
        "backend 'nccl_ep' in its low-latency form (NCCLEPOptions.mode='ll') moves rows of "
        "a multiple of 512 bf16 values, but hidden_size=2880"),
    "unknown `nccl_ep` mode": (
        lambda: NCCLEPOptions(mode="fast"), ValueError,
        "NCCLEPOptions.mode='fast' is not an nccl_ep mode"),
    "fixed-capacity backend without a capacity": (
        lambda: layer(backend="a2a_ll"), ValueError, "needs MoEConfig.max_tokens_per_rank"),
    "capacity overflow on this rank": (
        lambda: call_layer(torch.randn(9, 8), backend="a2a_ll", max_tokens_per_rank=8),
        ValueError, "9 tokens on this rank exceed MoEConfig.max_tokens_per_rank=8"),
    "unknown split mode": (lambda: DBOConfig(split="nope"), ValueError,
                           "DBOConfig.split='nope' is not a split mode"),
    "unknown overlap policy": (lambda: DBOConfig(overlap="both"), ValueError,
                               "DBOConfig.overlap='both' is not an overlap policy"),
    "seq_lens not summing to the tokens": (
        lambda: requests_runner()(torch.randn(5, 2), seq_lens=[2, 2]), ValueError,
        "seq_lens sum to 4 tokens but the batch has 5 tokens"),
    "requests split without seq_lens": (
        lambda: requests_runner()(torch.randn(5, 2)), TypeError,
        "split='requests' needs the tokens per request"),
    "a tensor argument whose dim 0 is not the step's rows (`DBORunner`, named split modes)": (
        lambda: DBORunner(lambda x, mask: x, DBOConfig(min_decode_tokens=0))(
            torch.randn(64, 8), torch.ones(32)), ValueError,
        "positional argument 1 has shape [32], but the step has 64 rows"),
    "`DBOConfig.unsplit_args` / `split_kwargs` not a tuple of argument names": (
        lambda: DBOConfig(unsplit_args="mask"), ValueError,
        "DBOConfig.unsplit_args='mask' must be a tuple"),
    "non-integer `input_ids_T` (`MoETransformer`, checked before the vote)": (
        float_ids_step, ValueError, "input_ids_T must be a 1-D integer tensor"),
    "a token id outside the vocabulary (`MoETransformer`, CPU ids, checked before the vote)": (
        out_of_vocabulary_step, ValueError,
        "input_ids_T[2]=256 is outside the vocabulary [0, vocab_size=256)"),
    "a KV cache that does not fit the call (`MoETransformer`: other request count, over capacity; checked before the vote)": (
        overfull_cache_step, ValueError,
        "request 0 would hold 9 tokens, more than the KV cache's capacity 8"),
    "a `dbo_agreement()` field that is not a plain value": (
        lambda: DBORunner(BadAgreement())(torch.ones(2)), TypeError,
        "field 'fn' is a function: use None, bool, int, float, str, torch.dtype"),
    "no ubatches": (lambda: UBatchScheduler("cpu").run([]), ValueError,
                    "run([]) got no ubatches"),
    "more than two ubatches": (lambda: UBatchScheduler("cpu").run([lambda: 0] * 3),
                               ValueError, "at most 2 are supported"),
    "a ubatch that is not callable": (lambda: UBatchScheduler("cpu").run([lambda: 0, 1]),
                                      TypeError, "ubatch 1 is a int, not a callable"),
}


def hf_convert_twice() -> None:
    from moe.hf import convert
    convert(convert(tiny_model("qwen3_moe")))


def hf_load_without(tmp_path: Path, name: str, **config_edits) -> None:
    from moe.hf import load
    path = save(tiny_model("mixtral"), tmp_path)
    rewrite_without(path, lambda k: k == name)
    if config_edits:
        config = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**config, **config_edits}))
    load(path)


def hf_load_edited(tmp_path: Path, family: str, **config_edits) -> None:
    """`moe.hf.load` of the saved tiny model of `family` (`moe.hf.coverage`), config.json
    edited."""
    from moe.hf import coverage, load
    path = save(coverage.tiny_model(family), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **config_edits}))
    load(path)


def hf_save_converted(tmp_path: Path, *, extra_tensor: bool = False, **options) -> None:
    """`save_pretrained` of a converted tiny OLMoE (its second block's experts module
    given a tensor the experts path does not keep, with `extra_tensor`)."""
    from moe.hf import convert, coverage
    model = coverage.tiny_model("olmoe")
    if extra_tensor:
        model.model.layers[1].mlp.experts.scale = torch.nn.Parameter(torch.ones(4))
    convert(model).save_pretrained(tmp_path, **options)


def hf_generate_unconverted() -> None:
    from moe.hf import generate
    generate(DBORunner(tiny_model("qwen3_moe")), torch.zeros(1, 2, dtype=torch.long),
             max_new_tokens=1)


def hf_generate_with(arch: str = "qwen3_moe", *, convert_with: Optional[dict] = None,
                     attention: Optional[str] = None, sizes: Optional[dict] = None,
                     **options) -> None:
    """`moe.hf.generate` on a converted tiny model with `options` (static_cache,
    cuda_graph), on CPU: refused before any step."""
    from moe.hf import convert, generate
    model = tiny_model(arch, **(sizes or {}))
    if attention is not None:
        from dbo.cli.bench.hf_graphs import use_mask_free_sdpa
        assert attention == "mask-free sdpa", attention
        use_mask_free_sdpa(model)
    convert(model, **(convert_with or {}))
    generate(DBORunner(model), torch.zeros(2, 3, dtype=torch.long), max_new_tokens=2,
             **options)


def hf_convert(arch: str, **sizes) -> None:
    from moe.hf import convert
    convert(tiny_model(arch, **sizes))


def hf_convert_with(**options) -> None:
    from moe.hf import convert
    convert(tiny_model("qwen3_moe"), **options)


def hf_batch_mask(*, mask_len: int = 4, **overrides) -> None:
    import moe.hf
    ids = torch.zeros(2, 4, dtype=torch.long)
    moe.hf.batch_attention_mask(tiny_model("qwen2_moe", **overrides), ids,
                                torch.ones(2, mask_len, dtype=torch.long))


# The same for moe.hf (transformers models); each action takes a tmp directory.
HF_REJECTED = {
    # GPT-OSS and OLMoE blocks convert since the experts path (moe.hf.generic); what it
    # refuses is tested in tests/models/test_hf_experts_path.py.
    "`moe.hf.convert` of a converted model": (
        lambda tmp: hf_convert_twice(), ValueError, "'model.layers.0.mlp' is already converted"),
    "`moe.hf.convert` / `moe.hf.load` with a backend that needs a capacity (`a2a_ll`, "
    "`symm_mem`, `deepep_ll`) and no `max_tokens_per_rank`": (
        lambda tmp: hf_convert_with(backend="a2a_ll"), ValueError,
        "backend 'a2a_ll' needs max_tokens_per_rank"),
    "`moe.hf.convert` / `moe.hf.load`: `max_tokens_per_rank` that is not a positive int": (
        lambda tmp: hf_convert_with(backend="a2a_ll", max_tokens_per_rank=0), ValueError,
        "max_tokens_per_rank=0 must be a positive int"),
    "`moe.hf.load` of a checkpoint missing an expert's tensor": (
        lambda tmp: hf_load_without(tmp, "model.layers.1.block_sparse_moe.experts.2.w3.weight"),
        ValueError, "has no tensor 'model.layers.1.block_sparse_moe.experts.2.w3.weight'"),
    "`moe.hf.load`: config.json and checkpoint shapes differ": (
        lambda tmp: hf_load_without(tmp, "", intermediate_size=24), ValueError,
        "config.json and the weights disagree"),
    "`moe.hf.load` of a quantized checkpoint": (
        lambda tmp: hf_load_edited(tmp, "olmoe", quantization_config={"quant_method": "fp8"}),
        ValueError, "holds quantized weights (config.json's quantization_config, quant_method "
                    "'fp8')"),
    "`moe.hf.load` of a model type transformers has no causal LM for": (
        lambda tmp: hf_load_edited(tmp, "mistral4"), ValueError,
        "transformers has no causal LM for a 'mistral4' config"),
    "`moe.hf.load` of a family whose experts transformers converts with an operation not "
    "known to keep experts apart": (
        lambda tmp: hf_load_edited(tmp, "inkling2_loop"), ValueError,
        "with Inkling2LoopDequantizeExperts, which dbo cannot apply to one rank's experts "
        "alone"),
    "`save_pretrained(state_dict=...)` of a converted model": (
        lambda tmp: hf_save_converted(tmp, state_dict={}), ValueError,
        "save_pretrained(state_dict=) of a converted model is not supported"),
    "`save_pretrained` of a converted block that did not keep a tensor of the module it "
    "replaced": (
        lambda tmp: hf_save_converted(tmp, extra_tensor=True), ValueError,
        "of the unconverted model: the converted block lacks it; save the model before "
        "converting it"),
    "`moe.hf.generate` on a model not converted": (
        lambda tmp: hf_generate_unconverted(), ValueError,
        "has no converted MoE block: convert it first, model = moe.hf.convert(model"),
    "`moe.hf.generate(cuda_graph=True)` on CPU tensors": (
        lambda tmp: hf_generate_with(cuda_graph=True), ValueError,
        "moe.hf.generate(cuda_graph=True) replays CUDA graphs, but input_ids are on cpu"),
    "`moe.hf.generate(cuda_graph=True)` on a model that reads device values on the host "
    "(backend `a2a`, experts `reference`)": (
        lambda tmp: hf_generate_with(convert_with=dict(experts="reference"), cuda_graph=True),
        ValueError, "moe.hf.generate(cuda_graph=True): this model cannot run in a CUDA "
                    "graph: model.layers.0.mlp.moe: experts 'reference' select each "
                    "expert's rows on the host"),
    "`moe.hf.generate(static_cache=True)` (or `cuda_graph=True`) on a model with sliding-"
    "window (or chunked, linear) attention layers": (
        lambda tmp: hf_generate_with("mixtral", sizes=dict(sliding_window=4),
                                     static_cache=True),
        ValueError, "a static window that rolls cannot be replayed"),
    "`moe.hf.generate(static_cache=True)` (or `cuda_graph=True`) on a model attending "
    "through other than sdpa or eager": (
        lambda tmp: hf_generate_with(attention="mask-free sdpa", static_cache=True),
        ValueError, "whose mask does not cover a static cache's empty slots; call "
                    "model.set_attn_implementation('sdpa') first"),
    "`moe.hf.generate`: `static_cache` or `cuda_graph` not a bool": (
        lambda tmp: hf_generate_with(static_cache="yes"), TypeError,
        "moe.hf.generate: static_cache='yes' must be True or False"),
    "`moe.hf.batch_attention_mask` for a model whose layers mix full and sliding-window "
    "attention": (
        lambda tmp: hf_batch_mask(layer_types=["full_attention", "sliding_attention"],
                                  use_sliding_window=True, sliding_window=4),
        ValueError, "the model's layers mix attention kinds ['full_attention', "
                    "'sliding_attention'], which need masks of their own"),
    "`moe.hf.batch_attention_mask` with input_ids and attention_mask of other shapes": (
        lambda tmp: hf_batch_mask(mask_len=3), ValueError,
        "input_ids (2, 4) and attention_mask (2, 3) must both be [B, S]"),
}


@pytest.mark.parametrize("key", sorted(HF_REJECTED))
def test_rejected_hf_input_raises_its_documented_error(key, tmp_path):
    pytest.importorskip("transformers")
    action, exc_type, text = HF_REJECTED[key]
    with pytest.raises(exc_type) as info:
        action(tmp_path)
    assert text in str(info.value)


@pytest.mark.parametrize("key", sorted(REJECTED))
def test_rejected_input_raises_its_documented_error(key):
    action, exc_type, text = REJECTED[key]
    with pytest.raises(exc_type) as info:
        action()
    assert text in str(info.value)


def test_zero_tokens_are_valid():
    with torch.no_grad():
        assert layer()(torch.randn(0, 8)).shape == (0, 8)


def test_non_contiguous_input_is_accepted():
    moe_layer = layer()
    x = torch.randn(8, 6).t()  # [6, 8], column-major: not contiguous
    assert not x.is_contiguous()
    with torch.no_grad():
        torch.testing.assert_close(moe_layer(x), moe_layer(x.contiguous()),
                                   atol=1e-6, rtol=1e-6)


def test_nan_router_logits_stay_in_their_token_by_default():
    moe_layer = layer()
    x = nan_logits_input()
    with torch.no_grad():
        out, clean = moe_layer(x), moe_layer(x[[0, 1, 3, 4]])
    assert torch.isfinite(out).all(dim=1).tolist() == [True, True, False, True, True]
    # Other tokens are unaffected (to summation order: row counts differ).
    torch.testing.assert_close(out[[0, 1, 3, 4]], clean, atol=1e-6, rtol=1e-6)


def test_forward_with_gradients_on_is_accepted():
    moe_layer = layer()
    x = torch.randn(5, 8)
    out = moe_layer(x)
    with torch.inference_mode():
        assert torch.equal(out, moe_layer(x))


def test_out_of_range_custom_routing_ids_are_dropped():
    def all_out_of_range(logits_TE: torch.Tensor, top_k: int):
        ids = torch.tensor([[-1, 4]]).expand(logits_TE.shape[0], top_k)
        return torch.full((logits_TE.shape[0], top_k), 0.5), ids

    with torch.no_grad():
        out = layer(custom_routing_function=all_out_of_range)(torch.randn(3, 8))
    assert torch.equal(out, torch.zeros(3, 8))


def documented_errors() -> list[tuple[str, str, str]]:
    """(what you did, exception or "exit 2" or "accepted", quoted excerpt) of every row of
    docs/errors.md's tables ("what you did | what you get | fix"): "what you get" is
    `Exception`: `excerpt`, exit 2: `excerpt`, or accepted: ..."""
    rows = []
    for line in ERRORS_DOC.read_text().splitlines():
        if not line.startswith("| ") or line.startswith("| what you did") or "---" in line:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 3, f"docs/errors.md: not a 3-cell row: {line}"
        spans = re.findall(r"`([^`]+)`", cells[1])
        if cells[1].startswith("accepted"):
            rows.append((cells[0], "accepted", ""))
        elif cells[1].startswith("exit 2: ") and spans:
            rows.append((cells[0], "exit 2", spans[0]))
        else:
            assert len(spans) >= 2 and cells[1].startswith(f"`{spans[0]}`: "), (
                f"docs/errors.md: 'what you get' is not `Exception`: `excerpt`: {line}")
            rows.append((cells[0], spans[0], spans[1]))
    return rows


def test_errors_doc_quotes_every_error_tested_here():
    """Each case here has a row naming its exception and quoting part of its text (at
    least 20 characters of it, so the quote identifies the error); every row quotes an
    excerpt of a real error, of a known exception type."""
    rows = documented_errors()
    assert len(rows) >= len(REJECTED) + len(HF_REJECTED)
    known = {"accepted", "exit 2", "ValueError", "TypeError", "RuntimeError", "ImportError",
             "PeerInputError", "ConfigMismatchError", "NoYieldWarning", "GroupUnusableError"}
    assert {kind for _, kind, _ in rows} <= known, {kind for _, kind, _ in rows} - known
    for key, (_, exc_type, message) in {**REJECTED, **HF_REJECTED}.items():
        quoting = [did for did, kind, excerpt in rows
                   if kind == exc_type.__name__ and len(excerpt) >= 20 and excerpt in message]
        assert quoting, f"docs/errors.md has no {exc_type.__name__} row quoting: {message}"
