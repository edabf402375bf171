"""What the DeepEP backends (`deepep_ht`, `deepep_ll`, `deepep_v2`) need before they can
be built: DeepEP's `deep_ep` package with the right class, and CUDA.

`deep_ep` is imported only here, inside `require_deep_ep`, when a layer with one of
these backends is constructed: importing `moe` never needs it. The adapters themselves
are not built yet, so where everything is present the backend still refuses, saying so.
"""
from __future__ import annotations

import importlib
import importlib.util

import torch

_HOW_TO_GET = {
    "Buffer": ("build DeepEP v1 from source for your torch and CUDA "
               "(github.com/deepseek-ai/DeepEP, see its README; it needs NVSHMEM) and pip "
               "install it"),
    "ElasticBuffer": ("build DeepEP v2 (the main branch of github.com/deepseek-ai/DeepEP, "
                      "see its README; it needs NCCL >= 2.30.4) and pip install it"),
}


def require_deep_ep(backend: str, cls_name: str) -> None:
    """Raise, in one line, what is missing for `backend` and how to get it: ImportError
    without `deep_ep` or without its `cls_name` ("Buffer" for v1, "ElasticBuffer" for
    v2), ValueError without CUDA, NotImplementedError while the adapter is not built."""
    how = _HOW_TO_GET[cls_name]
    if importlib.util.find_spec("deep_ep") is None:
        raise ImportError(f"backend {backend!r} needs DeepEP (deep_ep.{cls_name}), which is "
                          f"not installed: {how}; or use backend 'a2a' or 'a2a_ll'")
    deep_ep = importlib.import_module("deep_ep")
    if not hasattr(deep_ep, cls_name):
        raise ImportError(f"backend {backend!r} needs deep_ep.{cls_name}, which the installed "
                          f"deep_ep lacks: {how}; or use backend 'a2a' or 'a2a_ll'")
    if not torch.cuda.is_available():
        raise ValueError(f"backend {backend!r} runs DeepEP's CUDA kernels and this process "
                         f"has no CUDA device: run on GPUs, or use backend 'a2a' or 'a2a_ll' "
                         f"(these run on CPU with gloo)")
    raise NotImplementedError(f"backend {backend!r}: its DeepEP adapter is not built yet: use "
                              f"backend 'a2a' or 'a2a_ll'")
