"""TensorFlow graph mode: function bodies of call ops (``While``, ``If``,
``Case``, ``PartitionedCall``): which calls are instrumented op by op, the
functions they run, a body rebuilt as a graph of its own (`_prefixed_body`,
`_Library`), `evaluate` inside one (`_BodyProbe`) and a gradient body's
ops marked as backward ops for the pipeline (`_gradient_body`). `_BodyRewrite` is in
``tensorflow_rewrite`` (it and `_GraphRewrite` build each other).
"""

from __future__ import annotations

import itertools
import warnings

import tensorflow as tf

from amanda.errors import BackendError, NotInstrumentedWarning
from amanda.ir import Graph
from amanda.passes.lower_actions import ROUTINE
from amanda.runtime.tensorflow.probes import _BodiesBackend


# Ops of a function body that are its plumbing, not computation.
_BODY_PLUMBING = frozenset({"Placeholder", "Const", "Identity", "IdentityN", "NoOp"})


def _ops_in_bodies(ir_graph):
    """The call ops of ``ir_graph`` (``While``, ``If``, ``PartitionedCall``...)
    whose function bodies compute something, each with the number of
    computing ops in its bodies (nested bodies included)."""
    def count(graph):
        total = 0
        for op in graph.ops:
            total += op.type not in _BODY_PLUMBING
            total += sum(count(v) for v in op.attrs.values() if isinstance(v, Graph))
        return total
    found = []
    for op in ir_graph.ops:
        if op.type in _BODY_ATTRS:
            continue   # instrumented op by op (`_BodyRewrite`)
        bodies = [v for v in op.attrs.values() if isinstance(v, Graph)]
        if bodies:
            n = sum(count(body) for body in bodies)
            if n:
                found.append((op, n))
    return found


# Call ops whose function bodies are instrumented op by op: the attributes
# naming the functions they run (a list for Case), and the stateful twin a
# call becomes once its body holds a routine (a callback is stateful).
_BODY_ATTRS = {
    "While": ("cond", "body"), "StatelessWhile": ("cond", "body"),
    "If": ("then_branch", "else_branch"), "StatelessIf": ("then_branch", "else_branch"),
    "Case": ("branches",), "StatelessCase": ("branches",),
    "PartitionedCall": ("f",), "StatefulPartitionedCall": ("f",),
}
_STATEFUL_TWIN = {"StatelessWhile": "While", "StatelessIf": "If", "StatelessCase": "Case",
                  "PartitionedCall": "StatefulPartitionedCall"}
_body_names = itertools.count()


def _called_functions(node):
    """``(label, NameAttrList)`` per function a call NodeDef runs; the
    label is the attribute, ``"branches/<i>"`` for Case's list (TF op names
    cannot hold ONNX's ``[i]``)."""
    for attr in _BODY_ATTRS.get(node.op, ()):
        if attr not in node.attr:
            continue
        value = node.attr[attr]
        if value.HasField("func"):
            yield attr, value.func
        elif value.HasField("list"):
            for index, func in enumerate(value.list.func):
                yield f"{attr}/{index}", func


class _BodyProbe:
    """`evaluate` inside a body: its values exist once per execution of the
    body (each iteration, or never), so there is none to compute."""

    def __init__(self, outer, prefix):
        self.outer = outer
        self.prefix = prefix

    def session(self):
        return None if self.outer is None else self.outer.session()

    def evaluate(self, tensors):
        raise BackendError(f"evaluate: tensors of the function body {self.prefix!r} have a value "
                           "per execution of the body (each loop iteration, or none), not one "
                           "per run; read them in an instrumentation routine instead")


def _gradient_body(ir_graph, user_graph, gradient_of):
    """Prepare a gradient function's body for the pipeline: ``(backend,
    forward ops)``.

    Every op of the body is a backward op; one named after a forward body
    op's gradient scope (``gradients/mul_grad/Mul``) gets that op as its
    forward op (its context starts from that op's context, as at top level).
    The forward ops live in the plans of the forward bodies
    (``gradient_of``, their `_BodyRewrite` objects), handed to the pipeline as
    ``forward``; contexts look each op up in the graph that holds it.
    """
    from amanda.frontends.tensorflow import forward_op_of
    prefix = user_graph.name + "/"
    forward, names, graphs = {}, {}, [user_graph]
    for body in gradient_of:
        forward.update(body.rewrite.plan.ops)
        names.update(body.forward_names())
        graphs.append(body.user)
    for op in ir_graph.ops:
        local = op.name[len(prefix):] if op.name.startswith(prefix) else op.name
        owner = forward_op_of(local, names) if names else None
        op.attrs["backward"] = True
        op.attrs["forward_op"] = names[owner] if owner is not None else None
    return _BodiesBackend(graphs), forward


class _Library:
    """A FunctionDefLibrary, and a graph holding its functions (built once,
    on first need: rebuilding a body resolves the calls in it there)."""

    def __init__(self, proto):
        self.proto = proto
        self._graph = None

    def graph(self):
        if self._graph is None:
            self._graph = tf.Graph()
            holder = tf.compat.v1.GraphDef()
            holder.library.CopyFrom(self.proto)
            with self._graph.as_default():
                tf.import_graph_def(holder, name="")
        return self._graph


def _prefixed_body(prefix, fdef, library):
    """The body of ``fdef`` (a function of the `_Library` ``library``) as a
    FuncGraph whose ops are named ``"<prefix>/<node>"``, with its input
    placeholders' and output tensors' names."""
    from tensorflow.python.framework.func_graph import FuncGraph
    from tensorflow.python.framework.function_def_to_graph import function_def_to_graph
    with library.graph().as_default():
        plain = function_def_to_graph(fdef)
    graph_def = plain.as_graph_def()
    graph_def.library.CopyFrom(library.proto)
    _drop_outer_colocation(graph_def)
    user = FuncGraph(prefix)
    with user.as_default():
        tf.import_graph_def(graph_def, name=prefix)
    inputs = [f"{prefix}/{t.name}" for t in plain.inputs]
    outputs = [f"{prefix}/{t.name}" for t in plain.outputs]
    user.inputs = [user.get_tensor_by_name(name) for name in inputs]
    user.outputs = [user.get_tensor_by_name(name) for name in outputs]
    return user, inputs, outputs


def _drop_outer_colocation(graph_def):
    """Remove colocation constraints (``_class: loc:@op``) naming ops outside
    the body (a gradient body's nodes name the forward call op): importing
    the body on its own would fail on them."""
    names = {node.name for node in graph_def.node}
    for node in graph_def.node:
        if "_class" not in node.attr:
            continue
        kept = [c for c in node.attr["_class"].list.s
                if not c.startswith(b"loc:@") or c[5:].decode() in names]
        if kept:
            del node.attr["_class"].list.s[:]
            node.attr["_class"].list.s.extend(kept)
        else:
            del node.attr["_class"]


def _xla_compiled(node, fdef):
    """Whether TF compiles the call with XLA (``jit_compile=True``): the call
    op or its function carries ``_XlaMustCompile``."""
    for attrs in (node.attr, fdef.attr):
        value = attrs.get("_XlaMustCompile")
        if value is not None and value.b:
            return True
    return False


def _warn_xla_compiled(compiled):
    """Say, once per rewrite, which ``(call op, function)`` bodies XLA
    compiles and so were left as they are."""
    if not compiled:
        return
    from amanda.runtime.tensorflow.hosting import _user_stacklevel
    listed = ", ".join(f"{call!r} ({func})" for call, func in compiled[:3])
    more = f" and {len(compiled) - 3} more" if len(compiled) > 3 else ""
    warnings.warn(
        f"amanda (TensorFlow): the ops of {len(compiled)} function bodies that XLA compiles "
        "(jit_compile=True, e.g. Keras' depthwise convolutions) are not instrumented one by "
        "one, as a Python routine cannot run inside an XLA cluster; their call ops are "
        f"points: {listed}{more}. See docs/tensorflow.md, Limits.",
        NotInstrumentedWarning, stacklevel=_user_stacklevel())


def _origin(ir_tensor):
    """Name of the user tensor behind a chain of routine ops (in a graph
    or a body)."""
    while ir_tensor.producer is not None and ir_tensor.producer.type == ROUTINE:
        ir_tensor = ir_tensor.producer.inputs[ir_tensor.index]
    if ir_tensor.producer is None:   # a loop's back edge (NextIteration -> Merge)
        return ir_tensor.attrs.get("back_edge") or ir_tensor.name
    return f"{ir_tensor.producer.name}:{ir_tensor.index}"
