"""`Checkpoint`: the tensors of a safetensors checkpoint directory, read lazily and in part.

Shape legend: N rows of a tensor's first dimension (e.g. its experts), n of them read.

A directory holds `model.safetensors`, or shards listed in `model.safetensors.index.json`
(`weight_map`: tensor name -> file), every file checked on opening (`moe.hf.folder`:
inside the directory, readable, each tensor in one file). Only headers are read on
opening; a tensor is read when asked for, and `read_rows` reads only the rows asked for
(`safe_open`'s `get_slice`), so a rank never reads another rank's experts of a fused
tensor. Which names a model reads, and how, is `moe.hf.weights`'.
"""
from __future__ import annotations

import os
from contextlib import ExitStack
from typing import Any, Optional, Sequence

from torch import Tensor

from moe.hf.folder import open_shard, tensor_files

__all__ = ["Checkpoint"]


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

    def names(self) -> list[str]:
        """Every tensor name of the checkpoint."""
        return list(self._files)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, *, shape: Optional[Sequence[int]] = None,
             what: str = "a model weight") -> Tensor:
        """Tensor `name`, checked to have `shape` where given; `what` names it in errors."""
        if shape is not None:
            self.check_shape(name, tuple(shape), what)
        return self._handle(name).get_tensor(name)

    def read_rows(self, name: str, first: int, stop: int) -> Tensor:
        """Rows [first, stop) of tensor `name`'s first dimension: [n, ...], no other rows read."""
        return self._handle(name).get_slice(name)[first:stop]

    def check_shape(self, name: str, shape: tuple[int, ...], what: str) -> None:
        """ValueError naming tensor `name` where its shape is not `shape`."""
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
