"""Decode steps of `dbo bench --hf NAME --mode decode`: one new token per request over
KV caches that do not grow, unconverted, converted with DBO off, SBO, DBO on and DBO with
joined experts.

    result = run_hf_decode(cfg, group=dist.group.WORLD, device=device)   # on every rank

Shape legend: R requests on this rank (one point per count of `cfg.decode.requests`),
C tokens already cached per request (`context`), V vocab.

Each rank builds the model as the prefill path does (`hf_sweep.build_model`: the same
random weights on every rank) and fills, untimed, one transformers `DynamicCache` with
C random tokens of each of its R_max requests (the unconverted model, in chunks of
about `PREFILL_CHUNK_TOKENS` tokens). A point of R requests uses rows [0, R) of it.
One decode step calls the model on input_ids [R, 1] with the cache and keeps the last
position's logits [R, V]; the cache's layers append one position (a `torch.cat` of the
whole layer, as transformers decodes) and the step then puts back the layers' C-position
tensors (`PrefixCache.restore`), so every timed step decodes over the same C tokens and
the cache never grows. The restore only rebinds tensors the append never wrote to.

1. unconverted: every expert on every rank, this rank's requests;
2. converted (`moe.hf.convert`, this rank's experts), per backend: DBO off (the model
   called directly on the whole cache), SBO (the same step through a `DBORunner` with
   `DBOConfig(overlap="sbo")`: never split; where the model offers none, the point says
   why; not gated) and DBO on (`DBORunner` with `SplitCaches`:
   ubatch 0 gets requests [0, ceil(R/2)) with a cache of its own rows, ubatch 1 the rest
   with its own, as `moe.hf.generate` keeps one cache per ubatch), then DBO with joined
   experts (`hf_joined`: the DBO-on step with each MoE layer's experts once over both
   ubatches' rows; not gated, as SBO), `rounds` rounds in
   alternation, each round with a separate short trial of DBO on for the gate
   (`dbo.cli.bench.gating`: the request-count threshold, then the worst trial). A
   backend that needs a capacity gets `max_tokens_per_rank` as in prefill
   (`hf_config.conversions`), a point's requests being its tokens per rank.
Each point reports how far the converted model's decode logits are from the unconverted
model's over the same cached prefix (largest difference over the largest logit, max
over ranks): ~1e-6 in float32.

With `cuda_graph` (GPU) the steps are graphed as the prefill sweep's are
(`dbo.cli.bench.hf_graphs`): DBO off one captured step replayed, DBO on (the gate's
trials too) and joined each a `dbo.graphs.GraphedRunner` (the vote, then a replay), the
unconverted model
eagerly and, where it captures, as a graph (its ratios use the faster). A step captures
as it is: it reads the prefix tensors in place (never written) and its append writes a
new tensor in the graph's memory, so every replay decodes over the same C tokens. A
`GraphedRunner` keys its graphs on the call's non-tensor arguments by value: a
`PrefixCache` hashes by identity, as the graph reads that cache's tensors. Every model
of the run attends through `hf_graphs.use_mask_free_sdpa` (`hf_sweep.build_model`), so
that a captured step builds no attention mask where the eager one builds none. Each
point's graphs go before the next.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dbo import DBOConfig, DBORunner, GraphedRunner, capture_graph
from dbo.cli.bench.gating import GatePolicy
from dbo.cli.bench.hf_config import Conversion, HFBenchConfig, HFDecodeOptions, conversions
from dbo.cli.bench.hf_graphs import (GRAPH_WARMUP, UnconvertedTimes, graphed_unconverted,
                                     replayed)
from dbo.cli.bench.hf_joined import attach_joined, joined_runners
from dbo.cli.bench.hf_points import HFPointTimes, flat_row, timing_fields
from dbo.cli.bench.hf_sweep import (attach_sbo, build_model, converted_model, describe_model,
                                    free_memory, max_rel_diff, round_tag, sbo_not_run,
                                    sbo_runners)
from dbo.cli.bench.sweep import Progress
from dbo.cli.bench.timing import Timing, median_of_rounds, time_steps
from moe.hf import cache_keyword

__all__ = ["DecodeStep", "HFDecodePoint", "HFDecodeResult", "PrefixCache", "SplitCaches",
           "prefill_cache", "run_hf_decode"]

PREFILL_CHUNK_TOKENS = 4096
"""Tokens per untimed prefill call: the prefill bench's step, which fits the real shapes."""


@dataclass(eq=False)
class PrefixCache:
    """A `DynamicCache` of some requests holding C positions per layer, and those
    positions' tensors, to put back after a step appended one (`restore`).

    Equal and hashed by identity (`eq=False`): a `GraphedRunner` keys its graphs on it,
    and a graph captured over one cache reads that cache's tensors, no other's."""

    cache: Any
    prefix: tuple[tuple[Tensor, Tensor], ...]

    @classmethod
    def rows_of(cls, base: Any, rows: slice) -> "PrefixCache":
        """Rows `rows` of the filled cache `base`, as a new cache viewing its tensors."""
        cache = copy.copy(base)
        cache.layers = []
        for layer in base.layers:
            _check_layer(layer)
            new = copy.copy(layer)
            new.keys, new.values = layer.keys[rows], layer.values[rows]
            cache.layers.append(new)
        return cls(cache, tuple((layer.keys, layer.values) for layer in cache.layers))

    @property
    def num_requests(self) -> int:
        return self.prefix[0][0].shape[0]

    def restore(self) -> None:
        for layer, (keys, values) in zip(self.cache.layers, self.prefix, strict=True):
            layer.keys, layer.values = keys, values


class DecodeStep(nn.Module):
    """One decode step of a transformers causal LM over a `PrefixCache`:
    `forward(input_ids [R, 1], cache=...)` -> the logits [R, V] in the model's dtype,
    on the current stream; the cache holds the same C positions before and after.
    `parts` (two caches of the same requests' rows, split in `SplitCaches`) is used only
    by a DBO step; an unsplit step uses `cache`."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self._cache_kwarg = cache_keyword(model)

    def forward(self, input_ids: Tensor, *, cache: PrefixCache,
                parts: Optional[tuple[PrefixCache, PrefixCache]] = None) -> Tensor:
        try:
            out = self.model(input_ids=input_ids, use_cache=True, logits_to_keep=1,
                             **{self._cache_kwarg: cache.cache})
        finally:
            cache.restore()
        return out.logits[:, -1, :]


class SplitCaches:
    """The DBO split of a `DecodeStep` call (a callable `DBOConfig.split`): ubatch u gets
    the requests of `parts[u]` and that cache; None (unsplit) without `parts`."""

    def __repr__(self) -> str:  # the runner names the callable in its decisions
        return "SplitCaches()"

    def __call__(self, args: tuple, kwargs: dict) -> Optional[list[tuple[tuple, dict]]]:
        parts = kwargs.get("parts")
        if parts is None:
            return None
        input_ids = args[0] if args else kwargs["input_ids"]
        b = parts[0].num_requests
        assert b + parts[1].num_requests == input_ids.shape[0], (b, input_ids.shape)
        return [((input_ids[:b],), {"cache": parts[0]}), ((input_ids[b:],), {"cache": parts[1]})]


def prefill_cache(model: nn.Module, input_ids: Tensor, *,
                  chunk_tokens: int = PREFILL_CHUNK_TOKENS) -> Any:
    """A `DynamicCache` of `input_ids` [R, C] (no padding), filled by `model` in calls of
    about `chunk_tokens` tokens (whole requests), untimed; the logits are dropped."""
    from moe.hf import require
    transformers = require("transformers")
    keyword = cache_keyword(model)
    num_requests, context = input_ids.shape
    per_call = max(1, chunk_tokens // context)
    parts = []
    with torch.no_grad():
        for start in range(0, num_requests, per_call):
            cache = transformers.DynamicCache(config=model.config)
            model(input_ids=input_ids[start:start + per_call], use_cache=True,
                  logits_to_keep=1, **{keyword: cache})
            parts.append(cache)
    base = copy.copy(parts[0])
    base.layers = []
    for i, layer in enumerate(parts[0].layers):
        _check_layer(layer)
        new = copy.copy(layer)
        new.keys = torch.cat([p.layers[i].keys for p in parts])
        new.values = torch.cat([p.layers[i].values for p in parts])
        base.layers.append(new)
    return base


@dataclass(kw_only=True)
class HFDecodePoint(HFPointTimes):
    """One backend and request count (the shared fields: `hf_sweep.HFPointTimes`)."""

    requests_per_rank: int
    context: int
    gate: str
    """"dbo" where the gate runs the point with DBO, else "off"."""
    gate_reason: str
    t_gated_ms: float
    gated_speedup: Optional[float]
    """T_noDBO / T_gated."""
    trial_speedups: list[float] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        """The flat fields (CSV columns), rounded for people."""
        return flat_row(self, ("trial_speedups", "per_rank_ms", "rounds_ms"),
                        first=("requests_per_rank", "context"))


@dataclass
class HFDecodeResult:
    config: HFBenchConfig
    world_size: int
    shapes: dict[str, Any]
    points: list[HFDecodePoint]


def run_hf_decode(cfg: HFBenchConfig, *, group: Optional[dist.ProcessGroup],
                  device: torch.device) -> HFDecodeResult:
    """Every decode point on this rank (all ranks call this with the same `cfg`)."""
    opts = cfg.decode
    assert opts is not None, "run_hf_decode needs HFBenchConfig.decode"
    world = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    config = cfg.model_config(world)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timing = dict(device=device, group=group, warmup=cfg.warmup, iters=cfg.iters)
    # No ceiling probe here (min_gain unused): the threshold and the trials decide.
    gate = GatePolicy(min_tokens_per_rank=opts.gate_min_requests, min_gain=0.0)
    progress = Progress(1 + len(opts.requests) * (1 + 4 * len(cfg.backends)) * cfg.rounds,
                        enabled=cfg.progress and rank == 0)
    max_requests = max(opts.requests)
    gen = torch.Generator().manual_seed(cfg.seed * 7 + 1000 * rank + 1)
    prompt_ids = torch.randint(0, config.vocab_size, (max_requests, opts.context), generator=gen)
    next_ids = torch.randint(0, config.vocab_size, (max_requests, 1), generator=gen)
    prompt_ids, next_ids = prompt_ids.to(device), next_ids.to(device)

    model: Optional[nn.Module] = build_model(cfg, config, device=device, dtype=dtype)
    assert model is not None
    shapes = describe_model(model, config, world=world, dtype=dtype)
    progress.step(f"prefill {max_requests} requests x {opts.context} tokens/rank (untimed)")
    base = prefill_cache(model, prompt_ids)
    shapes.update(_describe_cache(base, opts))
    caches = {r: PrefixCache.rows_of(base, slice(0, r)) for r in opts.requests}
    parts = {r: (PrefixCache.rows_of(base, slice(0, (r + 1) // 2)),
                 PrefixCache.rows_of(base, slice((r + 1) // 2, r))) for r in opts.requests}

    t_hf: dict[int, Timing] = {}
    hf_times: dict[int, UnconvertedTimes] = {}
    reference: dict[int, Tensor] = {}
    unconverted = DecodeStep(model)
    for r in opts.requests:
        step = _step(unconverted, next_ids[:r], cache=caches[r])
        reference[r] = step().float()
        rounds = []
        for index in range(cfg.rounds):
            progress.step(f"unconverted R={r}/rank{round_tag(cfg, index)}")
            rounds.append(time_steps(step, **timing))
        t_hf[r] = median_of_rounds(rounds)
        if cfg.cuda_graph:
            hf_times[r] = graphed_unconverted(step, t_hf[r], cfg, timing, device=device,
                                              group=group)
            t_hf[r] = hf_times[r].best
    unconverted = step = None

    points = []
    plans = [(backend, conversion) for backend in cfg.backends
             for conversion in conversions(backend, opts.requests, world_size=world,
                                           ubatch_of=lambda r: (r + 1) // 2)]
    for backend, conversion in plans:
        model = converted_model(cfg, config, model, backend, conversion, shapes,
                                device=device, dtype=dtype, group=group, world=world)
        decoder = DecodeStep(model)
        runner = DBORunner(decoder, DBOConfig(split=SplitCaches()), group=group)
        graphed = GraphedRunner(runner, warmup=GRAPH_WARMUP) if cfg.cuda_graph else None
        joined_runner, joined_graphed = joined_runners(decoder, runner.config, cfg,
                                                       group=group)
        # SBO: the DBO-off step (one cache, no parts: never split) with overlap="sbo".
        blocker, sbo_runner, sbo_graphed = sbo_runners(
            decoder, DBOConfig(split=SplitCaches(), overlap="sbo"), cfg, group=group)
        for r in conversion.points:
            off = _step(decoder, next_ids[:r], cache=caches[r])
            if cfg.cuda_graph:
                off = replayed(capture_graph(off, device=device, warmup=GRAPH_WARMUP))
            on = _step(graphed if graphed is not None else runner, next_ids[:r],
                       cache=caches[r], parts=parts[r])
            diffs = [max_rel_diff(s(), reference[r], group) for s in (off, on)]
            joined = _step(joined_graphed if joined_graphed is not None else joined_runner,
                           next_ids[:r], cache=caches[r], parts=parts[r])
            joined_diff = max_rel_diff(joined(), reference[r], group)
            sbo, sbo_note = None, f"not offered: {blocker}" if blocker is not None else ""
            if sbo_runner is not None:
                sbo = _step(sbo_graphed if sbo_graphed is not None else sbo_runner,
                            next_ids[:r], cache=caches[r])
                diffs.append(max_rel_diff(sbo(), reference[r], group))
                sbo_note = sbo_not_run(sbo_runner)
                if sbo_note:
                    sbo = None
            offs, ons, sbos, trials, joineds = [], [], [], [], []
            for index in range(cfg.rounds):
                tag = f"{backend} R={r}/rank{round_tag(cfg, index)}"
                progress.step(f"{tag}: DBO off")
                offs.append(time_steps(off, **timing))
                progress.step(f"{tag}: SBO" + ("" if sbo is not None else " (not run)"))
                if sbo is not None:
                    sbos.append(time_steps(sbo, **timing))
                progress.step(f"{tag}: DBO trial + on")
                trial = time_steps(on, **{**timing, "iters": opts.gate_trial_iters})
                trials.append(offs[-1].max_ms / trial.max_ms)
                ons.append(time_steps(on, **timing))
                progress.step(f"{tag}: joined")
                joineds.append(time_steps(joined, **timing))
            decision = runner.last_decision
            if sbo is not None:
                sbo_note = sbo_not_run(sbo_runner)  # of the timed steps too
            off = on = sbo = joined = None  # the DBO-off graph and its memory go here
            for g in (graphed, sbo_graphed, joined_graphed):
                if g is not None:
                    g.reset()  # this point's graphs: no later point replays them
            free_memory(device)
            points.append(_point(cfg, opts, gate, backend=backend, requests=r, world=world,
                                 conversion=conversion, unconverted=hf_times.get(r),
                                 hf=t_hf[r], offs=offs, ons=ons, trials=trials,
                                 split=bool(decision is not None and decision.split),
                                 reason="" if decision is None else decision.reason,
                                 diffs=diffs))
            attach_sbo(points[-1], sbos if not sbo_note else [], note=sbo_note,
                       diff=diffs[2] if len(diffs) > 2 else None, perf=not cfg.functional,
                       total_tokens=r * world)
            attach_joined(points[-1], joineds, diff=joined_diff, runner=joined_runner,
                          perf=not cfg.functional, total_tokens=r * world)
        model = decoder = runner = graphed = sbo_runner = sbo_graphed = None
        joined_runner = joined_graphed = None
    progress.close()
    free_memory(device)
    return HFDecodeResult(cfg, world, shapes, points)


def _step(call: Callable[..., Tensor], input_ids: Tensor, **kwargs: Any) -> Callable[[], Tensor]:
    def step() -> Tensor:
        with torch.no_grad():
            return call(input_ids, **kwargs)
    return step


def _point(cfg: HFBenchConfig, opts: HFDecodeOptions, gate: GatePolicy, *, backend: str,
           requests: int, world: int, conversion: Conversion,
           unconverted: Optional[UnconvertedTimes], hf: Timing, offs: list[Timing],
           ons: list[Timing], trials: list[float], split: bool, reason: str,
           diffs: list[float]) -> HFDecodePoint:
    times = timing_fields(hf, offs, ons, total_tokens=requests * world,  # a token each
                          perf=not cfg.functional)
    decision = gate.decide(tokens_per_rank=requests, ceiling=None, trial_speedups=trials,
                           no_probe_reason="no ceiling probe in --hf")
    gated_ms = times["t_dbo_ms"] if decision.use_dbo else times["t_nodbo_ms"]
    return HFDecodePoint(
        regime=cfg.regime, arch=cfg.arch, backend=backend, requests_per_rank=requests,
        context=opts.context, world_size=world, cuda_graph=cfg.cuda_graph,
        **({} if unconverted is None else unconverted.fields()),
        max_tokens_per_rank=conversion.max_tokens_per_rank,
        max_tokens_per_ubatch=conversion.max_tokens_per_ubatch,
        gate=decision.choice, gate_reason=decision.reason, t_gated_ms=gated_ms,
        gated_speedup=times["t_nodbo_ms"] / gated_ms if not cfg.functional else None,
        dbo_split=split, dbo_split_reason=reason, logits_diff_nodbo=diffs[0],
        logits_diff_dbo=diffs[1], trial_speedups=trials, **times)


def _describe_cache(base: Any, opts: HFDecodeOptions) -> dict[str, Any]:
    """The cache this run decodes over (the largest point's: R_max requests)."""
    layer = base.layers[0]
    return {"context": opts.context, "max_requests": max(opts.requests),
            "kv_cache_layer": type(layer).__name__,
            "kv_keys_shape_layer0": list(layer.keys.shape),
            "kv_values_shape_layer0": list(layer.values.shape),
            "kv_cache_bytes_per_rank": sum(t.numel() * t.element_size()
                                           for lay in base.layers
                                           for t in (lay.keys, lay.values))}


def _check_layer(layer: Any) -> None:
    # A sliding-window layer also counts the positions it has seen: rebinding its
    # tensors would not restore it.
    name = type(layer).__name__
    if name != "DynamicLayer" or not layer.is_initialized:
        raise ValueError(f"dbo bench --hf --mode decode: the model's KV cache has a {name} "
                         f"layer{'' if layer.is_initialized else ' left empty by the prefill'}"
                         f"; the bench restores DynamicLayer caches only: use an "
                         f"architecture without sliding-window or shared-KV layers")

