"""The IR checker behind `Graph.verify`.

It stops at the first broken invariant and raises a `VerificationError` whose
message names the graph and the op and shows a few ops around it, the offending
one marked with ``>>>``, so a broken pass can be found from the message alone.
"""

from .attrs import iter_graphs
from .errors import VerificationError
from .printer import format_op, format_tensor_ref, format_window


def verify_graph(graph):
    """Checks every invariant of ``graph`` and of the graphs nested in its attrs.

    Args:
        graph: The graph to check.

    Raises:
        VerificationError: The first broken invariant found.
    """
    positions = {op: i for i, op in enumerate(graph.ops)}
    _check_inputs(graph)
    _check_unique_names(graph)
    for op in graph.ops:
        _check_op(graph, op, positions)
    _check_outputs(graph, positions)
    # Reverse links last: a stale use usually follows from a bad forward link,
    # which names the op to blame more precisely.
    _check_reverse_links(graph, positions)
    _check_nested(graph)


def _fail(graph, message, op=None):
    text = f"graph {graph.name!r}: "
    if op is not None:
        text += f"op {op.name!r} ({format_op(op)}): "
    text += message
    window = format_window(graph, op) if op is not None else ""
    raise VerificationError(text + ("\n" + window if window else ""), op=op)


def _check_inputs(graph):
    for i, tensor in enumerate(graph.inputs):
        where = f"graph input {i} {format_tensor_ref(tensor)}"
        if tensor.graph is not graph:
            _fail(graph, f"{where} belongs to another graph")
        if tensor.producer is not None or tensor.index != i:
            _fail(graph, f"{where} has producer {tensor.producer!r} and index {tensor.index}, expected none and {i}")


def _check_unique_names(graph):
    owners = {}
    for tensor in _defined_tensors(graph):
        other = owners.setdefault(tensor.name, tensor)
        if other is not tensor:
            _fail(graph, f"two tensors are named {tensor.name!r}", tensor.producer or other.producer)
    ops = {}
    for op in graph.ops:
        other = ops.setdefault(op.name, op)
        if other is not op:
            _fail(graph, f"two ops are named {op.name!r}", op)


def _check_op(graph, op, positions):
    if op.graph is not graph:
        _fail(graph, "is in the op list but its graph is another one", op)
    for position, tensor in enumerate(op.inputs):
        _check_input(graph, op, position, tensor, positions)
    for c in op.control_inputs:
        _check_control_input(graph, op, c, positions)
    for index, tensor in enumerate(op.outputs):
        _check_output(graph, op, index, tensor)


def _check_input(graph, op, position, tensor, positions):
    where = f"input {position} {format_tensor_ref(tensor)}"
    if tensor.graph is not graph:
        _fail(graph, f"{where} does not belong to this graph", op)
    producer = tensor.producer
    if producer is None:
        if not (tensor.index < len(graph.inputs) and graph.inputs[tensor.index] is tensor):
            _fail(graph, f"{where} has no producer but is not a graph input", op)
    elif producer not in positions:
        _fail(graph, f"{where} is produced by op {producer.name!r}, which is not in this graph", op)
    elif positions[producer] >= positions[op]:
        _fail(graph, f"{where} is used before it is defined (by op {producer.name!r})", op)
    if (op, position) not in tensor._uses:
        _fail(graph, f"{where} does not record this use; uses are out of date", op)


def _check_control_input(graph, op, control, positions):
    if control not in positions:
        _fail(graph, f"control input {control!r} is not in this graph", op)
    if positions[control] >= positions[op]:
        _fail(graph, f"control input {control.name!r} comes after it", op)
    if op not in control.control_users:
        _fail(graph, f"control input {control.name!r} does not record it as a control user", op)


def _check_output(graph, op, index, tensor):
    where = f"output {index} {format_tensor_ref(tensor)}"
    if tensor.producer is not op or tensor.index != index:
        _fail(graph, f"{where} records producer {tensor.producer!r} and index {tensor.index}", op)
    if tensor.graph is not graph:
        _fail(graph, f"{where} does not belong to this graph", op)


def _check_reverse_links(graph, positions):
    for tensor in _defined_tensors(graph):
        for user, position in tensor.uses:
            if user not in positions or not _reads(user, position, tensor):
                where = f"op {user.name!r} input {position}"
                _fail(graph, f"{format_tensor_ref(tensor)} records a use by {where}, which reads something else", user)
    for op in graph.ops:
        for user in op.control_users:
            if user not in positions or op not in user.control_inputs:
                _fail(graph, f"lists control user {user.name!r}, which does not list it as a control input", op)


def _reads(op, position, tensor):
    return 0 <= position < len(op.inputs) and op.inputs[position] is tensor


def _check_outputs(graph, positions):
    for i, tensor in enumerate(graph.outputs):
        where = f"graph output {i} {format_tensor_ref(tensor)}"
        if tensor.graph is not graph:
            _fail(graph, f"{where} does not belong to this graph")
        if tensor.producer is not None and tensor.producer not in positions:
            _fail(graph, f"{where} is produced by op {tensor.producer.name!r}, which is not in this graph")


def _check_nested(graph):
    sources = [("graph attrs", None, graph.attrs)] + [(f"op {op.name!r}", op, op.attrs) for op in graph.ops]
    for owner, op, attrs in sources:
        for path, subgraph in iter_graphs(attrs):
            if subgraph is graph:
                _fail(graph, f"attr {path!r} of {owner} contains the graph itself", op)
            try:
                verify_graph(subgraph)
            except VerificationError as error:
                context = f"in attr {path!r} of {owner} of graph {graph.name!r}"
                raise VerificationError(f"{context}: {error}", op=error.op) from error


def _defined_tensors(graph):
    yield from graph.inputs
    for op in graph.ops:
        yield from op.outputs
