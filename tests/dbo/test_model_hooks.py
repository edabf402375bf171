"""Layer 1 (CPU): the declared model protocol (`dbo.model_hooks`): every hook found once
per model, the values kept for the model's life read once, and the runner's one
`ModelHooks` renewed only when its model is replaced."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

import pytest
import torch
from torch import nn

from dbo import DBOConfig, DBORunner
from dbo import model_hooks
from dbo.model_hooks import HOOKS, NO_SBO_HOOK, ModelHooks

DBO = Path(__file__).resolve().parents[2] / "dbo"


class Inner(nn.Module):
    """A module with every module-level hook; counts the calls of each."""

    def __init__(self, capacity: Optional[int]) -> None:
        super().__init__()
        self.capacity = capacity
        self.calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def dbo_agreement(self) -> dict[str, object]:
        self._count("agreement")
        return {"width": 4}

    def dbo_max_tokens_per_rank(self) -> Optional[int]:
        self._count("capacity")
        return self.capacity

    def dbo_max_tokens_per_ubatch(self) -> Optional[int]:
        return None

    def dbo_sbo_blocker(self) -> Optional[str]:
        self._count("sbo")
        return None

    @property
    def cuda_graph_blocker(self) -> Optional[str]:
        return "reads counts on the host" if self.capacity is None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class Model(nn.Module):
    """Two `Inner`s and every model-level hook, counted."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Inner(capacity=16), Inner(capacity=None)
        self.mode_calls = 0

    def dbo_split_mode(self) -> str:
        self.mode_calls += 1
        return "tokens"

    def dbo_can_split_inside_request(self) -> bool:
        return True

    def dbo_check_inputs(self, x: torch.Tensor) -> None:
        if x.dim() != 2:
            raise ValueError(f"x must be 2-D, got shape {list(x.shape)}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_every_hook_of_a_model_and_its_modules_is_found():
    model = Model()
    hooks = ModelHooks.of(model)
    assert [name for name, _, _ in hooks.agreement] == ["a", "b"]
    assert hooks.agreement_fields() == {"a.width": 4, "b.width": 4}
    assert hooks.capacity() == 16 and hooks.capacity(per_ubatch=True) is None
    assert hooks.sbo_blocker is None
    assert hooks.split_mode == "tokens" and hooks.can_split_inside_request is True
    assert hooks.graph_blockers == ("b: reads counts on the host",)
    with pytest.raises(ValueError, match=r"x must be 2-D, got shape \[3\]"):
        hooks.check_inputs_hook(torch.ones(3))
    # A plain function: the model itself is the only owner, and it has no hooks.
    plain = ModelHooks.of(lambda x: x)
    assert plain.capacity() is None and plain.agreement_fields() == {}
    assert plain.sbo_blocker == NO_SBO_HOOK and plain.split_mode is None
    assert plain.graph_blockers == () and plain.name.endswith("<lambda>")


def test_the_runner_finds_the_hooks_once_per_model_and_reads_kept_values_once():
    model = Model()
    runner = DBORunner(model, DBOConfig(overlap="auto", min_decode_tokens=2))
    hooks = runner.hooks
    x = torch.ones(8, 2)
    for _ in range(3):
        assert torch.equal(runner(x), x * 4)
        assert runner.hooks is hooks
    assert model.mode_calls == 1  # read at construction (split=None), kept
    assert model.a.calls["sbo"] == 1  # read once, voted as a field and used per step
    # The agreement (and the capacity) are collected once per model and config object.
    assert model.a.calls["agreement"] == 1 and model.a.calls["capacity"] == 1
    runner.config = DBOConfig(overlap="auto", min_decode_tokens=4)
    runner(x)
    assert runner.hooks is hooks and model.a.calls["agreement"] == 2
    runner.model = Model()
    runner(x)
    assert runner.hooks is not hooks and runner.hooks.model is runner.model


def test_the_model_is_read_only_through_model_hooks():
    """No other module of the runtime core looks a hook up by name (`getattr` or
    `hasattr` of a hook's name, written out or through a constant that holds it)."""
    hook_names = {name for name in dir(model_hooks) if getattr(model_hooks, name) in HOOKS}
    offenders = []
    for path in sorted(DBO.rglob("*.py")):
        if path.name == "model_hooks.py" or "cli" in path.relative_to(DBO).parts:
            continue
        tree = ast.parse(path.read_text())
        constants = hook_names | {
            target.id for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) and node.value.value in HOOKS
            for target in node.targets if isinstance(target, ast.Name)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2):
                continue
            name = node.args[1]
            if (isinstance(name, ast.Constant) and name.value in HOOKS) or (
                    isinstance(name, ast.Name) and name.id in constants):
                offenders.append(f"{path.relative_to(DBO)}:{node.lineno}")
    assert offenders == []
