"""`local`: no expert parallelism (EP size 1): every expert is on this rank, nothing moves."""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist
from torch import Tensor

from moe.backends.base import Dispatched, OwnRows, Pending, PrepareFinalize
from moe.config import MoEConfig
from moe.workspace import Workspace


class LocalBackend(PrepareFinalize):
    """Identity dispatch and combine; global expert ids are the local ids."""

    name = "local"
    graph_safe_with_capacity = True
    single_rank = True
    comm_recordable = True  # nothing to record: EP size 1
    graph_safe = True

    @classmethod
    def check_runs(cls, world_size: int, config: Optional[MoEConfig] = None) -> None:
        if world_size != 1:
            raise ValueError(f"backend 'local' needs an EP group of size 1, got "
                             f"{world_size} ranks: use backend='a2a', 'a2a_ll' or 'naive'")

    def __init__(self, config: MoEConfig, group: Optional[dist.ProcessGroup]) -> None:
        super().__init__(config, group)
        self.check_runs(self.world_size)

    def prepare_async(self, x_TH: Tensor, topk_weights_TK: Tensor, topk_ids_TK: Tensor, *,
                      workspace: Workspace) -> Pending[Dispatched]:
        dispatched = Dispatched(x_TH, topk_ids_TK, topk_weights_TK, handle=None)
        return Pending(None, lambda: dispatched)

    def finalize_async(self, expert_out_RH: Tensor, dispatched: Dispatched, *,
                       workspace: Workspace, own: Optional[OwnRows] = None) -> Pending[Tensor]:
        self.refuse_split(own)
        return Pending(None, lambda: expert_out_RH)
