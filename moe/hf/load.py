"""`load`: a transformers MoE checkpoint directory, converted, each rank reading only its
own experts: `AutoModelForCausalLM.from_pretrained(path)` then `moe.hf.convert`, in one
call, without any rank holding every expert.

    model = moe.hf.load("ckpt/", group=ep_group, dtype=torch.bfloat16)

Shape legend: E routed experts, W ranks in the EP group.

1. The model is built from config.json on the meta device (no memory), and its MoE
   blocks are checked (`moe.hf.convert.plan_blocks`): what dbo cannot convert is refused
   before anything is read or allocated.
2. It is built again on the CPU by transformers itself, non-persistent buffers (rotary
   tables) included, but for the blocks' experts modules, built on the meta device.
3. Every parameter and persistent buffer but the routed experts is read from the
   checkpoint, whole on every rank, with transformers' own name mapping and conversions
   (`moe.hf.weights`).
4. `moe.hf.convert` replaces the blocks (or their experts modules), as it does for a
   loaded model, and then the routed experts of this rank only are read into them (1/W
   of the experts' bytes): a rank whose own experts the checkpoint lacks fails alone,
   after every collective of the conversion.

No download: the directory must hold config.json and safetensors files, every file read
checked first (`moe.hf.folder`); the directory's own Python (config.json's `auto_map`)
runs only with `trust_remote_code=True`, and nothing prompts.
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from moe.backend_options import BackendOptions
from moe.hf.checkpoint import Checkpoint
from moe.hf.convert import check_capacity_argument, convert_blocks, layer_options, plan_blocks
from moe.hf.deps import require
from moe.hf.folder import read_config, read_generation_config
from moe.hf.rows import expert_tensor_names, fill_experts, local_rows, rows_per_expert
from moe.hf.weights import ExpertRows, WeightReader

__all__ = ["load"]


def load(path: str | os.PathLike, *, group: Optional[dist.ProcessGroup] = None,
         backend: str = "auto", experts: str = "auto",
         max_tokens_per_rank: Optional[int] = None,
         max_tokens_per_ubatch: Optional[int] = None,
         dtype: Optional[torch.dtype] = None, conversion: str = "auto",
         trust_remote_code: bool = False,
         backend_options: Optional[BackendOptions] = None) -> nn.Module:
    """Build the model of checkpoint directory `path`, load its weights, this rank's
    experts only, and convert it (`moe.hf.convert`). Returns the model in eval mode on
    the CPU.

    Args:
        path: a directory with config.json and model.safetensors (or shards and
            model.safetensors.index.json), as `save_pretrained` writes it.
        group, backend, experts, max_tokens_per_rank, max_tokens_per_ubatch, conversion,
        backend_options: as for `moe.hf.convert`.
        dtype: parameter dtype; None: the dtype config.json names, else float32.
        trust_remote_code: run the Python of the directory that config.json's `auto_map`
            names (it builds the model). False: transformers' own classes of its
            `model_type` are built, never the directory's code.

    Raises:
        ValueError: what `convert` refuses; a model type transformers has no causal LM
            for; a quantized checkpoint; a tensor the checkpoint lacks, or whose shape
            differs from what config.json implies, or that transformers converts with an
            operation not known to keep the experts apart, or that an experts module
            computes when built (naming the tensor); a file of the directory that is
            malformed or lies outside it (`moe.hf.folder`).
    """
    transformers = require("transformers")
    path = os.fspath(path)
    world = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    check_capacity_argument(backend, max_tokens_per_rank, world=world, where="moe.hf.load")
    layer_options(max_tokens_per_ubatch, backend_options)  # before reading anything
    with Checkpoint(path) as checkpoint:  # checks the directory before building anything
        config = read_config(path, trust_remote_code=trust_remote_code)
        _refuse_quantized(path, config)
        if dtype is None:
            dtype = config.dtype if isinstance(getattr(config, "dtype", None), torch.dtype) \
                else torch.float32
        build = functools.partial(_build, transformers, config, dtype,
                                  trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            meta = build()
        plans = plan_blocks(meta, world=world, check_weights=False, backend=backend,
                            experts=experts, conversion=conversion)
        classes = {type(meta.get_submodule(plan.path).experts) for plan in plans}
        del meta
        with _built_on_meta(classes):
            model = build()
        wanted = {}
        for plan in plans:
            first, stop = local_rows(plan, rank=rank, world=world)
            for name in expert_tensor_names(plan):
                wanted[f"{plan.path}.experts.{name}"] = ExpertRows(
                    block=plan.path, first=first, stop=stop, per_expert=rows_per_expert(plan))
        reader = WeightReader(model, checkpoint, wanted)
        reader.read_model()  # the same on every rank: fails on all alike
        convert_blocks(model, group=group, backend=backend, experts=experts,
                       max_tokens_per_rank=max_tokens_per_rank,
                       max_tokens_per_ubatch=max_tokens_per_ubatch, conversion=conversion,
                       plans=plans, backend_options=backend_options)
        # After the conversion's collectives: a rank that lacks its own experts fails alone.
        read = reader.read_experts()
        fill_experts(model, plans, {plan.path: {name: read[f"{plan.path}.experts.{name}"]
                                                for name in expert_tensor_names(plan)}
                                    for plan in plans})
    _refuse_meta(model)
    generation_config = read_generation_config(path)
    if generation_config is not None:
        model.generation_config = generation_config
    return model.eval()


def _refuse_meta(model: nn.Module) -> None:
    """ValueError naming a tensor left on the meta device: one that an experts module
    computes when it is built (a non-persistent buffer) rather than reads."""
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        if tensor.is_meta:
            raise ValueError(f"moe.hf.load: {model.config.model_type}: tensor {name!r} is not "
                             f"in the checkpoint and its module was built on the meta device: "
                             f"load the model with transformers "
                             f"(AutoModelForCausalLM.from_pretrained(path)) and convert it, "
                             f"moe.hf.convert(model, group=ep_group)")


def _refuse_quantized(path: str, config: Any) -> None:
    """ValueError for a checkpoint of quantized weights (config.json's
    `quantization_config`), which this loader would read as plain numbers."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return
    method = (quantization.get("quant_method") if isinstance(quantization, dict)
              else getattr(quantization, "quant_method", type(quantization).__name__))
    raise ValueError(f"moe.hf.load: {path!r} holds quantized weights (config.json's "
                     f"quantization_config, quant_method {method!r}): moe.hf.load reads "
                     f"unquantized checkpoints only; use the model's bfloat16 or float32 "
                     f"checkpoint")


def _build(transformers: Any, config: Any, dtype: torch.dtype, *,
           trust_remote_code: bool) -> nn.Module:
    """transformers' causal LM of `config` (in the device context of the caller)."""
    try:
        return transformers.AutoModelForCausalLM.from_config(
            config, dtype=dtype, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        if "Unrecognized configuration class" not in str(exc):
            raise
        raise ValueError(f"moe.hf.load: transformers has no causal LM for a "
                         f"{config.model_type!r} config (AutoModelForCausalLM cannot build "
                         f"it): build the model with its own transformers class and convert "
                         f"it, moe.hf.convert(model, group=ep_group)") from None


@contextlib.contextmanager
def _built_on_meta(classes: set[type]) -> Iterator[None]:
    """While open, a module of one of `classes` builds its tensors on the meta device
    (its `__init__` runs under `torch.device("meta")`), whatever device the rest of the
    model is built on: no rank allocates the routed experts it does not hold."""
    saved = {cls: cls.__dict__.get("__init__") for cls in classes}
    for cls in classes:
        init = cls.__init__

        @functools.wraps(init)
        def on_meta(self: nn.Module, *args: Any, _init: Any = init, **kwargs: Any) -> None:
            with torch.device("meta"):
                _init(self, *args, **kwargs)

        cls.__init__ = on_meta
    try:
        yield
    finally:
        for cls, init in saved.items():
            if init is None:
                del cls.__init__
            else:
                cls.__init__ = init
