"""CUDA graphs for DBO steps: capture a step once per input signature, then replay it.

    graphed = GraphedRunner(DBORunner(model, DBOConfig(...), group=ep_group))
    out = graphed(x_TH)     # first call per signature: warm up and capture; then replay
    graphed.last_decision   # the runner's SplitPlan of this call

A DBO step launches each ubatch's kernels from a greenlet and switches between them at
every dispatch and combine. Where a step's kernels are short (about a thousand tokens per
rank at DeepSeek-V3 shapes), the host cannot queue them as fast as the GPU runs them, and
DBO's extra launches and switches cost more than the overlap gains. A CUDA graph replays
the step's kernels on both streams, with the event waits between them, in one launch.

What is captured: the runner's step with its split already decided. The vote stays
outside the graph and runs on every call (every rank must still agree on each step), and
it carries one more fact: whether each rank already holds a graph for the step it is
about to run. If any rank lacks one, every rank captures anew (`warmup` eager steps,
then the capture), so all ranks issue the same collectives in the same order.

Graphs are keyed by the call's signature and the decided split: shape, dtype, device
and strides of each CUDA tensor argument, the value of every other argument (CPU tensors
by value), and the ubatch boundaries of the plan. Before a replay the caller's CUDA
tensors are copied into the graph's own input tensors; outputs are cloned out of the
graph, so a result stays valid after the next call. At most `max_graphs` graphs are kept
(least recently used dropped first); each holds its own memory pool.

The step must not read device values on the host: backend `a2a` (it reads its counts),
`naive` without `MoEConfig.max_tokens_per_rank`, the `reference` experts and
`MoEConfig.check_finite_logits` do, and are refused before any capture (modules that say
so through `cuda_graph_blocker`, `dbo.model_hooks`); backend `a2a_ll` (or `naive` with a
capacity) with the `triton` experts is the capturable path. Anything else that syncs fails the
capture with a RuntimeError saying so.

Measured on 2x H200 (scale-out emulated, layer mode, DeepSeek-V3 shapes, a2a_ll; `dbo
bench` with and without `--cuda-graph` on one machine, twice at 1024 and 4096 tokens;
BENCHMARKS.md section 6): at 1024 tokens per rank the DBO step took 14.6-14.9
ms eagerly against 15.3 ms without DBO (1.03-1.05x), and 13.8-13.9 ms as a graph against
15.1 ms (1.08-1.09x). At 4096 and 8192 tokens the graph made the DBO step 0.1-0.4 ms
faster.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional

import torch
from torch.utils._pytree import tree_map

from dbo.agreement import check_inputs
from dbo.failures import annotate_step_failure, reset_collectives
from dbo.graph_host import collect_graph_host_buffers
from dbo.model_hooks import ModelHooks
from dbo.runner import DBORunner
from dbo.mode_policy import Wish
from dbo.split import SplitPlan, first_tensor
from streams.graph_capture import GRAPH_CAPTURES

#: Eager steps before a capture: the first compiles and autotunes kernels, allocates the
#: workspaces and initialises the communicators, none of which a capture may do.
DEFAULT_WARMUP = 2
DEFAULT_MAX_GRAPHS = 8
# CPU tensor arguments are keyed by value; larger ones are refused (pass them on CUDA).
MAX_CPU_KEY_ELEMENTS = 4096


@dataclass
class CapturedGraph:
    """A captured CUDA graph and the output its capture returned (refilled by `replay`),
    with the pinned host buffers its copies read at every replay (`dbo.graph_host`)."""

    graph: Any  # torch.cuda.CUDAGraph
    output: Any
    host_buffers: list = field(default_factory=list)

    def replay(self) -> Any:
        """Run the graph on the current stream; returns `output` (valid after it, in
        stream order; overwritten by the next replay)."""
        self.graph.replay()
        return self.output


def capture_graph(fn: Callable[[], Any], *, device: torch.device,
                  warmup: int = DEFAULT_WARMUP) -> CapturedGraph:
    """Run `fn` `warmup` times eagerly, then capture one call of it in a CUDA graph.

    `fn` must launch the same work on every call and read nothing back on the host. The
    warmup runs on a side stream (as torch recommends before a capture), the capture on
    torch's capture stream; both are joined back into the current stream.
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA device, got {device}: run eagerly on CPU")
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
        raise ValueError(f"warmup must be an int >= 1 (eager steps before the capture), "
                         f"got {warmup!r}")
    with torch.cuda.device(device):
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        current.wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        GRAPH_CAPTURES.begin()  # buffers allocated so far may be baked into this graph
        try:
            # thread_local: NCCL's watchdog thread may query its events meanwhile.
            with (collect_graph_host_buffers() as host_buffers,
                  torch.cuda.graph(graph, capture_error_mode="thread_local")):
                output = fn()
        except Exception as exc:
            raise RuntimeError(
                f"the step could not be captured in a CUDA graph ({type(exc).__name__}: "
                f"{exc}). A captured step may not read device values on the host (e.g. "
                f"backend 'a2a' reads its counts: use 'a2a_ll'), nor change what it "
                f"launches between calls") from exc
    return CapturedGraph(graph, output, host_buffers)


def graph_blockers(model: Any) -> list[str]:
    """Why `model` cannot be captured: the `cuda_graph_blocker` of each of its modules
    that has one set (e.g. `moe.layer.MoELayer` with backend `a2a`;
    `dbo.model_hooks.ModelHooks.graph_blockers`)."""
    return list(ModelHooks.of(model).graph_blockers)


@dataclass
class _Entry:
    """One graph and the input tensors it reads (the caller's are copied into them)."""

    captured: CapturedGraph
    static_args: tuple
    static_kwargs: dict
    device: torch.device

    def load(self, args: tuple, kwargs: dict) -> None:
        for static, new in zip(_leaves(self.static_args, self.static_kwargs),
                               _leaves(args, kwargs)):
            if isinstance(static, torch.Tensor) and static.is_cuda:
                static.copy_(new, non_blocking=True)


class GraphedRunner:
    """A `DBORunner` whose steps are captured in CUDA graphs and replayed (module doc).

    Args:
        runner: the eager runner (its model, config and group).
        warmup: eager steps before each capture (>= 1).
        max_graphs: graphs kept at once (>= 1); the least recently used go first.

    Every rank of the runner's group must call this on every step, as with the runner.
    A rank whose inputs are rejected still votes; its peers then raise
    `dbo.PeerInputError` instead of waiting in the step's collectives (`DBORunner.vote`).
    """

    def __init__(self, runner: DBORunner, *, warmup: int = DEFAULT_WARMUP,
                 max_graphs: int = DEFAULT_MAX_GRAPHS) -> None:
        if not isinstance(runner, DBORunner):
            raise TypeError(f"GraphedRunner wraps a DBORunner, got a {type(runner).__name__}: "
                            f"GraphedRunner(DBORunner(model, DBOConfig(...), group=...))")
        for name, value in (("warmup", warmup), ("max_graphs", max_graphs)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        blockers = runner.hooks.graph_blockers
        if blockers:
            raise ValueError("this model cannot run in a CUDA graph: " + "; ".join(blockers))
        self.runner = runner
        self.warmup = warmup
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[Hashable, _Entry] = OrderedDict()
        self.num_captures = 0

    def __repr__(self) -> str:
        return (f"GraphedRunner({self.runner!r}, warmup={self.warmup}, "
                f"max_graphs={self.max_graphs}, graphs={len(self._graphs)})")

    @property
    def last_decision(self) -> Optional[SplitPlan]:
        return self.runner.last_decision

    def reset(self) -> None:
        """Drop every graph (and its memory); the next call captures again. Every rank
        need not reset together: the vote finds out and all ranks capture."""
        entries = list(self._graphs.values())
        self._graphs.clear()
        _release(entries)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        reset_collectives()
        try:
            return self._step(args, kwargs)
        except BaseException as exc:
            annotate_step_failure(exc)
            raise

    def _step(self, args: tuple, kwargs: dict) -> Any:
        runner = self.runner
        wish: Optional[Wish] = None
        keys: dict[bool, Hashable] = {}
        rejected: Optional[Exception] = None
        x = first_tensor(args, kwargs)
        try:
            if x is None or not x.is_cuda:
                raise ValueError(f"GraphedRunner replays CUDA graphs: the first tensor "
                                 f"argument must be on a CUDA device, got "
                                 f"{'none' if x is None else x.device}; call the DBORunner "
                                 f"itself on CPU")
            signature = _signature(args, kwargs)
            check_inputs(runner.hooks, args, kwargs)
            wish = runner.plan(args, kwargs)
            keys = {split: (signature, split, _boundaries(wish.plan) if split else ())
                    for split in (False, True)}
        except Exception as exc:
            # Vote "not ok": every rank then stops in the vote, rather than waiting in
            # the step's collectives (the runner's mechanism, `DBORunner.vote`).
            rejected = exc
        have = (keys.get(True) in self._graphs, keys.get(False) in self._graphs)
        try:
            tally = runner.vote(None if wish is None else wish.plan, rejected,
                                have_graphs=have, cuda_graph=True)
        finally:
            rejected = None  # no frame of a stopped step may keep its error (`stop_step`)
        assert wish is not None and x is not None  # else the vote raised
        plan = runner.decide(wish, tally.split, tally.max_tokens, tally.all_decode)
        runner.last_decision = plan
        runner.check_capacity(plan, tally, cuda_graph=True)
        all_split, all_unsplit = tally.have_graphs
        key = keys[plan.split]  # a vetoed plan is unsplit
        if not (all_split if plan.split else all_unsplit):
            stale = self._graphs.pop(key, None)  # a peer lacks its graph: all ranks capture
            _release([stale] if stale is not None else [])
            self._graphs[key] = self._capture(plan, args, kwargs, x.device)
            evicted = []
            while len(self._graphs) > self.max_graphs:
                evicted.append(self._graphs.popitem(last=False)[1])
            _release(evicted)
        self._graphs.move_to_end(key)
        entry = self._graphs[key]
        entry.load(args, kwargs)
        return tree_map(_clone, entry.captured.replay())

    # ------------------------------------------------------------------ internals
    def _capture(self, decided: SplitPlan, args: tuple, kwargs: dict,
                 device: torch.device) -> _Entry:
        """Capture the step `decided` (after the vote) on copies of the inputs."""
        static_args = tree_map(_clone_cuda, args)
        static_kwargs = tree_map(_clone_cuda, kwargs)
        step = decided_step(self.runner, static_args, static_kwargs, split=decided.split,
                            voted=decided)
        captured = capture_graph(step, device=device, warmup=self.warmup)
        self.num_captures += 1
        return _Entry(captured, static_args, static_kwargs, device)


def _release(entries: list[_Entry]) -> None:
    """Let dropped graphs go only once their GPUs are done with them. A replay may still
    be queued, and its host-to-device copies read the graph's pinned host buffers
    (`dbo.graph_host`): freed at once, the host could hand one out and overwrite it first.
    Graphs are dropped only around a capture or by `reset`, so the wait is rare."""
    for device in {entry.device for entry in entries}:
        torch.cuda.synchronize(device)


def decided_step(runner: DBORunner, args: tuple, kwargs: dict, *, split: bool,
                 voted: Optional[SplitPlan] = None) -> Callable[[], Any]:
    """The runner's step on these inputs with the split decided by the caller and no vote
    (every rank must decide alike): what `GraphedRunner` captures. `split=True` where
    the runner's plan would not split runs unsplit, as a veto would. `voted`: the plan
    the step's vote left, whose group figures (largest token count, decode) the overlap
    choice reads, so that every rank captures the same mode; None: this rank's own."""
    wish = runner.plan(args, kwargs)
    group_tokens = wish.plan.total_tokens
    group_decode = None
    if voted is not None and voted.group_max_tokens is not None:
        group_tokens, group_decode = voted.group_max_tokens, voted.group_decode
    plan = runner.decide(wish, split, group_tokens, group_decode)

    def step() -> Any:
        return runner._execute(plan, wish.cut, args, kwargs)
    return step


# ---------------------------------------------------------------------------- helpers


def _leaves(args: tuple, kwargs: dict) -> list[Any]:
    out: list[Any] = []
    tree_map(out.append, (args, kwargs))
    return out


def _clone(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _clone_cuda(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) and value.is_cuda else value


def _boundaries(plan: SplitPlan) -> tuple:
    return (plan.num_tokens, tuple((ub.token_start, ub.token_end) for ub in plan.ubatches))


def _signature(args: tuple, kwargs: dict) -> Hashable:
    """What a graph depends on besides the values of CUDA tensors (module doc)."""
    def key(value: Any) -> Hashable:
        if isinstance(value, torch.Tensor):
            if value.is_cuda:
                return ("cuda", tuple(value.shape), value.dtype, value.device,
                        value.stride())
            if value.numel() > MAX_CPU_KEY_ELEMENTS:
                raise ValueError(
                    f"GraphedRunner keys its graphs on the values of CPU tensor arguments; "
                    f"one has {value.numel()} elements (more than {MAX_CPU_KEY_ELEMENTS}): "
                    f"pass it on the CUDA device")
            return ("cpu", tuple(value.shape), value.dtype, tuple(value.flatten().tolist()))
        try:
            hash(value)
        except TypeError:
            raise TypeError(f"GraphedRunner keys its graphs on the values of non-tensor "
                            f"arguments; a {type(value).__name__} cannot be hashed: pass "
                            f"numbers, strings, tensors, or lists, tuples and dicts of "
                            f"them") from None
        return value
    flat_args = tuple(_tree_key(a, key) for a in args)
    flat_kwargs = tuple((k, _tree_key(v, key)) for k, v in kwargs.items())
    return flat_args, flat_kwargs


def _tree_key(value: Any, key: Callable[[Any], Hashable]) -> Hashable:
    """`key` of every leaf, with lists and tuples (e.g. seq_lens) walked."""
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_tree_key(v, key) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _tree_key(v, key)) for k, v in value.items()))
    return key(value)
