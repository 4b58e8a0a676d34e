"""Graph tracing: the IR graph of each executed step, on every backend.

Preload it with ``depends_on(GraphTracingTool())`` and a tool's analysis
routines can read the graph around the op they analyse:

* ``context.get_graph()``: on a graph backend (TensorFlow, ONNX) the whole
  graph; in PyTorch eager the graph traced so far in this step.
* ``context.get_ir_op()``: the op itself, in routines that see it traced
  (graph backends: every routine; PyTorch eager: forward routines registered
  with ``require_outputs=True``).
* :meth:`GraphTracingTool.ir_op` fills the gaps of eager tracing from the
  previous step's complete graph (:attr:`GraphTracingTool.previous`): the op
  before it ran this step, and backward ops, which eager tracing only lifts
  when the step ends.
* Look-back from an op: :meth:`~GraphTracingTool.producers` (transitively,
  bounded), :meth:`~GraphTracingTool.module_path`, and for a backward op
  :meth:`~GraphTracingTool.forward_op`.

Exports of a traced graph: IR JSON (:meth:`~GraphTracingTool.to_json`),
Graphviz DOT (:meth:`~GraphTracingTool.to_dot`; SVG with
:meth:`~GraphTracingTool.to_svg` where Graphviz's ``dot`` is installed),
``networkx`` (:meth:`~GraphTracingTool.to_networkx`) and a PNG drawn with
networkx and matplotlib (:func:`render_png`), which needs no Graphviz.
"""

from __future__ import annotations

import collections
import json
import shutil
import subprocess
import weakref

import amanda
from amanda.errors import ToolError
from amanda.ir import to_dot as _ir_to_dot
from amanda.ir import to_networkx as _ir_to_networkx

__all__ = [
    "GraphTracingTool",
    "forward_op_of",
    "forward_subgraph",
    "layered_layout",
    "module_path",
    "producers",
    "render_png",
]


class GraphTracingTool(amanda.Tool):
    """Collect the IR graph of each finished step and look around an op.

    Args:
        keep: how many finished graphs to keep (oldest dropped first).

    Attributes:
        graphs: the finished graphs, oldest first.
    """

    def __init__(self, keep=2):
        super().__init__()
        self.requires_graph = True
        self.graphs = collections.deque(maxlen=keep)
        self._indexes = weakref.WeakKeyDictionary()   # graph -> _OpIndex
        self._live = None    # weakref to the graph forward contexts last showed
        self.add_inst_for_op(self._note_graph)

    def _note_graph(self, context):
        # Eager backward contexts carry no graph: remember the step's graph
        # from forward contexts (with the analysis cache on, backward routines
        # run in the step whose forward routines ran, so this is that step's).
        graph = context.get_graph()
        if graph is not None:
            self._live = weakref.ref(graph)

    # -- the graphs ---------------------------------------------------------------
    @property
    def graph(self):
        """The last finished step's graph, or None before one finished."""
        return self.graphs[-1] if self.graphs else None

    @property
    def previous(self):
        """The previous step's complete graph (same as :attr:`graph`): in
        PyTorch eager, the graph of the iteration before the running one."""
        return self.graph

    def graph_completed(self, graph):
        self.graphs.append(graph)

    def current(self, context):
        """The graph ``context``'s op belongs to: the whole graph on graph
        backends, the graph traced so far in PyTorch eager; falls back to
        :attr:`previous` where the backend traces none."""
        graph = context.get_graph()
        if graph is None and context.is_backward():
            graph = self._live_graph()
        return graph if graph is not None else self.previous

    def _live_graph(self):
        graph = self._live() if self._live is not None else None
        return graph if graph is not None and len(graph) else None

    # -- finding the op --------------------------------------------------------------
    def ir_op(self, context):
        """The IR op of ``context``: the traced op where the backend gives it,
        else the op with the same stable id in the graph traced so far, else
        in the previous step's graph.

        In a backward context this is the backward IR op (in PyTorch eager, of
        the previous step's graph: backward ops are lifted when a step ends).

        Returns:
            An :class:`amanda.ir.Op`, or None when no traced graph has it yet
            (the op's first execution in the first step).
        """
        op = context.get_ir_op()
        if op is not None:
            return op
        if context.is_backward():
            key = context.get_backward_op_id()
        else:
            key = context.get_op_id()
        for graph in (self.current(context), self.previous):
            found = self._find(graph, key)
            if found is not None:
                return found
        return None

    def forward_op(self, op_or_context):
        """The forward op that owns a backward op.

        Args:
            op_or_context: a backward IR op, or a backward context (then the
                forward op of this step's graph is returned where traced, else
                that of the previous step's graph).

        Returns:
            The forward IR op, or None for a forward op or an unowned backward op.
        """
        if isinstance(op_or_context, amanda.OpContext):
            context = op_or_context
            if not context.is_backward():
                return None
            for graph in (self.current(context), self.previous):
                found = self._find(graph, context.get_op_id())
                if found is not None:
                    return found
            return None
        return forward_op_of(op_or_context)

    def _find(self, graph, key):
        """The op of ``graph`` whose stable id is ``key`` (eager ``op_id``
        attr; op name on graph backends)."""
        if graph is None or key is None:
            return None
        index = self._indexes.get(graph)
        if index is None:
            index = self._indexes[graph] = _OpIndex()
        return index.find(graph, key)

    # -- look-back -----------------------------------------------------------------
    @staticmethod
    def producers(op, depth=1, limit=None):
        """The ops producing ``op``'s inputs, transitively; see :func:`producers`."""
        return producers(op, depth=depth, limit=limit)

    @staticmethod
    def module_path(op_or_context):
        """Where an op sits in the model; see :func:`module_path`."""
        if isinstance(op_or_context, amanda.OpContext):
            return op_or_context.get_module_path()
        return module_path(op_or_context)

    # -- exports ------------------------------------------------------------------
    def _pick(self, graph):
        graph = self.graph if graph is None else graph
        if graph is None:
            raise ToolError("no graph was traced yet: run a step inside amanda.apply first",
                            tool=self)
        return graph

    def to_json(self, graph=None, path=None):
        """The graph's IR JSON (a dict); also written to ``path`` if given."""
        data = self._pick(graph).to_json()
        if path is not None:
            with open(path, "w") as f:
                json.dump(data, f)
        return data

    def to_dot(self, graph=None, path=None, forward_only=False):
        """Graphviz DOT text of the graph (backward ops left out with
        ``forward_only``); also written to ``path`` if given."""
        graph = self._pick(graph)
        text = _ir_to_dot(forward_subgraph(graph) if forward_only else graph)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    def to_svg(self, path, graph=None, forward_only=False):
        """Render the DOT output to an SVG file with Graphviz's ``dot``.

        Raises:
            ToolError: ``dot`` is not installed (use :func:`render_png`) or failed.
        """
        dot = shutil.which("dot")
        if dot is None:
            raise ToolError("to_svg needs Graphviz's `dot` program, which is not installed; "
                            "render_png draws the graph with networkx and matplotlib instead",
                            tool=self, routine=self.to_svg)
        text = self.to_dot(graph, forward_only=forward_only)
        done = subprocess.run([dot, "-Tsvg", "-o", str(path)], input=text.encode(),
                              capture_output=True, check=False)
        if done.returncode != 0:
            raise ToolError(f"dot failed: {done.stderr.decode(errors='replace').strip()}",
                            tool=self, routine=self.to_svg)
        return path

    def to_networkx(self, graph=None, control_edges=False):
        """The graph as a ``networkx.MultiDiGraph`` (see :func:`amanda.ir.to_networkx`)."""
        return _ir_to_networkx(self._pick(graph), control_edges=control_edges)

    def render_png(self, path, graph=None, **options):
        """Draw the graph to a PNG file; see :func:`render_png`."""
        return render_png(self._pick(graph), path, **options)


class _OpIndex:
    """Stable op id -> op for one graph, extended as an eager graph grows."""

    __slots__ = ("ops", "seen")

    def __init__(self):
        self.ops = {}
        self.seen = 0

    def find(self, graph, key):
        found = self.ops.get(key)
        if found is None and len(graph) > self.seen:
            ops = graph.ops
            for op in ops[self.seen:]:
                self.ops.setdefault(op.attrs.get("op_id", op.name), op)
            self.seen = len(ops)
            found = self.ops.get(key)
        if found is not None and found.graph is not graph:   # removed since indexed
            return None
        return found


# -- graph-level helpers (any backend) ---------------------------------------------

def forward_op_of(op):
    """The forward op owning a backward IR op: its control input in a
    PyTorch eager trace, the op named by ``attrs["forward_op"]`` in a
    TensorFlow graph. None for forward ops and unowned backward ops."""
    if not op.attrs.get("backward"):
        return None
    name = op.attrs.get("forward_op")
    if name is not None and op.graph is not None:
        for candidate in op.graph:
            if candidate.name == name:
                return candidate
    owner_id = op.attrs.get("forward_op_id")
    for control in op.control_inputs:
        if owner_id is None or control.attrs.get("op_id") == owner_id:
            return control
    return None


def producers(op, depth=1, limit=None):
    """The ops producing ``op``'s inputs, breadth first, each once.

    Args:
        op: an IR op.
        depth: how many producer levels to follow (1: direct producers).
        limit: stop after this many ops (None: no bound).

    Returns:
        A list of ops, nearest first, in input order within a level. Graph
        inputs (parameters, model inputs) have no producer and are not listed.
    """
    found, seen, level = [], {op}, [op]
    for _ in range(depth):
        following = []
        for consumer in level:
            for tensor in consumer.inputs:
                producer = tensor.producer
                if producer is None or producer in seen:
                    continue
                seen.add(producer)
                found.append(producer)
                following.append(producer)
                if limit is not None and len(found) >= limit:
                    return found
        level = following
    return found


def module_path(op):
    """Where an op sits in the model: the PyTorch module path (``attrs["module"]``:
    ``"encoder.layer.0"``, ``""`` for the root module, None outside modules);
    on graph backends the op's name scope (``"dense_1"`` for ``"dense_1/MatMul"``),
    "" when it has none."""
    if "module" in op.attrs:
        return op.attrs["module"]
    return op.name.rpartition("/")[0]


def forward_subgraph(graph):
    """A copy of ``graph`` without its backward ops, the ops reading their
    results (such as optimizer updates) and the graph inputs only they read
    (gradient seeds).

    Returns:
        A new :class:`amanda.ir.Graph`; ``graph`` is left untouched.
    """
    from amanda.ir import Graph

    drop = set()
    for op in graph.ops:
        if op.attrs.get("backward") or any(t.producer in drop for t in op.inputs):
            drop.add(op.name)
    data = graph.to_json()
    if not drop:
        return Graph.from_json(data)
    ops = [op for op in data["ops"] if op["name"] not in drop]
    for op in ops:
        op["control_inputs"] = [c for c in op.get("control_inputs", ()) if c not in drop]
    read = {name for op in ops for name in op["inputs"]}
    read_by_dropped = {t.name for op in graph.ops if op.name in drop for t in op.inputs}
    data["inputs"] = [t for t in data["inputs"]
                      if t["name"] in read or t["name"] not in read_by_dropped]
    produced = {t["name"] for t in data["inputs"]} | {
        out["name"] for op in ops for out in op["outputs"]}
    data["outputs"] = [name for name in data["outputs"] if name in produced]
    data["ops"] = ops
    return Graph.from_json(data)


# -- drawing without Graphviz ---------------------------------------------------------

def layered_layout(view):
    """Positions for a DAG drawn top-down: one row per topological generation.

    Args:
        view: a ``networkx`` DAG (e.g. :func:`amanda.ir.to_networkx`).

    Returns:
        ``{node: (x, y)}`` with y decreasing from the graph's sources.
    """
    import networkx as nx

    positions = {}
    for row, generation in enumerate(nx.topological_generations(view)):
        width = len(generation)
        for column, node in enumerate(sorted(generation, key=str)):
            positions[node] = (column - (width - 1) / 2.0, -row)
    return positions


def render_png(graph, path, forward_only=True, highlight=None, title=None, dpi=110,
               label=None):
    """Draw an IR graph to a PNG with networkx and matplotlib (no Graphviz).

    Args:
        graph: an :class:`amanda.ir.Graph`.
        path: the PNG file to write.
        forward_only: leave backward ops out.
        highlight: ``{op name: value in [0, 1]}``; highlighted ops are filled
            with a colour scale (e.g. effective-path density), others grey.
        title: a title drawn above the graph.
        dpi: resolution.
        label: ``label(op) -> str`` (default: the op type and its module path).

    Returns:
        ``path``.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    if forward_only:
        graph = forward_subgraph(graph)
    view = _ir_to_networkx(graph)
    ops = {op.name: op for op in graph.ops}
    positions = layered_layout(view)
    rows = 1 + max((-y for _, y in positions.values()), default=0)
    columns = max((abs(x) * 2 + 1 for x, _ in positions.values()), default=1)
    figure, axes = plt.subplots(figsize=(max(5.5, 2.4 * columns), max(3.0, 0.9 * rows)))
    label = label or _default_label
    colours = []
    cmap = plt.get_cmap("YlOrRd")
    for node in view.nodes:
        if highlight and node in highlight:
            colours.append(cmap(0.25 + 0.75 * float(highlight[node])))
        else:
            colours.append("#dddddd" if highlight else "#cfe2f3")
    import networkx as nx

    nx.draw_networkx_edges(view, positions, ax=axes, arrows=True, arrowsize=10,
                           node_size=2200, edge_color="#555555")
    nx.draw_networkx_nodes(view, positions, ax=axes, node_shape="s", node_size=2200,
                           node_color=colours, edgecolors="#333333")
    nx.draw_networkx_labels(view, positions, ax=axes, font_size=7,
                            labels={n: label(ops[n]) for n in view.nodes})
    if title:
        axes.set_title(title)
    axes.axis("off")
    figure.tight_layout()
    figure.savefig(path, dpi=dpi)
    plt.close(figure)
    return path


def _default_label(op):
    where = module_path(op)
    return op.type if not where else f"{op.type}\n{where}"
