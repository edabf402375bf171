"""`Checkpoint`: the tensors of a safetensors checkpoint directory, read lazily and in part.

Shape legend: E routed experts, n of them read here, H hidden, I one expert's width.

A directory holds `model.safetensors`, or shards listed in `model.safetensors.index.json`
(`weight_map`: tensor name -> file), every file checked on opening (`moe.hf.folder`:
inside the directory, readable, each tensor in one file). Only headers are read on
opening; a tensor is read
when asked for, and an expert slice reads only its experts' rows (`safe_open`'s
`get_slice`), so a rank never reads another rank's experts.

Routed experts are stored in one of two layouts, both read here:
- per expert (what `save_pretrained` writes for every architecture of `moe.hf.arch`:
  transformers fuses them on load and unfuses them on save):
  `<block>.experts.<e>.<gate|up|down>.weight` [I, H], [I, H], [H, I];
- fused: `<block>.experts.gate_up_proj` [E, 2I, H] and `<block>.experts.down_proj` [E, H, I].
"""
from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from moe.hf.folder import open_shard, tensor_files

__all__ = ["Checkpoint", "ExpertRange"]

@dataclass(frozen=True, kw_only=True)
class ExpertRange:
    """Experts [first, first + count) of one block, and how checkpoints name them."""

    prefixes: tuple[str, ...]
    """The block's names in checkpoints, the model's first (e.g. "model.layers.1.mlp",
    then "model.layers.1.block_sparse_moe")."""
    first: int
    count: int
    num_experts: int
    """E, all experts of the block."""
    names: tuple[str, str, str]
    """Per-expert tensor names (gate, up, down), e.g. ("w1", "w3", "w2")."""


class Checkpoint:
    """A safetensors checkpoint directory, opened for reading (use as a context manager)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._files = tensor_files(self.path)  # every file checked (moe.hf.folder)
        self._stack = ExitStack()
        self._handles: dict[str, Any] = {}

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, *, shape: Sequence[int], what: str) -> Tensor:
        """Tensor `name`, checked to have `shape`; `what` names it in errors."""
        self._check_shape(name, tuple(shape), what)
        return self._handle(name).get_tensor(name)

    def read_experts(self, experts: ExpertRange, *, hidden: int, width: int,
                     block: str) -> tuple[Tensor, Tensor]:
        """(w13 [n, 2I, H], w2 [n, H, I]) of the range's experts, in the checkpoint's dtype.

        Raises ValueError naming the missing or mis-shaped tensor of the block."""
        lo, hi = experts.first, experts.first + experts.count
        for prefix in experts.prefixes:
            fused_gate_up, fused_down = f"{prefix}.experts.gate_up_proj", f"{prefix}.experts.down_proj"
            if fused_gate_up in self or fused_down in self:
                e = experts.num_experts
                self._require(fused_gate_up, block, "the fused gate/up weights of every expert")
                self._require(fused_down, block, "the fused down weights of every expert")
                self._check_shape(fused_gate_up, (e, 2 * width, hidden), f"block {block!r}")
                self._check_shape(fused_down, (e, hidden, width), f"block {block!r}")
                return (self._handle(fused_gate_up).get_slice(fused_gate_up)[lo:hi],
                        self._handle(fused_down).get_slice(fused_down)[lo:hi])
            if any(self._expert_key(prefix, e, name) in self
                   for e in range(lo, hi) for name in experts.names):
                return self._read_per_expert(prefix, experts, hidden=hidden, width=width,
                                             block=block)
        prefix = experts.prefixes[0]
        raise ValueError(
            f"moe.hf.load: checkpoint {self.path!r} has no tensor "
            f"{self._expert_key(prefix, lo, experts.names[0])!r} (expert {lo} of block "
            f"{block!r}), nor the fused '{prefix}.experts.gate_up_proj': the checkpoint is "
            f"incomplete or was saved from another model; re-save it with save_pretrained")

    # ------------------------------------------------------------------ internals
    def _read_per_expert(self, prefix: str, experts: ExpertRange, *, hidden: int, width: int,
                         block: str) -> tuple[Tensor, Tensor]:
        gate, up, down = experts.names
        w13, w2 = [], []
        for e in range(experts.first, experts.first + experts.count):
            what = f"expert {e} of block {block!r}"
            keys = [self._expert_key(prefix, e, name) for name in (gate, up, down)]
            for key in keys:
                self._require(key, block, f"a weight of expert {e}")
            gate_w, up_w = (self.read(k, shape=(width, hidden), what=what) for k in keys[:2])
            w13.append(torch.cat([gate_w, up_w], dim=0))
            w2.append(self.read(keys[2], shape=(hidden, width), what=what))
        return torch.stack(w13), torch.stack(w2)

    @staticmethod
    def _expert_key(prefix: str, expert: int, name: str) -> str:
        return f"{prefix}.experts.{expert}.{name}.weight"

    def _require(self, name: str, block: str, what: str) -> None:
        if name not in self:
            raise ValueError(f"moe.hf.load: checkpoint {self.path!r} has no tensor {name!r} "
                             f"({what}, block {block!r}): the checkpoint is incomplete or was "
                             f"saved from another model; re-save it with save_pretrained")

    def _check_shape(self, name: str, shape: tuple[int, ...], what: str) -> None:
        found = self.shape(name)
        if found != shape:
            raise ValueError(f"moe.hf.load: tensor {name!r} ({what}) has shape {list(found)} "
                             f"in the checkpoint, but the model built from config.json needs "
                             f"{list(shape)}: config.json and the weights disagree (fix "
                             f"config.json, or re-save the checkpoint from its model)")

    def _handle(self, name: str) -> Any:
        file = self._files[name]
        handle = self._handles.get(file)
        if handle is None:
            handle = self._stack.enter_context(open_shard(self.path, file))
            self._handles[file] = handle
        return handle
