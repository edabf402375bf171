"""`Checkpoint`: the tensors of a safetensors checkpoint directory, read lazily and in part.

Shape legend: E routed experts, n of them read here, H hidden, I one expert's width.

A directory holds `model.safetensors`, or shards listed in `model.safetensors.index.json`
(`weight_map`: tensor name -> file). Only headers are read on opening; a tensor is read
when asked for, and an expert slice reads only its experts' rows (`safe_open`'s
`get_slice`), so a rank never reads another rank's experts.

Routed experts are stored in one of two layouts, both read here:
- per expert (what `save_pretrained` writes for every architecture of `moe.hf.arch`:
  transformers fuses them on load and unfuses them on save):
  `<block>.experts.<e>.<gate|up|down>.weight` [I, H], [I, H], [H, I];
- fused: `<block>.experts.gate_up_proj` [E, 2I, H] and `<block>.experts.down_proj` [E, H, I].
"""
from __future__ import annotations

import json
import os
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from moe.hf.deps import require

__all__ = ["Checkpoint", "ExpertRange"]

INDEX_FILE = "model.safetensors.index.json"


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
        if not os.path.isdir(self.path):
            raise ValueError(f"moe.hf.load: {self.path!r} is not a directory: pass a checkpoint "
                             f"directory (config.json and *.safetensors, as save_pretrained "
                             f"writes)")
        self._files = self._file_of_tensor()
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
            safetensors = require("safetensors")
            handle = self._stack.enter_context(
                safetensors.safe_open(os.path.join(self.path, file), framework="pt"))
            self._handles[file] = handle
        return handle

    def _file_of_tensor(self) -> dict[str, str]:
        """Tensor name -> file, from the index where there is one, else from the headers
        of every *.safetensors file. ValueError, naming the file and the fix, for an
        index that is not JSON, has no `weight_map` of names to files, or names a file
        the directory lacks, and for a file whose header safetensors cannot read."""
        index = os.path.join(self.path, INDEX_FILE)
        if os.path.exists(index):
            return _read_index(index)
        files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
        if not files:
            raise ValueError(f"moe.hf.load: {self.path!r} holds no *.safetensors file: save the "
                             f"model with save_pretrained (safetensors is its default)")
        safetensors = require("safetensors")
        names: dict[str, str] = {}
        for file in files:
            path = os.path.join(self.path, file)
            try:
                with safetensors.safe_open(path, framework="pt") as f:
                    names.update((key, file) for key in f.keys())
            except (OSError, safetensors.SafetensorError) as exc:
                raise ValueError(f"moe.hf.load: cannot read {path!r} ({exc}): save the model "
                                 f"again with save_pretrained") from None
        return names


def _read_index(path: str) -> dict[str, str]:
    """The `weight_map` (tensor name -> file) of index file `path`, each file checked to
    be beside it; ValueError naming the file and the fix otherwise."""
    fix = "save the model again with save_pretrained, which writes it"
    try:
        with open(path) as f:
            index = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"moe.hf.load: {path!r} is not a JSON file ({exc}): {fix}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if (not isinstance(weight_map, dict) or not weight_map
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())):
        raise ValueError(f"moe.hf.load: {path!r} has no weight_map (an object of tensor names "
                         f"to *.safetensors files): {fix}")
    folder = os.path.dirname(path)
    missing = sorted({f for f in weight_map.values()
                      if not os.path.isfile(os.path.join(folder, f))})
    if missing:
        raise ValueError(f"moe.hf.load: {path!r} lists {missing[0]!r}, which is not in "
                         f"{folder!r}: copy the whole checkpoint folder, or {fix}")
    return dict(weight_map)
