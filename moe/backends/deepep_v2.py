"""`deepep_v2`: DeepEP v2, `deep_ep.ElasticBuffer`. Not built yet: constructing it
refuses in one line saying what is missing (`moe.backends.deepep_support`)."""
from __future__ import annotations

from typing import NoReturn, Optional

import torch.distributed as dist

from moe.backends.base import PrepareFinalize
from moe.backends.deepep_support import require_deep_ep
from moe.config import MoEConfig


class DeepEPV2Backend(PrepareFinalize):
    """Refuses: raises from the constructor (ImportError, ValueError or
    NotImplementedError, see `require_deep_ep`)."""

    name = "deepep_v2"

    def __new__(cls, config: MoEConfig, group: Optional[dist.ProcessGroup]) -> NoReturn:
        require_deep_ep(cls.name, "ElasticBuffer")
        raise AssertionError("require_deep_ep always raises")
