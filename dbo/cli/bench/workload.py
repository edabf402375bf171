"""The model and inputs of one sweep point, and the DBO policy the bench applies to them.

    factory = WorkloadFactory(cfg, group=dist.group.WORLD, device=device)
    off = factory.get(tokens=1024, backend="a2a", dbo=False)
    out = off.step()                      # the model called directly (DBO off)
    on = factory.get(tokens=1024, backend="a2a", dbo=True)
    out = on.step()                       # DBORunner(model, factory.dbo_config)(...)
    sbo = factory.get(tokens=1024, backend="a2a", dbo=False, sbo=True)
    out = sbo.step()                      # the same, with DBOConfig(overlap="sbo")
    joined = factory.get(tokens=1024, backend="a2a", dbo=True, joined=True)
    out = joined.step()                   # DBO on, with DBOConfig(joined_experts=True)

Layer mode: a `LayerStack` of the preset's MoE layer shape, inputs [T, H], DBO split
"tokens". Decode mode: a `DecodeStack` (`dbo.cli.bench.decode_stack`), T requests of one
new token each over KV caches of `context` tokens, inputs [T, H], DBO split on request
boundaries (`SplitRequests`, each ubatch with its requests' caches). Model mode:
`moe.models.transformer.MoETransformer` of the preset, a batch of `requests` requests of
random lengths summing to T (`moe.models.transformer.make_batch`; each rank its own), DBO
split "requests" at the request boundary nearest half the tokens (the model has no KV
cache in this mode, so a request is never cut: `dbo.split`).

`a2a_ll` and `deepep_ll` have a fixed capacity per rank: the DBO-off model gets max_tokens_per_rank = T,
the DBO-on model the larger ubatch of the split the runner will make (so DBO moves no
more padding than the unsplit step), computed with the runner's own planner. A
single-batch-overlap (SBO) step is not split: it runs on the DBO-off model, through a
runner whose policy never splits (`DBOConfig(overlap="sbo")`, `dbo.overlap`). A step
with joined experts is a DBO step: the DBO-on model, through a runner of the same policy
with `joined_experts=True` (`dbo.meet`). `symm_mem`
sizes its buffers by a capacity but moves only routed rows: both models get T. The factory
keeps one model alive, rebuilt only when the backend or that capacity changes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from dbo import DBOConfig, DBORunner, GraphedRunner, decided_step, plan_split, plan_token_split
from dbo.cli.bench.config import BENCH_BACKENDS, BenchConfig
from dbo.cli.bench.decode_stack import (DecodeStack, SplitRequests, describe_decode,
                                        make_kv_caches, ubatch_requests)
from dbo.cli.bench.layer_stack import LayerStack, layer_moe_config, make_input
from dbo.cli.bench.timing import gather_floats
from moe import MoEConfig
from moe.backends import backend_traits, backends_with, options_with
from moe.models import get_preset

#: Backends that the bench gives a capacity per point, DBO's per ubatch: those whose work
#: grows with it (the trait `pads_to_capacity`).
FIXED_CAPACITY_BACKENDS: tuple[str, ...] = backends_with(pads_to_capacity=True,
                                                         among=BENCH_BACKENDS)

DEFAULT_LAYERS = 4

# DBO on: thresholds low enough that every sweep point (T >= 2) is split; the gate,
# not the runner, decides where DBO should stay off.
_SPLIT_ALWAYS = dict(min_decode_tokens=2, min_prefill_tokens=2)


@dataclass
class Workload:
    """One step's model and inputs; `step()` runs it (through the runner when DBO is on:
    a `GraphedRunner` under `--cuda-graph`, which votes and replays)."""

    model: nn.Module
    args: tuple
    kwargs: dict
    num_tokens: int
    runner: Optional[Union[DBORunner, GraphedRunner]]

    def step(self) -> Any:
        call: Callable[..., Any] = self.runner if self.runner is not None else self.model
        with torch.no_grad():
            return call(*self.args, **self.kwargs)

    @property
    def eager_runner(self) -> Optional[DBORunner]:
        """The DBORunner itself (inside the GraphedRunner, if any)."""
        if isinstance(self.runner, GraphedRunner):
            return self.runner.runner
        return self.runner

    def split_step(self) -> Any:
        """One DBO step split as the runner plans it, without the vote (every rank must
        call it together): what a graph of the split compute captures."""
        runner = self.eager_runner
        assert runner is not None, "split_step needs the DBO-on workload"
        with torch.no_grad():
            return decided_step(runner, self.args, self.kwargs, split=True)()

    @property
    def split_reason(self) -> str:
        """Why the last DBO step was (or was not) split; "" with DBO off."""
        if self.runner is None or self.runner.last_decision is None:
            return ""
        return self.runner.last_decision.reason

    @property
    def was_split(self) -> bool:
        return bool(self.runner is not None and self.runner.last_decision is not None
                    and self.runner.last_decision.split)


class WorkloadFactory:
    """Builds the workloads of a sweep on one rank (all ranks build the same ones)."""

    def __init__(self, cfg: BenchConfig, *, group: Optional[dist.ProcessGroup],
                 device: torch.device) -> None:
        self.cfg = cfg
        self.group = group
        self.device = device
        self.world_size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        preset = get_preset(cfg.preset)
        self.num_experts = cfg.resolve_num_experts(self.world_size, preset.moe.num_experts)
        self.base_moe = dataclasses.replace(
            layer_moe_config(preset.moe, num_experts=self.num_experts,
                             max_tokens_per_rank=None),
            split_last_combine=cfg.split_last_combine)
        self.hidden_size = preset.hidden_size
        self.dtype = preset.dtype
        if cfg.mode in ("layer", "decode"):
            self.num_layers = cfg.layers if cfg.layers is not None else DEFAULT_LAYERS
        else:
            self.num_layers = cfg.layers if cfg.layers is not None else preset.num_layers
        # Model mode: MoETransformer runs without a KV cache here, so its requests stay
        # whole; any request boundary is taken (max_imbalance=1.0) so every point is split.
        split = {"layer": dict(split="tokens"),
                 "model": dict(split="requests", max_imbalance=1.0)}.get(
                     cfg.mode, dict(split=SplitRequests()))
        self.dbo_config = DBOConfig(**split, gemm_sm_carveout=cfg.gemm_sm_carveout,
                                    **_SPLIT_ALWAYS)
        self._kv_caches: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # decode mode
        self._model_key: Optional[tuple] = None
        self._model: Optional[nn.Module] = None
        self._inputs: dict[int, tuple[tuple, dict]] = {}
        if cfg.mode == "model":
            _import_model()  # fail early with the reason

    # ------------------------------------------------------------------ public
    def describe(self) -> dict[str, Any]:
        """Shapes actually run (for the outputs)."""
        moe = self.base_moe
        return {"hidden_size": self.hidden_size, "num_experts": self.num_experts,
                "experts_per_rank": self.num_experts // self.world_size, "top_k": moe.top_k,
                "intermediate_size": moe.intermediate_size,
                "num_shared_experts": moe.num_shared_experts, "layers": self.num_layers,
                "dtype": str(self.dtype).replace("torch.", ""),
                "grouped_topk": moe.n_group is not None,
                **(describe_decode(get_preset(self.cfg.preset), context=self.cfg.context,
                                   max_requests=max(self.cfg.tokens))
                   if self.cfg.mode == "decode" else {})}

    def get(self, *, tokens: int, backend: str, dbo: bool, sbo: bool = False,
            joined: bool = False) -> Workload:
        """The workload of one point: the model called directly (`dbo` and `sbo` False),
        through a DBO runner (`dbo`; with `joined`, one that runs each MoE layer's experts
        once over both ubatches' rows), or through a runner that overlaps within the one
        unsplit batch (`sbo`; a `GraphedRunner` around any of them under --cuda-graph)."""
        assert not (dbo and sbo), "a workload runs DBO (two ubatches) or SBO (one)"
        assert dbo or not joined, "joined experts are a DBO step's (dbo=True)"
        capacity = None
        if backend in FIXED_CAPACITY_BACKENDS:
            capacity = self.ubatch_capacity(tokens) if dbo else tokens
        elif backend_traits(backend).needs_capacity:  # symm_mem
            # Only routed rows travel: the capacity sizes buffers, not transfers, so DBO
            # off and on share one model (and one set of symmetric buffers).
            capacity = tokens
        model = self._get_model(backend, capacity)
        args, kwargs = self._get_inputs(tokens)
        runner: Optional[Union[DBORunner, GraphedRunner]] = None
        if dbo or sbo:
            config = (dataclasses.replace(self.dbo_config, overlap="sbo") if sbo
                      else dataclasses.replace(self.dbo_config, joined_experts=True) if joined
                      else self.dbo_config)
            runner = DBORunner(model, config, group=self.group)
            if self.cfg.cuda_graph:
                runner = GraphedRunner(runner, warmup=max(self.cfg.warmup, 1))
        return Workload(model, args, kwargs, tokens, runner)

    def ubatch_capacity(self, tokens: int) -> int:
        """Tokens of the larger ubatch the runner makes of a `tokens` step (T if unsplit),
        the max over ranks: a fixed-capacity all-to-all needs the same capacity on all.
        A collective: every rank calls it for the same points."""
        if self.cfg.mode == "decode":
            return ubatch_requests(tokens) if tokens >= 2 else tokens  # same R on every rank
        if self.cfg.mode == "layer":
            plan = plan_token_split(tokens, self.dbo_config)
        else:
            plan = plan_split(list(self._seq_lens(tokens)), self.dbo_config, num_tokens=tokens)
        mine = max(plan.num_tokens) if plan.split else tokens
        return int(max(gather_floats(mine, self.group)))

    def release(self) -> None:
        """Drop the model and inputs (frees device memory before the next build)."""
        self._model = self._model_key = None
        self._kv_caches = None
        self._inputs.clear()

    # --------------------------------------------------------------- internals
    def _sbo_options(self, backend: str, chunks: int) -> Any:
        """The options of `backend` with `chunks` combine chunks and the config's expert
        groups where its options take them (`combine_chunks`, `combine_groups`: a2a_ll),
        else None: the backend's defaults."""
        return options_with(backend, self.world_size, combine_chunks=chunks,
                            combine_groups=self.cfg.combine_groups)

    def _get_model(self, backend: str, capacity: Optional[int]) -> nn.Module:
        key = (backend, capacity)
        if key == self._model_key and self._model is not None:
            return self._model
        self._model = None  # free the old weights before allocating the new ones
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        # Only SBO steps chunk their combine, on the no-overlap model (capacity T); the
        # DBO model's smaller capacity may hold fewer slot rows than chunks.
        chunks = self.cfg.combine_chunks if capacity is None else min(self.cfg.combine_chunks,
                                                                       capacity)
        moe = dataclasses.replace(self.base_moe, max_tokens_per_rank=capacity,
                                  backend=backend, experts=self.cfg.experts,
                                  backend_options=self._sbo_options(backend, chunks))
        if self.cfg.mode == "layer":
            model = LayerStack(moe, num_layers=self.num_layers,
                               attn_context=self.cfg.attn_context, group=self.group,
                               device=self.device)
            model.init_weights(self.cfg.seed)
        elif self.cfg.mode == "decode":
            model = self._build_decode_stack(moe)
        else:
            model = self._build_transformer(moe)
        self._model, self._model_key = model, key
        return model

    def _build_transformer(self, moe: MoEConfig) -> nn.Module:
        MoETransformer, _ = _import_model()
        config = get_preset(self.cfg.preset, num_layers=self.num_layers, moe=moe)
        model = MoETransformer(config, group=self.group, device=self.device)
        model.init_weights(self.cfg.seed)
        for p in model.parameters():
            p.requires_grad_(False)
        return model

    def _build_decode_stack(self, moe: MoEConfig) -> nn.Module:
        preset = get_preset(self.cfg.preset)
        if self._kv_caches is None:  # once per sweep, for its largest request count
            self._kv_caches = make_kv_caches(preset, max_requests=max(self.cfg.tokens),
                                             context=self.cfg.context, device=self.device,
                                             seed=self.cfg.seed * 7 + 1000 * self.rank + 1)
        keys, values = self._kv_caches
        model = DecodeStack(moe, preset, num_layers=self.num_layers, keys=keys,
                            values=values, group=self.group, device=self.device)
        model.init_weights(self.cfg.seed)
        return model

    def _get_inputs(self, tokens: int) -> tuple[tuple, dict]:
        cached = self._inputs.get(tokens)
        if cached is not None:
            return cached
        self._inputs.clear()  # one token count at a time
        seed = self.cfg.seed * 7 + 1000 * self.rank + tokens
        if self.cfg.mode in ("layer", "decode"):  # decode: one token per request
            x_TH = make_input(tokens, self.hidden_size, dtype=self.dtype, device=self.device,
                              seed=seed)
            inputs: tuple[tuple, dict] = ((x_TH,), {})
        else:
            _, make_batch = _import_model()
            config = get_preset(self.cfg.preset, num_layers=self.num_layers,
                                moe=self.base_moe)
            batch = make_batch(config, num_tokens=tokens, num_requests=self.cfg.requests,
                               seed=seed, device=self.device)
            inputs = ((batch.input_ids_T, batch.positions_T), {"seq_lens": batch.seq_lens})
        self._inputs[tokens] = inputs
        return inputs

    def _seq_lens(self, tokens: int) -> tuple[int, ...]:
        seq_lens = self._get_inputs(tokens)[1]["seq_lens"]
        if isinstance(seq_lens, torch.Tensor):
            return tuple(int(v) for v in seq_lens.tolist())
        return tuple(seq_lens)


def _import_model() -> tuple[Any, Any]:
    try:
        from moe.models import MoETransformer, make_batch
    except ImportError as exc:
        raise ValueError(f"--mode model needs moe.models.transformer (MoETransformer, make_batch), which "
                         f"cannot be imported here ({exc}); use --mode layer") from exc
    return MoETransformer, make_batch
