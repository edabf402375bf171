"""`dbo run --hf PATH` / `--hf-config NAME`: the run job over a Hugging Face MoE model.

    dbo run --hf-config qwen3_moe                 # a tiny random Qwen3-MoE, 2 CPU ranks
    dbo run --hf /models/my-moe --tokens 4096     # a local checkpoint, experts sharded
    dbo run --hf-config qwen3_moe --cuda-graph    # GPUs: both modes replayed from graphs

Shape legend: B sequences, S tokens per sequence, V vocab.

Each rank holds the model with its share of the experts (`moe.hf.load` for a checkpoint,
`moe.hf.convert` of the same random weights on every rank for a tiny model) and its own
left-padded batch: `--requests` sequences of `tokens // requests` tokens (ranks differ
as in the preset job), sequence b padded by b % 3 tokens. DBO splits the batch at a
sequence boundary (`split="batch"`). The model is called with `use_cache=False` and the
job compares the logits [B * S, V] of DBO on and off. The phase order shows the MoE
layer's phases (router, dispatch, experts, combine, shared experts): transformers'
attention and norms open no dbo phase, so they appear in the trace only as kernels
under each ubatch's `ub<n>/run` range. With `--cuda-graph` (GPUs; backend "auto" is then
a2a_ll) both modes run as CUDA graph replays, as for the presets; a2a_ll's DBO ubatches
get a capacity of their own (`A2ALLOptions.max_tokens_per_ubatch`: half the sequences).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor, nn

from dbo import DBOConfig, DBORunner

__all__ = ["LogitsOnly", "build_hf", "hf_model_config", "hf_label"]

# The fix `dbo run --hf` gives for a folder whose config.json names its own code.
REMOTE_CODE_FIX = ("pass --trust-remote-code to run it (on every rank) if you trust it, or "
                   "remove auto_map from config.json to run transformers' own class of its "
                   "model_type")


class LogitsOnly(nn.Module):
    """A transformers causal LM whose call returns its logits as [B * S, V] (the rows the
    run job compares; a DBO step's two ubatches concatenate to the whole batch's)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask,
                            use_cache=False).logits
        return logits.reshape(-1, logits.shape[-1])


def _cat_rows(outputs: list[Tensor]) -> Tensor:
    """The two ubatches' [b * S, V] logits, ubatch 0's sequences first: the batch's."""
    return torch.cat(outputs, dim=0)


def hf_label(job: Any) -> str:
    return f"hf {job.hf}" if job.hf is not None else f"hf-config {job.hf_config}"


def hf_model_config(job: Any, world_size: int) -> Any:
    """The transformers config the job runs, checked as every rank would (architecture,
    experts over the ranks, a checkpoint's index or safetensors headers); ValueError with
    the fix. Reads config.json of --hf and where its tensors are, not the tensors."""
    from moe.hf import expert_sizes
    if job.hf is not None:
        from moe.hf import read_config, tensor_files
        # The folder's own code runs only with --trust-remote-code; without it a folder
        # that names some is refused, rather than silently run as transformers' class.
        config = read_config(job.hf, where="--hf", trust_remote_code=job.trust_remote_code,
                             code_fix=REMOTE_CODE_FIX)
        tensor_files(job.hf, where="--hf")  # its index and files' headers, here, not on every rank
    else:
        config = _named_config(job)
    num_experts, top_k, _ = expert_sizes(config)
    if num_experts % world_size:
        fix = ("another --world-size" if job.hf is not None else
               f"pass --num-experts N with N a multiple of {world_size}, or another --world-size")
        raise ValueError(f"{num_experts} routed experts ({hf_label(job)}) do not split over "
                         f"{world_size} ranks: {fix}")
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} exceeds num_experts="
                         f"{num_experts} ({hf_label(job)}): pass a larger --num-experts")
    return config


def _named_config(job: Any) -> Any:
    """The config of --hf-config NAME: a tiny random model of a hand-mapped architecture or
    of any MoE model type of the installed transformers, or real shapes (then --layers is
    needed: a whole real model is not what a run job builds by accident)."""
    from moe.hf import REAL_SHAPES, is_named, named_config, unknown_name
    name = job.hf_config
    if not is_named(name):  # the listed names first, the ~2 s discovery only otherwise
        raise ValueError(unknown_name(name, option="--hf-config"))
    if name in REAL_SHAPES and job.layers is None:
        raise ValueError(f"--hf-config {name} builds real shapes: pass --layers N (e.g. 2) "
                         f"to build N decoder layers of it")
    return named_config(name, num_layers=job.layers, num_experts=job.num_experts)


def build_hf(ctx: Any, job: Any, *, backend: str, tokens: int,
             max_tokens: int) -> dict[str, Any]:
    """This rank's model (its experts), batch and runner: the fields of the run job's
    `RankSetup` (`backend`: the one the job runs, "auto" resolved; `tokens`: this rank's
    token count; `max_tokens`: the largest rank's, the capacity a fixed-capacity backend
    gets, the same on every rank)."""
    import moe.hf
    from moe.backends import backend_class
    from moe.hf import converted_experts, tiny_model

    num_seqs = job.requests
    seq_len = max(1, tokens // num_seqs)
    capacity = ubatch = None
    if backend_class(backend, ctx.world_size).needs_capacity:
        capacity = max_tokens
        if backend_class(backend, ctx.world_size).takes_ubatch_capacity:
            # the largest rank's larger ubatch
            ubatch = min(capacity,
                         moe.hf.ubatch_capacity(num_seqs, max(1, max_tokens // num_seqs)))
    dtype: Optional[torch.dtype] = torch.bfloat16 if ctx.device.type == "cuda" else None
    if job.hf is not None:
        model = moe.hf.load(job.hf, group=ctx.group, backend=backend, experts=job.experts,
                            dtype=dtype, max_tokens_per_rank=capacity,
                            max_tokens_per_ubatch=ubatch,
                            trust_remote_code=job.trust_remote_code)
    else:
        model = tiny_model(hf_model_config(job, ctx.world_size), seed=job.seed)
        if dtype is not None:
            model = model.to(dtype)
        model = moe.hf.convert(model, group=ctx.group, backend=backend, experts=job.experts,
                               max_tokens_per_rank=capacity, max_tokens_per_ubatch=ubatch)
    model = LogitsOnly(model.to(ctx.device))
    gen = torch.Generator().manual_seed(job.seed + 1000 + ctx.rank)
    ids = torch.randint(0, model.model.config.vocab_size, (num_seqs, seq_len), generator=gen)
    mask = torch.ones_like(ids)
    for b in range(num_seqs):
        mask[b, : min(b % 3, seq_len - 1)] = 0
    runner = DBORunner(model, DBOConfig(split="batch", split_kwargs=("attention_mask",),
                                        min_prefill_tokens=2, min_decode_tokens=2,
                                        merge=_cat_rows, joined_experts=job.joined_experts),
                       group=ctx.group)
    experts = converted_experts(model)
    return dict(model=model, runner=runner, args=(),
                kwargs={"input_ids": ids.to(ctx.device), "attention_mask": mask.to(ctx.device)},
                backend=backend, dtype=experts[0].w13.dtype,
                num_tokens=num_seqs * seq_len, moe_layer_id=experts[0].layer_id,
                num_experts=experts[0].config.num_experts, label=hf_label(job))


def check_hf_options(job: Any) -> None:
    """The options that do not go with --hf / --hf-config (ValueError with the fix)."""
    if job.hf is not None and job.hf_config is not None:
        raise ValueError("--hf and --hf-config name two models: pass one")
    if job.hf is None and job.hf_config is None:
        return
    option = "--hf" if job.hf is not None else "--hf-config"
    if job.trust_remote_code and job.hf is None:
        raise ValueError("--trust-remote-code with --hf-config: a tiny random model has no "
                         "folder code to run; drop it (it goes with --hf PATH)")
    if job.hf is not None and not (Path(job.hf) / "config.json").is_file():
        raise ValueError(f"--hf={job.hf}: no config.json there: name a local checkpoint "
                         f"folder (save_pretrained's), nothing is downloaded")
    if job.hf is not None:
        for name in ("num_experts", "layers"):
            if getattr(job, name) is not None:
                raise ValueError(f"--{name.replace('_', '-')} with --hf: a checkpoint's sizes "
                                 f"come from its config.json; use it with --hf-config")
    if job.preset != "tiny":
        raise ValueError(f"--preset with {option}: the preset is dbo's reference model, "
                         f"{option} names the model: pass one")
