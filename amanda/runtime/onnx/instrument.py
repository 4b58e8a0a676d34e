"""Instrumenting an ONNX model: lift it, run the tools' analysis routines
over it (and over its bodies), lower the recorded actions.

Analysis contexts see the user's model (`OnnxGraphBackend`); analysis
routines may read tensor values with `evaluate` (initializers directly,
other tensors by running the part of the original model they depend on,
with `example_feeds`). `instrument_model` (``amanda.instrument``) and
`export` are the graph-level ways in; the session driver
(:mod:`amanda.runtime.onnx.session`) calls `_instrument` too.
"""

from __future__ import annotations

import os
import threading

import onnx
import onnxruntime as ort
from onnx import helper

from amanda import controls
from amanda.context import Deferred
from amanda.errors import BackendError
from amanda.frontends.onnx import lift, load_model
from amanda.frontends.onnx.weightless import weightless_copy
from amanda.passes.instrumentation import GraphBackend
from amanda.passes.manager import PassResult
from amanda.passes.pipeline import instrument_graph
from amanda.runtime import probe as _probe
from amanda.runtime import swapped
from amanda.runtime.onnx.bodies import _analyse_bodies, _bodies, _lower_bodies
from amanda.runtime.onnx.host import _original_init
from amanda.runtime.onnx.lowering import MAX_IR_VERSION, _Lowering, lower
from amanda.runtime.onnx.portable import elem_type
from amanda.runtime.onnx.routine_nodes import observes_only
from amanda.runtime.onnx.sites import SitedGraph


class OnnxGraphBackend(GraphBackend):
    """Contexts see the user's model: ``get_op()`` is its ``onnx.NodeProto``,
    ``get_inputs()`` ``onnx.ValueInfoProto`` symbols (None for absent
    optional values)."""

    def __init__(self, ir_graph, nodes):
        super().__init__(ir_graph.namespace)
        self.nodes = nodes
        self._symbols = {}

    def raw_op(self, ir_op):
        return self.nodes.get(ir_op.name)

    def values(self, ir_tensors):
        # made when a routine asks: most tools never read them
        return Deferred(lambda: [self._symbol(t) for t in ir_tensors])

    def _symbol(self, tensor):
        if tensor.attrs.get("absent"):
            return None
        symbol = self._symbols.get(tensor)
        if symbol is None:
            symbol = onnx.ValueInfoProto(name=tensor.name)
            onnx_type = tensor.attrs.get("onnx_type")
            if onnx_type is not None:
                symbol.type.CopyFrom(onnx_type.message)
            self._symbols[tensor] = symbol
        return symbol


# -- values for analysis routines (the probe: amanda.runtime.probe) -----------------

_BACKEND = "onnx"
_analysis = threading.local()   # .feeds: example_feeds


def example_feeds(feeds):
    """Inputs that `evaluate` may run the model on while tools analyse it.

    Analysis happens when the session is created (or the model instrumented),
    before any ``run``: values that depend on graph inputs need example feeds.

    Args:
        feeds: ``{graph input name: array}``.
    """
    return swapped(_analysis, "feeds", dict(feeds))


def evaluate(values):
    """Values of tensors of the model being instrumented, as NumPy arrays.

    Call it from an analysis routine: ``evaluate(context.get_inputs()[1])``.
    Initializers are read directly; other tensors are computed by running
    the part of the *original* model they depend on in onnxruntime, which
    needs :func:`example_feeds` when they depend on graph inputs.

    Args:
        values: an ``onnx.ValueInfoProto`` from ``get_inputs()`` /
            ``get_outputs()`` (or a tensor name), or a list of them.

    Returns:
        One array, or a list of arrays for a list.

    Raises:
        BackendError: called outside analysis, or the tensor needs graph
            inputs that no :func:`example_feeds` gave.
    """
    return _probe.evaluate(_BACKEND, values, "amanda.runtime.onnx.evaluate() works only while "
                           "analysis routines run on an ONNX model", _name)


def _name(value):
    return value if isinstance(value, str) else value.name


class _Probe:
    """`evaluate` for one model: initializers directly, other tensors by
    running the nodes they depend on."""

    def __init__(self, model, ir_graph, nodes):
        self.model = model
        self.graph = ir_graph
        self.nodes = nodes
        self.tensors = {t.name: t for t in ir_graph.inputs}
        for op in ir_graph:
            self.tensors.update((t.name, t) for t in op.outputs)
        self.in_bodies = {}   # name -> (tensor, holding op) of values defined in bodies
        self._bodies(ir_graph, None)

    def _bodies(self, graph, holder):
        for op in graph.ops:
            if holder is not None:
                for tensor in op.outputs:
                    self.in_bodies.setdefault(tensor.name, (tensor, holder))
            for _, body in _bodies(op):
                for tensor in body.inputs:
                    if tensor.attrs.get("captured") is None:
                        self.in_bodies.setdefault(tensor.name, (tensor, holder or op))
                self._bodies(body, holder or op)

    def evaluate(self, names):
        values, pending = {}, []
        for name in names:
            tensor = self.tensors.get(name)
            if tensor is None and name in self.in_bodies:
                tensor, holder = self.in_bodies[name]
                if tensor.attrs.get("initializer") is None:
                    # a body runs any number of times per run (or not at all)
                    raise BackendError(f"evaluate: {name!r} is computed inside a body of "
                                       f"{holder.type} {holder.name!r}, which has no single "
                                       "value per run; evaluate() computes values of the "
                                       "top-level graph and initializers (routines receive "
                                       "body values on each execution)")
            if tensor is None:
                raise BackendError(f"evaluate: the model has no tensor named {name!r}")
            initializer = tensor.attrs.get("initializer")
            if initializer is not None:
                values[name] = initializer.to_numpy()
            else:
                pending.append(name)
        if pending:
            values.update(zip(pending, self._run(pending)))
        return [values[name] for name in names]

    def _run(self, names):
        ops, inputs = self._ancestors([self.tensors[n] for n in names])
        feeds = getattr(_analysis, "feeds", None) or {}
        needed = [t for t in inputs if t.attrs.get("initializer") is None]
        missing = [t.name for t in needed if t.name not in feeds]
        if missing:
            raise BackendError(f"evaluate: {', '.join(map(repr, names))} depends on graph "
                               f"input(s) {', '.join(map(repr, missing))}; give example inputs "
                               "with amanda.runtime.onnx.example_feeds({...}) around the "
                               "session creation or amanda.instrument call")
        graph = helper.make_graph(
            [self.nodes[op.name] for op in ops], "amanda_evaluate",
            [_value_info(t.name, t) for t in needed], [onnx.ValueInfoProto(name=n) for n in names],
            [_named_initializer(t) for t in inputs if t.attrs.get("initializer") is not None])
        model = helper.make_model(graph, opset_imports=self.model.opset_import,
                                  functions=self.model.functions)
        model.ir_version = min(max(self.model.ir_version, 4), MAX_IR_VERSION)
        session = ort.InferenceSession(model.SerializeToString(),
                                       providers=["CPUExecutionProvider"])
        return session.run(names, {t.name: feeds[t.name] for t in needed})

    def _ancestors(self, tensors):
        ops, inputs, seen = set(), set(), set()
        stack = list(tensors)
        while stack:
            tensor = stack.pop()
            if tensor in seen:
                continue
            seen.add(tensor)
            producer = tensor.producer
            if producer is None:
                if not tensor.attrs.get("absent"):
                    inputs.add(tensor)
            elif producer not in ops:
                ops.add(producer)
                stack.extend(producer.inputs)
        order = [op for op in self.graph.ops if op in ops]
        return order, [t for t in self.graph.inputs if t in inputs]


def _probing(probe):
    return _probe.probing(_BACKEND, probe)


class _Observing:
    """What `_instrument` gives instead of a written model when every routine
    only observes and the caller attaches them to onnxruntime's optimised
    model itself (`_SideBranches`): the lowered IR graph, and the facts a
    written `_Lowering` would report."""

    side_only = True
    uses_callbacks = True
    inline = False

    def __init__(self, top):
        self.top = top


def _instrument(model, session, callbacks, apart=False):
    """(lowered ModelProto or None, its `_Lowering`); ``(None, None)`` when
    nothing was recorded. ``apart``: when every routine only observes
    (`observes_only`), write no model and return ``(None, _Observing)``;
    a session attaches them to onnxruntime's optimised model instead."""
    nodes = {}
    ir_graph = lift(model, nodes=nodes)
    _complete_types(model, ir_graph)
    bodies = {}
    backend = OnnxGraphBackend(ir_graph, nodes)

    def analyse_bodies(graph):
        _analyse_bodies(graph, session, backend, bodies)
        return PassResult(graph, False)

    analyse_bodies.name = "onnx_bodies"
    sited = []

    def lower_when(plan, graph):
        # every routine only looks and none is in a body: the session reads
        # the plan at its sites (`SitedGraph`), no routine op is made
        if apart and callbacks and plan and not any(bodies.values()):
            view = SitedGraph(graph, plan)
            if observes_only(view, bodies=False):
                sited.append(view)
                return False
        return True

    # the lifted graph is this call's own (the probe reads it only during the
    # analysis), so lowering may add the routine ops to it rather than a copy
    with _probing(_Probe(model, ir_graph, nodes)):   # evaluate() runs onnxruntime sessions
        plan, lowered = instrument_graph(ir_graph, session, backend, extras=[analyse_bodies],
                                         name="onnx", lower_in_place=True,
                                         lower_when=lower_when)
    if sited:
        return None, _Observing(sited[0])
    if not plan and not any(bodies.values()):
        return None, None
    _lower_bodies(lowered, bodies)
    if apart and callbacks and observes_only(lowered, bodies=bool(bodies)):
        return None, _Observing(lowered)
    lowering = _Lowering(lowered, callbacks)
    return lowering.model(), lowering


def _complete_types(model, ir_graph):
    """Element types onnx's shape inference left unknown, from onnxruntime.

    A routine is handed only tensors of known hostable types; onnx does not
    infer some outputs (e.g. the mask of an opset-9 ``Dropout``) that
    onnxruntime types when it resolves the graph. Asking it costs a session
    creation without optimisation and without a run, and only happens when
    such tensors exist. Shapes are left unknown: onnxruntime reports an
    unknown shape as ``[]``.
    """
    unknown = {t.name: t for op in ir_graph for t in op.outputs
               if t.attrs.get("dtype") is None and not t.attrs.get("absent")}
    if not unknown:
        return
    # large weights as inputs of the same type: no element type depends on
    # their values, and they are not copied
    probe = weightless_copy(model)[0]
    declared = {o.name for o in probe.graph.output}
    probe.graph.output.extend(onnx.ValueInfoProto(name=n) for n in unknown if n not in declared)
    probe.ir_version = min(probe.ir_version, MAX_IR_VERSION)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession.__new__(ort.InferenceSession)
    try:
        _original_init(session, probe.SerializeToString(), options, ["CPUExecutionProvider"])
    except Exception:   # noqa: BLE001 - custom ops, huge models: types stay unknown
        return
    for output in session.get_outputs():
        tensor = unknown.get(output.name)
        kind = output.type or ""
        if tensor is not None and kind.startswith("tensor(") and kind.endswith(")"):
            dtype = _ORT_ELEMENT_TYPES.get(kind[7:-1])
            if dtype is not None:
                tensor.attrs["dtype"] = dtype


#: onnxruntime's element type names (``tensor(<name>)``) -> NumPy dtype names.
_ORT_ELEMENT_TYPES = {"float": "float32", "double": "float64", "float16": "float16",
                      "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64",
                      "uint8": "uint8", "uint16": "uint16", "uint32": "uint32",
                      "uint64": "uint64", "bool": "bool"}


def instrument_model(model, session):
    """``amanda.instrument`` for an ``onnx.ModelProto``: an instrumented copy.

    Python routines become custom ops hosted by this process: run the result
    with :func:`inference_session`. The input model is not modified.
    """
    model = load_model(model)
    lowered, _ = _instrument(model, session, callbacks=True)
    if lowered is None:
        lowered = lower(lift(model))
    return lowered


def export(model, *tools, path=None):
    """An instrumented copy of ``model`` that runs in any ONNX runtime.

    Every routine must be portable (``amanda.portable.routine``) and
    expressible in the model's opset; Python callbacks cannot travel with a
    file.

    Args:
        model: an ``onnx.ModelProto``, its bytes or a path.
        *tools: the tools to apply.
        path: where to save the result too (optional).

    Returns:
        The instrumented ``onnx.ModelProto``.

    Raises:
        BackendError: a routine cannot be lowered natively; the message names
            the routine, its tool and op, and why.
    """
    from amanda.tool import session_for
    model = load_model(model)
    session = session_for(tools)
    with controls.muted():   # all of it is amanda's own work, tracing routines included
        lowered, _ = _instrument(model, session, callbacks=False)
    if lowered is None:
        lowered = lower(lift(model))
    if path is not None:
        onnx.save(lowered, os.fspath(path))
    return lowered


def _value_info(name, tensor):
    info = onnx.ValueInfoProto(name=name)
    onnx_type = tensor.attrs.get("onnx_type")
    if onnx_type is not None:
        info.type.CopyFrom(onnx_type.message)
    elif tensor.attrs.get("dtype") is not None:
        info.type.CopyFrom(helper.make_tensor_type_proto(elem_type(tensor.attrs["dtype"]),
                                                         tensor.attrs.get("shape")))
    return info


def _named_initializer(tensor):
    copy = onnx.TensorProto()
    copy.CopyFrom(tensor.attrs["initializer"].message)
    copy.name = tensor.name
    return copy
