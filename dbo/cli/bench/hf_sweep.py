"""The measurements of `dbo bench --hf NAME`: a transformers MoE model as transformers
runs it, then converted by `moe.hf.convert` (expert parallelism), DBO off, SBO, DBO on and
DBO with joined experts.

    result = run_hf_sweep(cfg, group=dist.group.WORLD, device=device)   # on every rank

Shape legend: B sequences per rank (`requests`), S = tokens / B, V vocab.

Each rank builds the same model (random weights from the seed, bfloat16 on GPU, float32
on CPU, built on its device directly) and its own prefill batch, input_ids [B, S]
without padding, called with `use_cache=False, logits_to_keep=1` (a prefill step's
logits are the last position's, as a server computes them: [B, 1, V]).
1. unconverted: the transformers model with every expert on every rank (no expert
   parallelism) runs this rank's batch, with its own experts implementation
   (`config._experts_implementation`, grouped_mm on GPU);
2. the same model converted in place (`moe.hf.convert(model, group, backend)`: this
   rank's experts only, the others' freed), then per token count `rounds` rounds of
   DBO off (the model called directly) and DBO on (`DBORunner`, split "batch" between
   sequences) in alternation. Another backend rebuilds the model and converts it again.
   A backend that needs a capacity gets `max_tokens_per_rank` (`hf_config.conversions`):
   a2a_ll and deepep_ll the point's tokens per rank, converted (and rebuilt) per point;
   symm_mem the largest point's. The DBO-on runner shares the DBO-off model; a2a_ll's
   ubatches get a capacity of their own (the point's larger ubatch), deepep_ll's carry
   the whole capacity (its padding, twice). Each round also times an SBO step between
   DBO off and DBO on: the same model through `DBORunner(model, DBOConfig(overlap=
   "sbo"))` (never split; a `GraphedRunner` under `cuda_graph`), its combine in the form
   `--combine-chunks` / `--combine-groups` give a2a_ll (`hf_config.layer_options`);
   where the model offers none (`dbo_sbo_blocker`) or the runner ran none, the point
   says why (`sbo_note`) instead of a time. After DBO on, each round times DBO with
   joined experts (`hf_joined`): the DBO-on step through a runner with
   `joined_experts=True` (a `GraphedRunner` under `cuda_graph`). Before its reported
   SBO, DBO-on and joined steps, each round times a separate short trial of each
   (`gate_trial_iters` steps) against that round's DBO-off time, for the gate.
With `cuda_graph` (GPU, prefill): DBO off is one captured forward (`dbo.graphs.
capture_graph`) replayed, DBO on a `dbo.graphs.GraphedRunner` (the vote, then a
replay), both with their output cloned out as a caller would keep it. The unconverted
model is timed eagerly and, if transformers' forward captures, as a replayed graph as
well; its ratios use the faster of the two (`t_hf_ms` is that one, `t_hf_eager_ms` and
`t_hf_graph_ms` both, or why it did not capture).
After a point's rounds, its ceiling probe (`dbo.cli.bench.hf_probe`, GPU and a backend
made of torch.distributed collectives only): compute alone, comm alone, both, and the
DBO-on step's compute alone (split), once per point; ceiling and eta as the layer bench's.
Then the point is gated as the layer bench's points are (`dbo.cli.bench.hf_gate`): no
overlap, SBO, DBO or joined, from the tokens per rank, the probe's ceiling (where it ran)
and the worst trials, never from the reported times; `t_gated_ms` is the chosen mode's
time.
Times are per-rank medians (`dbo.cli.bench.timing`), folded over rounds; the derived
figures use the slowest rank's. Each point also reports how far the converted model's
logits are from the unconverted model's on the same batch (largest difference over
the largest logit, max over ranks): 1e-6 in float32, bfloat16 rounding on GPU.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dbo import DBOConfig, DBORunner, GraphedRunner, capture_graph, collect_sbo_blocker
from dbo.cli.bench.hf_config import Conversion, HFBenchConfig, conversions, layer_options
from dbo.cli.bench.hf_graphs import (GRAPH_WARMUP, UnconvertedTimes, graphed_unconverted,
                                     replayed, use_mask_free_sdpa)
from dbo.cli.bench.hf_gate import attach_gate, prefill_gate
from dbo.cli.bench.hf_joined import attach_joined, joined_runners
from dbo.cli.bench.hf_probe import HFProbe, no_probe_reason, probe_hf_point, skipped
from dbo.cli.bench.sweep import Progress
from dbo.cli.bench.hf_points import HFPoint, HFPointTimes, HFSweepResult, timing_fields
from dbo.cli.bench.timing import (Timing, gather_floats, median_of_rounds, set_mode_times,
                                   time_steps)

__all__ = ["HFPoint", "HFPointTimes", "HFSweepResult", "attach_sbo", "build_model",
           "describe_model", "max_rel_diff", "run_hf_sweep", "sbo_not_run", "timing_fields"]

# DBO on: every point split (B >= 2 sequences), so that every point has a DBO time; the
# bench's own gate (`hf_gate`) decides afterwards whether a deployment would run it.
_DBO_ON = DBOConfig(split="batch", min_prefill_tokens=2, min_decode_tokens=2)
# SBO: the same thresholds, never split (`dbo.overlap`).
_SBO = dataclasses.replace(_DBO_ON, overlap="sbo")


def run_hf_sweep(cfg: HFBenchConfig, *, group: Optional[dist.ProcessGroup],
                 device: torch.device) -> HFSweepResult:
    """Every point on this rank (all ranks call this with the same `cfg`)."""
    world = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    config = cfg.model_config(world)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timing = dict(device=device, group=group, warmup=cfg.warmup, iters=cfg.iters)
    probes = len(cfg.tokens) * len(cfg.backends) if device.type == "cuda" else 0
    # Per point and round: DBO off, SBO's trial, SBO, DBO's trial, DBO on, joined's trial,
    # joined.
    progress = Progress(len(cfg.tokens) * (1 + 7 * len(cfg.backends)) * cfg.rounds + probes,
                        enabled=cfg.progress and rank == 0)
    gate = prefill_gate(cfg)
    trial_timing = {**timing, "iters": cfg.gate_trial_iters}
    inputs = {t: _batch(cfg, t, config.vocab_size, rank=rank, device=device)
              for t in cfg.tokens}

    model: Optional[nn.Module] = build_model(cfg, config, device=device, dtype=dtype)
    assert model is not None
    shapes = describe_model(model, config, world=world, dtype=dtype)
    t_hf: dict[int, Timing] = {}
    unconverted: dict[int, UnconvertedTimes] = {}
    reference: dict[int, Tensor] = {}
    for tokens in cfg.tokens:
        step = _step(model, inputs[tokens])
        reference[tokens] = step().logits.float()
        rounds = []
        for index in range(cfg.rounds):
            progress.step(f"unconverted T={tokens}/rank{round_tag(cfg, index)}")
            rounds.append(time_steps(step, **timing))
        t_hf[tokens] = median_of_rounds(rounds)
        if cfg.cuda_graph:
            unconverted[tokens] = graphed_unconverted(step, t_hf[tokens], cfg, timing,
                                                       device=device, group=group)
            t_hf[tokens] = unconverted[tokens].best

    points = []
    plans = [(backend, conversion) for backend in cfg.backends
             for conversion in conversions(backend, cfg.tokens, world_size=world,
                                           ubatch_of=lambda t: largest_ubatch(cfg, t))]
    for backend, conversion in plans:
        model = converted_model(cfg, config, model, backend, conversion, shapes,
                                device=device, dtype=dtype, group=group, world=world)
        runner = DBORunner(model, _DBO_ON, group=group)
        graphed = GraphedRunner(runner, warmup=GRAPH_WARMUP) if cfg.cuda_graph else None
        blocker, sbo_runner, sbo_graphed = sbo_runners(model, _SBO, cfg, group=group)
        joined_runner, joined_graphed = joined_runners(model, _DBO_ON, cfg, group=group)
        for tokens in conversion.points:
            off = _step(model, inputs[tokens])
            if cfg.cuda_graph:
                off = replayed(capture_graph(off, device=device, warmup=GRAPH_WARMUP))
            on = _step(graphed if graphed is not None else runner, inputs[tokens])
            diffs = [max_rel_diff(s().logits, reference[tokens], group) for s in (off, on)]
            joined = _step(joined_graphed if joined_graphed is not None else joined_runner,
                           inputs[tokens])
            joined_diff = max_rel_diff(joined().logits, reference[tokens], group)
            sbo, sbo_note = None, f"not offered: {blocker}" if blocker is not None else ""
            if sbo_runner is not None:
                sbo = _step(sbo_graphed if sbo_graphed is not None else sbo_runner,
                            inputs[tokens])
                diffs.append(max_rel_diff(sbo().logits, reference[tokens], group))
                sbo_note = sbo_not_run(sbo_runner)
                if sbo_note:
                    sbo = None
            offs, ons, sbos, joineds = [], [], [], []
            trials: list[float] = []
            sbo_trials: list[float] = []
            joined_trials: list[float] = []
            for index in range(cfg.rounds):
                tag = f"{backend} T={tokens}/rank{round_tag(cfg, index)}"
                progress.step(f"{tag}: DBO off")
                offs.append(time_steps(off, **timing))
                # The gate's trials: short timings of their own, before (and apart from)
                # the reported ones, against this round's DBO-off time (`hf_gate`).
                not_run = "" if sbo is not None else " (not run)"
                progress.step(f"{tag}: SBO trial{not_run}")
                if sbo is not None:
                    sbo_trials.append(offs[-1].max_ms / time_steps(sbo, **trial_timing).max_ms)
                progress.step(f"{tag}: SBO{not_run}")
                if sbo is not None:
                    sbos.append(time_steps(sbo, **timing))
                progress.step(f"{tag}: DBO trial")
                trials.append(offs[-1].max_ms / time_steps(on, **trial_timing).max_ms)
                progress.step(f"{tag}: DBO on")
                ons.append(time_steps(on, **timing))
                progress.step(f"{tag}: joined trial")
                joined_trials.append(offs[-1].max_ms
                                     / time_steps(joined, **trial_timing).max_ms)
                progress.step(f"{tag}: joined")
                joineds.append(time_steps(joined, **timing))
            decision = runner.last_decision  # of the timed steps: the probe runs more
            if sbo is not None:
                sbo_note = sbo_not_run(sbo_runner)  # of the timed steps too
            off = on = sbo = joined = None  # the DBO-off graph and its memory go here
            free_memory(device)
            if not skipped(model, device):
                progress.step(f"{backend} T={tokens}/rank: ceiling probe")
            probe = probe_hf_point(model, inputs[tokens], tokens=tokens,
                                   runner=graphed if graphed is not None else runner,
                                   device=device, group=group, warmup=cfg.warmup,
                                   iters=cfg.iters, cuda_graph=cfg.cuda_graph,
                                   gemm_sm_carveout=_DBO_ON.gemm_sm_carveout)
            points.append(_point(cfg, backend=backend, tokens=tokens, world=world,
                                 conversion=conversion, unconverted=unconverted.get(tokens),
                                 hf=t_hf[tokens], offs=offs, ons=ons,
                                 split=bool(decision is not None and decision.split),
                                 reason="" if decision is None else decision.reason,
                                 diffs=diffs, probe=probe))
            attach_sbo(points[-1], sbos if not sbo_note else [], note=sbo_note,
                       diff=diffs[2] if len(diffs) > 2 else None, perf=not cfg.functional,
                       total_tokens=tokens * world)
            attach_joined(points[-1], joineds, diff=joined_diff, runner=joined_runner,
                          perf=not cfg.functional, total_tokens=tokens * world)
            attach_gate(points[-1], gate,
                        ceiling=None if probe.ceiling is None else probe.ceiling.ceiling,
                        no_probe_reason=no_probe_reason(model, device),
                        dbo_trials=trials, sbo_trials=sbo_trials if not sbo_note else [],
                        joined_trials=joined_trials, perf=not cfg.functional)
            free_memory(device)
        for g in (graphed, sbo_graphed, joined_graphed):
            if g is not None:
                g.reset()
        model = runner = graphed = sbo_runner = sbo_graphed = None
        joined_runner = joined_graphed = None
    progress.close()
    free_memory(device)
    return HFSweepResult(cfg, world, shapes, points)


def converted_model(cfg: HFBenchConfig, config: Any, model: Optional[nn.Module],
                    backend: str, conversion: Any, shapes: dict[str, Any], *,
                    device: torch.device, dtype: torch.dtype,
                    group: Optional[dist.ProcessGroup], world: int) -> nn.Module:
    """`model` (built again if the previous conversion's is gone) converted for one
    (backend, conversion) plan of the sweep, with `layer_options`; the first conversion's
    expert bytes and summary go into `shapes`."""
    import moe.hf
    if model is None:  # the previous conversion's model is gone
        model = build_model(cfg, config, device=device, dtype=dtype)
    free_memory(device)
    model = moe.hf.convert(model, group=group, backend=backend, experts=cfg.experts,
                           conversion=cfg.conversion,
                           max_tokens_per_rank=conversion.max_tokens_per_rank,
                           backend_options=layer_options(cfg, backend, conversion,
                                                         world_size=world))
    free_memory(device)
    shapes.setdefault("expert_bytes_per_rank_converted", moe.hf.expert_bytes(model))
    shapes.setdefault("conversion", model.dbo_conversion_summary)
    return model


def sbo_runners(model: Callable[..., Any], config: DBOConfig, cfg: HFBenchConfig, *,
                group: Optional[dist.ProcessGroup]
                ) -> tuple[Optional[str], Optional[DBORunner], Optional[GraphedRunner]]:
    """(why the model offers no SBO, or None; the SBO runner under `config`, whose
    overlap is "sbo"; its graphed runner under --cuda-graph): None where not offered."""
    blocker = collect_sbo_blocker(model)
    runner = DBORunner(model, config, group=group) if blocker is None else None
    graphed = (GraphedRunner(runner, warmup=GRAPH_WARMUP)
               if cfg.cuda_graph and runner is not None else None)
    return blocker, runner, graphed


def sbo_not_run(runner: DBORunner) -> str:
    """Why the last step of `runner` (`DBOConfig(overlap="sbo")`) was not a
    single-batch-overlap step (`SplitPlan.overlap`), or "" where it was."""
    decision = runner.last_decision
    if decision is None:
        return "not run: the runner made no decision"
    return "" if decision.overlap == "sbo" else f"not run: {decision.reason}"


def attach_sbo(point: HFPointTimes, rounds: list[Timing], *, note: str,
               diff: Optional[float], perf: bool, total_tokens: int) -> None:
    """Set the SBO fields of `point` (prefill or decode) from its rounds (none where
    `note` says why), as `timing_fields` sets DBO's: medians over rounds, the slowest
    rank's time, the rate of `total_tokens` over all ranks, T_noDBO / T_SBO only in a
    performance run (`perf`)."""
    point.sbo_note, point.logits_diff_sbo = note, diff
    if rounds:
        set_mode_times(point, "sbo", rounds, total_tokens=total_tokens, speedup=perf)


def build_model(cfg: HFBenchConfig, config: Any, *, device: torch.device,
                dtype: torch.dtype) -> nn.Module:
    """The transformers model of `config` with seeded random weights, in eval mode, built
    on `device` in `dtype` (the tiny architectures as `dbo run --hf-config` builds them).
    Where the steps are graphed (`cfg.cuda_graph`) it attends through
    `hf_graphs.use_mask_free_sdpa`, so that a captured step builds no attention mask where
    the eager one builds none (the bench's calls have no padding)."""
    from moe.hf import REAL_SHAPES, require, tiny_model
    if cfg.arch not in REAL_SHAPES:
        model = tiny_model(config, seed=cfg.seed).to(device=device, dtype=dtype)
    else:
        torch.manual_seed(cfg.seed)  # every rank the same weights (CUDA generators too)
        with torch.device(device):
            model = require("transformers").AutoModelForCausalLM.from_config(config,
                                                                             dtype=dtype)
        for p in model.parameters():
            p.requires_grad_(False)
        model.eval()
    if cfg.cuda_graph:
        use_mask_free_sdpa(model)
    return model


def _batch(cfg: HFBenchConfig, tokens: int, vocab: int, *, rank: int,
           device: torch.device) -> dict[str, Any]:
    """This rank's prefill call: input_ids [B, S], no padding, last position's logits."""
    gen = torch.Generator().manual_seed(cfg.seed * 7 + 1000 * rank + tokens)
    ids = torch.randint(0, vocab, (cfg.requests, tokens // cfg.requests), generator=gen)
    return {"input_ids": ids.to(device), "use_cache": False, "logits_to_keep": 1}


def largest_ubatch(cfg: HFBenchConfig, tokens: int) -> int:
    """Rows of the larger ubatch of a DBO step at `tokens` per rank: the "batch" split
    gives it ceil(B / 2) of the B sequences (`moe.hf.ubatch_capacity`)."""
    from moe.hf import ubatch_capacity
    return ubatch_capacity(cfg.requests, tokens // cfg.requests)


def _step(call: Callable[..., Any], kwargs: dict[str, Any]) -> Callable[[], Any]:
    def step() -> Any:
        with torch.no_grad():
            return call(**kwargs)
    return step


def max_rel_diff(logits: Tensor, reference: Tensor, group: Optional[dist.ProcessGroup]) -> float:
    """max |logits - reference| / max |reference|, the largest over ranks."""
    mine = ((logits.float() - reference).abs().max() / reference.abs().max()).item()
    return max(gather_floats(mine, group))


def _point(cfg: HFBenchConfig, *, backend: str, tokens: int, world: int,
           conversion: Conversion, unconverted: Optional[UnconvertedTimes], hf: Timing,
           offs: list[Timing], ons: list[Timing], split: bool, reason: str,
           diffs: list[float], probe: HFProbe) -> HFPoint:
    graph_fields = {} if unconverted is None else unconverted.fields()
    times = timing_fields(hf, offs, ons, total_tokens=tokens * world,
                          perf=not cfg.functional)
    times["per_rank_ms"].update(probe.per_rank_ms())
    probed = probe.fields(t_nodbo_ms=times["t_nodbo_ms"], t_dbo_ms=times["t_dbo_ms"],
                          perf=not cfg.functional)
    return HFPoint(
        regime=cfg.regime, arch=cfg.arch, backend=backend, tokens_per_rank=tokens,
        world_size=world, max_tokens_per_rank=conversion.max_tokens_per_rank,
        max_tokens_per_ubatch=conversion.max_tokens_per_ubatch, cuda_graph=cfg.cuda_graph,
        dbo_split=split, **graph_fields,
        dbo_split_reason=reason, logits_diff_nodbo=diffs[0], logits_diff_dbo=diffs[1],
        **times, **probed)


def describe_model(model: nn.Module, config: Any, *, world: int,
                   dtype: torch.dtype) -> dict[str, Any]:
    from moe.hf import expert_sizes
    num_experts, top_k, width = expert_sizes(config)
    return {"model_type": config.model_type, "hidden_size": config.hidden_size,
            "num_experts": num_experts, "experts_per_rank": num_experts // world,
            "top_k": top_k, "intermediate_size": width,
            "layers": config.num_hidden_layers, "vocab_size": config.vocab_size,
            "dtype": str(dtype).replace("torch.", ""),
            "hf_experts_implementation": getattr(model.config, "_experts_implementation", None),
            "param_bytes_unconverted": sum(p.numel() * p.element_size()
                                           for p in model.parameters())}


def round_tag(cfg: HFBenchConfig, index: int) -> str:
    """" (round i/n)" for progress lines, "" for a run of one round."""
    return f" (round {index + 1}/{cfg.rounds})" if cfg.rounds > 1 else ""


def free_memory(device: torch.device) -> None:
    """Give the caching allocator's free blocks back (between models of the sweep)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
