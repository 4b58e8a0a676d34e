"""Graph tracing: the IR graph of each executed step, on every backend.

Preload it with ``depends_on(GraphTracingTool())`` so a tool's analysis
routines can read ``context.get_graph()`` (the graph so far) and, in routines
registered with ``require_outputs=True``, ``context.get_ir_op()``.
"""

from __future__ import annotations

import collections

import amanda


class GraphTracingTool(amanda.Tool):
    """Collect the IR graph of each finished step.

    Args:
        keep: how many finished graphs to keep (oldest dropped first).

    Attributes:
        graphs: the finished graphs, oldest first.
    """

    def __init__(self, keep=2):
        super().__init__()
        self.requires_graph = True
        self.graphs = collections.deque(maxlen=keep)

    @property
    def graph(self):
        """The last finished step's graph, or None before one finished."""
        return self.graphs[-1] if self.graphs else None

    def graph_completed(self, graph):
        self.graphs.append(graph)
