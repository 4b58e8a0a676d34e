"""Numeric diff of a TensorFlow graph and its ONNX conversion, op by op.

:func:`diff_tf_onnx` runs a ``tf.compat.v1`` session graph and its
``tf2onnx`` conversion (:func:`tf_to_onnx`) and matches every TF op on the
path from the feeds to the fetches with the ONNX node writing a tensor of
its name; see :mod:`amanda.tools.diff`, which re-exports these names.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import amanda
from amanda.errors import ToolError
from amanda.runtime import vocabulary
from amanda.runtime.tool_support import for_value, provider
from amanda.tools import mapping_tables
from amanda.tools.diff_values import _ORT_IR_VERSION, _errors, onnx_tensor_values

__all__ = ["OpDiffReport", "OpDivergence", "OpMatch", "OpOutputRecorder", "diff_tf_onnx",
           "tf_to_onnx"]


@dataclasses.dataclass
class OpMatch:
    """A TF tensor compared with the ONNX tensor of the same name.

    Attributes:
        tensor: the tensor's name (``conv/BiasAdd:0``), the same in both graphs.
        tf_op, tf_type: the TF op writing it and its type.
        onnx_node, onnx_type: the ONNX node writing it and its op type.
        same_op: whether the two ops are the same canonical op (mapping
            tables) or the same type name; False where the converter fused
            ops (a ``Conv`` writing a ``BiasAdd``'s output).
        covered: TF ops this comparison stands for, in execution order: the
            ops without an ONNX tensor of their own that feed ``tf_op`` (up to
            the previous compared tensors), then ``tf_op``.
        onnx_covered: ONNX nodes with no TF tensor feeding ``onnx_node``
            (inserted transposes, renamed fused nodes), then ``onnx_node``.
        layout: ``"same"``, ``"NHWC->NCHW"`` where the TF value was
            transposed to the ONNX node's layout to compare, or ``"squeezed"``
            where the shapes differ by size-1 axes only.
        onnx_tensor: the ONNX tensor compared (``tensor`` unless matched by
            inputs).
        matched_by: ``"name"`` (the ONNX tensor has the TF tensor's name) or
            ``"inputs"`` (the data input of a matched pair of the same op:
            a fused node the converter renamed, ``Conv__18``).
        max_abs_error: largest absolute difference (in ``layout``).
        scale: largest magnitude of the TF value (the tolerance's scale).
    """

    tensor: str
    tf_op: str
    tf_type: str
    onnx_node: str
    onnx_type: str
    same_op: bool
    covered: list
    onnx_covered: list
    layout: str = "same"
    onnx_tensor: str = ""
    matched_by: str = "name"
    max_abs_error: float = 0.0
    scale: float = 0.0


@dataclasses.dataclass
class OpDivergence:
    """Where a TF graph and its ONNX conversion first disagree.

    Attributes:
        tf_op, tf_type: the TF op named as the culprit: the op whose output
            was compared, or, when the ONNX node fused several TF ops, the one
            of them that is the same canonical op as the ONNX node (the
            ``Conv2D`` of a ``Conv`` writing ``BiasAdd:0``).
        onnx_node, onnx_type: the ONNX node writing the compared tensor.
        tensor: the compared tensor's name.
        covered, onnx_covered: as in :class:`OpMatch`: the culprit is among
            these ops (everything before them agreed).
        layout: how the TF value was laid out to compare.
        max_abs_error, max_rel_error: largest absolute difference and largest
            difference relative to the TF value.
        shape: the compared tensor's shape (ONNX layout).
        onnx_tensor, matched_by: as in :class:`OpMatch`.
    """

    tf_op: str
    tf_type: str
    onnx_node: str
    onnx_type: str
    tensor: str
    covered: list
    onnx_covered: list
    layout: str
    max_abs_error: float
    max_rel_error: float
    shape: tuple
    onnx_tensor: str = ""
    matched_by: str = "name"

    def describe(self):
        text = (f"first divergence at TF op {self.tf_op!r} ({self.tf_type}) vs ONNX node "
                f"{self.onnx_node!r} ({self.onnx_type}), tensor {self.tensor!r}: max |Δ| = "
                f"{self.max_abs_error:.3g} (relative {self.max_rel_error:.3g}), shape "
                f"{list(self.shape)}")
        if self.layout != "same":
            text += f", TF value {self.layout}"
        others = [op for op in self.covered if op != self.tf_op]
        if others:
            text += f"; the comparison also covers TF ops {others}"
        return text


@dataclasses.dataclass
class OpDiffReport:
    """What :func:`diff_tf_onnx` found.

    Attributes:
        first: the first :class:`OpDivergence` in execution order, or None
            when every compared tensor agrees.
        compared: the :class:`OpMatch` of every compared tensor, in TF
            execution order.
        unmatched: TF ops between the feeds and the fetches with no ONNX
            tensor of their name (fused into a later node, folded away or
            renamed by the converter); each is covered by the comparison of
            the next matched op it feeds, if any.
        incomparable: ``(tensor, TF shape, ONNX shape)`` of same-named tensors
            whose shapes differ in every layout (not compared).
        onnx_only: ONNX nodes writing no tensor named like a TF tensor nor
            matched through inputs (transposes inserted for NHWC/NCHW).
        output_error: largest absolute difference of the fetched outputs.
    """

    first: OpDivergence | None
    compared: list
    unmatched: list
    incomparable: list
    onnx_only: list
    output_error: float

    def describe(self):
        head = self.first.describe() if self.first else "no divergence"
        fused = sum(not m.same_op for m in self.compared)
        return (f"{head}; {len(self.compared)} TF ops compared ({fused} written by another op "
                f"type: fused or rewritten by the converter), "
                f"{len(self.unmatched)} without an ONNX tensor, {len(self.onnx_only)} ONNX-only "
                f"nodes; final outputs differ by at most {self.output_error:.3g}")


class OpOutputRecorder(amanda.Tool):
    """Records the outputs of selected ops, as NumPy copies.

    Backend-neutral (TF graph mode routines receive NumPy arrays, PyTorch
    routines tensors). ``values`` maps ``"<op id>:<position>"`` (the TF tensor
    name in TensorFlow) to the value of the op's latest execution; outputs
    that are not numeric (TF resource handles) are skipped.

    Args:
        ops: op ids to record (TF op names); None records every op.
    """

    def __init__(self, ops=None):
        super().__init__()
        self.ops = None if ops is None else set(ops)
        self.values = {}
        self.add_inst_for_op(self._analysis)

    def _analysis(self, context):
        op_id = context.get_op_id()
        if self.ops is None or op_id in self.ops:
            context.insert_after_op(self._record, op_id=op_id)

    def _record(self, *outputs, op_id):
        for position, value in enumerate(outputs):
            array = _numeric_copy(value)
            if array is not None:
                self.values[f"{op_id}:{position}"] = array


def _numeric_copy(value):
    if value is None:
        return None
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    array = np.asarray(value)
    return array.copy() if array.dtype.kind in "biufc" else None


def tf_to_onnx(session, inputs, outputs, opset=17):
    """Convert a ``tf.compat.v1`` graph to ONNX with ``tf2onnx``.

    The session's variables are frozen into constants
    (``convert_variables_to_constants``, which reads them without adding ops
    to the graph), and the frozen ``GraphDef`` is converted; ONNX tensors
    keep the TF tensor names (``x:0``).

    Args:
        session: a ``tf.compat.v1.Session`` with initialised variables.
        inputs: the input tensors (placeholders) or their names.
        outputs: the output tensors or their names.
        opset: the ONNX opset.

    Returns:
        An ``onnx.ModelProto`` (IR version at most 10, for onnxruntime).

    Raises:
        ToolError: tf2onnx is missing or fails on the graph.
    """
    tf_support = for_value(session)     # the session's backend freezes and converts
    try:
        convert = tf_support.tf2onnx_converter()
    except ImportError:
        raise ToolError("diff: tf_to_onnx needs tf2onnx "
                        "(pip install 'amanda-instrument[onnx]')") from None
    graph = session.graph
    inputs = [_tf_tensor(graph, t, "tf_to_onnx").name for t in _as_list(inputs)]
    outputs = [_tf_tensor(graph, t, "tf_to_onnx").name for t in _as_list(outputs)]
    frozen = tf_support.frozen_graph_def(session, outputs)
    try:
        model = convert(frozen, inputs, outputs, opset)
    except Exception as error:   # tf2onnx raises exceptions of many kinds
        raise ToolError(f"diff: tf2onnx could not convert the graph ({type(error).__name__}: "
                        f"{error})") from error
    model.ir_version = min(model.ir_version, _ORT_IR_VERSION)
    return model


def _as_list(value):
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _tf_tensor(graph, tensor, routine):
    if isinstance(tensor, str):
        try:
            return graph.get_tensor_by_name(tensor if ":" in tensor else tensor + ":0")
        except (KeyError, ValueError):
            raise ToolError(f"diff: {routine}: the graph has no tensor {tensor!r}") from None
    if getattr(tensor, "graph", None) is not graph:
        raise ToolError(f"diff: {routine}: {tensor!r} is not a tensor of the session's graph")
    return tensor


def _data_path(graph, feeds, fetches):
    """The ops on a path from a fed tensor to a fetched one (feeds excluded),
    in graph order (creation order: every op after its inputs)."""
    fed_ops = {t.op for t in feeds}
    needed, stack = set(), [t.op for t in fetches]
    while stack:   # everything the fetches read, stopping at fed ops
        op = stack.pop()
        if op in needed:
            continue
        needed.add(op)
        if op not in fed_ops:
            stack.extend(t.op for t in op.inputs)
    downstream = set(fed_ops)
    path = []
    for op in graph.get_operations():
        if op in needed and op not in fed_ops and any(t.op in downstream for t in op.inputs):
            downstream.add(op)
            path.append(op)
    return path


def _same_op(tf_type, onnx_type, backends):
    """Whether a TF op type and an ONNX op type are the same op: a common
    canonical type in the backends' vocabularies, else the same type name.
    ``backends``: the names of the two backends (of the session and the model)."""
    tf_canonical = vocabulary.canonical_types(backends[0], tf_type)
    onnx_canonical = vocabulary.canonical_types(backends[1], onnx_type)
    if tf_canonical and onnx_canonical:
        return bool(tf_canonical & onnx_canonical)
    return tf_type.lower() == onnx_type.lower()


def _onnx_layout(onnx_type, backend):
    spec = vocabulary.lookup(backend, onnx_type)
    return spec.layout("input") if spec is not None else None


def _layouts(tf_value, onnx_value, onnx_type, backend):
    """The ways to lay the TF value out like the ONNX one, preferred first:
    ``[(name, array)]``, empty when no layout gives the ONNX shape."""
    tf_value, onnx_shape = np.asarray(tf_value), np.shape(onnx_value)
    candidates = []
    if tf_value.shape == onnx_shape:
        candidates.append(("same", tf_value))
    if tf_value.ndim == 4:
        moved = mapping_tables.convert_layout(tf_value, "NHWC", "NCHW")
        if moved.shape == onnx_shape:
            candidates.append(("NHWC->NCHW", moved))
    if _onnx_layout(onnx_type, backend) == "NCHW":
        candidates.sort(key=lambda c: c[0] == "same")
    if not candidates and np.squeeze(tf_value).shape == np.squeeze(onnx_value).shape:
        # dropping size-1 axes keeps the element order ((1, C) vs (1, C, 1, 1))
        candidates.append(("squeezed", tf_value.reshape(onnx_shape)))
    return candidates


def _covered(op, matched_ops, path_ops):
    """``op`` and the data-path ops feeding it that have no compared tensor
    (up to the compared ones), in execution order (``path_ops``: op -> position)."""
    seen, stack = {op}, [t.op for t in op.inputs]
    while stack:
        producer = stack.pop()
        if producer in seen or producer not in path_ops or producer in matched_ops:
            continue
        seen.add(producer)
        stack.extend(t.op for t in producer.inputs)
    return sorted(seen, key=path_ops.get)


def _onnx_covered(node, producers, matched_tensors, order):
    seen, stack = {node.name: node}, list(node.input)
    while stack:
        name = stack.pop()
        producer = producers.get(name)
        if producer is None or name in matched_tensors or producer.name in seen:
            continue
        seen[producer.name] = producer
        stack.extend(producer.input)
    return sorted(seen, key=order.get)


def _data_inputs(op, path_ops):
    return [t for t in op.inputs if t.op in path_ops]


def _onnx_data_inputs(node, producers):
    return [name for name in node.input if name in producers]


_PASS_THROUGH = ("Transpose", "Identity")


def _match(path_ops, producers, backends):
    """Pairs ``(TF tensor, ONNX node, ONNX tensor name, how)`` to compare, in
    TF execution order.

    By name first: tf2onnx names an ONNX tensor after the TF tensor holding
    the same value. Then through inputs: where a TF op and an ONNX node of
    the same canonical op (mapping tables) are matched and each has exactly
    one data input, those inputs hold the same value too, so a fused node the
    converter renamed (``Conv__18``) is matched with the TF op feeding its
    consumer (the converter's own transposes are looked through).
    """
    plan, by_tf, by_onnx = [], set(), set()
    for op in path_ops:
        for tensor in op.outputs:
            if tensor.name in producers:
                plan.append((tensor, producers[tensor.name], tensor.name, "name"))
                by_tf.add(tensor.name)
                by_onnx.add(tensor.name)
    work = list(plan)
    while work:
        tensor, node, _, _ = work.pop()
        if not _same_op(tensor.op.type, node.op_type, backends):
            continue
        tf_inputs = _data_inputs(tensor.op, path_ops)
        onnx_inputs = _onnx_data_inputs(node, producers)
        if len(tf_inputs) != 1 or len(onnx_inputs) != 1:
            continue
        source, name = tf_inputs[0], onnx_inputs[0]
        producer = producers[name]
        while producer.op_type in _PASS_THROUGH and name not in by_onnx:
            inner = _onnx_data_inputs(producer, producers)
            if len(inner) != 1:
                break
            name = inner[0]
            producer = producers[name]
        if source.name in by_tf or name in by_onnx:
            continue
        pair = (source, producer, name, "inputs")
        plan.append(pair)
        work.append(pair)
        by_tf.add(source.name)
        by_onnx.add(name)
    plan.sort(key=lambda p: (path_ops[p[0].op], p[0].value_index))
    return plan


def diff_tf_onnx(session, feeds, outputs, onnx_model=None, rtol=1e-4, atol=0.0, opset=17):
    """Compare a TensorFlow graph with its ONNX conversion, op by op.

    The TF graph runs once under an amanda tool (:class:`OpOutputRecorder`)
    recording the outputs of every op on the path from the feeds to the
    fetches (the user's graph is not modified: amanda runs an instrumented
    copy); the ONNX model runs in onnxruntime with the same-named tensors
    exposed. Tensors are compared in TF execution order.

    Args:
        session: a ``tf.compat.v1.Session`` with initialised variables; its
            graph is the model.
        feeds: placeholder (tensor or name) -> input array.
        outputs: the output tensor(s) or name(s).
        onnx_model: an ``onnx.ModelProto`` (or path) converted from this
            graph with TF tensor names kept (as tf2onnx does); by default the
            graph is converted with :func:`tf_to_onnx`.
        rtol, atol: the tolerance: two values of a tensor agree when their
            largest absolute difference is at most ``atol + rtol * scale``,
            ``scale`` being the largest magnitude of the TF value (a
            per-tensor scale: randomly initialised deep networks have tiny
            activations, which an element-wise ``atol`` would hide, and
            rounding makes element-wise relative errors of near-zero
            elements meaningless). Raise ``atol`` to ignore tensors whose
            values are all negligible.
        opset: opset of the default conversion.

    Returns:
        An :class:`OpDiffReport`.

    Raises:
        ToolError: a feed or output is not in the graph, or the ONNX model
            has an input that is not fed.
    """
    graph = session.graph
    feeds = {_tf_tensor(graph, key, "diff_tf_onnx"): np.asarray(value)
             for key, value in feeds.items()}
    fetches = [_tf_tensor(graph, t, "diff_tf_onnx") for t in _as_list(outputs)]
    if onnx_model is None:
        onnx_model = tf_to_onnx(session, list(feeds), fetches, opset=opset)
    else:
        onnx_model = provider("load_model").load_model(onnx_model)
    backends = (vocabulary.backend_of(session), vocabulary.backend_of(onnx_model))

    nodes = list(onnx_model.graph.node)
    order = {node.name: index for index, node in enumerate(nodes)}
    producers = {out: node for node in nodes for out in node.output if out}
    path = _data_path(graph, feeds, fetches)
    path_ops = {op: index for index, op in enumerate(path)}
    initializers = {t.name for t in onnx_model.graph.initializer}
    plan = _match(path_ops, producers, backends)
    matched_ops = {tensor.op for tensor, *_ in plan}
    matched_onnx = {onnx_name for _, _, onnx_name, _ in plan}
    tf_names = {t.name for op in graph.get_operations() for t in op.outputs}
    onnx_only = [node.name for node in nodes
                 if not any(out in tf_names or out in matched_onnx for out in node.output)]

    by_name = {tensor.name: value for tensor, value in feeds.items()}
    onnx_feeds = {}
    for graph_input in onnx_model.graph.input:
        if graph_input.name in initializers:
            continue
        if graph_input.name not in by_name:
            raise ToolError(f"diff: diff_tf_onnx: the ONNX model's input {graph_input.name!r} is "
                            f"not among the fed tensors {sorted(by_name)}")
        onnx_feeds[graph_input.name] = by_name[graph_input.name]

    recorder = OpOutputRecorder(ops={op.name for op in matched_ops})
    with amanda.apply(recorder):
        expected = session.run(fetches, feed_dict=dict(feeds))
    onnx_values = onnx_tensor_values(onnx_model, onnx_feeds, sorted(matched_onnx))

    compared, incomparable, first = [], [], None
    for tensor, node, onnx_name, by in plan:
        tf_value = recorder.values.get(tensor.name)
        if tf_value is None:   # not numeric, or did not run
            continue
        onnx_value = onnx_values[onnx_name]
        candidates = _layouts(tf_value, onnx_value, node.op_type, backends[1])
        if not candidates:
            incomparable.append((tensor.name, tuple(np.shape(tf_value)),
                                 tuple(np.shape(onnx_value))))
            continue
        covered = [op.name for op in _covered(tensor.op, matched_ops, path_ops)]
        onnx_covered = _onnx_covered(node, producers, matched_onnx, order)
        scale = float(np.abs(tf_value).max(initial=0.0))
        errors = {name: _errors(value, onnx_value)[0] for name, value in candidates}
        close = [name for name, _ in candidates if errors[name] <= atol + rtol * scale]
        layout = close[0] if close else candidates[0][0]
        match = OpMatch(tensor.name, tensor.op.name, tensor.op.type, node.name, node.op_type,
                        _same_op(tensor.op.type, node.op_type, backends), covered, onnx_covered,
                        layout, onnx_name, by, errors[layout], scale)
        compared.append(match)
        if close or first is not None:
            continue
        culprit = tensor.op
        if not match.same_op:
            culprit = next((graph.get_operation_by_name(name) for name in reversed(covered)
                            if _same_op(graph.get_operation_by_name(name).type, node.op_type,
                                        backends)),
                           tensor.op)
        abs_error, rel_error = _errors(dict(candidates)[layout], onnx_value)
        first = OpDivergence(culprit.name, culprit.type, node.name, node.op_type, tensor.name,
                             covered, onnx_covered, layout, abs_error, rel_error,
                             tuple(np.shape(onnx_value)), onnx_name, by)

    unmatched = [op.name for op in path if op not in matched_ops]
    output_error = 0.0
    for tensor, value in zip(fetches, expected):
        other = onnx_values.get(tensor.name)
        if other is not None and np.shape(other) == np.shape(value):
            output_error = max(output_error, _errors(value, other)[0])
    return OpDiffReport(first, compared, unmatched, incomparable, onnx_only, output_error)
