"""`load`: a transformers MoE checkpoint directory, converted, each rank reading only its
own experts.

    model = moe.hf.load("ckpt/", group=ep_group, dtype=torch.bfloat16)

Shape legend: E routed experts, W ranks in the EP group.

1. The model is built from config.json with one routed expert per block instead of E
   (the config's expert count is set to 1 while transformers builds it, then restored):
   no rank ever holds all experts, while every other module, non-persistent buffers
   (rotary tables) included, is built by transformers itself.
2. `moe.hf.convert` replaces the blocks, leaving the new ones' parameters uninitialised.
3. Every parameter and persistent buffer is read from the checkpoint: the routed experts
   of this rank only (1/W of the experts' bytes), the rest whole on every rank.

No download: the directory must hold config.json and safetensors files, every file read
checked first (`moe.hf.folder`); the directory's own Python (config.json's `auto_map`)
runs only with `trust_remote_code=True`, and nothing prompts.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from moe.hf.arch import ARCHITECTURES, ArchSpec
from moe.hf.block import HFMoEBlock, hf_param_name
from moe.hf.checkpoint import Checkpoint, ExpertRange
from moe.hf.convert import check_capacity_argument, convert_blocks
from moe.hf.deps import require
from moe.hf.folder import read_config, read_generation_config

__all__ = ["load"]

# The expert count transformers builds each block with (step 1 of the module doc).
_SKELETON_EXPERTS = 1


def load(path: str | os.PathLike, *, group: Optional[dist.ProcessGroup] = None,
         backend: str = "auto", experts: str = "auto",
         max_tokens_per_rank: Optional[int] = None,
         max_tokens_per_ubatch: Optional[int] = None,
         dtype: Optional[torch.dtype] = None, trust_remote_code: bool = False) -> nn.Module:
    """Build the model of checkpoint directory `path`, convert it (`moe.hf.convert`) and
    load its weights, this rank's experts only. Returns the model in eval mode on the CPU.

    Args:
        path: a directory with config.json and model.safetensors (or shards and
            model.safetensors.index.json), as `save_pretrained` writes it.
        group, backend, experts, max_tokens_per_rank, max_tokens_per_ubatch: as for
            `moe.hf.convert`.
        dtype: parameter dtype; None: the dtype config.json names, else float32.
        trust_remote_code: run the Python of the directory that config.json's `auto_map`
            names (it builds the model). False: transformers' own classes of its
            `model_type` are built, never the directory's code.

    Raises:
        ValueError: what `convert` refuses; an architecture without a fused path
            (`moe.hf.arch`: load it with transformers and convert it); a tensor the
            checkpoint lacks, or whose shape differs from what config.json implies
            (naming the tensor); a file of the directory that is malformed or lies
            outside it (`moe.hf.folder`).
    """
    transformers = require("transformers")
    path = os.fspath(path)
    world = 1 if group is None else dist.get_world_size(group)
    check_capacity_argument(backend, max_tokens_per_rank, world=world, where="moe.hf.load")
    with Checkpoint(path) as checkpoint:  # checks the directory before building anything
        config = read_config(path, trust_remote_code=trust_remote_code)
        spec = _fused_spec(config)
        if dtype is None:
            dtype = config.dtype if isinstance(getattr(config, "dtype", None), torch.dtype) \
                else torch.float32
        model = _build_skeleton(transformers, config, spec, dtype,
                                trust_remote_code=trust_remote_code)
        convert_blocks(model, group=group, backend=backend, experts=experts,
                       max_tokens_per_rank=max_tokens_per_rank,
                       max_tokens_per_ubatch=max_tokens_per_ubatch, weights_from_blocks=False)
        _load_weights(model, checkpoint, spec)
    generation_config = read_generation_config(path)
    if generation_config is not None:
        model.generation_config = generation_config
    return model.eval()


def _fused_spec(config: object) -> ArchSpec:
    """The architecture's `ArchSpec`; ValueError for one without a fused path, whose
    checkpoint names this loader does not know."""
    model_type = getattr(config, "model_type", None)
    spec = ARCHITECTURES.get(model_type)
    if spec is None:
        raise ValueError(
            f"moe.hf.load: the checkpoint is a {model_type!r} model; moe.hf.load reads the "
            f"checkpoints of {', '.join(sorted(ARCHITECTURES))} only: load it with "
            f"transformers (AutoModelForCausalLM.from_pretrained(path)) and convert it, "
            f"moe.hf.convert(model, group=ep_group), which runs it on the experts path")
    return spec


def _build_skeleton(transformers: object, config: object, spec: ArchSpec,
                    dtype: torch.dtype, *, trust_remote_code: bool) -> nn.Module:
    """The model with `_SKELETON_EXPERTS` experts per block, its config restored after."""
    field = spec.num_experts_field
    num_experts = getattr(config, field)
    setattr(config, field, _SKELETON_EXPERTS)
    try:
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=dtype, trust_remote_code=trust_remote_code)
    finally:
        setattr(config, field, num_experts)
    assert model.config is config, "the modules must see the restored expert count"
    return model


def _load_weights(model: nn.Module, checkpoint: Checkpoint, spec: ArchSpec) -> None:
    """Fill every parameter and persistent buffer of `model` from `checkpoint`."""
    blocks = {path: m for path, m in model.named_modules() if isinstance(m, HFMoEBlock)}
    loaded: set[int] = set()
    missing: dict[int, list[str]] = {}
    with torch.no_grad():
        for path, block in blocks.items():
            _load_experts(block, path, checkpoint, spec)
            loaded.update(id(t) for t in (block.moe.w13, block.moe.w2))
        for name, tensor in model.state_dict(keep_vars=True).items():
            if id(tensor) in loaded:
                continue
            candidates = _checkpoint_names(name, blocks, spec)
            found = next((c for c in candidates if c in checkpoint), None)
            if found is None:
                missing.setdefault(id(tensor), []).append(candidates[0])
                continue
            tensor.copy_(checkpoint.read(found, shape=tensor.shape, what="a model weight"))
            loaded.add(id(tensor))
    # A tied tensor (lm_head / embeddings) is found under any one of its names.
    absent = [names[0] for key, names in missing.items() if key not in loaded]
    if absent:
        raise ValueError(f"moe.hf.load: checkpoint {checkpoint.path!r} has no tensor "
                         f"{absent[0]!r}{f' (and {len(absent) - 1} more)' if len(absent) > 1 else ''}"
                         f", which the model built from config.json needs: the checkpoint is "
                         f"incomplete or for another model; re-save it with save_pretrained")


def _load_experts(block: HFMoEBlock, path: str, checkpoint: Checkpoint,
                  spec: ArchSpec) -> None:
    layer = block.moe
    config = layer.config
    experts = ExpertRange(prefixes=_block_prefixes(path, spec), first=layer.first_expert,
                          count=layer.num_local_experts, num_experts=config.num_experts,
                          names=spec.per_expert_names)
    w13, w2 = checkpoint.read_experts(experts, hidden=config.hidden_size,
                                      width=config.intermediate_size, block=path)
    layer.w13.copy_(w13)
    layer.w2.copy_(w2)


def _block_prefixes(path: str, spec: ArchSpec) -> list[str]:
    """The block's names in checkpoints: its model path with the last component replaced
    by each of `spec.checkpoint_block_names` (the model's own name first)."""
    parent, _, own = path.rpartition(".")
    names = [own] + [n for n in spec.checkpoint_block_names if n != own]
    return [f"{parent}.{n}" if parent else n for n in names]


def _checkpoint_names(name: str, blocks: dict[str, HFMoEBlock], spec: ArchSpec) -> list[str]:
    """Checkpoint names of model tensor `name` (the Hugging Face name first)."""
    for path in blocks:
        if name.startswith(path + "."):
            inner = hf_param_name(name.removeprefix(path + "."))
            assert inner is not None, "routed experts are loaded by _load_experts"
            return [f"{prefix}.{inner}" for prefix in _block_prefixes(path, spec)]
    return [name]

