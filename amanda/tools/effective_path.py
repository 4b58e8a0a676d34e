"""Effective path: the neurons and synapses that carry a prediction.

Qiu et al., "Adversarial Defense Through Network Profiling Based Path
Extraction" (CVPR 2019). For one input, start from the output neuron of the
predicted class and walk the forward graph backwards. At each op, every
critical output neuron keeps the *minimal* set of input contributions whose
sum reaches ``theta`` of its total; the inputs (and weights) of those
contributions become critical in turn. The critical weights are the op's
*synapses*; the critical neurons of every tensor and the synapses of every op
make the sample's *effective path*. Uniting the paths of a class's samples
gives the *class path*; a sample whose path lies far outside its predicted
class's path is suspicious (the paper's adversarial-example detector).

How it runs here:

* :class:`EffectivePathTool` depends on
  :class:`~amanda.tools.graph.GraphTracingTool` (the traced IR graph of each
  PyTorch eager step) and on a :class:`~amanda.tools.mapping.MappingTool`
  with :data:`~amanda.tools.mapping_rules.RULES` (canonical op types,
  ``context["type"]``). Its analysis routine records, for every forward op,
  the canonical type and two observe-only routines keeping the op's inputs
  and outputs. When a step's graph is complete it walks that graph.
* The walk, :func:`extract_paths`, knows no framework: it takes an IR graph,
  a function giving each IR tensor's value (NumPy) and one giving each op's
  canonical type. On graph backends (ONNX, TensorFlow ``Session.run``) the
  same tool records the whole graph when it is rewritten and its routines
  keep each run's values; the run computing the logits ends a step.
* Per-op extraction rules live in :data:`RULES`, keyed by canonical type.
  Backend attributes (strides, pads...) are read into canonical parameters by
  a reader of the op's backend's vocabulary (``PARAM_READERS`` in
  ``amanda/runtime/<backend>/vocabulary.py``, shown by backend in
  :data:`PARAM_READERS`); a reader may name the
  backend's layouts (its vocabulary's rows: TF ``NHWC``
  activations, ``HWIO`` and ``(in, out)`` weights), and the rule then sees
  PyTorch's layouts (``NCHW``, ``OIHW``, ``(out, in)``). An op on the path
  with no rule is reported in :attr:`EffectivePath.unknown` (or raises with
  ``strict=True``), never silently passed through.
* Masks are reported in PyTorch's layouts on every backend (TF image tensors
  transposed to ``CHW``); a flattened NHWC map keeps TF's ``HWC`` feature
  order.

Selection rule (exactly what :func:`select_contributions` computes): sort a
neuron's contributions in descending order (ties: lower input index first);
its *total* is the sum of the positive ones, accumulated in that order in
float64; keep the shortest prefix whose running sum reaches
``theta * total``. A neuron without positive contribution keeps none.
Contributions: ``activation x weight`` for ``linear`` and ``conv2d`` (bias
excluded, zero padding contributes nothing), ``activation / divisor`` for
average pooling; ``max_pool2d`` keeps the first maximal input of the window;
``add`` keeps both branches; element-wise activations, normalisations,
TF's ``BiasAdd`` and reshapes pass critical neurons through. A mean (TF
``Mean``: Keras ``GlobalAveragePooling2D``) is an average: ``x_i / count``.
An operand computed from weights and constants only (a bias, the
``gamma * rsqrt(variance + eps)`` of Keras' batch norm, which TF builds from
``Mul``/``AddV2``) gets no neurons: ``x * c`` passes through like
``batch_norm``, ``x + c`` like ``BiasAdd``.

Layout of the code: the selection and the per-op rules (:data:`RULES`) are
in :mod:`amanda.tools.effective_path_rules`, each backend's parameter
readers (:data:`PARAM_READERS`) in :mod:`amanda.tools.effective_path_params`;
this module extracts paths from a traced graph, compares them and holds the
tool. Every name is importable from here.
"""

from __future__ import annotations

import warnings
from collections import Counter

import numpy as np

import amanda
from amanda.errors import ToolError
from amanda.runtime import vocabulary
from amanda.runtime.tool_support import support_for
from amanda.tools import mapping_rules
from amanda.tools.effective_path_params import (PARAM_READERS, StepValues, _canonical_call, _params,
                                                 stable_op_key)
from amanda.tools.effective_path_rules import (  # the rule table; names re-exported
    CONSTANT_TYPES,
    INPUT_TYPES,
    PASS_THROUGH_TYPES,
    RESHAPE_TYPES,
    RULES,
    WEIGHT_SOURCE_TYPES,
    Extraction,
    OpValues,
    select_contributions,
)
from amanda.tools.graph import GraphTracingTool, module_path
from amanda.tools.mapping import MappingTool

__all__ = [
    "CONSTANT_TYPES",
    "INPUT_TYPES",
    "PARAM_READERS",
    "PASS_THROUGH_TYPES",
    "RESHAPE_TYPES",
    "RULES",
    "WEIGHT_SOURCE_TYPES",
    "EffectivePath",
    "EffectivePathTool",
    "Extraction",
    "class_paths",
    "extract_paths",
    "select_contributions",
    "similarity",
]

# -- paths ------------------------------------------------------------------------------

class EffectivePath:
    """The effective path of one sample (or, united, of a class).

    Attributes:
        label: the class the path starts from (None for a union of classes).
        theta: the selection threshold.
        neurons: op name -> boolean mask of its output's critical neurons
            (batch dim dropped), for the ops on the path in graph order.
        inputs: graph input name -> mask of its critical elements (e.g. pixels).
        synapses: op name -> boolean mask of its critical weights.
        types: op name -> canonical type.
        modules: op name -> module path (PyTorch) or name scope.
        unknown: ``(op name, type)`` of ops on the path without a rule.
        count: how many samples were united into this path.
    """

    def __init__(self, label, theta):
        self.label, self.theta = label, theta
        self.neurons, self.inputs, self.synapses = {}, {}, {}
        self.types, self.modules = {}, {}
        self.unknown = []
        self.count = 1

    def density(self):
        """Op name -> fraction of its output neurons on the path."""
        return {name: float(mask.mean()) for name, mask in self.neurons.items()}

    def synapse_density(self):
        """Op name -> fraction of its weights on the path (ops with weights)."""
        return {name: float(mask.mean()) for name, mask in self.synapses.items()}

    def union(self, other):
        """A new path holding the neurons and synapses of both."""
        result = EffectivePath(self.label if self.label == other.label else None, self.theta)
        for mine, theirs, target in ((self.neurons, other.neurons, result.neurons),
                                     (self.inputs, other.inputs, result.inputs),
                                     (self.synapses, other.synapses, result.synapses)):
            for name in list(mine) + [n for n in theirs if n not in mine]:
                a, b = mine.get(name), theirs.get(name)
                target[name] = a | b if a is not None and b is not None else \
                    (a if b is None else b).copy()
        result.types = {**other.types, **self.types}
        result.modules = {**other.modules, **self.modules}
        result.unknown = sorted(set(self.unknown) | set(other.unknown))
        result.count = self.count + other.count
        return result

    __or__ = union

    def similarity(self, other, level="synapses"):
        """``|self ∩ other| / |self|``; see :func:`similarity`."""
        return similarity(self, other, level)

    def __repr__(self):
        size = sum(int(m.sum()) for m in self.synapses.values())
        return (f"<EffectivePath label={self.label} theta={self.theta} ops={len(self.neurons)} "
                f"synapses={size} samples={self.count}>")


def similarity(path, reference, level="synapses"):
    """How much of ``path`` lies inside ``reference`` (e.g. its class path).

    Args:
        path: a sample's :class:`EffectivePath`.
        reference: the path to compare with.
        level: ``"synapses"`` (critical weights) or ``"neurons"`` (critical
            outputs of every op).

    Returns:
        ``|path ∩ reference| / |path|`` counted over every op, in ``[0, 1]``
        (1.0 for an empty path).
    """
    if level not in ("synapses", "neurons"):
        raise ValueError(f"level must be 'synapses' or 'neurons', got {level!r}")
    mine, theirs = getattr(path, level), getattr(reference, level)
    inside = total = 0
    for name, mask in mine.items():
        total += int(mask.sum())
        other = theirs.get(name)
        if other is not None and other.shape == mask.shape:
            inside += int((mask & other).sum())
    return inside / total if total else 1.0


def class_paths(paths):
    """Unite sample paths by label: ``{label: EffectivePath}``."""
    result = {}
    for path in paths:
        result[path.label] = path if path.label not in result else result[path.label] | path
    return result


def extract_paths(graph, value_of, type_of, theta=0.5, output=None, labels=None,
                  strict=False):
    """Extract the effective path of every sample of a batch from an IR graph.

    Framework-free: any backend that gives values can use it.

    Args:
        graph: an :class:`amanda.ir.Graph`; backward ops are ignored.
        value_of: ``value_of(ir_tensor)`` -> NumPy array (batch first), or None.
        type_of: ``type_of(ir_op)`` -> canonical type.
        theta: the threshold, in ``(0, 1]``.
        output: the IR tensor holding the logits ``(N, classes)``; default:
            the first output of the last forward op.
        labels: classes to start from, one per sample; default: the argmax.
        strict: raise on an op with no rule instead of reporting it.

    Returns:
        One :class:`EffectivePath` per sample.

    Raises:
        ToolError: bad ``theta``/``output``, or with ``strict`` an op on the
            path has no rule; the message names the op.
    """
    if not 0 < theta <= 1:
        raise ToolError(f"effective path: theta must be in (0, 1], got {theta!r}")
    forward = [op for op in graph.ops if not op.attrs.get("backward")]
    if output is None:
        if not forward or not forward[-1].outputs:
            raise ToolError("effective path: the graph has no forward op with an output")
        output = forward[-1].outputs[0]
    logits = value_of(output)
    if logits is None or np.ndim(logits) != 2:
        raise ToolError(f"effective path: the output %{output.name} must be (batch, classes), "
                        f"got shape {None if logits is None else np.shape(logits)}")
    batch = logits.shape[0]
    labels = np.argmax(logits, axis=1) if labels is None else np.asarray(labels).reshape(batch)
    start = np.zeros(logits.shape, dtype=bool)
    start[np.arange(batch), labels] = True
    masks = {output: start}
    found, unknown, order, retyped = {}, [], [], {}
    constants = _constant_tensors(forward, type_of)
    for op in reversed(forward):
        out_mask = _merged_output_mask(op, masks)
        if out_mask is None:
            continue
        order.append(op)
        _step(op, out_mask, value_of, type_of, theta, strict, masks, found, unknown,
              constants, retyped)

    def reported_type(op):
        return retyped.get(op) or type_of(op)

    return _per_sample(graph, reversed(order), masks, found, unknown, labels, theta,
                       reported_type)


def _constant_tensors(forward, type_of):
    """The IR tensors computed from weights and constants only, never from
    the model's input: weight graph inputs (ONNX initializers), outputs of
    ``WEIGHT_SOURCE_TYPES`` and ``CONSTANT_TYPES`` ops, and of ops reading
    only such tensors (``rsqrt(variance + eps)``). PyTorch eager traces do
    not tell parameters from inputs (both are graph inputs without
    producer), so there no operand counts as constant."""
    constant = set()
    for op in forward:                   # graph order: producers first
        op_type = type_of(op)
        if op_type in WEIGHT_SOURCE_TYPES or op_type in CONSTANT_TYPES or (op.inputs and all(
                t in constant or (t.producer is None and _is_weight(t, op.namespace))
                for t in op.inputs)):
            constant.update(op.outputs)
    return constant


def _is_weight(tensor, namespace):
    """Whether a graph input of an op of ``namespace`` is a weight (an ONNX
    initializer, a captured parameter): the backend says."""
    support = support_for(namespace)
    return support is not None and support.is_weight_input(tensor)


def _merged_output_mask(op, masks):
    if not op.outputs:
        return None
    return masks.get(op.outputs[0])


def _step(op, out_mask, value_of, type_of, theta, strict, masks, found, unknown,
          constants=frozenset(), retyped=None):
    op_type = type_of(op)
    tensors = [t for t in op.inputs]
    if not tensors:
        return   # a source (constant, random): nothing further back
    rule = RULES.get(op_type)
    result = None
    if rule is not None:
        values = [value_of(t) for t in tensors]
        output = value_of(op.outputs[0])
        params = _params(op, op_type, values)
        layouts = params.pop("layouts", None)
        constant = [t in constants for t in tensors]
        values = OpValues(op, op_type, values, output, out_mask, params, theta, constant)
        result = _canonical_call(rule, values, layouts) if layouts else rule(values)
    if result is None:   # no rule, or none for this form of the op
        if strict:
            form = "" if rule is None else " in this form"
            raise ToolError(f"effective path: no extraction rule for op type {op_type!r}"
                            f"{form} (add one to amanda.tools.effective_path.RULES)",
                            op_name=op.name, namespace=op.namespace)
        unknown.append((op.name, op_type))
        return
    if result.type is not None and retyped is not None:
        retyped[op] = result.type
    # operands computed from weights only (a bias, a batch norm's scale) get no
    # neurons: the walk does not enter them, as it does not enter a layer's weight
    mixed = not all(constant)
    for position, mask in result.inputs.items():
        tensor = tensors[position]
        if mixed and constant[position]:
            continue
        if tensor in masks:
            masks[tensor] = masks[tensor] | mask
        else:
            masks[tensor] = mask
    if result.synapses is not None:
        found[op] = result.synapses


#: Types whose output keeps its input's layout (element-wise, bias, add,
#: scaling, padding, concatenation).
_LAYOUT_KEEPING = PASS_THROUGH_TYPES | {"add", "mul", "sub", "div", "real_div", "pad", "pad_v2",
                                        "concat", "concat_v2", "cat"}


def _channels_last(ops, type_of):
    """The IR tensors on the path holding NHWC images.

    Seeds: the activation input and output of ops with a ``data_format``
    attribute of ``NHWC`` (TF convolutions, pooling, ``BiasAdd`` on 4-D
    tensors); spread, in both directions, through element-wise ops keeping
    the layout (``relu``, ``add``...), not through reshapes."""
    found = set()
    for op in ops:
        if op.attrs.get("data_format") == "NHWC" and op.inputs and op.outputs:
            found.update(t for t in (op.inputs[0], op.outputs[0])
                         if len(t.attrs.get("shape") or ()) == 4)
    keeping = [op for op in ops if type_of(op) in _LAYOUT_KEEPING and op.outputs]
    changed = bool(found)
    while changed:
        changed = False
        for op in keeping:
            ends = [t for t in op.inputs if t.attrs.get("shape") is not None
                    and len(t.attrs["shape"]) == 4] + [op.outputs[0]]
            if any(t in found for t in ends) and not all(t in found for t in ends):
                found.update(ends)
                changed = True
    return found


def _report(mask, tensor, channels_last):
    """One sample's mask in the canonical layout (CHW for NHWC images)."""
    return np.transpose(mask, (2, 0, 1)) if tensor in channels_last and mask.ndim == 3 else mask


def _per_sample(graph, ops, masks, found, unknown, labels, theta, type_of):
    ops = list(ops)
    channels_last = _channels_last(ops, type_of)
    paths = []
    for b, label in enumerate(labels):
        path = EffectivePath(int(label), theta)
        for op in ops:
            op_type = type_of(op)
            if op_type in WEIGHT_SOURCE_TYPES:
                continue
            output = op.outputs[0]
            mask = _report(masks[output][b], output, channels_last)
            if op_type in INPUT_TYPES and not op.inputs:
                path.inputs[op.name] = mask
                continue
            path.neurons[op.name] = mask
            path.types[op.name] = op_type
            path.modules[op.name] = module_path(op)
            if op in found:
                path.synapses[op.name] = found[op][b]
        for tensor in graph.inputs:
            mask = masks.get(tensor)
            namespace = tensor.uses[0][0].namespace if tensor.uses else graph.namespace
            if mask is not None and not _is_weight(tensor, namespace) and \
                    mask.shape[0] == len(labels):
                path.inputs[tensor.name] = _report(mask[b], tensor, channels_last)
        path.unknown = list(unknown)
        paths.append(path)
    return paths


# -- the tool -----------------------------------------------------------------------------

class EffectivePathTool(amanda.Tool):
    """Extract effective paths of the samples run under ``amanda.apply``.

    Every step (a root module call in PyTorch eager; an ONNX or TensorFlow
    ``Session.run`` that computes the logits) adds one
    :class:`EffectivePath` per sample to :attr:`paths`. A step's values are
    kept when its graph is complete (at the next step or when the ``apply``
    scope exits; on graph backends when the logits are computed) and walked
    when :attr:`paths` is read.

    Args:
        theta: the threshold, in ``(0, 1]``.
        output: which op's first output holds the logits: None for the last
            forward op of the step (of a whole graph: the last forward op
            whose output is statically ``(batch, classes)``), a module path
            (the last op run by that module) or an op or tensor name
            (``"dense/BiasAdd:0"``), an object with ``op.name`` (a
            ``tf.Tensor``), or a predicate ``f(ir_op) -> bool`` (the last
            matching op).
        strict: raise on ops without a rule instead of reporting them.

    Attributes:
        unknown: ``Counter`` of canonical types met on a path without a rule.
        tracer: the :class:`GraphTracingTool` this tool depends on.

    Example::

        tool = EffectivePathTool(theta=0.5)
        with torch.no_grad(), amanda.apply(tool):
            model(x)
        print(tool.paths[0].density())
    """

    def __init__(self, theta=0.5, output=None, strict=False):
        super().__init__()
        if not 0 < theta <= 1:
            raise ToolError(f"theta must be in (0, 1], got {theta!r}", tool=self)
        self.theta, self.output, self.strict = theta, output, strict
        self.tracer = GraphTracingTool(keep=1)
        self.depends_on(self.tracer, MappingTool(rules=mapping_rules.RULES))
        self.requires_graph = True
        self.add_inst_for_op(self.record_op)
        self._paths = []
        self._steps = []      # (graph, values) of finished steps not walked yet
        self.unknown = Counter()
        self._types = {}      # op id -> canonical type
        self._pending = {}    # op id -> inputs of the running execution
        self._values = {}     # op id -> (inputs, outputs) of this step
        self._targets = {}    # id(whole graph) -> (graph, its logits tensor)

    def record_op(self, context):
        """Analysis routine: remember the op's canonical type and keep its
        inputs and outputs each time it runs."""
        op_id = context.get_op_id()
        self._types[op_id] = context.get("type") or context.get_op_name()
        last = self._whole_graph_output(context)
        context.insert_before_op(self._keep_inputs, op_id=op_id)
        context.insert_after_op(self._keep_outputs, op_id=op_id, graph=last)

    def _whole_graph_output(self, context):
        """On a graph backend (the op is in the whole graph before anything
        ran), the graph if this op makes its logits, else None; eager steps
        end through ``graph_completed`` instead."""
        ir_op = context.get_ir_op()
        graph = context.get_graph()
        if ir_op is None or graph is None or "op_id" in ir_op.attrs:
            return None
        cached = self._targets.get(id(graph))
        if cached is None or cached[0] is not graph:
            cached = self._targets[id(graph)] = (graph, self._output_tensor(graph, required=False))
        target = cached[1]
        return graph if target is not None and target.producer is ir_op else None

    def _keep_inputs(self, *tensors, op_id):
        self._pending[op_id] = [np.array(amanda.evaluate(t)) for t in tensors]

    def _keep_outputs(self, *tensors, op_id, graph=None):
        # Committed after the op ran: when this op starts the next step, the
        # previous step's graph is completed before its values are replaced.
        inputs = self._pending.pop(op_id, [])
        self._values[op_id] = (inputs, [np.array(amanda.evaluate(t)) for t in tensors])
        if graph is not None:   # a graph backend ran the op making the logits
            self.graph_completed(graph)

    def graph_completed(self, graph):
        values, self._values = self._values, {}
        if values:
            self._steps.append((graph, values))

    @property
    def paths(self):
        """The effective paths of every sample run so far, in order.

        Steps are walked when this is read (not while the model runs), so an
        error in the walk (``strict``, a bad ``output``) raises here.
        """
        while self._steps:
            graph, values = self._steps.pop(0)
            self._paths.extend(self._extract(graph, values))
        return self._paths

    def _extract(self, graph, values):
        with amanda.disabled():   # the walk's own array work is no model code
            paths = extract_paths(graph, StepValues(values), self._type_of,
                                  theta=self.theta, output=self._output_tensor(graph),
                                  strict=self.strict)
        unknown = paths[0].unknown if paths else []
        for _, op_type in unknown:
            self.unknown[op_type] += 1
        if unknown:
            types = sorted({str(t) for _, t in unknown})
            warnings.warn(f"EffectivePathTool: ops without an extraction rule on the path "
                          f"stop it there: {', '.join(types)}", stacklevel=3)
        return paths

    def _type_of(self, op):
        found = self._types.get(stable_op_key(op))
        return found if found is not None else vocabulary.canonical_type(op.namespace, op.type)

    def _output_tensor(self, graph, required=True):
        """The IR tensor holding the logits: see ``output``. None (the last
        forward op's output) for eager steps when no ``output`` is given."""
        forward = [op for op in graph.ops if not op.attrs.get("backward")]
        if self.output is None:
            return _default_output(forward) if _whole_graph(graph) else None
        name = getattr(getattr(self.output, "op", None), "name", None)   # a TF tensor
        if name is not None:
            matches = [op for op in forward if op.name == name]
        elif callable(self.output):
            matches = [op for op in forward if self.output(op)]
        else:
            wanted = str(self.output)
            op_name = wanted.rpartition(":")[0] if wanted.rpartition(":")[2].isdigit() else wanted
            matches = [op for op in forward if op.attrs.get("module") == wanted]
            matches = matches or [op for op in forward if op.name == op_name]
        if not matches or not matches[-1].outputs:
            if not required:
                return None
            raise ToolError(f"no forward op matches output={self.output!r} in this step",
                            tool=self)
        return matches[-1].outputs[0]

    def class_paths(self):
        """The class paths of :attr:`paths`: ``{label: EffectivePath}``."""
        return class_paths(self.paths)

    def clear(self):
        """Forget the extracted paths (and the steps not walked yet)."""
        self._paths, self._steps = [], []
        self.unknown.clear()


def _whole_graph(graph):
    """Whether ``graph`` is a whole graph (ONNX, TensorFlow), not an eager
    step traced op by op (the backend says)."""
    if not graph.ops:
        return False
    support = support_for(graph.ops[0].namespace or graph.namespace)
    return True if support is None else support.is_whole_graph(graph)


def _default_output(forward):
    """The logits of a whole graph: the last forward op whose first output
    is statically ``(batch, classes)``; else the last forward op with an
    output (graphs without shapes)."""
    with_outputs = [op for op in forward if op.outputs]
    for op in reversed(with_outputs):
        shape = op.outputs[0].attrs.get("shape")
        if shape is not None and len(shape) == 2 and \
                str(op.outputs[0].attrs.get("dtype", "float")).startswith(("float", "double")):
            return op.outputs[0]
    return with_outputs[-1].outputs[0] if with_outputs else None
