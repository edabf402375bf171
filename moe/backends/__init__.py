"""Prepare/finalize backends, registered by name.

| name | engine | host sync | CUDA graphs | CPU (gloo) |
|---|---|---|---|---|
| local | none (EP = 1) | no | yes | yes |
| naive | all-gather + reduce-scatter | only without max_tokens_per_rank | with max_tokens_per_rank | yes |
| naive_mono | all-gather of tokens and router logits (every rank routes them) + reduce-scatter | only without max_tokens_per_rank | with max_tokens_per_rank | yes |
| a2a | exact all_to_all_single: count exchange, then data | yes: yields before it | no | yes |
| a2a_ll | fixed-capacity padded all_to_all_single | no | yes | yes |
| symm_mem | exact all_to_all_vdev on torch symmetric memory (NVSHMEM), counts on the GPU | no | yes | no (CUDA GPUs) |
| deepep_ht | DeepEP normal kernels (NVLink, bfloat16) | yes (DeepEP busy-waits for the counts; yields before it) | with DeepEPHTOptions.worst_case_dispatch | no |
| deepep_ll | DeepEP low-latency kernels, receive halves as hooks (hidden 2048..8192, bfloat16) | no | yes | no |
| deepep_v2 | DeepEP v2 ElasticBuffer (needs NCCL >= 2.30.4); its exactness against the real library on 2 GPUs not yet measured | prefill mode: yes, yields before it; decode mode: no | decode mode | no (its fake: yes) |
| nccl_ep | NCCL EP (nccl-extensions, NCCL >= 2.29): low-latency or high-throughput form; measured on one GPU, not yet across two | no | yes | no |
| auto | local for EP size 1, else a2a | | | |

Each backend declares its traits as class attributes (`PrepareFinalize`); ask them by
name with `backend_traits(name)` or `backends_with(trait=value, ...)`, never by a
hand-kept list of names. It also declares its options class (`options_type`, held as
`MoEConfig.backend_options`), the fields it adds to the agreement (`agreement_fields`)
and its requirements (`check_runs`, `check_shape`, `check_max_tokens`, `row_dtypes`,
`hidden_sizes`). Names, where each is implemented and the named defaults
(`DEFAULT_BACKEND`, ...) are `moe.backends.registry`'s.

Modules are imported when their backend is first asked for, so an optional engine's
import cost (or absence) never touches the others. The tools import from here only
(`__all__`, tests/test_layers.py): NVSHMEM's one owner (`check_one_process`,
`claim_nvshmem`) is re-exported, and DeepEP's helpers (`require_deep_ep`,
`destroy_buffers`) lazily, so that `moe.backends.deepep_support` is imported on first use
like the DeepEP backends themselves.
"""
from __future__ import annotations

import importlib
from typing import Any, Optional

import torch.distributed as dist

from dbo.agreement import agree_before_building
from dbo.failures import check_group_usable
from moe.backends.base import Dispatched, Pending, PrepareFinalize
from moe.backends.nvshmem_owner import check_one_process, claim_nvshmem
from moe.backends.traits import TRAITS, BackendTraits, backend_traits, backends_with
from moe.backend_options import BackendOptions, NoOptions
from moe.backends.registry import (AUTO, BACKENDS, COMPARED_BACKENDS, DEFAULT_BACKEND,
                                   DEFAULT_GRAPH_BACKEND, SINGLE_RANK_BACKEND,
                                   UNTESTED_BACKENDS, backend_class, options_with,
                                   resolve_backend_name)
from moe.config import MoEConfig


def make_backend(config: MoEConfig, group: Optional[dist.ProcessGroup]) -> PrepareFinalize:
    """Instantiate backend `config.backend` ("auto" allowed) on `group` (None: EP = 1).

    Collective over `group`: first every rank checks that the others were given the same
    config (`MoEConfig.agreement_fields` and the backend's `agreement_fields`, backend
    resolved; one all-gather of a
    fingerprint, `dbo.agreement.agree_before_building`) and raises ConfigMismatchError
    naming the fields that differ, on every rank, before a backend makes a process group
    or a buffer; then that `num_experts` divides the EP size. A group that a failed step
    left unusable is refused before that, issuing nothing (`dbo.failures`)."""
    if group is not None:
        check_group_usable(group)
    world_size = 1 if group is None else dist.get_world_size(group)
    name = resolve_backend_name(config.backend, world_size)
    cls = backend_class(name, world_size)
    agree_before_building({**config.agreement_fields(), **cls.agreement_fields(config),
                           "backend": name}, group, what="MoEConfig")
    if config.num_experts % world_size != 0:
        raise ValueError(f"MoEConfig.num_experts={config.num_experts} is not divisible by "
                         f"the EP size {world_size}: use a multiple of {world_size} experts")
    return cls(config, group)


# Re-exported on first use ("module:attribute"): importing their module registers DeepEP's
# buffer teardown with `dbo.groups`, which a process without DeepEP backends never needs.
_LAZY = {"destroy_buffers": "moe.backends.deepep_support:destroy_buffers",
         "require_deep_ep": "moe.backends.deepep_support:require_deep_ep",
         # NCCL EP's checks, and torch's NCCL communicator (the bench's raw NCCL EP calls).
         "require_nccl_ep": "moe.backends.nccl_ep_support:require_nccl_ep",
         "check_nccl_ep_rows": "moe.backends.nccl_ep_support:check_nccl_ep_rows",
         "nccl_comm_ptr": "moe.backends.nccl_comm:nccl_comm_ptr",
         "start_nccl_comm": "moe.backends.nccl_comm:start_nccl_comm",
         # DeepEP v2's checks (the bench's raw DeepEP v2 calls).
         "require_elastic_buffer": "moe.backends.deepep_v2:require_elastic_buffer",
         # Each backend's options class, from its backend's module (imported on first use).
         "A2ALLOptions": "moe.backends.a2a_ll:A2ALLOptions",
         "DeepEPHTOptions": "moe.backends.deepep_ht:DeepEPHTOptions",
         "DeepEPLLOptions": "moe.backends.deepep_ll:DeepEPLLOptions",
         "DeepEPV2Options": "moe.backends.deepep_v2:DeepEPV2Options",
         "NCCLEPOptions": "moe.backends.nccl_ep:NCCLEPOptions"}


def __getattr__(name: str) -> Any:
    """The lazily re-exported names of `_LAZY`, imported on first use."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module_name, _, attribute = _LAZY[name].partition(":")
    return getattr(importlib.import_module(module_name), attribute)


__all__ = ["A2ALLOptions", "DeepEPHTOptions", "DeepEPLLOptions", "DeepEPV2Options", "NCCLEPOptions",
           "AUTO", "BACKENDS", "COMPARED_BACKENDS", "DEFAULT_BACKEND", "DEFAULT_GRAPH_BACKEND",
           "SINGLE_RANK_BACKEND", "TRAITS", "UNTESTED_BACKENDS", "BackendOptions",
           "BackendTraits", "Dispatched", "NoOptions", "Pending", "PrepareFinalize",
           "backend_class", "backend_traits", "backends_with", "check_one_process",
           "check_nccl_ep_rows", "claim_nvshmem", "destroy_buffers", "make_backend",
           "nccl_comm_ptr", "options_with", "require_deep_ep", "require_elastic_buffer",
           "require_nccl_ep", "resolve_backend_name", "start_nccl_comm"]
