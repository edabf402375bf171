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
from typing import Any, Callable, TypeVar

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


def eager_twin(fn: F) -> F:
    """`torch.compiler.disable(fn)`: a call dynamo does not trace (a graph break) and that
    runs with dynamo's frame hook off, so nothing it calls is compiled."""
    return torch.compiler.disable(fn, reason=f"{fn.__qualname__}: {GRAPH_BREAK_REASON}")


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
