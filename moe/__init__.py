"""moe: the MoE layer (router, modular kernel, dispatch/combine backends, expert kernels)."""
from moe.backends import BACKENDS, make_backend
from moe.config import SUPPORTED_DTYPES, MoEConfig, round_up_hidden
from moe.experts import EXPERTS, Experts, experts_class, make_experts
from moe.layer import MoELayer, Router
from moe.modular_kernel import ModularKernel
from moe.reference import init_moe_weights, reference_moe
from moe.router import route
from moe.shared import SharedExperts
from moe.workspace import Workspace, WorkspaceSets

__all__ = ["BACKENDS", "EXPERTS", "Experts", "MoEConfig", "MoELayer", "ModularKernel", "Router",
           "SUPPORTED_DTYPES", "SharedExperts", "Workspace", "WorkspaceSets", "experts_class",
           "init_moe_weights", "make_backend", "make_experts", "reference_moe", "round_up_hidden",
           "route"]
