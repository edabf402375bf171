"""`MoETransformer`: a small reference decoder-only MoE model to run DBO steps on.

    cfg = get_preset("tiny", backend="a2a")     # MoEConfig fields go into cfg.moe
    model = MoETransformer(cfg, group=ep_group, device="cuda")
    model.init_weights(seed=0)
    batch = make_batch(cfg, num_tokens=4096, num_requests=8, seed=0, device="cuda")
    logits_TV = DBORunner(model, group=ep_group)(   # split="requests": dbo_split_mode
        batch.input_ids_T, batch.positions_T, seq_lens=batch.seq_lens)

Shape legend: T tokens of the call (all requests packed back to back), H hidden,
V vocab, D head dim.

Layer i: ``x += attn(norm(x)); x += ffn(norm(x))`` where ffn is a dense gated MLP for
the first `num_dense_layers` layers and an `MoELayer` (with shared experts when
configured) after. Attention (`moe.models.attention`) is causal within each request and
never crosses requests; rotary positions come from `positions_T`, so a request split
across calls keeps its positions. Without `cache=` a call attends only over the tokens
it is given; with a `KVCache` (`moe.models.kv_cache`: a prefill, then decode steps of one
token per request) each request's new tokens also attend over its cached ones and are
appended to them. The DBO runner splits its calls by requests (`dbo_split_mode`, what
`DBOConfig(split=None)` takes) and never cuts a request across its ubatches
(`dbo_can_split_inside_request`).

Weights are deterministic in the seed and *independent of the EP size*: every rank draws
the same replicated weights, and expert e's weights depend only on (seed, layer, e), so
the model on W ranks computes the same logits as the model on one process.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from dbo.phases import phase_scope
from moe.layer import MoELayer
from moe.models.attention import Attention, rotary_cos_sin
from moe.models.kv_cache import CacheStep, KVCache
from moe.models.presets import PRESETS, ModelConfig, estimate_param_bytes, get_preset
from moe.shared import SharedExperts

__all__ = ["Batch", "KVCache", "ModelConfig", "MoETransformer", "PRESETS",
           "estimate_param_bytes", "get_preset", "make_batch"]

SeqLens = Union[Sequence[int], Tensor]


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` computed in float32; [T, H] -> [T, H] in x's dtype."""

    def __init__(self, hidden_size: int, *, eps: float, dtype: torch.dtype,
                 device: torch.device | str | None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))

    def forward(self, x_TH: Tensor) -> Tensor:
        # One fused kernel on CUDA (fp32 math for 16-bit x); on CPU the same bits as
        # casting x and the weight to fp32, scaling, and casting back.
        return F.rms_norm(x_TH, (x_TH.shape[-1],), self.weight, self.eps)


class DecoderLayer(nn.Module):
    """Pre-norm block: attention, then a dense gated MLP or an `MoELayer`, each residual."""

    def __init__(self, config: ModelConfig, *, layer_id: int, group: Optional[dist.ProcessGroup],
                 device: torch.device | str | None) -> None:
        super().__init__()
        self.layer_id = layer_id
        norm = dict(eps=config.rms_norm_eps, dtype=config.dtype, device=device)
        self.attn_norm = RMSNorm(config.hidden_size, **norm)
        self.attn = Attention(config, device=device)
        self.ffn_norm = RMSNorm(config.hidden_size, **norm)
        self.ffn: nn.Module
        if layer_id < config.num_dense_layers:
            # The dense FFN is the same gated MLP as the shared experts ([2I, H] + [H, I]).
            self.ffn = SharedExperts(hidden_size=config.hidden_size,
                                     intermediate_size=config.dense_intermediate_size,
                                     dtype=config.dtype, device=device)
        else:
            self.ffn = MoELayer(config.moe, group=group, layer_id=layer_id, last_layer=layer_id == config.num_layers - 1,
                                device=device)

    def forward(self, x_TH: Tensor, cos_TD2: Tensor, sin_TD2: Tensor,
                seq_lens: Sequence[int], cached: Optional[CacheStep] = None) -> Tensor:
        """[T, H] -> [T, H]; the MoE layer (if any) yields to the other ubatch inside."""
        with phase_scope("attention", layer=self.layer_id):
            x_TH = x_TH + self.attn(self.attn_norm(x_TH), cos_TD2, sin_TD2, seq_lens,
                                    cached, self.layer_id)
        return x_TH + self.ffn(self.ffn_norm(x_TH))


class MoETransformer(nn.Module):
    """Embedding, `num_layers` decoder layers, final RMSNorm, LM head.

    Args:
        config: the model shapes (see `moe.models.presets` for named ones); every MoE layer
            is built from `config.moe`, its backend and expert kernel included
            (`get_preset(name, backend="a2a", experts="triton")`).
        group: expert-parallel process group; None = all experts on this process.
        device: where the parameters are created; they hold garbage until
            `init_weights` (or a state dict load).
    """

    def __init__(self, config: ModelConfig, *, group: Optional[dist.ProcessGroup] = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(f"MoETransformer takes a ModelConfig (see moe.models.presets.get_preset), "
                            f"got {type(config).__name__}")
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size, dtype=config.dtype,
                                  device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, layer_id=i, group=group, device=device)
            for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=config.dtype,
                            device=device)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False,
                                 dtype=config.dtype, device=device)

    @property
    def moe_layers(self) -> list[MoELayer]:
        """The MoE layers in layer order (layers num_dense_layers .. num_layers - 1)."""
        return [layer.ffn for layer in self.layers if isinstance(layer.ffn, MoELayer)]

    def forward(self, input_ids_T: Tensor, positions_T: Tensor, *,
                seq_lens: Optional[SeqLens] = None, cache: Optional[KVCache] = None) -> Tensor:
        """Logits [T, V] in config.dtype for T packed tokens.

        Args:
            input_ids_T: [T] integer token ids.
            positions_T: [T] integer positions (0.. within each request, or where the
                request's slice starts when a request is split over calls).
            seq_lens: tokens per request, in order, summing to T (list, tuple or 1-D
                tensor; a tensor costs a host copy). Required: its default None only
                lets a call without it fail with a TypeError that says how to pass it.
            cache: the requests' KV cache (`moe.models.kv_cache.KVCache`, one request per
                entry of seq_lens): the tokens are appended to it and attend over it;
                positions_T must then continue each request (`cache.next_positions()`
                for a decode step).

        Every rank of the EP group must call forward the same number of times (with T = 0
        too): each MoE layer runs collectives.
        """
        seq_lens = self._check_inputs(input_ids_T, positions_T, seq_lens, cache)
        cached = None if cache is None else cache.begin(seq_lens)
        cos_TD2, sin_TD2 = rotary_cos_sin(positions_T, head_dim=self.config.head_dim,
                                          theta=self.config.rope_theta)
        x_TH = self.embed(input_ids_T)
        for layer in self.layers:
            x_TH = layer(x_TH, cos_TD2, sin_TD2, seq_lens, cached)
        if cache is not None:
            cache.commit(seq_lens)
        return self.lm_head(self.norm(x_TH))

    def dbo_split_mode(self) -> str:
        """"requests": the DBO runner's split mode for this model's calls under
        `DBOConfig(split=None)` (`dbo.split.modes`): a step is cut at request boundaries
        of its `seq_lens`, each ubatch getting its own. (A call with `cache=` needs
        `moe.models.kv_cache.with_cache_split`, which gives each ubatch its requests'
        cache.)"""
        return "requests"

    def dbo_can_split_inside_request(self) -> bool:
        """False: a request's tokens must stay in one call (`dbo.split`). Attention runs
        over the call's tokens (and, with a cache, the tokens cached by earlier calls), so
        the tail of a request cut across the two ubatches of one step would attend
        without its head's keys."""
        return False

    def dbo_check_inputs(self, input_ids_T: Tensor, positions_T: Tensor, *,
                         seq_lens: Optional[SeqLens] = None,
                         cache: Optional[KVCache] = None) -> None:
        """The checks of `forward` alone, for the DBO runner to run before its vote: a
        rank whose inputs fail them stops every rank there (`dbo.agreement`), instead of
        leaving its peers waiting in the first MoE layer's dispatch. Token ids outside
        the vocabulary are among them on CPU only (`_check_vocab`)."""
        self._check_inputs(input_ids_T, positions_T, seq_lens, cache)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter deterministically from `seed`, on its own device.

        Each tensor gets its own generator seed from (seed, parameter name); each routed
        expert from (seed, parameter name, global expert id), so an EP rank's experts equal
        the same experts of the one-process model. Embedding N(0, 1); norms 1; correction
        bias N(0, 0.1^2); other weights N(0, 1/fan_in) so activations stay O(1). Values
        are drawn in the parameter dtype on the parameter device: the same seed gives the
        same weights on the same kind of device (CPU, or one GPU model), not across kinds.
        """
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"init_weights: seed={seed!r} must be an int.")
        generators: dict[torch.device, torch.Generator] = {}
        moe_first_expert = {id(m.w13): m.first_expert for m in self.moe_layers}
        moe_first_expert.update({id(m.w2): m.first_expert for m in self.moe_layers})
        for name, param in self.named_parameters():
            gen = generators.get(param.device)
            if gen is None:
                gen = generators[param.device] = torch.Generator(device=param.device)
            tag = zlib.crc32(name.encode())
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name == "embed.weight":
                param.normal_(0.0, 1.0, generator=gen.manual_seed(_mix(seed, tag)))
            elif name.endswith("e_score_correction_bias"):
                param.normal_(0.0, 0.1, generator=gen.manual_seed(_mix(seed, tag)))
            elif id(param) in moe_first_expert:
                first = moe_first_expert[id(param)]
                std = param.shape[-1] ** -0.5
                for local, expert_weight in enumerate(param):
                    expert_weight.normal_(0.0, std, generator=gen.manual_seed(
                        _mix(seed, tag, first + local + 1)))
            else:
                param.normal_(0.0, param.shape[-1] ** -0.5,
                              generator=gen.manual_seed(_mix(seed, tag)))

    def _check_vocab(self, input_ids_T: Tensor) -> None:
        """ValueError for a token id outside [0, vocab_size), where the ids are on the CPU.

        On a GPU the ids are not checked: the check would read a device value on the
        host, a sync of the compute stream before every step's vote, which waits for
        nothing queued (`dbo.vote`). An id outside the vocabulary then fails in the
        embedding's device-side assert, which leaves the process's CUDA context unusable
        (restart the process; its peers fail at the group's timeout)."""
        if input_ids_T.device.type != "cpu" or input_ids_T.numel() == 0:
            return
        vocab = self.config.vocab_size
        bad_T = (input_ids_T < 0) | (input_ids_T >= vocab)
        if bool(bad_T.any()):
            first = int(bad_T.nonzero()[0, 0])
            raise ValueError(f"MoETransformer.forward: input_ids_T[{first}]="
                             f"{int(input_ids_T[first])} is outside the vocabulary "
                             f"[0, vocab_size={vocab}) ({int(bad_T.sum())} such ids): pass "
                             f"token ids of this model's tokenizer.")

    def _check_inputs(self, input_ids_T: Tensor, positions_T: Tensor,
                      seq_lens: Optional[SeqLens], cache: Optional[KVCache] = None
                      ) -> list[int]:
        """Validate the call's inputs; return seq_lens as a list of ints."""
        for name, t in (("input_ids_T", input_ids_T), ("positions_T", positions_T)):
            if not isinstance(t, Tensor) or t.dim() != 1 or t.is_floating_point():
                got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(f"MoETransformer.forward: {name} must be a 1-D integer tensor "
                                 f"[T], got {got}: flatten requests into one packed sequence.")
            if t.device != self.embed.weight.device:
                raise ValueError(f"MoETransformer.forward: {name} is on {t.device}, the model on "
                                 f"{self.embed.weight.device}: move the inputs to the model.")
        self._check_vocab(input_ids_T)
        if input_ids_T.shape != positions_T.shape:
            raise ValueError(f"MoETransformer.forward: input_ids_T has {input_ids_T.shape[0]} "
                             f"tokens but positions_T has {positions_T.shape[0]}: pass one "
                             f"position per token.")
        if seq_lens is None:
            num_tokens = input_ids_T.shape[0]
            raise TypeError(f"MoETransformer.forward needs the keyword seq_lens=, the tokens "
                            f"per request in order, summing to T={num_tokens}: pass e.g. "
                            f"seq_lens=[{num_tokens}] for one request of all {num_tokens} "
                            f"tokens (make_batch gives batch.seq_lens).")
        if isinstance(seq_lens, Tensor):
            seq_lens = seq_lens.tolist()
        lens = list(seq_lens)
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in lens):
            raise ValueError(f"MoETransformer.forward: seq_lens={lens!r} must be ints >= 0 (tokens "
                             f"per request).")
        if sum(lens) != input_ids_T.shape[0]:
            raise ValueError(f"MoETransformer.forward: seq_lens={lens!r} sum to {sum(lens)}, but "
                             f"the call has T={input_ids_T.shape[0]} tokens: seq_lens must count "
                             f"every token of input_ids_T, request by request.")
        if cache is not None:
            if not isinstance(cache, KVCache):
                raise TypeError(f"MoETransformer.forward: cache must be a "
                                f"moe.models.kv_cache.KVCache, got a {type(cache).__name__}")
            cache.check(lens, num_layers=self.config.num_layers,
                        device=self.embed.weight.device)
        return lens


def _mix(*parts: int) -> int:
    """A 63-bit generator seed from ints (splitmix64 steps): stable across processes."""
    mask = (1 << 64) - 1
    h = 0x9E3779B97F4A7C15
    for part in parts:
        h = ((h ^ (part & mask)) * 0xBF58476D1CE4E5B9) & mask
        h = ((h ^ (h >> 31)) * 0x94D049BB133111EB) & mask
        h ^= h >> 29
    return h >> 1


@dataclass(frozen=True, kw_only=True)
class Batch:
    """One step's packed inputs for `MoETransformer.forward`."""

    input_ids_T: Tensor
    """[T] int64 token ids."""
    positions_T: Tensor
    """[T] int64 positions, 0..len-1 within each request."""
    seq_lens: tuple[int, ...]
    """Tokens per request, each >= 1, summing to T."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_T.shape[0])


def make_batch(config: ModelConfig, *, num_tokens: int, num_requests: int, seed: int,
               device: torch.device | str = "cpu") -> Batch:
    """A random packed batch: `num_requests` requests (at most one per token) of random
    lengths >= 1 summing to `num_tokens`, random ids in [0, V). Drawn on the CPU from
    `seed`, so the same on every device. `num_tokens = 0` gives an empty batch."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"make_batch: num_tokens={num_tokens!r} must be an int >= 0.")
    if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"make_batch: num_requests={num_requests!r} must be an int >= 1.")
    gen = torch.Generator().manual_seed(seed)
    num_requests = min(num_requests, num_tokens)
    if num_requests == 0:
        seq_lens: tuple[int, ...] = ()
    else:
        # num_requests - 1 distinct cut points in 1..T-1: every length >= 1.
        cuts = (torch.randperm(num_tokens - 1, generator=gen)[: num_requests - 1] + 1).sort().values
        bounds = [0, *cuts.tolist(), num_tokens]
        seq_lens = tuple(b - a for a, b in zip(bounds, bounds[1:]))
    input_ids = torch.randint(0, config.vocab_size, (num_tokens,), generator=gen)
    positions = (torch.cat([torch.arange(n) for n in seq_lens]) if seq_lens
                 else torch.zeros(0, dtype=torch.int64))
    return Batch(input_ids_T=input_ids.to(device), positions_T=positions.to(device),
                 seq_lens=seq_lens)
