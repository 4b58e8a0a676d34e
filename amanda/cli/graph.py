"""``amanda graph``: one traced step as IR JSON and a drawing."""

from __future__ import annotations

import collections
import os
import shutil

import amanda
from amanda.cli.common import (
    Command,
    UsageError,
    _add_model_argument,
    _add_out_argument,
    _count,
    _load,
    _stderr,
    require,
    staged,
)
from amanda.cli.table import print_table


GRAPH_FORMATS = ("json", "dot", "svg", "html", "png")


def run_graph(args):
    from amanda.tools.graph import GraphTracingTool
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = sorted(set(formats) - set(GRAPH_FORMATS))
    if unknown:
        raise UsageError(f"--formats: unknown {', '.join(unknown)}; choose from "
                         f"{', '.join(GRAPH_FORMATS)}")
    require("graph", [args.model])
    work = _load(args.model, "graph")
    tracer = GraphTracingTool()
    with amanda.apply(tracer):
        work.run()
    graph = tracer.graph if tracer.graph is not None else _lift(work)
    ops = list(graph.ops)
    counts = collections.Counter(op.type for op in ops)
    print_table(["op type", "ops"], [[t, n] for t, n in counts.most_common(args.top)], "<>",
                 title=f"{args.model}: {len(ops)} ops, {len(graph.inputs)} inputs, "
                       f"{len(graph.outputs)} outputs ({graph.namespace})")
    from amanda.tools import graph_view
    if work.framework == "pytorch":
        graph_view.name_parameters(graph, work.model)
    view = graph_view.build_view(graph, show_init=args.show_init,
                                 collapse=not args.no_collapse,
                                 forward_only=args.forward_only)
    written = _write_graph(args, tracer, graph, view, formats, graph_view)
    print(f"\ndrawing: {len(view.nodes)} boxes for {len(ops)} ops"
          + (f" ({view.hidden} initialiser/constant ops hidden; --show-init shows them)"
             if view.hidden else ""))
    print("written: " + ", ".join(written))
    return 0


def _write_graph(args, tracer, graph, view, formats, graph_view):
    """Write the chosen formats (staged: in place when the command succeeds).
    SVG and PNG are Graphviz's drawing of the DOT; without ``dot`` both fall
    back to graph.html, which needs nothing."""
    written = []

    def path(name):
        written.append(os.path.join(args.out, name))
        return staged(written[-1])

    if "json" in formats:
        tracer.to_json(graph, path=path("graph.json"))
    if "dot" in formats:
        with open(path("graph.dot"), "w") as f:
            f.write(graph_view.to_dot(view, title=args.model))
    drawn = [f for f in ("svg", "png") if f in formats]
    if drawn and shutil.which("dot") is None:
        if "html" not in formats:
            formats = formats + ["html"]
        instead = " and ".join(f"graph.{f}" for f in drawn)
        _stderr("amanda graph: Graphviz's `dot` is not installed (Debian: apt-get install "
                f"graphviz); writing graph.html instead of {instead}")
        drawn = []
    for fmt in drawn:
        graph_view.render(view, path(f"graph.{fmt}"), fmt, title=args.model)
    if "html" in formats:
        with open(path("graph.html"), "w") as f:
            f.write(graph_view.to_html(view, title=args.model))
    return written


def _lift(work):
    """The IR graph of a graph-mode workload, lifted by its frontend."""
    if work.framework == "tensorflow":
        from amanda.frontends.tensorflow import lift_graph
        return lift_graph(work.model.graph)
    if work.framework == "onnx":
        from amanda.frontends.onnx import lift
        return lift(work.model)
    raise UsageError(f"no graph was traced for {work.name}")


def add_graph_arguments(parser):
    _add_model_argument(parser)
    parser.add_argument("--formats", default="json,dot,svg",
                        help="comma-separated: json (IR), dot (readable Graphviz source), svg "
                             "(drawn by Graphviz's dot; graph.html when dot is missing), html "
                             "(self-contained page with pan and zoom), png (drawn by dot like the "
                             "svg; graph.html when dot is missing) (default: json,dot,svg)")
    parser.add_argument("--forward-only", action="store_true",
                        help="leave backward ops out of the drawings")
    parser.add_argument("--show-init", action="store_true",
                        help="TF: also draw variable initialisers and constants")
    parser.add_argument("--no-collapse", action="store_true",
                        help="draw every repeated block and backward op (default: a block "
                             "repeating its sibling, e.g. layer.1..11, is one box)")
    parser.add_argument("--top", type=_count(1), default=10, help="op types to list (default: 10)")
    _add_out_argument(parser, "graph.json, graph.dot, graph.svg (or graph.html)")


COMMAND = Command("graph",
    help="trace one step into amanda's IR: JSON, and a drawing (SVG or HTML)",
    description="""\
Trace one training step (forward and backward ops) into an amanda IR graph
with the graph tracing tool (amanda.tools.graph) and write it as IR JSON and
a readable drawing (amanda.tools.graph_view): op types, module paths,
parameter names and tensor shapes; forward ops blue, backward orange; ops in
module clusters, repeated blocks as one box; TF initialisers hidden. SVG
when Graphviz's dot is installed, else one self-contained HTML page.""",
    example="amanda graph cnn --forward-only",
    add_arguments=add_graph_arguments, run=run_graph)
