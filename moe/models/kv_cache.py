"""KV caches of `MoETransformer`: a prefill fills them, decode steps append one token each.

    cache = KVCache.empty(config, num_requests=4, capacity=64)        # zeros, lengths 0
    logits_TV = model(ids_T, positions_T, seq_lens=prompt_lens, cache=cache)   # prefill
    ids_B = logits_TV[ends].argmax(-1)                                 # a token per request
    logits_BV = model(ids_B, cache.next_positions(), seq_lens=[1] * 4, cache=cache)

    runner = DBORunner(model, with_cache_split(DBOConfig(min_decode_tokens=2)), group=g)
    logits_BV = runner(ids_B, cache.next_positions(), seq_lens=[1] * 4, cache=cache)

Shape legend: B requests of a cache, Nk kv heads, P positions a request can hold
(capacity), D head dim, T tokens of a call, N query heads, M the most new tokens of one
request in a call, S the longest request after the call.

A call with `cache=` gives each request of the cache its next `seq_lens[b]` tokens (0
allowed): their keys and values are written at the request's next positions, and each
new token attends to every cached token of its request and to the new ones before it
(a prefill is the first such call, on empty requests). The lengths advance once the
call has run every layer.

Under DBO each ubatch owns its requests' caches: `with_cache_split` splits a step on a
request boundary (never inside a request) and hands ubatch u the cache of its requests
only (`KVCache.requests`: views of the same memory, so no copy and nothing to join
back), with the runner's thresholds deciding whether the step splits at all. The two
ubatches read and write disjoint rows, and each advances the lengths of its own
requests. `moe.hf.generate` keeps one transformers cache per ubatch for the same reason;
these caches are views of one buffer, so an unsplit step needs no join.

Attention over the cache is SDPA with a boolean mask ([B, 1, M, S]), the new tokens
padded to M per request: a reference path, exact against recomputing the whole
sequences without a cache. The cache starts zeroed, so masked positions never hold
NaN. A call with a cache reads its lengths on the host: it cannot be captured in a
CUDA graph (the positions would be baked in).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from dbo.config import DBOConfig
from dbo.split import plan_split
from moe.models.presets import ModelConfig

__all__ = ["CacheStep", "KVCache", "SplitWithCache", "with_cache_split"]


class KVCache:
    """Keys and values [B, Nk, P, D] per decoder layer for B requests, and each request's
    length (tokens cached). `requests(a, b)` gives a cache of requests [a, b) that views
    the same tensors and lengths."""

    def __init__(self, keys: list[Tensor], values: list[Tensor], lengths: list[int], *,
                 start: int = 0) -> None:
        self.keys, self.values = keys, values
        self._lengths = lengths  # shared with every view; this cache owns [start, start + B)
        self._start = start

    @classmethod
    def empty(cls, config: ModelConfig, *, num_requests: int, capacity: int,
              device: torch.device | str = "cpu") -> "KVCache":
        """An empty (zeroed) cache of `num_requests` requests, each up to `capacity`
        tokens, in the model's dtype on `device`."""
        for name, value in (("num_requests", num_requests), ("capacity", capacity)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"KVCache.empty: {name}={value!r} must be an int >= 1")
        shape = (num_requests, config.num_kv_heads, capacity, config.head_dim)
        keys = [torch.zeros(shape, dtype=config.dtype, device=device)
                for _ in range(config.num_layers)]
        values = [torch.zeros_like(k) for k in keys]
        return cls(keys, values, [0] * num_requests)

    @property
    def num_requests(self) -> int:
        return self.keys[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @property
    def lengths(self) -> tuple[int, ...]:
        """Tokens cached per request."""
        return tuple(self._lengths[self._start:self._start + self.num_requests])

    def requests(self, start: int, end: int) -> "KVCache":
        """The cache of requests [start, end): views of these tensors and lengths."""
        assert 0 <= start <= end <= self.num_requests, (start, end, self.num_requests)
        return KVCache([k[start:end] for k in self.keys], [v[start:end] for v in self.values],
                       self._lengths, start=self._start + start)

    def next_positions(self, device: Optional[torch.device] = None) -> Tensor:
        """[B] int64: the position of each request's next token (a decode step's)."""
        return torch.tensor(self.lengths, dtype=torch.int64,
                            device=device if device is not None else self.keys[0].device)

    def check(self, seq_lens: Sequence[int], *, num_layers: int, device: torch.device) -> None:
        """ValueError naming the fix where a call of `seq_lens` cannot use this cache."""
        if len(self.keys) != num_layers:
            raise ValueError(f"the KV cache has {len(self.keys)} layers, the model "
                             f"{num_layers}: build it with KVCache.empty(model.config, ...)")
        if self.keys[0].device != device:
            raise ValueError(f"the KV cache is on {self.keys[0].device}, the model on "
                             f"{device}: KVCache.empty(..., device=...)")
        if len(seq_lens) != self.num_requests:
            raise ValueError(f"seq_lens has {len(seq_lens)} requests but the KV cache "
                             f"{self.num_requests}: give every request of the cache its "
                             f"new tokens (0 for none)")
        over = [b for b, (n, have) in enumerate(zip(seq_lens, self.lengths))
                if have + n > self.capacity]
        if over:
            b = over[0]
            raise ValueError(f"request {b} would hold {self.lengths[b] + seq_lens[b]} tokens, "
                             f"more than the KV cache's capacity {self.capacity}: build the "
                             f"cache with a larger capacity")

    def begin(self, seq_lens: Sequence[int]) -> "CacheStep":
        """The index tensors of one call that appends `seq_lens` tokens (host work, once
        per call; the model's layers share them)."""
        device = self.keys[0].device
        lengths = self.lengths
        counts = torch.tensor(list(seq_lens), dtype=torch.int64)
        req_T = torch.repeat_interleave(torch.arange(len(counts)), counts)
        starts = torch.cumsum(counts, 0) - counts
        qi_T = torch.arange(int(counts.sum())) - starts[req_T]
        pos_T = torch.tensor(lengths, dtype=torch.int64)[req_T] + qi_T
        most = max(seq_lens, default=0)
        longest = max((have + n for have, n in zip(lengths, seq_lens)), default=0)
        # Query i of request b sits at position lengths[b] + i and sees positions <= it.
        query_pos_BM = (torch.tensor(lengths, dtype=torch.int64)[:, None]
                        + torch.arange(most)[None, :])
        mask_B1MS = (torch.arange(longest)[None, None, None, :]
                     <= query_pos_BM[:, None, :, None])
        return CacheStep(cache=self, req_T=_to_device(req_T, device),
                         qi_T=_to_device(qi_T, device), pos_T=_to_device(pos_T, device),
                         mask_B1MS=_to_device(mask_B1MS, device), longest=longest)

    def commit(self, seq_lens: Sequence[int]) -> None:
        """Advance each request's length by its new tokens (after the call ran)."""
        for b, n in enumerate(seq_lens):
            self._lengths[self._start + b] += n


@dataclass(frozen=True, kw_only=True)
class CacheStep:
    """One call's placement of its T new tokens in a `KVCache` (from `KVCache.begin`)."""

    cache: KVCache
    req_T: Tensor
    """[T] int64: the request of each token."""
    qi_T: Tensor
    """[T] int64: each token's index among its request's new tokens."""
    pos_T: Tensor
    """[T] int64: each token's position in its request."""
    mask_B1MS: Tensor
    """[B, 1, M, S] bool: which positions each (padded) new token attends to."""
    longest: int
    """S: the longest request after the call."""

    def attend(self, layer: int, q_TND: Tensor, k_TND: Tensor, v_TND: Tensor) -> Tensor:
        """Write the new tokens' keys and values ([T, Nk, D]) into layer `layer`'s cache,
        then attend each query ([T, N, D]) over its request's positions up to its own;
        returns [T, N, D] in q's dtype, on the current stream."""
        if q_TND.shape[0] == 0:
            return torch.empty_like(q_TND)
        keys, values = self.cache.keys[layer], self.cache.values[layer]
        keys[self.req_T, :, self.pos_T] = k_TND
        values[self.req_T, :, self.pos_T] = v_TND
        num_requests, most = self.mask_B1MS.shape[0], self.mask_B1MS.shape[2]
        q_BMND = q_TND.new_zeros(num_requests, most, *q_TND.shape[1:])
        q_BMND[self.req_T, self.qi_T] = q_TND
        o_BNMD = F.scaled_dot_product_attention(
            q_BMND.transpose(1, 2), keys[:, :, :self.longest], values[:, :, :self.longest],
            attn_mask=self.mask_B1MS, enable_gqa=keys.shape[1] != q_TND.shape[1])
        return o_BNMD.transpose(1, 2)[self.req_T, self.qi_T]


class SplitWithCache:
    """The callable `DBOConfig.split` for `MoETransformer` calls with `cache=`: the step
    split on a request boundary by `dbo.split.plan_split` under `config`'s thresholds,
    each ubatch with its tokens, its `seq_lens` and the cache of its requests; None
    (unsplit) where the plan does not split. Calls without a cache split the same way."""

    def __init__(self, config: DBOConfig) -> None:
        self.config = config

    def __repr__(self) -> str:  # the runner names the callable in its decisions
        return (f"SplitWithCache(min_prefill_tokens={self.config.min_prefill_tokens}, "
                f"min_decode_tokens={self.config.min_decode_tokens})")

    def __call__(self, args: tuple, kwargs: dict) -> Optional[list[tuple[tuple, dict]]]:
        input_ids_T, positions_T = args
        seq_lens = kwargs["seq_lens"]
        if isinstance(seq_lens, Tensor):
            seq_lens = seq_lens.tolist()
        cache: Optional[KVCache] = kwargs.get("cache")
        plan = plan_split(list(seq_lens), self.config, num_tokens=input_ids_T.shape[0],
                          allow_split_inside_request=False)
        if not plan.split:
            return None
        out = []
        for ub in plan.ubatches:
            rows = slice(ub.token_start, ub.token_end)
            assert ub.seq_lens is not None
            ub_kwargs: dict[str, Any] = {"seq_lens": list(ub.seq_lens)}
            if cache is not None:
                ub_kwargs["cache"] = cache.requests(ub.request_start, ub.request_end)
            out.append(((input_ids_T[rows], positions_T[rows]), ub_kwargs))
        return out


def with_cache_split(config: DBOConfig) -> DBOConfig:
    """`config` splitting by `SplitWithCache` (its thresholds kept): the runner config
    for `MoETransformer` calls with a KV cache."""
    return dataclasses.replace(config, split=SplitWithCache(config), unsplit_args=(),
                               split_kwargs=())


def _to_device(x: Tensor, device: torch.device) -> Tensor:
    """`x` (a small CPU tensor) on `device`, without a host sync on CUDA (pinned copy)."""
    if device.type != "cuda":
        return x
    return x.pin_memory().to(device, non_blocking=True)
