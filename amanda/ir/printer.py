"""Text form of the IR: one op per line, read like Python.

    graph main(%x, %w) [namespace: 'pytorch/2.13.0/eager'] {
      %0 = pytorch::conv2d(%x, %w) {stride: [1, 1]}  # conv2d
      return %0
    }

An op whose namespace is its graph's default shows only the framework part
(``pytorch::``); any other namespace is shown in full. Tuples print as lists, so the
text survives a JSON round trip.
"""

import re

from .attrs import iter_graphs
from .errors import IRError
from .graph import Graph

_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.:/\-]+\Z")
_INDENT = "  "


def format_tensor_ref(tensor):
    """Returns ``%name``, quoting names that would not read as one token."""
    return "%" + _quote_if_needed(tensor.name)


def format_attr_value(value):
    """Formats an attr value compactly: ``[1, 1]``, ``{mode: 'same'}``, ``'x'``."""
    if isinstance(value, Graph):
        return f"<graph {_quote_if_needed(value.name)}>"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_attr_value(item) for item in value) + "]"
    if isinstance(value, dict):
        items = (f"{_format_key(key)}: {format_attr_value(item)}" for key, item in value.items())
        return "{" + ", ".join(items) + "}"
    return repr(value)


def format_op(op, with_name=False):
    """Formats one op as ``%3 = pytorch::conv2d(%0, %1) {stride: [1, 1]}``.

    Args:
        op: The op.
        with_name: Append the op's name as a trailing ``# name`` comment.

    Returns:
        One line of text.
    """
    results = ", ".join(format_tensor_ref(t) for t in op.outputs)
    line = (f"{results} = " if results else "") + _callee(op)
    line += "(" + ", ".join(format_tensor_ref(t) for t in op.inputs) + ")"
    if op.attrs:
        line += " " + format_attr_value(op.attrs)
    if op.control_inputs:
        line += " after(" + ", ".join(_quote_if_needed(c.name) for c in op.control_inputs) + ")"
    if with_name:
        line += f"  # {op.name}"
    return line


def format_graph(graph):
    """Formats a whole graph, nested graphs in op attrs indented below their op."""
    return "\n".join(_graph_lines(graph, "", ""))


def format_window(graph, focus, radius=2):
    """Formats the ops around ``focus``, marking it with ``>>>``.

    Args:
        graph: The graph holding ``focus``.
        focus: The op to mark.
        radius: How many ops to show on each side.

    Returns:
        A few lines of text, or "" if ``focus`` is not in the op list.
    """
    try:
        before = _walk(graph.prev_op, focus, radius + 1)
        after = _walk(graph.next_op, focus, radius + 1)
    except IRError:  # focus is not in the op order
        return ""
    # One op more than shown on each side tells whether to print "...".
    lines = ["    ..."] if len(before) > radius else []
    lines += ["    " + format_op(op, with_name=True) for op in reversed(before[:radius])]
    lines.append(">>> " + format_op(focus, with_name=True))
    lines += ["    " + format_op(op, with_name=True) for op in after[:radius]]
    if len(after) > radius:
        lines.append("    ...")
    return "\n".join(lines)


def _walk(step, op, count):
    """Up to ``count`` ops reached from ``op`` by repeating ``step``, nearest first."""
    found = []
    while len(found) < count:
        op = step(op)
        if op is None:
            break
        found.append(op)
    return found


def _graph_lines(graph, indent, label):
    params = ", ".join(format_tensor_ref(t) for t in graph.inputs)
    header = f"{indent}{label}graph {_quote_if_needed(graph.name)}({params})"
    if graph.namespace:
        header += f" [namespace: {graph.namespace!r}]"
    if graph.attrs:
        header += " " + format_attr_value(graph.attrs)
    lines = [header + " {"]
    body_indent = indent + _INDENT
    for op in graph.ops:
        lines.append(body_indent + format_op(op, with_name=True))
        for path, subgraph in iter_graphs(op.attrs):
            lines.extend(_graph_lines(subgraph, body_indent + _INDENT, f"{path} = "))
    lines.append(body_indent + "return " + ", ".join(format_tensor_ref(t) for t in graph.outputs))
    lines.append(indent + "}")
    return lines


def _callee(op):
    namespace = op.namespace
    if not namespace:
        return op.type
    if op.graph is not None and namespace == op.graph.namespace:
        namespace = namespace.split("/")[0]
    return f"{namespace}::{op.type}"


def _format_key(key):
    return key if isinstance(key, str) and _PLAIN_NAME.match(key) else repr(key)


def _quote_if_needed(name):
    return name if isinstance(name, str) and _PLAIN_NAME.match(name) else repr(name)
