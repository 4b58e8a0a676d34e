"""JSON form of a graph, and graph copying (which shares its rebuilding logic).

Format (version 1)::

    {"format": "amanda.ir.graph", "format_version": 1,
     "name": "main", "namespace": "pytorch/2.13.0/eager", "attrs": {...},
     "inputs": [{"name": "x", "attrs": {...}}],
     "ops": [{"name": "conv2d", "type": "conv2d", "namespace": "...",
              "attrs": {...}, "inputs": ["x", "w"],
              "outputs": [{"name": "0", "attrs": {...}}],
              "control_inputs": ["other_op"]}],
     "outputs": ["0"]}

Tensors are referenced by name and control inputs by op name; both are unique in a
verified graph. Attr values are encoded as described in `amanda.ir.attrs`; a
nested graph is stored whole under a ``$graph`` marker.

A graph file is data: reading one never imports or evaluates a name it holds.
An op naming a Python callable (``attrs["target"]`` of a captured PyTorch op)
is checked against the explicit table of its namespace when the file is read,
see `amanda.ir.targets`; a name outside the table is an `IRError` then.
"""

from .attrs import copy_attrs, decode_attrs, encode_attrs
from .errors import IRError
from .graph import Graph
from .targets import check_targets

FORMAT = "amanda.ir.graph"
FORMAT_VERSION = 1


def graph_to_json(graph):
    """Returns a `json.dumps`-able dict describing ``graph``.

    Args:
        graph: The graph; names must be unique (as `Graph.verify` checks).

    Returns:
        A dict in the format described in this module.

    Raises:
        IRError: Two tensors or two ops share a name, so references would be
            ambiguous.
    """
    _check_unique_names(graph)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "name": graph.name,
        "namespace": graph.namespace,
        "attrs": _encode(graph.attrs),
        "inputs": [_encode_tensor(t) for t in graph.inputs],
        "ops": [_encode_op(op) for op in graph.ops],
        "outputs": [t.name for t in graph.outputs],
    }


def graph_from_json(data):
    """Builds a graph from the output of `graph_to_json`.

    Args:
        data: A dict as produced by `graph_to_json` (e.g. after `json.loads`).

    Returns:
        A new `Graph` with the same structure, names and attrs.

    Raises:
        IRError: The data is not an amanda IR graph, has an unsupported format
            version, refers to an unknown tensor or op, or an op names a call
            target outside the table of its namespace (`amanda.ir.targets`).
    """
    _check_header(data)
    try:
        graph = _decode_graph(data)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise IRError(f"malformed amanda IR graph JSON: {error!r}") from error
    check_targets(graph)
    return graph


def copy_graph(graph):
    """Returns a structural copy of ``graph``; see `Graph.copy`.

    Ops are created first and wired afterwards, so even a graph whose op order is
    not topological (one that fails `Graph.verify`) can be copied for inspection.

    Raises:
        IRError: The graph refers to a tensor or op outside it.
    """
    new = Graph(graph.name, graph.namespace, copy_attrs(graph.attrs))
    tensors = {t: new._add_input(t.name, copy_attrs(t.attrs)) for t in graph.inputs}
    ops = {op: _copy_op_unwired(new, op, tensors) for op in graph.ops}
    try:
        for op, clone in ops.items():
            clone.set_inputs([tensors[t] for t in op.inputs])
            clone.set_control_inputs([ops[c] for c in op.control_inputs])
        new.set_outputs([tensors[t] for t in graph.outputs])
    except KeyError as missing:
        raise IRError(f"cannot copy graph {graph.name!r}: it refers to {missing} outside it") from None
    return new


def _copy_op_unwired(new, op, tensors):
    clone = new.create_op(
        op.type,
        num_outputs=len(op.outputs),
        attrs=copy_attrs(op.attrs),
        namespace=op.namespace,
        name=op.name,
        output_names=[t.name for t in op.outputs],
    )
    for old, fresh in zip(op.outputs, clone.outputs):
        fresh.attrs = copy_attrs(old.attrs)
        tensors[old] = fresh
    return clone


# -- encoding ----------------------------------------------------------------


def _encode(attrs):
    return encode_attrs(attrs, graph_to_json)


def _encode_tensor(tensor):
    return {"name": tensor.name, "attrs": _encode(tensor.attrs)}


def _encode_op(op):
    return {
        "name": op.name,
        "type": op.type,
        "namespace": op.namespace,
        "attrs": _encode(op.attrs),
        "inputs": [t.name for t in op.inputs],
        "outputs": [_encode_tensor(t) for t in op.outputs],
        "control_inputs": [c.name for c in op.control_inputs],
    }


def _check_unique_names(graph):
    tensor_names = [t.name for t in graph.inputs] + [t.name for op in graph.ops for t in op.outputs]
    for kind, names in (("tensor", tensor_names), ("op", [op.name for op in graph.ops])):
        duplicate = _first_duplicate(names)
        if duplicate is not None:
            raise IRError(f"cannot serialize graph {graph.name!r}: two {kind}s are named {duplicate!r}")


def _first_duplicate(names):
    seen = set()
    for name in names:
        if name in seen:
            return name
        seen.add(name)
    return None


# -- decoding ----------------------------------------------------------------


def _check_header(data):
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise IRError(f"not an amanda IR graph: expected format {FORMAT!r}")
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        raise IRError(f"unsupported amanda IR format version {version!r} (this reader handles {FORMAT_VERSION})")


def _decode(attrs):
    return decode_attrs(attrs, graph_from_json)


def _decode_graph(data):
    graph = Graph(data["name"], data["namespace"], _decode(data["attrs"]))
    tensors = {}
    for entry in data["inputs"]:
        tensors[entry["name"]] = graph._add_input(entry["name"], _decode(entry["attrs"]))
    ops = {}
    for entry in data["ops"]:
        op = _decode_op(graph, entry, tensors, ops)
        ops[op.name] = op
        tensors.update((t.name, t) for t in op.outputs)
    graph.set_outputs(_lookup(tensors, name, "graph output") for name in data["outputs"])
    return graph


def _decode_op(graph, entry, tensors, ops):
    role = f"op {entry['name']!r}"
    outputs = entry["outputs"]
    op = graph.create_op(
        entry["type"],
        [_lookup(tensors, name, f"input of {role}") for name in entry["inputs"]],
        num_outputs=len(outputs),
        attrs=_decode(entry["attrs"]),
        namespace=entry["namespace"],
        name=entry["name"],
        control_inputs=[_lookup(ops, name, f"control input of {role}") for name in entry["control_inputs"]],
        output_names=[output["name"] for output in outputs],
    )
    for tensor, output in zip(op.outputs, outputs):
        tensor.attrs = _decode(output["attrs"])
    return op


def _lookup(table, name, role):
    if name not in table:
        raise IRError(f"{role} refers to unknown name {name!r} (names must be defined before use)")
    return table[name]
