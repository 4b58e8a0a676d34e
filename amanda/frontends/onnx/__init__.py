"""Lift ONNX models into the amanda IR.

    from amanda.frontends.onnx import lift

    ir = lift(model_proto)          # an onnx.ModelProto
    ir = lift("model.onnx")         # a path (str or os.PathLike)
    ir = lift(serialized_bytes)     # ModelProto.SerializeToString()

The result is an :class:`amanda.ir.Graph` in namespace
``"onnx/<default opset>/graph"`` (e.g. ``"onnx/13/graph"``) that
:func:`amanda.runtime.onnx.lower` turns back into an equivalent model.

* **Nodes** become IR ops in topological order: ``type`` is the node's
  ``op_type``, the op's name is the node's name (``"<op_type>"`` numbered when
  the node has none, so it is a stable id), and ``attrs`` holds the node's
  attributes by name (ints, floats, ``str``, lists, `ProtoAttr` for tensors,
  nested IR graphs for graph attributes) plus ``attrs["_onnx"]``: the node's
  ``name``, ``domain``, the ONNX ``attribute_types`` and, for nodes with
  subgraphs, ``num_inputs``/``captures`` (below).
* **Graph inputs and initializers** are IR graph inputs, in that order:
  the declared inputs first, then the initializers that are not also declared
  inputs. An initializer's tensor carries ``attrs["initializer"]``: a
  `ProtoAttr` holding the ``TensorProto``; a declared input carries
  ``attrs["graph_input"] = True``. Keeping weights as inputs (rather than
  constant ops) means a tool sees every op of the model and nothing else, and
  a routine on a weight reads it like any other tensor.
* **Tensors** carry ``dtype`` (``"float32"``...; None for non-tensor types),
  ``shape`` (ints, None for unknown or symbolic dims; None for unknown rank)
  and ``onnx_type`` (a `ProtoAttr` of the ``TypeProto``, for an exact round
  trip) from the model's inputs, outputs and value infos (an initializer's
  from its dims); when some are missing, ``onnx.shape_inference`` (with data
  propagation) fills them in. Inferred types are never written back: a
  lowered model has the value infos the original declared. Tensors declared in the
  model's ``value_info`` get ``attrs["value_info"] = True``.
* **Absent optional values** (the empty name ``""``) read one graph input
  named ``"amanda.absent"`` with ``attrs["absent"] = True``; absent outputs get
  ``attrs["absent"] = True``.
* **Subgraphs** of ``If``/``Loop``/``Scan`` (any graph attribute) are nested
  IR graphs: their declared inputs, their initializers, then one input per
  value they read from an enclosing graph (``attrs["captured"]`` = its ONNX
  name). The node lists those captured values after its own inputs, so
  use-def in the enclosing graph sees them (``attrs["_onnx"]["num_inputs"]``
  is the node's own input count, ``["captures"]`` the captured names).
  A body's ops are named ``"<holding op>/<attribute>/<node name>"`` (e.g.
  ``"loop/body/add"``, ``"if/then_branch/Mul"``; deeper bodies repeat the
  pattern), unique in the whole model: their stable ids.
* **The model** is described in ``graph.attrs["_onnx"]``: ``ir_version``,
  ``opset_import`` (``[[domain, version], ...]``), producer, doc strings,
  metadata, model-local functions, and the graph's ``outputs`` (name and type
  of each declared output). Model-local functions are kept (as `ProtoAttr`)
  but not lifted: calls to them are ordinary ops.

A malformed model raises :class:`amanda.errors.BackendError` naming the node:
an input nothing produces, two producers of one name, an attribute of unknown
type, a cycle, a file that is not an ONNX model.
"""

from __future__ import annotations

import heapq

from amanda.errors import BackendError
from amanda.frontends.onnx.models import (  # noqa: F401 - re-exported
    _onnx, default_namespace, dtype_name, load_model, load_model_file)
from amanda.frontends.onnx.proto import ProtoAttr, _text
from amanda.frontends.onnx.weightless import weightless_copy
from amanda.ir import Graph
from amanda.ir.attrs import iter_graphs
from amanda.passes import manager

__all__ = ["ABSENT", "ProtoAttr", "default_namespace", "dtype_name", "lift", "load_model"]

ABSENT = "amanda.absent"
_FREE_VARIABLES = "_free_variables"


def lift(model, namespace=None, nodes=None):
    """Lift an ONNX model into an amanda IR graph.

    Args:
        model: an ``onnx.ModelProto``, its serialized bytes, or a path.
        namespace: the ops' namespace (default: ``"onnx/<opset>/graph"``).
        nodes: a dict to fill with IR op name -> ``onnx.NodeProto`` for every
            node of the model, those of ``If``/``Loop``/``Scan`` bodies included
            (the nodes of ``model`` itself).

    Returns:
        The :class:`amanda.ir.Graph` described in this module (verified when
        `VERIFY_LIFTED` is on).

    Raises:
        BackendError: the model is malformed or unsupported; the message names
            the node.
    """
    model = load_model(model)
    if not model.HasField("graph"):
        raise BackendError("the ONNX model has no graph")
    if not any(o.domain in ("", "ai.onnx") for o in model.opset_import) \
            and (not model.opset_import or _uses_default_domain(model.graph)):
        # without it no standard op has a meaning (onnx's checker and
        # onnxruntime reject such models too). A model whose nodes are all
        # of other domains (``ai.onnx.ml`` only) is valid: its namespace is
        # "onnx/unknown/graph", and the instrumented model imports a default
        # domain for amanda's own nodes (`default_domain_version`)
        domains = sorted(o.domain for o in model.opset_import)
        raise BackendError("the ONNX model imports no version of the default domain "
                           f"('' / 'ai.onnx'; it imports {domains or 'no opset at all'}): "
                           "add one to its opset_import")
    namespace = default_namespace(model) if namespace is None else namespace
    graphs = _graphs(model.graph)
    types = _value_types(model, graphs)
    lifter = _Lifter(namespace, types, nodes, flat=len(graphs) == 1)
    graph = lifter.graph(model.graph, outer=None)
    if nodes is not None:
        for op in _all_ops(graph):
            nodes[op.name] = lifter.protos[op]
    graph.attrs["_onnx"].update(_model_attrs(model))
    if VERIFY_LIFTED:
        try:
            graph.verify()
        except Exception as exc:   # a bug of the lifter, not of the model
            raise BackendError(f"lifting the ONNX model produced an invalid IR graph: {exc}") \
                from exc
    return graph


#: Verify every lifted graph (a check of the lifter, not of the model: about
#: a tenth of a cache-missing session creation on a small BERT). On in
#: amanda's ONNX tests and with ``AMANDA_DEBUG_PASSES=1``; off otherwise.
VERIFY_LIFTED = manager.DEBUG


def _uses_default_domain(graph):
    """Whether a node of ``graph`` or of its bodies is of the default domain."""
    for node in graph.node:
        if node.domain in ("", "ai.onnx"):
            return True
        for attribute in node.attribute:
            if attribute.HasField("g") and _uses_default_domain(attribute.g):
                return True
            if any(_uses_default_domain(g) for g in attribute.graphs):
                return True
    return False


def _model_attrs(model):
    return {
        "ir_version": int(model.ir_version),
        "opset_import": [[o.domain, int(o.version)] for o in model.opset_import],
        "producer_name": model.producer_name,
        "producer_version": model.producer_version,
        "domain": model.domain,
        "model_version": int(model.model_version),
        "doc_string": model.doc_string,
        "metadata_props": [[p.key, p.value] for p in model.metadata_props],
        "functions": [ProtoAttr(f) for f in model.functions],
        "training_info": [ProtoAttr(t) for t in model.training_info],
    }


def _value_types(model, graphs):
    """ONNX name -> TypeProto for every typed value, running shape inference
    when a node output has no declared type. ``graphs``: `_graphs` of the
    model's graph."""
    onnx = _onnx()
    declared = _collect_types(graphs)
    if not _all_declared(graphs, declared):
        # data propagation computes shapes that are values (Shape -> Concat ->
        # Reshape, as exporters write); if it fails, plain inference may not
        # on a copy without the large weights: inference serializes the model
        # and parses its result (several transient copies of the weights)
        skeleton, weights = weightless_copy(model)
        inferred = _inferred(onnx, skeleton, True) or _inferred(onnx, skeleton, False)
        if inferred is not None:
            for name, value in _collect_types(_graphs(inferred.graph)).items():
                if name not in declared and name not in weights:
                    # a copy: a TypeProto of ``inferred`` would keep that whole
                    # model (the weights included) alive with the IR
                    declared[name] = onnx.TypeProto()
                    declared[name].CopyFrom(value)
    return declared


def _inferred(onnx, model, data_prop):
    """``onnx.shape_inference.infer_shapes(model)``, or None where it fails."""
    try:
        return onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False,
                                                 data_prop=data_prop)
    except Exception:  # noqa: BLE001 - an unknown op, a model too large: types stay unknown
        return None


def _graphs(graph):
    """``graph`` and the bodies nested in it, a graph before its bodies, the
    bodies in node order (one walk over the nodes' attributes per graph)."""
    found = [graph]
    for sub in _node_bodies(graph):
        found.extend(_graphs(sub))
    return found


def _collect_types(graphs):
    """Name -> declared TypeProto over ``graphs`` (`_graphs`; the first
    declaration of a name wins)."""
    types = {}
    for graph in graphs:
        for infos in (graph.input, graph.output, graph.value_info):
            for info in infos:
                if info.HasField("type"):
                    types.setdefault(info.name, info.type)
    return types


def _all_declared(graphs, declared):
    """Whether every node output of ``graphs`` has a type in ``declared``
    (stops at the first that has none: an export without value infos)."""
    for graph in graphs:
        for node in graph.node:
            for name in node.output:
                if name and name not in declared:
                    return False
    return True


def _node_bodies(graph):
    """The graphs in the GRAPH and GRAPHS attributes of the nodes of
    ``graph`` (one level; what the lifter lifts as bodies)."""
    for node in graph.node:
        for attr in node.attribute:
            kind = attr.type
            if kind == _GRAPH:
                yield attr.g
            elif kind == _GRAPHS:
                yield from attr.graphs


def tensor_attrs(type_proto, known=None):
    """``dtype``, ``shape`` and ``onnx_type`` attrs of a value of ONNX type ``type_proto``.

    ``known``: a dict the caller keeps across calls, serialized type ->
    ``(dtype, shape)``: reading a shape dimension by dimension is the dear
    part, and a model's values share few types."""
    if type_proto is None:
        return {"dtype": None, "shape": None}
    key = None
    if known is not None:
        key = type_proto.SerializeToString()
        found = known.get(key)
        if found is not None:
            # (values of one type share its ProtoAttr: read-only, equal by content)
            return {"dtype": found[0], "shape": None if found[1] is None else list(found[1]),
                    "onnx_type": found[2]}
    attrs = {"dtype": None, "shape": None, "onnx_type": ProtoAttr(type_proto)}
    if type_proto.HasField("tensor_type"):
        tensor = type_proto.tensor_type
        attrs["dtype"] = dtype_name(tensor.elem_type)
        if tensor.HasField("shape"):
            attrs["shape"] = [d.dim_value if d.HasField("dim_value") else None
                              for d in tensor.shape.dim]
    if key is not None:
        known[key] = (attrs["dtype"], None if attrs["shape"] is None else tuple(attrs["shape"]),
                      attrs["onnx_type"])
    return attrs


def _initializer_attrs(tensor):
    # the type is kept for the symbols tools see (a weight's shape); lowering
    # writes an initializer without a ValueInfo unless it is a declared input
    onnx_type = _onnx().helper.make_tensor_type_proto(tensor.data_type,
                                                      [int(d) for d in tensor.dims])
    return {"dtype": dtype_name(tensor.data_type), "shape": [int(d) for d in tensor.dims],
            "onnx_type": ProtoAttr(onnx_type), "initializer": ProtoAttr(tensor)}


def _node_label(node, index):
    return f"node {node.name or '#' + str(index)!r} ({node.op_type})"


def _subgraphs(node):
    """(attribute name, GraphProto) for each graph in the node's attributes."""
    for attr in node.attribute:
        if attr.HasField("g"):
            yield attr.name, attr.g
        for g in attr.graphs:
            yield attr.name, g


def free_variables(graph):
    """Names a GraphProto reads but does not define (values of enclosing graphs)."""
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    defined |= {t.values.name for t in graph.sparse_initializer}
    used = []
    for node in graph.node:
        used.extend(node.input)
        for _, sub in _subgraphs(node):
            used.extend(free_variables(sub))
        defined.update(node.output)
    used.extend(o.name for o in graph.output)
    seen, free = set(), []
    for name in used:
        if name and name not in defined and name not in seen:
            seen.add(name)
            free.append(name)
    return free


class _Lifter:
    """Lifts a GraphProto (and its subgraphs, recursively) into IR graphs."""

    def __init__(self, namespace, types, nodes, flat=False):
        self.namespace = namespace
        self.flat = flat   # no node of the model holds a body
        self.types = types
        self.nodes = nodes
        self.protos = {}   # IR op -> its NodeProto, at every depth
        self.declared = set()
        self.known_types = {}   # for `tensor_attrs`

    def graph(self, proto, outer, label="graph"):
        """An IR graph for ``proto``; ``outer`` maps enclosing names -> True
        (None for the top-level graph)."""
        graph = Graph(proto.name or label, namespace=self.namespace)
        graph.attrs["_onnx"] = {"name": proto.name, "doc_string": proto.doc_string,
                                "outputs": [[o.name, ProtoAttr(o.type) if o.HasField("type")
                                             else None] for o in proto.output],
                                "sparse_initializers": [ProtoAttr(s) for s in
                                                        proto.sparse_initializer]}
        self.declared.update(v.name for v in proto.value_info)
        env = self._inputs(graph, proto)
        scope = _Scope(graph, env, outer)
        for index, node in self._ordered(proto, scope):
            self._node(graph, node, index, scope)
        outputs = []
        for info in proto.output:
            tensor = scope.lookup(info.name)
            if tensor is None:
                raise BackendError(f"graph {graph.name!r}: output {info.name!r} is produced by "
                                   "no node, graph input or initializer")
            outputs.append(tensor)
        graph.set_outputs(outputs)
        return graph

    def _inputs(self, graph, proto):
        env = {}
        initializers = {}
        for tensor in proto.initializer:
            if tensor.name in initializers:
                raise BackendError(f"graph {graph.name!r}: two initializers are named "
                                   f"{tensor.name!r}")
            initializers[tensor.name] = tensor
        for info in proto.input:
            if info.name in env:
                raise BackendError(f"graph {graph.name!r}: two inputs are named {info.name!r}")
            attrs = tensor_attrs(info.type if info.HasField("type") else None)
            attrs["graph_input"] = True
            if info.name in initializers:
                attrs["initializer"] = ProtoAttr(initializers[info.name])
            env[info.name] = self._add_input(graph, info.name, attrs)
        for name, tensor in initializers.items():
            if name not in env:
                env[name] = self._add_input(graph, name, _initializer_attrs(tensor))
        for sparse in proto.sparse_initializer:
            name = sparse.values.name
            if name not in env:
                env[name] = self._add_input(graph, name, {
                    "dtype": dtype_name(sparse.values.data_type),
                    "shape": [int(d) for d in sparse.dims],
                    "sparse_initializer": True})
        return env

    def _add_input(self, graph, name, attrs):
        tensor = graph.add_input(name, **attrs)
        if tensor.name != name:
            raise BackendError(f"graph {graph.name!r}: the name {name!r} is used twice")
        return tensor

    def _ordered(self, proto, scope):
        """Nodes in a stable topological order (the file's order when it is one).

        Raises:
            BackendError: an input no one produces, a name produced twice, or
                a cycle; the message names the node.
        """
        nodes = list(proto.node)
        if self._in_order(nodes, scope):
            return list(enumerate(nodes))
        producers = {}
        for index, node in enumerate(proto.node):
            for name in node.output:
                if not name:
                    continue
                if name in producers or scope.defines(name):
                    other = producers.get(name)
                    what = (_node_label(proto.node[other], other) if other is not None
                            else "a graph input or initializer")
                    raise BackendError(f"{_node_label(node, index)} outputs {name!r}, which "
                                       f"{what} already defines (ONNX names are assigned once)")
                producers[name] = index
        needs = []
        for index, node in enumerate(proto.node):
            reads = [(name, "") for name in node.input]
            for attr_name, sub in _subgraphs(node):
                reads.extend((name, f" (in its subgraph {attr_name!r})")
                             for name in free_variables(sub))
            node_needs = set()
            for name, where in reads:
                if not name or scope.defines(name):
                    continue
                producer = producers.get(name)
                if producer is None:
                    raise BackendError(f"{_node_label(node, index)} reads {name!r}{where}, which "
                                       "no node, graph input or initializer produces")
                if producer != index:
                    node_needs.add(producer)
                elif name in node.input:
                    raise BackendError(f"{_node_label(node, index)} reads its own output "
                                       f"{name!r}")
            needs.append(node_needs)
        return [(i, proto.node[i]) for i in _topological(needs, proto.node)]

    def _in_order(self, nodes, scope):
        """Whether the file's order is already a valid topological order
        (the usual case, checked in one pass): every node reads only what
        the graph's inputs, initializers, enclosing graphs or earlier nodes
        define, and defines each name once. Nodes with bodies are left to
        the full check. `_ordered` then gives the same order (Kahn's
        algorithm taking the earliest ready node keeps a topological
        order)."""
        if scope.outer is not None:
            return False   # (a body: the full check resolves enclosing names)
        defined = set(scope.env)
        defined.add("")   # an absent optional input
        count = len(defined)
        flat = self.flat
        for node in nodes:
            if not flat:
                for attr in node.attribute:
                    if attr.type in _BODY_KINDS:
                        return False
            if not defined.issuperset(node.input):
                return False
            outputs = [name for name in node.output if name]
            defined.update(outputs)
            count += len(outputs)
            if len(defined) != count:   # a name defined twice
                return False
        return True

    def _node(self, graph, node, index, scope):
        # (each protobuf field is read once: a read makes a new wrapper)
        attrs, types, captures = {}, {}, []
        bodies = False
        for attr in node.attribute:
            name, kind = attr.name, attr.type
            attrs[name] = self._attribute(node, index, attr, scope, captures)
            types[name] = _ATTR_TYPE_NAMES[kind]
            bodies = bodies or kind in _BODY_KINDS
        node_name = node.name
        meta = {"name": node_name, "domain": node.domain, "attribute_types": types}
        doc, overload = node.doc_string, node.overload
        if doc:
            meta["doc_string"] = doc
        if overload:
            meta["overload"] = overload
        names = list(node.input)
        env = scope.env
        inputs = [(env.get(name) or scope.lookup(name)) if name else scope.absent()
                  for name in names]
        if captures:
            meta["num_inputs"] = len(names)
            meta["captures"] = captures
            inputs.extend(scope.lookup(name) for name in captures)
        attrs["_onnx"] = meta
        outputs = list(node.output)
        op = graph.create_op(node.op_type, inputs, num_outputs=len(outputs), attrs=attrs,
                             name=node_name or node.op_type,
                             output_names=[name or ABSENT for name in outputs])
        types, known, declared = self.types, self.known_types, self.declared
        for tensor, name in zip(op.outputs, outputs):
            if not name:
                tensor.attrs = {"absent": True, "dtype": None, "shape": None}
                continue
            if tensor.name != name:
                raise BackendError(f"{_node_label(node, index)}: output name {name!r} clashes")
            tensor.attrs = tensor_attrs(types.get(name), known)
            if name in declared:
                tensor.attrs["value_info"] = True
            env[name] = tensor
        self.protos[op] = node
        # ops of a body are named after the node holding it, "<op>/<attribute>/<name>"
        # (nested bodies repeat the pattern), so every op of the model has a
        # stable id of its own: bodies often reuse names ("add" in then_branch
        # and in else_branch)
        if bodies:
            for key, value in attrs.items():
                if key == "_onnx" or isinstance(value, (int, float, str)):
                    continue
                for position, sub in iter_graphs(value):
                    _prefix_ops(sub, f"{op.name}/{key}{position}/")

    def _attribute(self, node, index, attr, scope, captures):
        if attr.ref_attr_name:
            raise BackendError(f"{_node_label(node, index)}: attribute {attr.name!r} refers to "
                               f"{attr.ref_attr_name!r}, which only functions may do")
        kind = attr.type
        read = _ATTR_READERS.get(kind)
        if read is not None:
            return read(attr)
        if kind == _GRAPH:
            return self._subgraph(node, index, attr.name, attr.g, scope, captures)
        if kind == _GRAPHS:
            return [self._subgraph(node, index, attr.name, g, scope, captures)
                    for g in attr.graphs]
        raise BackendError(f"{_node_label(node, index)}: attribute {attr.name!r} has unknown "
                           f"type {kind}")

    def _subgraph(self, node, index, name, proto, scope, captures):
        try:
            sub = self.graph(proto, outer=scope, label=f"{node.name or node.op_type}.{name}")
        except BackendError as exc:
            raise BackendError(f"in subgraph {name!r} of {_node_label(node, index)}: "
                               f"{exc}") from None
        for tensor in sub.inputs:
            captured = tensor.attrs.get("captured")
            if captured is not None and captured not in captures:
                captures.append(captured)
        return sub


def _all_ops(graph):
    """The ops of ``graph`` and of every body nested in it, parents first."""
    for op in graph.ops:
        yield op
        for key, value in op.attrs.items():
            if key != "_onnx":
                for _, sub in iter_graphs(value):
                    yield from _all_ops(sub)


def _prefix_ops(graph, prefix):
    for op in _all_ops(graph):
        op.name = prefix + op.name


class _Scope:
    """Names visible in one graph: its own values, then the enclosing graphs'."""

    def __init__(self, graph, env, outer):
        self.graph = graph
        self.env = env
        self.outer = outer
        self._absent = None

    def defines(self, name):
        """Whether ``name`` is a graph input/initializer here or a value of an
        enclosing graph (which this graph then captures)."""
        return name in self.env or (self.outer is not None and self.outer.visible(name))

    def visible(self, name):
        return name in self.env or (self.outer is not None and self.outer.visible(name))

    def lookup(self, name):
        tensor = self.env.get(name)
        if tensor is None and self.outer is not None and self.outer.visible(name):
            attrs = dict(self.outer.find(name).attrs)
            for key in ("graph_input", "initializer", "value_info", "sparse_initializer"):
                attrs.pop(key, None)
            attrs["captured"] = name
            tensor = self.env[name] = self.graph.add_input(name, **attrs)
        return tensor

    def find(self, name):
        tensor = self.env.get(name)
        return tensor if tensor is not None else self.outer.find(name)

    def absent(self):
        if self._absent is None:
            self._absent = self.graph.add_input(ABSENT, absent=True, dtype=None, shape=None)
        return self._absent


def _topological(needs, nodes):
    """A topological order of ``nodes``; raises on a cycle."""
    order = kahn_order(needs)
    if len(order) < len(needs):
        stuck = min(set(range(len(needs))) - set(order))
        raise BackendError(f"{_node_label(nodes[stuck], stuck)} is part of a cycle: its inputs "
                           "depend on its own outputs")
    return order


def kahn_order(needs):
    """Kahn's algorithm, always taking the earliest ready node: ``needs[k]``
    lists the nodes node ``k`` reads from. Nodes on a cycle are left out."""
    users = [[] for _ in needs]
    pending = [len(n) for n in needs]
    for index, node_needs in enumerate(needs):
        for producer in node_needs:
            users[producer].append(index)
    ready = [i for i, count in enumerate(pending) if count == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        index = heapq.heappop(ready)
        order.append(index)
        for user in users[index]:
            pending[user] -= 1
            if pending[user] == 0:
                heapq.heappush(ready, user)
    return order


#: AttributeProto.AttributeType values of the attributes holding bodies
_GRAPH, _GRAPHS = 5, 10
_BODY_KINDS = (_GRAPH, _GRAPHS)

#: AttributeProto.AttributeType value -> the IR value of such an attribute
#: (bodies aside: `_Lifter._attribute` lifts them)
_ATTR_READERS = {
    1: lambda a: float(a.f),                                     # FLOAT
    2: lambda a: int(a.i),                                       # INT
    3: lambda a: _text(a.s),                                     # STRING
    4: lambda a: ProtoAttr(a.t),                                 # TENSOR
    6: lambda a: [float(v) for v in a.floats],                   # FLOATS
    7: lambda a: [int(v) for v in a.ints],                       # INTS
    8: lambda a: [_text(v) for v in a.strings],                  # STRINGS
    9: lambda a: [ProtoAttr(t) for t in a.tensors],              # TENSORS
    11: lambda a: ProtoAttr(a.sparse_tensor),                    # SPARSE_TENSOR
    12: lambda a: [ProtoAttr(t) for t in a.sparse_tensors],      # SPARSE_TENSORS
    13: lambda a: ProtoAttr(a.tp),                               # TYPE_PROTO
    14: lambda a: [ProtoAttr(t) for t in a.type_protos],         # TYPE_PROTOS
}

# AttributeProto.AttributeType value -> name (as in the ONNX enum)
_ATTR_TYPE_NAMES = {0: "UNDEFINED", 1: "FLOAT", 2: "INT", 3: "STRING", 4: "TENSOR", 5: "GRAPH",
                    6: "FLOATS", 7: "INTS", 8: "STRINGS", 9: "TENSORS", 10: "GRAPHS",
                    11: "SPARSE_TENSOR", 12: "SPARSE_TENSORS", 13: "TYPE_PROTO",
                    14: "TYPE_PROTOS"}
