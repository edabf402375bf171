"""Layer 1 (CPU): DBO steps of models compiled with `torch.compile` (`dbo.compiling`).

Dynamo alone (a backend that runs each graph as traced, and counts the graphs): the
yield points are graph breaks, the ubatches still hand off at every yield, what the yield
points report is read when the graph runs, not when it was traced, and dynamo's frame
hook is off at every switch, so nothing of the runner is ever compiled. What inductor
adds is tested on the reference model (`tests/models/test_compile.py`).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dbo.compiling import frame_hook
from dbo.config import DBOConfig
from dbo.runner import DBORunner
from dbo.scheduler import UBatchScheduler
from dbo.yield_points import dbo_current_ubatch_id, dbo_enabled, dbo_yield

HIDDEN = 8
SPLIT = DBOConfig(split="tokens", min_decode_tokens=0, min_prefill_tokens=0)


class GraphCounter:
    """A torch.compile backend that runs each graph as traced and counts them."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs += 1
        return gm.forward


class Unrolled(nn.Module):
    """Three layers, a yield between each: the yields sit inside the compiled frame."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
        self.trace: list[tuple[int, int]] = []  # (ubatch, layer) in execution order

    def layer(self, i: int, x: torch.Tensor, ubatch: int) -> torch.Tensor:
        self.trace.append((ubatch, i))
        return torch.tanh(self.layers[i](x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ubatch = dbo_current_ubatch_id()
        x = self.layer(0, x, ubatch)
        dbo_yield()
        x = self.layer(1, x, ubatch)
        dbo_yield()
        return self.layer(2, x, ubatch)


class Looped(Unrolled):
    """The same layers in a Python loop, as models write them: dynamo runs a frame whose
    loop holds a graph break uncompiled (with its frame hook on) and compiles what it
    calls, so here the yields are called from a frame that dynamo did not compile."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ubatch = dbo_current_ubatch_id()
        for i in range(3):
            if i:
                dbo_yield()
            x = self.layer(i, x, ubatch)
        return x


INTERLEAVED = [(u, i) for i in range(3) for u in (0, 1)]


@pytest.mark.parametrize("model_class", [Unrolled, Looped])
def test_compiled_ubatches_hand_off_at_every_yield_and_match_eager(model_class):
    torch.manual_seed(0)
    model = model_class()
    x = torch.randn(10, HIDDEN)
    with torch.no_grad():
        expected = DBORunner(model, SPLIT)(x)
        assert model.trace == INTERLEAVED
        model.trace.clear()
        counter = GraphCounter()
        runner = DBORunner(torch.compile(model, backend=counter, dynamic=False), SPLIT)
        for _ in range(2):  # the first call compiles, the second runs the compiled code
            out = runner(x)
            assert runner.last_decision.split
            assert model.trace == INTERLEAVED  # ub0 L0, ub1 L0, ub0 L1, ...
            model.trace.clear()
    assert counter.graphs >= 3  # the code between the yields ran as graphs
    # The same torch calls on the same shapes, run as traced: the same bits.
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert frame_hook() is None
    # Nothing of the runner or the scheduler was compiled: each switch and the step's
    # end were made with dynamo's frame hook off.
    cache_entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list
    for code in (DBORunner._step.__code__, DBORunner._run.__code__,
                 DBORunner._merge.__code__,
                 UBatchScheduler.run.__code__, UBatchScheduler._loop.__code__):
        assert cache_entries(code) == [], code.co_name


def test_what_the_yield_points_report_is_read_when_the_graph_runs():
    """Dynamo would read the running step while tracing and keep the answer (a
    thread-local read is not guarded): the ubatch id and whether a step runs would be
    those of the first call, in both ubatches and after the step."""
    counter = GraphCounter()

    @torch.compile(backend=counter, dynamic=False)
    def tagged(x: torch.Tensor) -> torch.Tensor:
        return x + dbo_current_ubatch_id() + 10 * int(dbo_enabled())

    x = torch.zeros(2)
    assert tagged(x).tolist() == [0.0, 0.0]  # traced outside a step
    inside = UBatchScheduler("cpu").run([lambda: tagged(x), lambda: tagged(x)])
    assert [t.tolist() for t in inside] == [[10.0, 10.0], [11.0, 11.0]]
    assert tagged(x).tolist() == [0.0, 0.0]
    assert counter.graphs >= 1


def test_fullgraph_compile_names_the_graph_break_and_the_fix():
    model = Unrolled()
    compiled = torch.compile(model, backend=GraphCounter(), fullgraph=True)
    with pytest.raises(Exception, match="compile it without fullgraph") as raised:
        DBORunner(compiled, SPLIT)(torch.randn(4, HIDDEN))
    assert "dbo_current_ubatch_id" in str(raised.value)


FRESH_PROCESS = """
import sys
import dbo, moe
assert "torch._dynamo" not in sys.modules, "import dbo imported dynamo"
from dbo.compiling import _TWINS
assert _TWINS and all(t._disabled is None for t in _TWINS)
import torch
compiled = torch.compile(lambda x: x + 1, backend="eager")  # imports dynamo
assert all(t._disabled is not None for t in _TWINS), "twins not made on dynamo's import"
print(len(_TWINS), float(compiled(torch.ones(1))))
"""


def test_dbo_imports_dynamo_only_with_compile_and_the_graph_breaks_are_ready_then():
    # `import dbo` stays off torch._dynamo (about a second per process); torch.compile
    # imports it, and every graph-break twin is made then, before anything is traced.
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", FRESH_PROCESS], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    count, value = proc.stdout.split()
    assert int(count) >= 20 and float(value) == 2.0
