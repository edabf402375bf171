"""`generate`: greedy decoding of a converted transformers model through a `DBORunner`,
with one KV cache per ubatch.

    model = moe.hf.convert(model, group=ep_group)
    runner = dbo.DBORunner(model, dbo.DBOConfig(min_decode_tokens=64), group=ep_group)
    tokens_BN = moe.hf.generate(runner, input_ids_BS, attention_mask=mask_BS,
                                max_new_tokens=16)    # == model.generate(do_sample=False)

Shape legend: B sequences, S prompt tokens (left-padded), N = S + new tokens, V vocab.

The batch is parted once, at a sequence boundary, into two fixed row groups: ubatch 0
runs rows [0, b), ubatch 1 rows [b, B), b = ceil(B / 2), each with its own transformers
`DynamicCache` that it keeps from the prompt to the last token. Each step calls the
runner once with a callable split mode: the split hands each ubatch its rows and its
cache; the runner's own config decides whether the step splits (`min_prefill_tokens`
for the prompt, `min_decode_tokens` for decode steps, `enabled`) and every rank votes.
A step that runs unsplit (too few rows, DBO off, or a rank of the group voted no) makes
one model call on the whole batch: the two caches are joined into one for that call and
parted into views afterwards (`moe.hf.kv`), so the caches stay per ubatch and the step
issues its MoE collectives once, as DBO off does. (Calling the model once per group
instead would double the collectives, and a rank with a single sequence would need an
empty second call, which transformers' attention refuses.)

With `static_cache=True` the prompt runs as above, then the decode steps run over one
transformers `StaticCache` of S + max_new_tokens slots for the whole batch, each
ubatch's cache a view of its rows (`moe.hf.static_kv`), with inputs of the same shapes
every step (`moe.hf.static_decode`): no step joins, parts or grows a cache. With
`cuda_graph=True` those steps are replayed from CUDA graphs (`dbo.graphs.GraphedRunner`:
one graph per split decision, the vote outside it); token choice and the stop check stay
outside the graph.

Decode steps run within `moe.backends.capacity.exchange_capacity` of the largest batch
over the ranks (agreed once, before the first step): a fixed-capacity backend (`a2a_ll`),
whose capacity fits the prompt's B * S tokens per rank, sends slots for B tokens per
step, not the prompt's B * S again.

Padding is handled as `model.generate` does: left padding with `attention_mask`,
positions from the mask (cumsum - 1), the mask extended by one column per step;
finished sequences (an `eos_token_id` of the model's generation config) get
`pad_token_id` (else the first eos id) from then on. Every rank of the group runs the
same `max_new_tokens` steps (the vote is a collective); a rank's output stops where its
own sequences had all finished, as `model.generate`'s does. Without a group of more
than one rank, decoding stops as soon as every sequence has finished.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dbo.config import DBOConfig
from dbo.runner import DBORunner
from dbo.split import plan_split
from dbo.vote import vote_min
from moe.backends.capacity import exchange_capacity
from moe.hf.block import HFMoEBlock
from moe.hf.generic import HFExperts
from moe.hf.deps import require
from moe.hf.kv import cache_keyword, join_caches, part_cache
from moe.hf.static_decode import (check_cuda_graph, mask_buffer, runner_like, slot_tensor,
                                  static_step_runner)
from moe.hf.static_kv import StaticKV, check_static_cache, static_cache_from_prompt

__all__ = ["generate"]


@dataclasses.dataclass(eq=False)
class RowGroup:
    """The rows one ubatch decodes and their KV cache (replaced by each unsplit step)."""

    rows: slice
    cache: Any


class GroupedDecoder(nn.Module):
    """The runner's model during `generate`: one decode step of some row groups.

    `forward(input_ids, attention_mask, position_ids, groups=...)` takes the step's rows
    of those groups (input_ids / position_ids [R, S], attention_mask [R, L + S], R their
    rows) and returns the logits of each row's last position [R, V] float32. With one
    group it uses that group's cache; with both (an unsplit step) their joined cache.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self._cache_kwarg = cache_keyword(model)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, *,
                groups: tuple[RowGroup, ...]) -> Tensor:
        if len(groups) == 1:
            logits_RV, groups[0].cache = self._logits(input_ids, attention_mask, position_ids,
                                                      groups[0].cache)
            return logits_RV
        g0, g1 = groups
        joined = None if g0.cache is None else join_caches(g0.cache, g1.cache)
        logits_RV, joined = self._logits(input_ids, attention_mask, position_ids, joined)
        g0.cache, g1.cache = part_cache(joined, g0.rows.stop)
        return logits_RV

    def _logits(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                cache: Any) -> tuple[Tensor, Any]:
        """The last position's logits [R, V] float32, and the cache after the step (the
        model's own where it was given None: a model with a cache class of its own)."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, use_cache=True, logits_to_keep=1,
                         **{self._cache_kwarg: cache})
        returned = getattr(out, self._cache_kwarg, None)
        return out.logits[:, -1, :].float(), cache if returned is None else returned

    def dbo_check_inputs(self, input_ids: Tensor, attention_mask: Tensor,
                         position_ids: Tensor, *, groups: tuple[RowGroup, ...]) -> None:
        """The runner's input check (a rank whose prompt is bad votes "not ok", so every
        rank stops): left padding only."""
        if attention_mask.shape[1] == input_ids.shape[1] and input_ids.shape[1] > 1:
            # A 0 after a 1 in a row is right padding: its new tokens would follow pads.
            right_padded = (attention_mask[:, 1:] < attention_mask[:, :-1]).any(dim=1)
            if bool(right_padded.any()):
                row = int(right_padded.nonzero()[0, 0])
                raise ValueError(
                    f"moe.hf.generate: attention_mask row {row} is right-padded (a 0 after "
                    f"a 1): decoding appends after the last column, so pad prompts on the "
                    f"left (tokenizer.padding_side = 'left')")


def generate(runner: DBORunner, input_ids: Tensor, *, attention_mask: Optional[Tensor] = None,
             max_new_tokens: int, static_cache: bool = False,
             cuda_graph: bool = False) -> Tensor:
    """Greedy decoding of `runner.model` (a model converted by `moe.hf.convert` or loaded
    by `moe.hf.load`) with the runner's DBO config and group.

    Args:
        runner: a `DBORunner` over the converted model; its config's thresholds and
            `enabled` decide which steps split (its split mode is replaced by the
            per-ubatch caches' own), its group votes.
        input_ids: [B, S] int64 prompts, left-padded, B >= 1.
        attention_mask: [B, S], 1 for tokens and 0 for left padding; None: no padding.
        max_new_tokens: tokens to add to every sequence, >= 1.
        static_cache: decode over one transformers `StaticCache` of S + max_new_tokens
            slots, each ubatch's cache a view of its rows (`moe.hf.static_kv`), every
            decode step of the same shapes and tensors (`moe.hf.static_decode`); the
            prompt runs as without it. Full-attention layers and sdpa / eager attention
            only.
        cuda_graph: replay the decode steps from CUDA graphs (`dbo.graphs.GraphedRunner`,
            one graph per split decision) over the static cache (`static_cache` implied).
            A CUDA model and inputs, and a model that can be captured (backend `a2a_ll`,
            or `local` on one rank, experts `triton`).

    Returns:
        [B, S + n] int64: the prompts and their new tokens, n <= max_new_tokens (fewer
        when every sequence of this rank finished early) -- the tokens of
        `model.generate(input_ids, attention_mask=..., max_new_tokens=...,
        do_sample=False)` on the unconverted model.
    """
    model = _check(runner, input_ids, attention_mask, max_new_tokens)
    for name, value in (("static_cache", static_cache), ("cuda_graph", cuda_graph)):
        if not isinstance(value, bool):
            raise TypeError(f"moe.hf.generate: {name}={value!r} must be True or False")
    static = static_cache or cuda_graph
    prompt_len = input_ids.shape[1]
    max_cache_len = prompt_len + max_new_tokens
    if cuda_graph:
        check_cuda_graph(model, input_ids)
    if static:
        check_static_cache(model, max_cache_len)
    transformers = require("transformers")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    num_rows = input_ids.shape[0]
    b = (num_rows + 1) // 2
    groups = tuple(RowGroup(rows=rows, cache=_new_cache(transformers, model))
                   for rows in (slice(0, b), slice(b, num_rows)))
    eos, pad = _eos_and_pad(model)
    step_runner = runner_like(runner, GroupedDecoder(model), SplitRows(runner.config))
    lockstep = _group_size(runner.group) > 1  # every rank must make every step's vote
    decode_capacity = _decode_capacity(num_rows, runner.group)

    ids_BS, mask = input_ids, attention_mask
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    tokens = [input_ids]
    unfinished_B = torch.ones(num_rows, dtype=torch.bool, device=input_ids.device)
    finished_after: Optional[int] = None  # new tokens when every sequence had finished
    kv: Optional[StaticKV] = None  # the static cache, from the first decode step on
    decode_runner: Any = None
    with torch.no_grad():
        for step in range(max_new_tokens):
            present = groups if num_rows > b else groups[:1]
            # Decode steps exchange slots for a token per sequence, not the prompt's.
            with (exchange_capacity(*decode_capacity) if step > 0
                  else contextlib.nullcontext()):
                if static and step > 0:
                    if kv is None:
                        kv = static_cache_from_prompt(
                            model, _joined(present), max_cache_len=max_cache_len,
                            split_at=b if num_rows > b else None)
                        groups = present = ()  # the prompt's caches: no step reads them
                        mask = mask_buffer(mask, max_cache_len)
                        decode_runner = static_step_runner(model, runner, cuda_graph=cuda_graph)
                    slot = prompt_len + step - 1  # this token's slot; [0, S): the prompt
                    mask[:, slot] = 1
                    logits_BV = decode_runner(ids_BS, mask, positions,
                                              slot_tensor(slot, ids_BS.device), kv=kv)
                    runner.last_decision = decode_runner.last_decision
                else:
                    logits_BV = step_runner(ids_BS, mask, positions, groups=present)
                    runner.last_decision = step_runner.last_decision
            next_B = logits_BV.argmax(dim=-1)
            if eos is not None:
                next_B = torch.where(unfinished_B, next_B, torch.full_like(next_B, pad))
                unfinished_B &= ~torch.isin(next_B, eos)
            tokens.append(next_B[:, None])
            if finished_after is None and not bool(unfinished_B.any()):
                finished_after = step + 1
                if not lockstep:
                    break
            ids_BS = next_B[:, None]
            if not static:
                mask = torch.cat([mask, mask.new_ones(num_rows, 1)], dim=1)
            positions = positions[:, -1:] + 1
    out_BN = torch.cat(tokens, dim=1)
    return out_BN if finished_after is None else out_BN[:, :input_ids.shape[1] + finished_after]


class SplitRows:
    """The split mode of `generate`'s steps: ubatch u gets group u's rows and cache;
    None (unsplit) for a single group, or below the thresholds of `config` (the user's
    runner's: `min_prefill_tokens` for the prompt, `min_decode_tokens` for a decode step,
    rows kept whole as in "batch" mode)."""

    def __init__(self, config: DBOConfig) -> None:
        self.config = config

    def __repr__(self) -> str:  # the runner names the callable in its decisions
        return (f"SplitRows(min_prefill_tokens={self.config.min_prefill_tokens}, "
                f"min_decode_tokens={self.config.min_decode_tokens})")

    def __call__(self, args: tuple, kwargs: dict) -> Optional[list[tuple[tuple, dict]]]:
        groups: tuple[RowGroup, ...] = kwargs["groups"]
        if len(groups) < 2:
            return None
        input_ids = args[0]
        plan = plan_split([input_ids.shape[1]] * input_ids.shape[0], self.config,
                          allow_split_inside_request=False)
        if not plan.split:
            return None
        return [(tuple(a[g.rows] for a in args), {"groups": (g,)}) for g in groups]


def _check(runner: Any, input_ids: Any, attention_mask: Any, max_new_tokens: Any) -> nn.Module:
    """The runner's converted model; TypeError / ValueError naming the fix otherwise."""
    if not isinstance(runner, DBORunner):
        raise TypeError(f"moe.hf.generate takes a dbo.DBORunner over the converted model, got "
                        f"a {type(runner).__name__}: wrap it as DBORunner(model, DBOConfig(...), "
                        f"group=ep_group)")
    model = runner.model
    if not isinstance(model, nn.Module) or not any(
            isinstance(m, (HFMoEBlock, HFExperts)) for m in model.modules()):
        raise ValueError(f"moe.hf.generate: the runner's model ({type(model).__name__}) has no "
                         f"converted MoE block: convert it first, model = "
                         f"moe.hf.convert(model, group=ep_group) (or load it with "
                         f"moe.hf.load(path, group=ep_group)), then DBORunner(model, ...)")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 1:
        raise ValueError(f"moe.hf.generate: max_new_tokens={max_new_tokens!r} must be an int "
                         f">= 1")
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.shape[0] < 1 \
            or input_ids.shape[1] < 1 or input_ids.dtype != torch.long:
        raise ValueError(f"moe.hf.generate: input_ids must be a [B, S] int64 tensor with B, S "
                         f">= 1, got {_describe(input_ids)}")
    if attention_mask is not None and (not isinstance(attention_mask, Tensor)
                                       or attention_mask.shape != input_ids.shape):
        raise ValueError(f"moe.hf.generate: attention_mask must be a tensor of input_ids' "
                         f"shape {list(input_ids.shape)}, got {_describe(attention_mask)}")
    return model


def _decode_capacity(num_rows: int, group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    """(tokens per rank, per DBO ubatch) of a decode step over the ranks the runner votes
    with (`group`; None: the default group, as the vote takes it): the largest batch, and
    its larger half (`b = ceil(B / 2)`). One collective with more than one rank."""
    largest = -vote_min([-num_rows], group)[0]
    return largest, (largest + 1) // 2


def _new_cache(transformers: Any, model: nn.Module) -> Any:
    """An empty DynamicCache for one row group, or None for a model with a cache class of
    its own (`_supports_default_dynamic_cache` False, e.g. MiniMax's): its first step makes
    it, as `model.generate` lets it."""
    supports = getattr(type(model), "_supports_default_dynamic_cache", None)
    if supports is not None and not supports():
        return None
    return transformers.DynamicCache(config=model.config)


def _joined(groups: tuple[RowGroup, ...]) -> Any:
    """The whole batch's cache of the row groups (a new cache for two groups)."""
    return groups[0].cache if len(groups) == 1 else join_caches(groups[0].cache,
                                                                groups[1].cache)


def _describe(x: Any) -> str:
    if isinstance(x, Tensor):
        return f"a {x.dtype} tensor of shape {list(x.shape)}"
    return f"a {type(x).__name__}"


def _eos_and_pad(model: nn.Module) -> tuple[Optional[Tensor], int]:
    """The generation config's eos ids (a tensor, None without any) and the pad id that
    finished sequences get (`pad_token_id`, else the first eos id), as `generate` does."""
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return None, 0
    eos_ids = [eos] if isinstance(eos, int) else list(eos)
    pad = getattr(config, "pad_token_id", None)
    device = next(model.parameters()).device
    return torch.tensor(eos_ids, device=device), eos_ids[0] if pad is None else pad


def _group_size(group: Optional[dist.ProcessGroup]) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)
