"""Shared pytest setup: GPU markers skip without CUDA; Triton runs interpreted on CPU."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton reads this when a kernel is first defined, so it must be set before any
    # module with a @triton.jit kernel is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA devices")
    for item in items:
        if "gpu" in item.keywords and num_gpus == 0:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and num_gpus < 2:
            item.add_marker(skip_multi)
