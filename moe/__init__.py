"""moe: the MoE layer (router, modular kernel, dispatch/combine backends, expert kernels).

The names below (and those of `moe.backends`, `moe.experts`, `moe.kernels`,
`moe.kernels.fused_moe`, `moe.models`, `moe.hf`) are the MoE runtime's front door: the
tools import it from these packages only, never from their modules
(tests/test_layers.py). Importing `moe` imports neither DeepEP, the fused-MoE kernels nor
transformers.
"""
from moe.backends import BACKENDS, make_backend
from moe.config import SUPPORTED_DTYPES, MoEConfig, round_up_hidden
from moe.experts import EXPERTS, Experts, experts_class, make_experts
from moe.layer import MoELayer, Router
from moe.modular_kernel import ModularKernel, sharing_sms
from moe.reference import init_moe_weights, reference_moe
from moe.router import route
from moe.routing_log import record_routing, routing_ties, spread_in_requests
from moe.shared import SharedExperts
from moe.workspace import Workspace, WorkspaceSets

__all__ = ["BACKENDS", "EXPERTS", "Experts", "MoEConfig", "MoELayer", "ModularKernel", "Router",
           "SUPPORTED_DTYPES", "SharedExperts", "Workspace", "WorkspaceSets", "experts_class",
           "init_moe_weights", "make_backend", "make_experts", "record_routing",
           "reference_moe", "round_up_hidden", "route", "routing_ties", "sharing_sms",
           "spread_in_requests"]
