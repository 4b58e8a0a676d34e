"""Lift TensorFlow graphs into the amanda IR.

    from amanda.frontends.tensorflow import lift_graph

    ir = lift_graph(tf_graph)            # a tf.Graph / tf.compat.v1 graph
    ir = lift_graph(graph_def)           # a GraphDef (or its serialized bytes)
    ir = lift_graph(concrete_function)   # a tf.function ConcreteFunction

One IR op per TF operation, named exactly like it (TF op names are unique and
are the stable op ids), with ``type`` the TF op type and attrs the NodeDef
attrs as JSON-able values. Each TF output becomes one IR output named like the
TF tensor (``"conv/Conv2D:0"``) with ``shape`` (a list, ``None`` for unknown
dims; ``None`` for unknown rank) and ``dtype`` (``"float32"``) attrs. Ops come
in the GraphDef's node order, fixed up into a topological order. Tensors read
but produced nowhere in the graph (GraphDef fragments) become graph inputs.

Graph outputs: a ``FuncGraph`` (concrete function) returns its declared
outputs; a plain graph has none declared, so it returns the tensors nothing
reads, in op order (so that dead-code passes keep the model's results).

Function-valued attrs (``StatefulPartitionedCall``'s ``f``, ``While`` bodies,
``If`` branches, ...) become nested amanda IR graphs lifted from the function
library. A function that cannot be lifted becomes
``{"function": name, "lifted": False}`` and is listed in the top graph's
``attrs["unlifted_functions"]``.

Gradient ops (built by ``tf.gradients`` or ``tf.GradientTape``) get
``attrs["backward"] = True`` and ``attrs["forward_op"]``: the name of the
forward op they differentiate, or ``None`` when no single forward op owns them
(seeds, aggregations, or a tape op whose owner the graph does not determine).
Those are listed in ``graph.attrs["unowned_backward_ops"]``. See
`map_gradients` for the rules.
"""

from __future__ import annotations

import base64
import bisect
import heapq
import re

from amanda.ir import Graph

__all__ = [
    "default_namespace",
    "forward_op_of",
    "gradient_owners",
    "lift_graph",
    "map_gradients",
]

#: Constants with more elements than this keep only dtype and shape in attrs.
MAX_CONST_ELEMENTS = 64

# Attrs that duplicate what the IR records elsewhere (tensor shapes).
_SKIPPED_ATTRS = frozenset({"_output_shapes"})


def _tf():
    import tensorflow as tf

    return tf


def default_namespace():
    """``"tensorflow/<version>/graph"``."""
    return f"tensorflow/{_tf().__version__}/graph"


# ---------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------


def lift_graph(graph_or_graphdef, namespace=None):
    """Lifts a TF graph into an amanda IR graph.

    Args:
        graph_or_graphdef: A ``tf.Graph`` (including a ``FuncGraph``), a
            ``GraphDef`` (or its serialized bytes), or a ``ConcreteFunction``
            (anything with a ``.graph`` that is a ``tf.Graph``).
        namespace: The ops' namespace; ``"tensorflow/<version>/graph"`` if None.

    Returns:
        An `amanda.ir.Graph` (it verifies; nested function graphs included),
        with gradient ops mapped to their forward ops (see `map_gradients`).

    Raises:
        TypeError: The argument is none of the above.
    """
    tf = _tf()
    namespace = default_namespace() if namespace is None else namespace
    source = graph_or_graphdef
    graph_def_cls = tf.compat.v1.GraphDef
    if isinstance(source, (bytes, bytearray)):
        source = graph_def_cls.FromString(bytes(source))
    if not isinstance(source, (tf.Graph, graph_def_cls)):
        inner = getattr(source, "graph", None)
        if isinstance(inner, tf.Graph):
            source = inner
        else:
            raise TypeError(
                f"lift_graph expects a tf.Graph, GraphDef or ConcreteFunction, got {type(graph_or_graphdef).__name__}"
            )
    if isinstance(source, tf.Graph):
        graph_def = source.as_graph_def()
        records = _records_from_tf_graph(source, graph_def)
        outputs = _declared_outputs(source)
        name = getattr(source, "name", None) or "tf_graph"
    else:
        graph_def = source
        records = _records_from_graph_def(graph_def)
        outputs = None
        name = "tf_graph"
    library = _FunctionLibrary(graph_def.library, namespace)
    graph = _build(name, namespace, records, outputs, library)
    graph.attrs["unlifted_functions"] = sorted(library.unlifted)
    return graph


# ---------------------------------------------------------------------------
# Records: a backend-neutral description of one TF op
# ---------------------------------------------------------------------------


class _Record:
    __slots__ = ("name", "type", "attrs", "device", "inputs", "control_inputs", "outputs", "order")

    def __init__(self, name, op_type, attrs, device, inputs, control_inputs, outputs, order):
        self.name = name
        self.type = op_type
        self.attrs = attrs  # the NodeDef attr map (protos, converted when building)
        self.device = device
        self.inputs = inputs  # TF tensor names "op:i"
        self.control_inputs = control_inputs  # op names
        self.outputs = outputs  # [(tensor name, shape, dtype)]
        self.order = order


def _tensor_shape(shape):
    if shape.rank is None:
        return None
    return [None if d is None else int(d) for d in shape.as_list()]


def _records_from_tf_graph(tf_graph, graph_def, order=None):
    """Records for every op of a tf.Graph, ordered like ``graph_def.node``."""
    nodes = {node.name: node for node in graph_def.node}
    if order is None:
        order = {node.name: i for i, node in enumerate(graph_def.node)}
    records = []
    for i, op in enumerate(tf_graph.get_operations()):
        node = nodes.get(op.name)
        if node is None:
            node = op.node_def
        records.append(
            _Record(
                op.name,
                op.type,
                node.attr,
                node.device,
                [t.name for t in op.inputs],
                # a set in TF: sorted, as a GraphDef stores them, so that a
                # graph and its GraphDef lift alike
                sorted(c.name for c in op.control_inputs),
                [(t.name, _tensor_shape(t.shape), t.dtype.name) for t in op.outputs],
                order.get(op.name, len(order) + i),
            )
        )
    return records


def _records_from_graph_def(graph_def):
    """Imports the GraphDef for shape inference; reads it raw if that fails."""
    tf = _tf()
    try:
        imported = tf.Graph()
        with imported.as_default():
            tf.graph_util.import_graph_def(graph_def, name="")
        return _records_from_tf_graph(imported, imported.as_graph_def(), _node_order(graph_def))
    except Exception:  # fragments, unknown ops, bad shapes: lift the raw NodeDefs
        return _raw_records(graph_def)


def _node_order(graph_def):
    return {node.name: i for i, node in enumerate(graph_def.node)}


def _canonical_input(name):
    if name.startswith("^"):
        return name
    return name if ":" in name else name + ":0"


def _raw_records(graph_def):
    """Records straight from NodeDefs, with outputs counted from the op registry."""
    max_used = {}
    for node in graph_def.node:
        for name in node.input:
            if not name.startswith("^"):
                op_name, _, index = _canonical_input(name).rpartition(":")
                max_used[op_name] = max(max_used.get(op_name, -1), int(index))
    functions = {f.signature.name: f.signature for f in graph_def.library.function}
    records = []
    for i, node in enumerate(graph_def.node):
        dtypes = _output_dtypes(node, functions)
        if dtypes is None:
            dtypes = [None] * (max_used.get(node.name, -1) + 1)
        shapes = []
        if "_output_shapes" in node.attr:
            shapes = [_shape_value(s) for s in node.attr["_output_shapes"].list.shape]
        outputs = [
            (f"{node.name}:{k}", shapes[k] if k < len(shapes) else None, dtype) for k, dtype in enumerate(dtypes)
        ]
        inputs = [_canonical_input(n) for n in node.input if not n.startswith("^")]
        controls = sorted(n[1:] for n in node.input if n.startswith("^"))
        records.append(_Record(node.name, node.op, node.attr, node.device, inputs, controls, outputs, i))
    return records


def _output_dtypes(node, functions):
    """Output dtype names of a NodeDef from its OpDef, or None if unknown."""
    from tensorflow.python.framework import op_def_registry

    op_def = op_def_registry.get(node.op) or functions.get(node.op)
    if op_def is None:
        return None
    dtypes = []
    try:
        for arg in op_def.output_arg:
            if arg.number_attr:
                count = node.attr[arg.number_attr].i
                dtype = _dtype_name(arg.type) if arg.type else _dtype_name(node.attr[arg.type_attr].type)
                dtypes.extend([dtype] * count)
            elif arg.type_list_attr:
                dtypes.extend(_dtype_name(t) for t in node.attr[arg.type_list_attr].list.type)
            elif arg.type:
                dtypes.append(_dtype_name(arg.type))
            else:
                dtypes.append(_dtype_name(node.attr[arg.type_attr].type) if arg.type_attr in node.attr else None)
    except Exception:
        return None
    return dtypes


def _declared_outputs(tf_graph):
    outputs = getattr(tf_graph, "outputs", None)
    if isinstance(outputs, (list, tuple)):
        return [t.name for t in outputs if t is not None and hasattr(t, "name")]
    return None


# ---------------------------------------------------------------------------
# Building the IR graph
# ---------------------------------------------------------------------------


def _topological(records):
    """Stable topological order: ready ops by their ``order``; back edges broken.

    Returns the records and, per record name, the set of its input tensor
    names / control inputs that could not be ordered before it (cycles, e.g.
    v1 ``NextIteration`` -> ``Merge``).
    """
    by_name = {r.name: r for r in records}
    deps = {}
    users = {r.name: [] for r in records}
    for r in records:
        needed = set()
        for tensor in r.inputs:
            producer = tensor.rpartition(":")[0]
            if producer in by_name and producer != r.name:
                needed.add(producer)
        for control in r.control_inputs:
            if control in by_name and control != r.name:
                needed.add(control)
        deps[r.name] = needed
        for producer in needed:
            users[producer].append(r.name)
    pending = {name: len(needed) for name, needed in deps.items()}
    heap = [(r.order, r.name) for r in records if pending[r.name] == 0]
    heapq.heapify(heap)
    done = set()
    ordered = []
    remaining = sorted((r.order, r.name) for r in records)
    cursor = 0
    while len(ordered) < len(records):
        if not heap:  # a cycle: release the earliest op not yet placed
            while remaining[cursor][1] in done:
                cursor += 1
            heap.append(remaining[cursor])
        _, name = heapq.heappop(heap)
        if name in done:
            continue
        done.add(name)
        ordered.append(by_name[name])
        for user in users[name]:
            pending[user] -= 1
            if pending[user] == 0 and user not in done:
                heapq.heappush(heap, (by_name[user].order, user))
    return ordered


def _build(name, namespace, records, outputs, library):
    graph = Graph(name, namespace=namespace)
    ordered = _topological(records)
    tensors = {}  # TF tensor name -> IR tensor
    ops = {}
    back_edges = []
    defined = {t for r in records for t, _, _ in r.outputs}
    for record in ordered:
        inputs = []
        for tensor_name in record.inputs:
            tensor = tensors.get(tensor_name)
            if tensor is None:
                if tensor_name in defined:  # produced later: a cycle's back edge
                    back_edges.append([record.name, tensor_name])
                    tensor = graph.add_input(tensor_name + "^back_edge", back_edge=tensor_name)
                else:  # produced outside this graph (a fragment)
                    tensor = graph.add_input(tensor_name, shape=None, dtype=None)
                    tensors[tensor_name] = tensor
            inputs.append(tensor)
        controls = [ops[c] for c in record.control_inputs if c in ops]
        attrs = library.convert_attrs(record.attrs)
        missing = [c for c in record.control_inputs if c not in ops]
        if missing:
            attrs["unresolved_control_inputs"] = missing
        if record.device:
            attrs["device"] = record.device
        if library.has(record.type):  # a direct call of a library function
            attrs["call_function"] = library.lift(record.type)
        op = graph.create_op(
            record.type,
            inputs,
            num_outputs=len(record.outputs),
            attrs=attrs,
            name=record.name,
            control_inputs=controls,
            output_names=[t for t, _, _ in record.outputs],
        )
        for tensor, (tensor_name, shape, dtype) in zip(op.outputs, record.outputs):
            tensor.attrs = {"shape": shape, "dtype": dtype}
            tensors[tensor_name] = tensor
        ops[record.name] = op
    if back_edges:
        graph.attrs["back_edges"] = back_edges
    if outputs is None:
        result = [t for op in graph for t in op.outputs if not t.uses]
    else:
        result = [tensors[t] for t in outputs if t in tensors]
    graph.set_outputs(result)
    map_gradients(graph)
    return graph


# ---------------------------------------------------------------------------
# Attr values
# ---------------------------------------------------------------------------


def _dtype_name(enum):
    tf = _tf()
    try:
        return tf.dtypes.as_dtype(enum).name
    except Exception:
        return f"dtype_{int(enum)}"


def _shape_value(shape_proto):
    if shape_proto.unknown_rank:
        return None
    return [None if d.size < 0 else int(d.size) for d in shape_proto.dim]


def _bytes_value(data):
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(data).decode("ascii")}


def _tensor_value(proto):
    """``{"dtype", "shape"[, "value"]}`` for a TensorProto; value only when small."""
    dtype = _dtype_name(proto.dtype)
    shape = _shape_value(proto.tensor_shape)
    result = {"dtype": dtype, "shape": shape}
    if shape is None or None in shape:
        return result
    size = 1
    for d in shape:
        size *= d
    if size > MAX_CONST_ELEMENTS:
        return result
    try:
        array = _tf().make_ndarray(proto)
        kind = array.dtype.kind
        if kind in "biuSUO":
            value = array.tolist()
        elif kind == "c":
            value = array.tolist()
        else:  # float16/32/64, bfloat16 and other float-like numpy dtypes
            value = array.astype("float64").tolist()
    except Exception:
        return result
    result["value"] = _plain(value)
    return result


def _plain(value):
    """Makes numpy's ``tolist()`` output JSON-able (bytes, complex)."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, bytes):
        return _bytes_value(value)
    if isinstance(value, complex):
        return [value.real, value.imag]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return repr(value)


class _FunctionLibrary:
    """Lifts the functions of a FunctionDefLibrary on demand (each once)."""

    def __init__(self, library_proto, namespace):
        self.proto = library_proto
        self.namespace = namespace
        self.fdefs = {f.signature.name: f for f in library_proto.function}
        self.lifted = {}
        self.in_progress = set()
        self.unlifted = set()
        self._context = None

    def has(self, name):
        return name in self.fdefs

    def convert_attrs(self, attr_map):
        result = {}
        for key in sorted(attr_map):
            if key in _SKIPPED_ATTRS:
                continue
            result[key] = self.attr_value(attr_map[key])
        return result

    def attr_value(self, value):
        kind = value.WhichOneof("value")
        if kind is None:
            return None
        if kind == "s":
            return _bytes_value(value.s)
        if kind == "i":
            return int(value.i)
        if kind == "f":
            return float(value.f)
        if kind == "b":
            return bool(value.b)
        if kind == "type":
            return _dtype_name(value.type)
        if kind == "shape":
            return _shape_value(value.shape)
        if kind == "tensor":
            return _tensor_value(value.tensor)
        if kind == "func":
            return self.function_value(value.func)
        if kind == "placeholder":
            return {"placeholder": value.placeholder}
        if kind == "list":
            lst = value.list
            for field in ("s", "i", "f", "b", "type", "shape", "tensor", "func"):
                items = getattr(lst, field)
                if len(items):
                    return [self._list_item(field, item) for item in items]
            return []
        return None

    def _list_item(self, field, item):
        if field == "s":
            return _bytes_value(item)
        if field == "i":
            return int(item)
        if field == "f":
            return float(item)
        if field == "b":
            return bool(item)
        if field == "type":
            return _dtype_name(item)
        if field == "shape":
            return _shape_value(item)
        if field == "tensor":
            return _tensor_value(item)
        return self.function_value(item)

    def function_value(self, name_attr_list):
        name = name_attr_list.name
        graph = self.lift(name)
        if graph is None:
            return {"function": name, "lifted": False}
        if len(name_attr_list.attr):
            graph.attrs["function_attrs"] = self.convert_attrs(name_attr_list.attr)
        return graph

    def lift(self, name):
        """A fresh IR graph for library function ``name``, or None (recorded)."""
        if name in self.lifted:
            return self.lifted[name].copy()
        if name not in self.fdefs or name in self.in_progress:
            self.unlifted.add(name)
            return None
        self.in_progress.add(name)
        try:
            graph = self._lift(self.fdefs[name])
        except Exception:
            graph = None
        finally:
            self.in_progress.discard(name)
        if graph is None:
            self.unlifted.add(name)
            return None
        self.lifted[name] = graph
        return graph.copy()

    def _library_graph(self):
        tf = _tf()
        if self._context is None:
            self._context = tf.Graph()
            holder = tf.compat.v1.GraphDef()
            holder.library.CopyFrom(self.proto)
            with self._context.as_default():
                tf.graph_util.import_graph_def(holder, name="")
        return self._context

    def _lift(self, fdef):
        from tensorflow.python.framework.function_def_to_graph import function_def_to_graph

        with self._library_graph().as_default():
            func_graph = function_def_to_graph(fdef)
        args = [a.name for a in fdef.signature.input_arg]
        order = {name: i for i, name in enumerate(args)}
        for i, node in enumerate(fdef.node_def):
            order.setdefault(node.name, len(args) + i)
        records = _records_from_tf_graph(func_graph, func_graph.as_graph_def(), order)
        outputs = [t.name for t in func_graph.outputs]
        graph = _build(fdef.signature.name, self.namespace, records, outputs, self)
        graph.attrs["function_inputs"] = [t.name for t in func_graph.inputs]
        return graph


# ---------------------------------------------------------------------------
# Gradient mapping
# ---------------------------------------------------------------------------

_GRAD_ROOT = re.compile(r"gradients(_\d+)?\Z")
_GRAD_SCOPE = re.compile(r"(.+)_grad(_\d+)?\Z")
_GRAD_YS = re.compile(r"grad_ys_\d+\Z")
_TAPE_ROOT = "gradient_tape"
_GRAD_KERNEL = re.compile(r"(.+?)(?:BackpropInput|BackpropFilter|Backprop|GradWithArgmax|GradGrad|Grad)(?:V\d+)?\Z")
_VERSION_SUFFIX = re.compile(r"V\d+\Z")
_CALL_TYPES = frozenset({"PartitionedCall", "StatefulPartitionedCall"})
_SEED_TYPES = frozenset({"Const", "Fill", "ZerosLike", "OnesLike"})
# Ops whose gradient makes no op (or that have none): never owners of tape ops.
_NO_GRADIENT_TYPES = frozenset({
    "Placeholder", "PlaceholderWithDefault", "Const", "NoOp", "VarHandleOp", "VariableV2",
    "ReadVariableOp", "Identity", "IdentityN", "StopGradient", "PreventGradient",
    "Shape", "ShapeN", "Size", "Rank", "ZerosLike", "OnesLike", "VarIsInitializedOp",
    "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
})


def _tf_gradients_match(op_name, op_names):
    """``(root, owner)`` for a name in a ``tf.gradients`` scope, else None.

    ``tf.gradients`` names its ops ``[<scope>/]gradients[_<k>]/<forward op>_grad/...``
    (per forward op) or ``.../gradients[_<k>]/<op>`` (seed, aggregation).
    The owner is the first ``<prefix>_grad`` component under the root whose
    ``<prefix>`` names an existing op; None if there is none.
    """
    comps = op_name.split("/")
    for i in range(len(comps) - 1):
        if not _GRAD_ROOT.match(comps[i]):
            continue
        rest = comps[i + 1 :]
        root = "/".join(comps[: i + 1])
        for j in range(len(rest) - 1):
            match = _GRAD_SCOPE.match(rest[j])
            if match:
                candidate = "/".join(rest[:j] + [match.group(1)])
                if candidate != op_name and candidate in op_names:
                    return root, candidate
        return root, None
    return None


def forward_op_of(op_name, op_names):
    """The forward op a ``tf.gradients`` op differentiates, from names alone.

    ``gradients/conv1/Conv2D_grad/Conv2DBackpropFilter`` -> ``conv1/Conv2D``
    (also ``gradients_1/...`` and an enclosing name scope). The answer is
    always a member of ``op_names``.

    ``GradientTape`` ops (``gradient_tape/<forward name scope>/...``) name only
    the forward op's name scope, which several ops may share; their owners are
    found from data flow by `gradient_owners` / `map_gradients`, and this
    function returns None for them.

    Args:
        op_name: A TF op name.
        op_names: The names of the graph's ops (a set is fastest).

    Returns:
        The forward op name, or None.
    """
    if not isinstance(op_names, (set, frozenset, dict)):
        op_names = set(op_names)
    match = _tf_gradients_match(op_name, op_names)
    return None if match is None else match[1]


def gradient_owners(graph):
    """Classifies the ops of an IR graph lifted from TF (without changing it).

    Returns:
        A dict mapping every gradient op's name to its forward op's name or
        None; ops not in the dict are forward ops.
    """
    return _GradientMapper(graph).run()


def map_gradients(graph):
    """Sets ``backward``/``forward_op`` attrs on the gradient ops of ``graph``.

    Rules, in order:

    * ``tf.gradients``: ops under ``[<scope>/]gradients[_<k>]/`` (a root that
      holds a ``grad_ys_<n>`` seed or at least one ``<op>_grad`` scope) are
      gradient ops; the owner is the op named by the ``<op>_grad`` scope
      (`forward_op_of`), None for seeds and (until the last rule) ``AddN``
      aggregations.
    * ``GradientTape``: ops under ``gradient_tape/`` are gradient ops. TF names
      them ``gradient_tape/<name scope the forward op ran in>/...``, so the
      candidates are the forward ops named like a prefix of that path or lying
      directly in it (ops without gradient ops such as ``Identity`` or
      ``ReadVariableOp`` excluded). They are narrowed by the op type
      (``Conv2DBackpropFilter`` -> ``Conv2D``, ``ReluGrad`` -> ``Relu``), by
      the forward tensors the op reads (a gradient function sees only its op's
      inputs and outputs), by gradient flow from neighbouring gradient ops
      already mapped (same call, or an ancestor/descendant forward op with a
      matching tensor shape; a control edge or an ``AddN`` separates calls),
      and by contiguity (one call's ops are created one after the other). When
      evidence leaves several, the one whose name scope is the deepest prefix
      of the op's name wins. The owner is set only when one candidate is left;
      otherwise it is None (dead shape constants, ops at the boundary of two
      calls in the same scope).
    * Tape helpers outside that scope: a ``PartitionedCall`` of a
      ``__backward_*`` function (owner: the forward call whose outputs it
      reads), ``AddN`` over gradients, and seed constants (``ones``,
      ``zeros``) read only by gradient ops, are gradient ops.
    * A gradient op that its owner reads (the accumulators control flow v2
      adds as inputs of a forward ``While``) gets no owner: it runs before
      the forward op.
    * Plumbing left without an owner (``AddN`` aggregations, shape
      arithmetic from constants, dead ops) gets one where data flow or
      creation order is unambiguous: `_owners_from_readers`.

    Returns:
        The names of the gradient ops without owner, also stored in
        ``graph.attrs["unowned_backward_ops"]``.
    """
    owners = gradient_owners(graph)
    _disown_forward_feeders(graph, owners)
    _owners_from_readers(graph, owners)
    unowned = []
    for op in graph:
        if op.name in owners:
            owner = owners[op.name]
            op.attrs["backward"] = True
            op.attrs["forward_op"] = owner
            if owner is None:
                unowned.append(op.name)
    graph.attrs["unowned_backward_ops"] = unowned
    return unowned


def _disown_forward_feeders(graph, owners):
    """Gradient ops that their own forward op reads get no owner.

    Control flow v2 gradients add accumulators (``EmptyTensorList``) as
    extra inputs of the forward ``While``; they run before it, so a routine
    before the forward op cannot also be seen by them (that would be a
    cycle). Walks back from each owner's inputs through the gradient ops it
    owns.
    """
    by_name = {op.name: op for op in graph}
    for owner in set(o for o in owners.values() if o is not None):
        forward = by_name.get(owner)
        if forward is None:
            continue
        pending = [t.producer for t in forward.inputs if t.producer is not None]
        while pending:
            op = pending.pop()
            if owners.get(op.name) != owner:
                continue
            owners[op.name] = None
            pending.extend(t.producer for t in op.inputs if t.producer is not None)


def _inside_a_gradient_function(name):
    """Whether ``name`` lies in the scope of one gradient function.

    ``gradient_tape/<scope>/...`` or ``[...]gradients[_<k>]/.../<op>_grad/...``;
    seeds (``ones``, ``gradients/grad_ys_0``, ``gradients/Fill``) do not.
    """
    comps = name.split("/")
    if comps[0] == _TAPE_ROOT:
        return len(comps) > 2
    return any(_GRAD_ROOT.match(c) for c in comps) and any(_GRAD_SCOPE.match(c) for c in comps[:-1])


def _owners_from_readers(graph, owners):
    """Gives an owner to gradient plumbing the name and type rules left without.

    Two kinds of gradient op have a sound owner from their readers alone:

    * Shape arithmetic computed from constants only (``Const`` shapes TF
      folded, ``Maximum``, ``FloorDiv`` of them). It carries no gradient,
      so it is not a hand-off between two gradient functions: a gradient
      function sees only its op and the incoming gradients, so it is read
      by the function that built it. When all its readers are gradient ops
      of one forward op, that is its owner.
    * ``AddN`` summing the gradients of a forward tensor ``t`` read by
      several ops. Only the gradient function of ``t``'s producer receives
      the sum, and those of ops whose gradient passes ``t``'s through
      (``BiasAdd``, ``Identity``), which come before that producer in
      forward order. Its owner is the last of its readers' owners.

    A gradient op that reads another gradient function's result is not
    owned by this rule: its readers may be the next function's (the last op
    of one gradient function hands its result to the next one), so data
    flow alone cannot tell. Ops are visited readers first, so chains of
    constant arithmetic resolve in one sweep. Seeds (the gradient of the
    loss) and ops a forward op reads (`_disown_forward_feeders`) are never
    owned this way. Dead ops are left to `_owners_of_dead_ops`.
    """
    ops = list(graph)
    order = {op.name: i for i, op in enumerate(ops)}
    constant = set()  # gradient-scope ops computed from constants of gradient scopes only (not seeds)
    for op in ops:
        if (_inside_a_gradient_function(op.name) and not op.control_inputs
                and all(t.producer is not None and t.producer.name in constant for t in op.inputs)):
            constant.add(op.name)
    for op in reversed(ops):
        if not _unowned_plumbing(op, owners) or (op.type != "AddN" and op.name not in constant):
            continue
        readers = _readers(op)
        if not readers or any(r.name not in owners for r in readers):
            continue
        found = {owners[r.name] for r in readers}
        if None in found:
            continue
        if op.type == "AddN":
            owners[op.name] = max(found, key=order.get)
        elif len(found) == 1:
            owners[op.name] = found.pop()
    _owners_of_dead_ops(ops, owners)


def _readers(op):
    return list(op.users) + list(op.control_users)


def _unowned_plumbing(op, owners):
    if owners.get(op.name, 0) is not None:
        return False  # a forward op (absent), or owned already
    return op.type == "AddN" or _inside_a_gradient_function(op.name)


def _owners_of_dead_ops(ops, owners):
    """Dead gradient ops take the owner of the next owned op of their scope.

    A gradient function often builds shape arithmetic (``Shape`` folded to
    a ``Const``, ``Maximum``, ``FloorDiv``) and then uses its static value
    instead, leaving ops nothing reads. They have no data edge to go by;
    TF creates one gradient function's ops one after the other, and such
    shape work comes first in it, so a dead op belongs to the gradient
    function of the next op created in the same name scope that has an
    owner. Only ops inside a gradient function's scope are owned so.
    """
    live = set()
    dead = []
    for op in reversed(ops):
        readers = list(op.users) + list(op.control_users)
        if any(t.is_graph_output for t in op.outputs) or any(r.name in live for r in readers):
            live.add(op.name)
        elif op.name in owners and not _is_seed_or_forward(op, owners):
            dead.append(op)
        else:
            live.add(op.name)
    if not dead:
        return
    dead_names = {op.name for op in dead}
    following, preceding = {}, {}  # scope -> owner of the next / last owned op
    for op in ops:
        if op.name not in dead_names and owners.get(op.name) is not None:
            preceding[op.name.rpartition("/")[0]] = owners[op.name]
    for op in reversed(ops):
        scope = op.name.rpartition("/")[0]
        if op.name in dead_names:
            owner = None
            while owner is None and scope.count("/") >= 2:  # gradient_tape/<model>/<layer> at most
                owner = following.get(scope, preceding.get(scope))
                scope = scope.rpartition("/")[0]
            if owners[op.name] is None:
                owners[op.name] = owner
        elif owners.get(op.name) is not None:
            following[scope] = owners[op.name]


def _is_seed_or_forward(op, owners):
    return op.name not in owners or not (op.type == "AddN" or _inside_a_gradient_function(op.name))


class _GradientMapper:
    def __init__(self, graph):
        self.graph = graph
        self.ops = list(graph)
        self.by_name = {op.name: op for op in self.ops}
        self.owner = {}  # gradient op name -> owner name or None

    def run(self):
        self._tf_gradients()
        tape = [op for op in self.ops if op.name.split("/", 1)[0] == _TAPE_ROOT and op.name not in self.owner]
        for op in tape:
            self.owner[op.name] = None
        helpers = self._tape_helpers()
        if tape or helpers:
            self._tape_owners(tape, helpers)
        return {op.name: self.owner[op.name] for op in self.ops if op.name in self.owner}

    # -- tf.gradients -----------------------------------------------------------
    def _tf_gradients(self):
        names = self.by_name
        matches = {}
        valid_roots = set()
        for op in self.ops:
            match = _tf_gradients_match(op.name, names)
            if match is None:
                continue
            matches[op.name] = match
            root, owner = match
            if owner is not None or _GRAD_YS.match(op.name[len(root) + 1 :].split("/", 1)[0]):
                valid_roots.add(root)
        for name, (root, owner) in matches.items():
            if root in valid_roots:
                self.owner[name] = owner

    # -- GradientTape -----------------------------------------------------------
    def _is_backward(self, op):
        return op.name in self.owner

    def _tape_helpers(self):
        """Gradient ops a tape builds outside ``gradient_tape/``; returns {name: domain}."""
        helpers = {}
        # Calls of backward functions, and AddN aggregations, in graph order.
        for op in self.ops:
            if self._is_backward(op):
                continue
            if op.type in _CALL_TYPES and _is_backward_function(op.attrs.get("f")):
                readers = []
                for tensor in op.inputs:
                    producer = tensor.producer
                    if (producer is not None and not self._is_backward(producer)
                            and producer.type in _CALL_TYPES and producer.name not in readers):
                        readers.append(producer.name)
                self.owner[op.name] = None
                helpers[op.name] = set(readers)
            elif op.type == "AddN" and op.inputs and all(
                t.producer is not None and self._is_backward(t.producer) for t in op.inputs
            ):
                self.owner[op.name] = None
        # Seeds: constants whose readers are all gradient ops (reverse order so
        # that a Fill is classified before the Const feeding it).
        for op in reversed(self.ops):
            if self._is_backward(op) or op.type not in _SEED_TYPES:
                continue
            readers = list(op.users) + list(op.control_users)
            if readers and not any(t.is_graph_output for t in op.outputs) and all(
                self._is_backward(r) for r in readers
            ):
                self.owner[op.name] = None
        return helpers

    def _tape_owners(self, tape, helpers):
        forward = [op for op in self.ops if not self._is_backward(op)]
        self.forward_index = {op.name: i for i, op in enumerate(forward)}
        self.ancestors = _ancestor_bits(forward, self.forward_index)
        children = {}
        for op in forward:
            if op.type not in _NO_GRADIENT_TYPES:
                children.setdefault(op.name.rpartition("/")[0], []).append(op.name)
        domains = {}
        for op in tape:
            domains[op.name] = self._narrow(op, self._name_candidates(op.name, children))
        for name, readers in helpers.items():
            domains[name] = set(readers)
        for name, domain in domains.items():
            if len(domain) == 1:
                self.owner[name] = next(iter(domain))
        self._propagate(domains)

    def _name_candidates(self, name, children):
        """Forward ops whose name scope could be the one in ``name``."""
        comps = name.split("/")[1:]  # drop "gradient_tape"
        candidates = set()
        for k in range(len(comps)):  # strict prefixes, "" included
            prefix = "/".join(comps[:k])
            if prefix in self.forward_index and self.by_name[prefix].type not in _NO_GRADIENT_TYPES:
                candidates.add(prefix)
            candidates.update(children.get(prefix, ()))
        return candidates

    def _narrow(self, op, domain):
        evidence = False
        base = _grad_kernel_base(op.type)
        if base is not None:
            typed = {f for f in domain if _VERSION_SUFFIX.sub("", self.by_name[f].type) == base}
            if typed:
                domain, evidence = typed, True
        if len(domain) > 1:
            read = domain & self._touched_forward(op)
            if read:
                domain, evidence = read, True
        if len(domain) > 1 and evidence:
            return _deepest(op.name, domain)
        return domain

    def _touched_forward(self, op):
        """Forward ops having every forward tensor ``op`` reads as input or output.

        A gradient function sees only its op's inputs and outputs (and the
        incoming gradients); if no forward op fits all the tensors read (a
        custom gradient reading captured values), the ops fitting any of them.
        """
        every, some = None, set()
        for tensor in op.inputs:
            producer = tensor.producer
            if producer is None or producer.name not in self.forward_index:
                continue
            fits = {producer.name}
            fits.update(user.name for user, _ in tensor.uses if user.name in self.forward_index)
            every = fits if every is None else every & fits
            some |= fits
        return every if every else some

    # Gradient flow between gradient ops. A gradient op reading a gradient
    # tensor g made by an op of the call for F' is either in that same call
    # (owner F'), or in the call for an ancestor of F' that has an output shaped
    # like g (the gradient may pass unchanged through ops such as BiasAdd or
    # Identity that make no gradient ops). Across an AddN, or a control edge
    # (a gradient function waiting on its incoming gradient), the calls differ.

    def _is_ancestor(self, ancestor, op_name):
        return (self.ancestors[self.forward_index[op_name]] >> self.forward_index[ancestor]) & 1 == 1

    def _upstream_ok(self, candidate, owner, tensor, same_call):
        if same_call and candidate == owner:
            return True
        if not self._is_ancestor(candidate, owner):
            return False
        return tensor is None or _has_shape(self.by_name[candidate].outputs, tensor)

    def _downstream_ok(self, candidate, owner, tensor, same_call):
        if same_call and candidate == owner:
            return True
        if not self._is_ancestor(owner, candidate):
            return False
        return tensor is None or _has_shape(self.by_name[candidate].inputs, tensor)

    def _sources(self, op):
        """``(tensor or None, gradient op, same call possible)`` feeding ``op``."""
        for tensor in op.inputs:
            producer = tensor.producer
            if producer is None or producer.name not in self.owner:
                continue
            if producer.type == "AddN" and producer.name not in self.domains:
                for inner in producer.inputs:
                    if inner.producer is not None and inner.producer.name in self.owner:
                        yield tensor, inner.producer, False
            else:
                yield tensor, producer, True
        for control in op.control_inputs:
            # Gradient functions wait on their incoming gradients
            # (``with control_dependencies([grad])``): another call's op.
            if control.name in self.owner:
                yield _single_output(control), control, False

    def _sinks(self, op):
        """``(tensor or None, gradient op, same call possible)`` reading ``op``."""
        for tensor in op.outputs:
            for user, _ in tensor.uses:
                if user.name not in self.owner:
                    continue
                if user.type == "AddN" and user.name not in self.domains:
                    for inner in user.outputs:
                        for reader, _ in inner.uses:
                            if reader.name in self.owner:
                                yield tensor, reader, False
                else:
                    yield tensor, user, True
        for user in op.control_users:
            if user.name in self.owner:
                yield _single_output(op), user, False

    def _propagate(self, domains):
        self.domains = domains
        self.position = {op.name: i for i, op in enumerate(self.ops)}
        changed = True
        while changed:
            changed = False
            self._index_calls(domains)
            for name, domain in domains.items():
                if self.owner[name] is not None or len(domain) < 2:
                    continue
                narrowed = self._contiguous(name, self._flow_narrow(self.by_name[name], domain))
                if len(narrowed) == 1:
                    self.owner[name] = next(iter(narrowed))
                    domains[name] = narrowed
                    changed = True

    def _index_calls(self, domains):
        """Positions of the mapped gradient ops, overall and per owner."""
        self.resolved = sorted(self.position[n] for n in domains if self.owner[n] is not None)
        self.calls = {}
        for name in domains:
            owner = self.owner[name]
            if owner is not None:
                self.calls.setdefault(owner, []).append(self.position[name])
        for positions in self.calls.values():
            positions.sort()

    def _contiguous(self, name, domain):
        """Drops owners whose gradient call cannot contain op ``name``.

        A gradient function makes its ops one after the other, so the ops of
        one call are contiguous in creation order: an op cannot belong to F if
        the ops of another call lie between it and F's nearest mapped op.
        """
        if len(domain) < 2:
            return domain
        p = self.position[name]
        kept = set()
        for candidate in domain:
            positions = self.calls.get(candidate)
            if not positions:
                kept.add(candidate)
                continue
            k = bisect.bisect_left(positions, p)
            nearest = [positions[i] for i in (k - 1, k) if 0 <= i < len(positions)]
            q = min(nearest, key=lambda x: abs(x - p))
            lo, hi = min(p, q), max(p, q)
            between = bisect.bisect_left(self.resolved, hi) - bisect.bisect_right(self.resolved, lo)
            if between == 0:
                kept.add(candidate)
        return kept

    def _flow_narrow(self, op, domain):
        narrowed = set(domain)
        constrained = False
        for tensor, source, same_call in self._sources(op):
            owner = self.owner.get(source.name)
            if owner is not None and owner in self.forward_index:
                narrowed = {c for c in narrowed if self._upstream_ok(c, owner, tensor, same_call)}
                constrained = True
            elif (owner is None and source.type in _SEED_TYPES and tensor is not None and not source.inputs
                  and source.name not in self.domains):
                # A seed (ones/zeros shaped like the target) feeds the call of
                # the op producing the target.
                narrowed = {c for c in narrowed if _has_shape(self.by_name[c].outputs, tensor)}
                constrained = True
        for tensor, sink, same_call in self._sinks(op):
            owner = self.owner.get(sink.name)
            if owner is not None and owner in self.forward_index:
                narrowed = {c for c in narrowed if self._downstream_ok(c, owner, tensor, same_call)}
                constrained = True
        if not op.inputs:
            # No data inputs: a constant made inside a gradient function,
            # which belongs to the call of the gradient ops reading it.
            owners = {self.owner.get(u.name) for u in list(op.users) + list(op.control_users)}
            if len(owners) == 1 and None not in owners and owners <= domain:
                return owners
            return narrowed if len(narrowed) == 1 else domain
        if len(narrowed) > 1 and constrained:
            return _deepest(op.name, narrowed)
        return narrowed


def _deepest(name, candidates):
    """The candidates whose name scope is the longest prefix of ``name``.

    ``name`` is ``gradient_tape/<scope>/<rest>``; a candidate ``F`` fits a
    prefix ``P`` when ``F`` is named ``P`` (it opened that scope) or lies in it.
    Among the deepest fitting candidates one named ``P`` itself wins. Returns
    the candidates unchanged when that leaves more than one.
    """
    comps = name.split("/")[1:]
    for k in range(len(comps) - 1, -1, -1):
        prefix = "/".join(comps[:k])
        exact = [c for c in candidates if c == prefix]
        if exact:
            return set(exact)
        inside = [c for c in candidates if c.rpartition("/")[0] == prefix]
        if len(inside) == 1:
            return set(inside)
        if inside:
            return set(candidates)
    return set(candidates)


def _single_output(op):
    return op.outputs[0] if len(op.outputs) == 1 else None


def _ancestor_bits(ops, index):
    """Per op (by position), a bitset (int) of its data-flow ancestors among ``ops``."""
    bits = [0] * len(ops)
    for i, op in enumerate(ops):
        value = 0
        for tensor in op.inputs:
            producer = tensor.producer
            if producer is not None:
                j = index.get(producer.name)
                if j is not None and j < i:
                    value |= bits[j] | (1 << j)
        bits[i] = value
    return bits


def _has_shape(tensors, like):
    """Whether one of ``tensors`` has a shape compatible with ``like``'s."""
    target = like.attrs.get("shape")
    for tensor in tensors:
        shape = tensor.attrs.get("shape")
        if target is None or shape is None:
            return True
        if len(shape) == len(target) and all(a is None or b is None or a == b for a, b in zip(shape, target)):
            return True
    return False


def _grad_kernel_base(op_type):
    match = _GRAD_KERNEL.match(op_type)
    if match is None:
        return None
    return _VERSION_SUFFIX.sub("", match.group(1))


def _is_backward_function(value):
    if isinstance(value, Graph):
        name = value.name
    elif isinstance(value, dict):
        name = value.get("function", "")
    else:
        return False
    return "__backward_" in name
