"""The decode steps of `moe.hf.generate(..., static_cache=True)` and `cuda_graph=True`:
fixed shapes over one static KV cache, so that one CUDA graph per split decision serves
every decode step.

Shape legend: B sequences, b rows of ubatch 0, M cache slots (prompt + new tokens), V
vocab.

Every decode step calls the model with the same shapes and the same tensors: input_ids
and position_ids [B, 1] (a split step: each ubatch's rows), the 2D attention mask [B, M]
(1 for each real past token and the current one, 0 for left padding and the slots not
yet written) and `cache_position` [1] (the slot the step writes), all on the device, and
the cache of `moe.hf.static_kv` (the batch's; a split step: each ubatch's view of its
rows). The mask builder then makes the same [B, 1, 1, M] mask shape every step (a
static cache always has it built: transformers skips it only for prompts), and nothing
in the step reads a device value on the host. Token choice, eos handling and the stop
check stay outside the step (`moe.hf.generate`).

With `cuda_graph=True` the step runner is wrapped in a `dbo.graphs.GraphedRunner`: the
vote stays outside the graph; the graphs are keyed by the step's shapes, the cache (by
identity) and the split decision, so at most two are captured (split and unsplit), each
after `warmup` eager steps that write the step's own keys at the step's own slot again.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from dbo.config import DBOConfig
from dbo.graphs import GraphedRunner, graph_blockers
from dbo.runner import DBORunner
from dbo.split import plan_split
from moe.hf.kv import cache_keyword
from moe.hf.static_kv import StaticKV

__all__ = ["StaticDecoder", "StaticRows", "check_cuda_graph", "mask_buffer", "runner_like",
           "slot_tensor", "static_step_runner"]


class StaticDecoder(nn.Module):
    """The runner's model for the static decode steps.

    `forward(input_ids, attention_mask, position_ids, cache_position, kv=...)`: input_ids
    / position_ids [R, 1] int64, attention_mask [R, M], cache_position [1] int64 (all on
    the cache's device), `kv` the cache of those R rows; returns the logits of the step
    [R, V] float32 on the current stream, having written the step's keys and values at
    slot `cache_position` of `kv`.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self._cache_kwarg = cache_keyword(model)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                cache_position: Tensor, *, kv: StaticKV) -> Tensor:
        kv.set_slot(cache_position)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, use_cache=True, logits_to_keep=1,
                         **{self._cache_kwarg: kv.cache})
        return out.logits[:, -1, :].float()


class StaticRows:
    """The split mode of the static decode steps: ubatch u gets the rows of `kv.parts[u]`
    and that cache (`cache_position` whole); None (unsplit, on the batch's cache) without
    parts or below `config.min_decode_tokens` (rows kept whole, as in "batch" mode)."""

    def __init__(self, config: DBOConfig) -> None:
        self.config = config

    def __repr__(self) -> str:  # the runner names the callable in its decisions
        return f"StaticRows(min_decode_tokens={self.config.min_decode_tokens})"

    def __call__(self, args: tuple, kwargs: dict) -> Optional[list[tuple[tuple, dict]]]:
        kv: StaticKV = kwargs["kv"]
        if kv.parts is None:
            return None
        *row_args, cache_position = args
        plan = plan_split([1] * row_args[0].shape[0], self.config,
                          allow_split_inside_request=False)
        if not plan.split:
            return None
        return [((*(a[part.rows] for a in row_args), cache_position), {"kv": part})
                for part in kv.parts]


def runner_like(runner: DBORunner, module: nn.Module, split: Any) -> DBORunner:
    """A runner over `module` with `runner`'s config (thresholds, `enabled`) and group,
    splitting each call with the callable `split` (no merge or argument rules of its
    own: the split gives each ubatch its arguments, the outputs concatenate)."""
    config = dataclasses.replace(runner.config, split=split, merge=None, unsplit_args=(),
                                 split_kwargs=())
    return DBORunner(module, config, group=runner.group)


def static_step_runner(model: nn.Module, runner: DBORunner, *, cuda_graph: bool
                       ) -> Union[DBORunner, GraphedRunner]:
    """The runner of the decode steps: the user's runner's config and group with
    `StaticRows` as its split (`runner_like`), in a `GraphedRunner` with `cuda_graph`."""
    step_runner = runner_like(runner, StaticDecoder(model), StaticRows(runner.config))
    return GraphedRunner(step_runner) if cuda_graph else step_runner


def check_cuda_graph(model: nn.Module, input_ids: Tensor) -> None:
    """ValueError naming the fix where `model` cannot decode from CUDA graphs: a module
    that reads device values on the host (`dbo.graphs.graph_blockers`), or inputs and
    model off CUDA."""
    blockers = graph_blockers(model)
    if blockers:
        raise ValueError(
            f"moe.hf.generate(cuda_graph=True): this model cannot run in a CUDA graph: "
            f"{'; '.join(blockers)}. Convert it with a capturable backend and experts "
            f"(moe.hf.convert(model, backend='a2a_ll', experts='triton', "
            f"max_tokens_per_rank=...), or 'local' on one rank), or pass cuda_graph=False")
    device = next(model.parameters()).device
    if input_ids.device.type != "cuda" or device.type != "cuda":
        raise ValueError(
            f"moe.hf.generate(cuda_graph=True) replays CUDA graphs, but input_ids are on "
            f"{input_ids.device} and the model on {device}: move both to a GPU, or pass "
            f"cuda_graph=False (static_cache=True runs the same steps eagerly)")


def mask_buffer(mask_BS: Tensor, max_cache_len: int) -> Tensor:
    """The decode steps' attention mask [B, M]: the prompt's mask, zeros after it (each
    step sets its own slot to 1 before it runs)."""
    num_rows, prompt_len = mask_BS.shape
    mask_BM = mask_BS.new_zeros(num_rows, max_cache_len)
    mask_BM[:, :prompt_len] = mask_BS
    return mask_BM


def slot_tensor(slot: int, device: torch.device) -> Tensor:
    """`cache_position` [1] int64 on `device` (a fill, no host-to-device copy)."""
    return torch.full((1,), slot, dtype=torch.long, device=device)
