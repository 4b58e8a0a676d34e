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
import heapq

from amanda.frontends.tensorflow.gradients import forward_op_of, gradient_owners, map_gradients
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


def lift_graph(graph_or_graphdef, namespace=None, scope=None):
    """Lifts a TF graph into an amanda IR graph.

    Args:
        graph_or_graphdef: A ``tf.Graph`` (including a ``FuncGraph``), a
            ``GraphDef`` (or its serialized bytes), or a ``ConcreteFunction``
            (anything with a ``.graph`` that is a ``tf.Graph``).
        namespace: The ops' namespace; ``"tensorflow/<version>/graph"`` if None.
        scope: The name scope a function body's ops were imported under
            (``<scope>/<node>``): gradient ops are mapped by the names they
            have in the function (see `map_gradients`).

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
    graph = _build(name, namespace, records, outputs, library, scope)
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


def _build(name, namespace, records, outputs, library, scope=None):
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
    map_gradients(graph, scope)
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
