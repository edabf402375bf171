"""How many CUDA graph captures this process has begun: a buffer allocated before the
latest capture began may be baked into a captured graph (its replays keep writing the
addresses they were captured with), so whoever would free it for a larger one keeps it
alive instead (`moe.workspace.Workspace`).

    GRAPH_CAPTURES.begin()        # dbo.graphs.capture_graph, right before capturing
    GRAPH_CAPTURES.count          # compared with the count when a buffer was allocated

Captures made with `torch.cuda.graph` directly, not through `dbo.graphs`, are not
counted: call `GRAPH_CAPTURES.begin()` before them.
"""
from __future__ import annotations

__all__ = ["GRAPH_CAPTURES", "GraphCaptures"]


class GraphCaptures:
    """A count of the graph captures begun so far (only ever grows)."""

    def __init__(self) -> None:
        self.count = 0

    def begin(self) -> None:
        """Note that a capture begins."""
        self.count += 1


GRAPH_CAPTURES = GraphCaptures()
