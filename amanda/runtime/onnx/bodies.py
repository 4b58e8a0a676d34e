"""If/Loop/Scan bodies: finding them in the IR, analysing and lowering the
ops inside them, and walking them in ``GraphProto`` form.

A body is a graph attribute of its holding op; its key among the model's
bodies is ``(holding op name, attribute, index in a GRAPHS attribute or
None)``.
"""

from __future__ import annotations

import onnx

from amanda.ir import Graph
from amanda.passes.instrumentation import run_instrumentation_pass
from amanda.passes.lower_actions import ROUTINE, lower_actions


def _bodies(op):
    """``(key, body)`` for each If/Loop/Scan body (graph attribute) of an op;
    the key names it among the model's bodies."""
    for name, value in op.attrs.items():
        if name == "_onnx" or op.type == ROUTINE:
            continue
        if isinstance(value, Graph):
            yield (op.name, name, None), value
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                if isinstance(item, Graph):
                    yield (op.name, name, index), item


def _analyse_bodies(graph, session, backend, plans):
    """Run the analysis routines on the ops of every body nested in ``graph``
    (after the graph's own ops; each body's ops in order, bodies in the order
    of their holding nodes). Their ids are their lifted names
    (``"loop/body/add"``), contexts are those of top-level ops."""
    for op in graph.ops:
        for key, body in _bodies(op):
            plans[key] = run_instrumentation_pass(body, session, backend)
            _analyse_bodies(body, session, backend, plans)


def _lower_bodies(graph, plans):
    """Lower the actions recorded on body ops into the bodies of ``graph``
    (a lowered copy of the lifted graph), in place, innermost first."""
    for op in graph.ops:
        for (name, attr, index), body in list(_bodies(op)):
            plan = plans.get((name, attr, index))
            if plan:
                body = lower_actions(body, plan)
            _lower_bodies(body, plans)
            if index is None:
                op.attrs[attr] = body
            else:
                bodies = list(op.attrs[attr])
                bodies[index] = body
                op.attrs[attr] = bodies


def _hosts_routines(graph):
    return any(op.type == ROUTINE or any(_hosts_routines(b) for _, b in _bodies(op))
               for op in graph.ops)


def _bodies_host_routines(graph):
    """Whether a routine sits inside an If/Loop/Scan body of ``graph``: those
    run inside onnxruntime, so (to keep program order) all routines do."""
    return any(_hosts_routines(body) for op in graph for _, body in _bodies(op))


def _holding_node(proto, op_type, outputs):
    """The node of ``proto`` of type ``op_type`` with these outputs (None if
    there is not exactly one)."""
    found = [n for n in proto.node if n.op_type == op_type and list(n.output) == outputs]
    return found[0] if len(found) == 1 else None


def _body_proto(node, attr, index):
    for attribute in node.attribute:
        if attribute.name == attr:
            if index is None:
                return attribute.g if attribute.HasField("g") else None
            return attribute.graphs[index] if index < len(attribute.graphs) else None
    return None


def _sort_nodes(proto):
    """Order the nodes of a GraphProto (and of its bodies) topologically,
    keeping the present order where it is one; values a body reads from
    this graph count as inputs of the node holding it."""
    from amanda.frontends.onnx import kahn_order
    nodes, needs = _node_needs(proto)
    order = kahn_order([sorted(n) for n in needs])
    if len(order) == len(nodes) and order != list(range(len(nodes))):
        del proto.node[:]
        proto.node.extend(nodes[k] for k in order)


def _node_needs(proto):
    """``(nodes, needs)`` of a GraphProto: ``needs[k]`` is the set of the
    positions of the nodes whose outputs node ``k`` reads, values its bodies
    read from this graph included. Bodies are sorted (`_sort_nodes`) on the
    way."""
    from amanda.frontends.onnx import free_variables
    nodes = list(proto.node)
    producer = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    needs = []
    for k, node in enumerate(nodes):
        reads = set(node.input)
        for attribute in node.attribute:
            for sub in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                _sort_nodes(sub)
                reads.update(free_variables(sub))
        needs.append({j for j in map(producer.get, reads) if j is not None and j != k})
    return nodes, needs


def _collect_proto_names(proto, names, values=None):
    """Every tensor and node name of a GraphProto and its bodies into
    ``names``; ``values``, if given, receives the graph's own value names
    (inputs, initializers, node outputs; not its bodies')."""
    own = set() if values is None else values
    own.update(i.name for i in proto.input)
    own.update(i.name for i in proto.initializer)
    for node in proto.node:
        names.add(node.name)
        own.update(o for o in node.output if o)
        for attribute in node.attribute:
            kind = attribute.type
            if kind == onnx.AttributeProto.GRAPH:
                _collect_proto_names(attribute.g, names)
            elif kind == onnx.AttributeProto.GRAPHS:
                for sub in attribute.graphs:
                    _collect_proto_names(sub, names)
    names |= own
