"""What `torch.compile` must not trace in a DBO step, and how it is kept out.

    model = torch.compile(model, dynamic=False)      # then as usual:
    runner = DBORunner(model, DBOConfig(), group=ep_group)

A DBO step runs each ubatch's forward in a greenlet, and the two hand off to each other
inside every MoE layer's dispatch and combine (`dbo.yield_points`). Dynamo compiles
Python frames into graphs, and two things of a step must stay out of them:

- **Greenlet state.** The yield points read the running step from a thread-local. Dynamo
  would read it once, while tracing, and bake the answer into the graph without a guard:
  the ubatch id, whether a step runs, which ubatch is last, all frozen at their values
  of the first call. And dynamo's frame hook (set while a compiled callable runs, per OS
  thread, so shared by the greenlets) must be off at a greenlet switch: a switch made
  with it on would compile the other ubatch's eager frames, and the runner's after the
  step.
- **Communication.** The backends' collectives, stream switches, host reads of counts
  and receive hooks: their order on the streams is the point of DBO, and dynamo would
  rewrite or reorder them.

So each of these is a *graph break*: `graph_break(fn)` runs `fn` as written for eager
callers, and where dynamo traces the call (`compiling()`) or runs it with its frame hook
on (`frame_hook()`: in a frame dynamo chose not to compile) it calls
`torch.compiler.disable(fn)` instead, which runs `fn` eagerly between two compiled graphs
with the hook off, and everything `fn` calls with it. The yield points inline the same
tests (they are the hot path of every hand-off). `docs/compile.md` says what this gives
a compiled model.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
from typing import Any, Callable, Optional, TypeVar

import torch

__all__ = ["GRAPH_BREAK_REASON", "compiling", "eager_twin", "frame_hook", "graph_break"]

F = TypeVar("F", bound=Callable[..., Any])

# Whether dynamo traces the caller: `return False`, which dynamo reads as True while it
# traces (it knows the function by identity). Bound once: the test is made on every
# yield point, and this one costs a Python call where `torch.compiler.is_compiling`
# costs two (what it adds, export and AOT tracing, never reaches these calls).
compiling: Callable[[], bool] = torch.compiler.is_dynamo_compiling

# Dynamo's frame hook on this thread: None, except while a compiled callable runs
# (outside the graph breaks it makes). Read as `torch._dynamo.eval_frame` reads it; a
# build without dynamo has no hook.
frame_hook: Callable[[], Any] = getattr(
    getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None),
    "get_eval_frame_callback", lambda: None)

GRAPH_BREAK_REASON = (
    "dbo runs this eagerly between compiled graphs (a graph break): the DBO yield "
    "points, the MoE layer's dispatch and combine and the kernels that read device "
    "values on the host; torch.compile(fullgraph=True) cannot compile a model with "
    "them, compile it without fullgraph (docs/compile.md)")


class _EagerTwin:
    """`fn` as a graph break: `torch.compiler.disable(fn)`, made when `torch._dynamo` has
    been imported (`eager_twin`, `_WhenDynamoLoads`). Importing dynamo takes about a second, which
    `import dbo` would otherwise pay in every process whether it compiles or not; a
    process that compiles imports dynamo (`torch.compile`) before anything is traced, so
    the twin exists by the time a trace reaches it."""

    __slots__ = ("_fn", "_disabled")

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn
        self._disabled: Optional[Callable[..., Any]] = None

    def make(self) -> Callable[..., Any]:
        if self._disabled is None:
            self._disabled = torch.compiler.disable(
                self._fn, reason=f"{self._fn.__qualname__}: {GRAPH_BREAK_REASON}")
        return self._disabled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        disabled = self._disabled
        if disabled is None:  # dynamo was imported in a way the hook did not see
            disabled = self.make()
        return disabled(*args, **kwargs)


_TWINS: list[_EagerTwin] = []  # made once dynamo is imported


def _make_twins() -> None:
    for twin in _TWINS:
        twin.make()


class _WhenDynamoLoads(importlib.abc.MetaPathFinder):
    """Runs `_make_twins` right after `torch._dynamo` has been imported: finds the module
    as the other finders do, and wraps its loader so that the twins are made once the
    module has run (every import of dynamo goes through here until then)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch._dynamo":
            return None
        sys.meta_path.remove(self)  # the real finders find it
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _ThenMakeTwins(spec.loader, self)
        return spec


class _ThenMakeTwins(importlib.abc.Loader):
    """`loader`, then `_make_twins` (and the finder's removal) once the module has run."""

    def __init__(self, loader: Any, finder: _WhenDynamoLoads) -> None:
        self._loader = loader
        self._finder = finder

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        if self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        _make_twins()

    def __getattr__(self, name: str) -> Any:  # resources, source: the real loader's
        return getattr(self._loader, name)


def eager_twin(fn: F) -> F:
    """`torch.compiler.disable(fn)`: a call dynamo does not trace (a graph break) and that
    runs with dynamo's frame hook off, so nothing it calls is compiled. Made now where
    dynamo is imported already, else when it is (`_EagerTwin`, `_WhenDynamoLoads`)."""
    twin = _EagerTwin(fn)
    _TWINS.append(twin)
    if "torch._dynamo" in sys.modules:
        twin.make()
    elif not any(isinstance(f, _WhenDynamoLoads) for f in sys.meta_path):
        sys.meta_path.insert(0, _WhenDynamoLoads())
    return twin  # type: ignore[return-value]


def graph_break(fn: F) -> F:
    """`fn` for eager callers; a graph break under `torch.compile` (module doc). Costs an
    eager call two flag tests and one frame."""
    eager = eager_twin(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if compiling() or frame_hook() is not None:
            return eager(*args, **kwargs)
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]
