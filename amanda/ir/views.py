"""Read-only views of a graph for other tools: networkx and Graphviz DOT."""

import json

from .attrs import encode_attrs

_MAX_ATTR_LABEL = 120


def to_networkx(graph, control_edges=False):
    """Returns the op-level dataflow graph as a ``networkx.MultiDiGraph``.

    Nodes are keyed by op name and carry ``type``, ``namespace`` and ``attrs`` (a
    shallow copy). Each op input slot fed by another op's output becomes one edge
    from producer to consumer carrying ``tensor`` (its name), ``output_index``,
    ``input_position`` and ``kind="data"``; slots fed by graph inputs have no
    producer and so no edge. The graph-level ``name``, ``namespace``, ``inputs``
    and ``outputs`` (tensor names) are stored in ``G.graph``.

    Args:
        graph: The graph to view.
        control_edges: Also add one ``kind="control"`` edge per control input.

    Returns:
        A new ``networkx.MultiDiGraph``.
    """
    try:
        import networkx  # imported here so that importing amanda.ir stays light
    except ImportError as error:
        raise ImportError("to_networkx needs networkx: "
                          "pip install 'amanda-instrument[graph]'") from error

    view = networkx.MultiDiGraph(
        name=graph.name,
        namespace=graph.namespace,
        inputs=[t.name for t in graph.inputs],
        outputs=[t.name for t in graph.outputs],
    )
    for op in graph.ops:
        view.add_node(op.name, type=op.type, namespace=op.namespace, attrs=dict(op.attrs))
    for op in graph.ops:
        for position, tensor in enumerate(op.inputs):
            if tensor.producer is not None:
                view.add_edge(
                    tensor.producer.name,
                    op.name,
                    tensor=tensor.name,
                    output_index=tensor.index,
                    input_position=position,
                    kind="data",
                )
        if control_edges:
            for control in op.control_inputs:
                view.add_edge(control.name, op.name, kind="control")
    return view


def to_dot(graph):
    """Returns Graphviz DOT text drawing the graph.

    Graph inputs and outputs are ellipses, ops are boxes labelled with type and
    name, data edges are labelled with the tensor name, and control edges are
    dashed. Every identifier is quoted and escaped, so any name is safe.

    Args:
        graph: The graph to draw.

    Returns:
        The DOT source, starting with ``digraph``.
    """
    lines = [f"digraph {_quote(graph.name)} {{", "  rankdir=TB;"]
    for tensor in graph.inputs:
        lines.append(f"  {_quote('input:' + tensor.name)} [shape=ellipse, label={_quote('%' + tensor.name)}];")
    for op in graph.ops:
        lines.append(f"  {_quote('op:' + op.name)} [shape=box, label={_quote(_op_label(op))}];")
    for i, tensor in enumerate(graph.outputs):
        lines.append(f"  {_quote(f'output:{i}')} [shape=ellipse, label={_quote('return %' + tensor.name)}];")
    lines.extend(_dot_edges(graph))
    lines.append("}")
    return "\n".join(lines) + "\n"


def _dot_edges(graph):
    for op in graph.ops:
        for position, tensor in enumerate(op.inputs):
            label = _quote(f"%{tensor.name} @{position}")
            yield f"  {_source_id(tensor)} -> {_quote('op:' + op.name)} [label={label}];"
        for control in op.control_inputs:
            yield f"  {_quote('op:' + control.name)} -> {_quote('op:' + op.name)} [style=dashed];"
    for i, tensor in enumerate(graph.outputs):
        yield f"  {_source_id(tensor)} -> {_quote(f'output:{i}')};"


def _source_id(tensor):
    if tensor.producer is None:
        return _quote("input:" + tensor.name)
    return _quote("op:" + tensor.producer.name)


def _op_label(op):
    label = f"{op.namespace}::{op.type}" if op.namespace else op.type
    label += f"\n{op.name}"
    if op.attrs:
        text = json.dumps(encode_attrs(op.attrs, lambda g: g.name), sort_keys=True)
        # Long attrs (weights, tables) would swamp the drawing; the text form has them all.
        label += "\n" + (text if len(text) <= _MAX_ATTR_LABEL else text[: _MAX_ATTR_LABEL - 3] + "...")
    return label


def _quote(text):
    # DOT quoted strings only treat \" specially, so escape backslashes first to
    # keep them literal; a newline becomes DOT's centred line break \n.
    escaped = str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'
