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
  a per-namespace reader in :data:`PARAM_READERS`; a reader may name the
  backend's layouts (from :mod:`~amanda.tools.mapping_tables`: TF ``NHWC``
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
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter

import numpy as np

import amanda
from amanda.errors import ToolError
from amanda.tools import mapping_rules, mapping_tables
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

# Critical neurons of this many (neuron, contribution) pairs are selected at once.
_CHUNK_ELEMENTS = 1 << 22


# -- the selection --------------------------------------------------------------------

def select_contributions(contributions, theta):
    """The minimal set of contributions reaching ``theta`` of the positive total.

    Args:
        contributions: ``(M, K)`` array, one row per critical neuron.
        theta: the fraction in ``(0, 1]``.

    Returns:
        A boolean ``(M, K)`` array marking the selected contributions.
    """
    contributions = np.asarray(contributions, dtype=np.float64)
    rows, width = contributions.shape
    if rows == 0 or width == 0:
        return np.zeros((rows, width), dtype=bool)
    order = np.argsort(-contributions, axis=1, kind="stable")
    ranked = np.take_along_axis(contributions, order, axis=1)
    running = np.cumsum(np.where(ranked > 0, ranked, 0.0), axis=1)
    total = running[:, -1]
    reached = running >= (theta * total)[:, None]
    count = np.where(total > 0, np.argmax(reached, axis=1) + 1, 0)
    keep = np.arange(width)[None, :] < count[:, None]
    selected = np.zeros((rows, width), dtype=bool)
    np.put_along_axis(selected, order, keep, axis=1)
    return selected


def _select_chunked(contributions_of, count, width, theta):
    """Yield ``(start, selected)`` chunks of the selection for ``count``
    neurons; ``contributions_of(start, stop)`` builds their rows."""
    step = max(1, _CHUNK_ELEMENTS // max(1, width))
    for start in range(0, count, step):
        stop = min(count, start + step)
        yield start, select_contributions(contributions_of(start, stop), theta)


# -- rules ----------------------------------------------------------------------------

@dataclasses.dataclass
class Extraction:
    """What a rule found for one op.

    Attributes:
        inputs: input position -> boolean mask of its critical neurons
            (batch dim included); positions left out get none.
        synapses: boolean mask of critical weights per sample, shape
            ``(N,) + weight.shape``, or None.
        type: the canonical type the rule recognised, reported instead of
            the op's own (a TF ``Mean`` over the spatial axes is a
            ``global_avg_pool2d``), or None.
    """

    inputs: dict
    synapses: np.ndarray | None = None
    type: str | None = None


class OpValues:
    """What a rule sees of one op.

    Attributes:
        op: the IR op.
        type: its canonical type.
        inputs: NumPy values of its inputs (None where unknown).
        output: the value of its first output.
        mask: boolean mask of the critical neurons of that output.
        params: canonical parameters (``strides``, ``pads``...).
        theta: the selection threshold.
        constant: per input, whether it is computed from weights and
            constants only (a variable read, ``rsqrt(variance + eps)``),
            never from the model's input; such inputs get no critical
            neurons.
    """

    __slots__ = ("constant", "inputs", "mask", "op", "output", "params", "theta", "type")

    def __init__(self, op, type, inputs, output, mask, params, theta, constant=None):
        self.op, self.type, self.inputs, self.output = op, type, inputs, output
        self.mask, self.params, self.theta = mask, params, theta
        self.constant = tuple(constant) if constant is not None else (False,) * len(inputs)


def _linear(v):
    x, weight = v.inputs[0], v.inputs[1]   # weight (out, in): moved there by _step
    batch, width = x.shape[0], x.shape[-1]
    rows = x.reshape(batch, -1, width).astype(np.float64)
    w = weight.astype(np.float64)
    n, p, j = np.nonzero(v.mask.reshape(batch, rows.shape[1], -1))
    critical = np.zeros(rows.shape, dtype=bool)
    synapses = np.zeros((batch,) + weight.shape, dtype=bool)
    for start, selected in _select_chunked(
            lambda a, b: rows[n[a:b], p[a:b]] * w[j[a:b]], len(n), width, v.theta):
        stop = start + len(selected)
        m, i = np.nonzero(selected)
        critical[n[start:stop][m], p[start:stop][m], i] = True
        synapses[n[start:stop][m], j[start:stop][m], i] = True
    return Extraction({0: critical.reshape(x.shape)}, synapses)


def _windows(x, kernel, strides, pads, dilations, out_hw, fill):
    """Sliding windows of an NCHW array: ``(N, C, OH, OW, KH, KW)``; padding
    (and windows running past the end, as with ``ceil_mode``) reads ``fill``."""
    (kh, kw), (sh, sw), (dh, dw) = kernel, strides, dilations
    top, left = pads[0], pads[1]
    span_h, span_w = (kh - 1) * dh + 1, (kw - 1) * dw + 1
    need_h = (out_hw[0] - 1) * sh + span_h
    need_w = (out_hw[1] - 1) * sw + span_w
    bottom = max(0, need_h - top - x.shape[2])
    right = max(0, need_w - left - x.shape[3])
    padded = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)), constant_values=fill)
    view = np.lib.stride_tricks.sliding_window_view(padded, (span_h, span_w), axis=(2, 3))
    return view[:, :, ::sh, ::sw][:, :, :out_hw[0], :out_hw[1], ::dh, ::dw]


def _input_positions(oh, ow, a, b, params):
    """Input coordinates of kernel offsets ``(a, b)`` of outputs ``(oh, ow)``."""
    (sh, sw), (dh, dw), pads = params["strides"], params["dilations"], params["pads"]
    return oh * sh + a * dh - pads[0], ow * sw + b * dw - pads[1]


def _conv2d(v):
    x, weight = v.inputs[0], v.inputs[1]
    params = v.params
    groups = params["groups"]
    batch = x.shape[0]
    out_channels, group_in, kh, kw = weight.shape
    group_out = out_channels // groups
    windows = _windows(x.astype(np.float64), (kh, kw), params["strides"], params["pads"],
                       params["dilations"], v.output.shape[2:], 0.0)
    w = weight.astype(np.float64).reshape(out_channels, -1)
    n, co, oh, ow = np.nonzero(v.mask)
    first_in = (co // group_out) * group_in
    lanes = np.arange(group_in)

    def contributions(a, b):
        channels_in = first_in[a:b, None] + lanes[None, :]
        patches = windows[n[a:b, None], channels_in, oh[a:b, None], ow[a:b, None]]
        return patches.reshape(b - a, -1) * w[co[a:b]]

    critical = np.zeros(x.shape, dtype=bool)
    synapses = np.zeros((batch,) + weight.shape, dtype=bool)
    for start, selected in _select_chunked(contributions, len(n), w.shape[1], v.theta):
        m, flat = np.nonzero(selected)
        m = m + start
        ci, a, b = np.unravel_index(flat, (group_in, kh, kw))
        ih, iw = _input_positions(oh[m], ow[m], a, b, params)
        critical[n[m], first_in[m] + ci, ih, iw] = True   # padding never contributes
        synapses[n[m], co[m], ci, a, b] = True
    return Extraction({0: critical}, synapses)


def _max_pool2d(v):
    x, params = v.inputs[0], v.params
    kernel = params["kernel"]
    windows = _windows(x.astype(np.float64), kernel, params["strides"], params["pads"],
                       params["dilations"], v.output.shape[2:], -np.inf)
    n, c, oh, ow = np.nonzero(v.mask)
    flat = np.argmax(windows[n, c, oh, ow].reshape(len(n), -1), axis=1)  # first maximum
    a, b = np.unravel_index(flat, kernel)
    ih, iw = _input_positions(oh, ow, a, b, params)
    critical = np.zeros(x.shape, dtype=bool)
    critical[n, c, ih, iw] = True
    return Extraction({0: critical})


def _pool_windows_avg(v):
    """Per critical output: input rows/columns and divisor of its window."""
    x, params = v.inputs[0], v.params
    height, width = x.shape[2:]
    (kh, kw), (sh, sw) = params["kernel"], params["strides"]
    top, left, bottom, right = params["pads"]
    for n, c, oh, ow in zip(*np.nonzero(v.mask)):
        h0, w0 = oh * sh - top, ow * sw - left
        h1, w1 = min(h0 + kh, height + bottom), min(w0 + kw, width + right)
        divisor = params.get("divisor_override")
        if not divisor:
            if params.get("count_include_pad", True):
                divisor = (h1 - h0) * (w1 - w0)
            else:
                divisor = (min(h1, height) - max(h0, 0)) * (min(w1, width) - max(w0, 0))
        yield n, c, (max(h0, 0), min(h1, height)), (max(w0, 0), min(w1, width)), divisor


def _adaptive_windows(v):
    height, width = v.inputs[0].shape[2:]
    out_h, out_w = v.output.shape[2:]
    for n, c, oh, ow in zip(*np.nonzero(v.mask)):
        rows = (oh * height // out_h, -(-(oh + 1) * height // out_h))
        cols = (ow * width // out_w, -(-(ow + 1) * width // out_w))
        yield n, c, rows, cols, (rows[1] - rows[0]) * (cols[1] - cols[0])


def _average(windows_of):
    def rule(v):
        x = v.inputs[0]
        critical = np.zeros(x.shape, dtype=bool)
        for n, c, (h0, h1), (w0, w1), divisor in windows_of(v):
            patch = x[n, c, h0:h1, w0:w1].astype(np.float64)
            selected = select_contributions(patch.reshape(1, -1) / divisor, v.theta)
            critical[n, c, h0:h1, w0:w1] |= selected.reshape(patch.shape)
        return Extraction({0: critical})
    return rule


def _pass_through(v):
    return Extraction({0: v.mask.reshape(v.inputs[0].shape)})


def _unbroadcast(mask, shape):
    """Reduce a mask of a broadcast result to one operand's shape (any)."""
    extra = mask.ndim - len(shape)
    if extra > 0:
        mask = mask.any(axis=tuple(range(extra)))
    axes = tuple(i for i, d in enumerate(shape) if d == 1 and mask.shape[i] != 1)
    if axes:
        mask = mask.any(axis=axes, keepdims=True)
    return mask.reshape(shape)


def _add(v):
    return Extraction({i: _unbroadcast(v.mask, np.shape(value))
                       for i, value in enumerate(v.inputs) if value is not None})


def _scale(v):
    """``x * c``, ``x - c``, ``x / c`` where ``c`` is computed from weights
    and constants only (``x + c`` is an ``add``, whose constant operand gets
    no neurons either): an affine map of each neuron, like
    ``batch_norm`` (Keras' inference batch normalisation is ``x * (gamma *
    rsqrt(variance + eps)) + (beta - mean * ...)``), so critical neurons pass
    through to ``x``; the walk does not enter ``c``. None (no rule) when
    more than one operand depends on the model's input (a gate ``x * s``)."""
    data = [i for i, value in enumerate(v.inputs) if value is not None and not v.constant[i]]
    if len(data) != 1:
        return None
    (i,) = data
    return Extraction({i: _unbroadcast(v.mask, np.shape(v.inputs[i]))})


def _mean(v):
    """A mean over ``params["axes"]`` is a linear op: each critical output
    neuron keeps the minimal set of its inputs ``x_i / count`` (in row-major
    order of the reduced axes) reaching theta, as average pooling does. A TF
    ``Mean`` over the spatial axes of an NHWC map (Keras
    ``GlobalAveragePooling2D``) selects exactly what PyTorch's
    ``adaptive_avg_pool2d(x, 1)`` does."""
    x = v.inputs[0]
    axes = tuple(sorted(v.params["axes"]))
    kept = [a for a in range(x.ndim) if a not in axes]
    kept_shape = [x.shape[a] for a in kept]
    count = int(np.prod([x.shape[a] for a in axes], dtype=np.int64))
    rows = np.transpose(x, kept + list(axes)).reshape(-1, count).astype(np.float64) / count
    (critical_rows,) = np.nonzero(v.mask.reshape(-1))
    critical = np.zeros(rows.shape, dtype=bool)
    for start, selected in _select_chunked(lambda a, b: rows[critical_rows[a:b]],
                                           len(critical_rows), count, v.theta):
        critical[critical_rows[start:start + len(selected)]] = selected
    critical = critical.reshape(kept_shape + [x.shape[a] for a in axes])
    back = np.argsort(kept + list(axes))
    return Extraction({0: np.transpose(critical, back)}, type=v.params.get("type"))


def _pad(v):
    """Constant padding: the critical neurons that lie inside the input
    (padded elements are no neurons). ``params["before"]``: elements added
    before each axis; None (no rule) for other modes (reflect...)."""
    before = v.params.get("before")
    if before is None:
        return None
    x = v.inputs[0]
    inside = tuple(slice(b, b + size) for b, size in zip(before, x.shape))
    return Extraction({0: v.mask[inside].reshape(x.shape)})


def _concat(v):
    """A concatenation: each part gets its slice of the critical neurons
    along ``params["axis"]``; ``params["parts"]``: the input positions of
    the concatenated tensors."""
    axis, parts = v.params.get("axis"), v.params.get("parts")
    if axis is None:
        return None
    found, start = {}, 0
    for position in parts:
        size = np.shape(v.inputs[position])[axis]
        found[position] = np.take(v.mask, np.arange(start, start + size), axis=axis)
        start += size
    return Extraction(found)


#: Element-wise ops whose critical neurons pass to their first input
#: (``bias_add``: TF's separate bias, excluded like a layer's bias elsewhere).
PASS_THROUGH_TYPES = frozenset({
    "relu", "relu6", "leaky_relu", "gelu", "silu", "sigmoid", "tanh", "hardtanh", "elu",
    "selu", "softplus", "batch_norm", "dropout", "identity", "clone", "contiguous", "to",
    "float", "detach", "cast", "bias_add",
})
#: Ops producing a weight's value (TF ``ReadVariableOp``): the walk ends
#: there and they are not reported as neurons, like PyTorch parameters and
#: ONNX initializers.
WEIGHT_SOURCE_TYPES = frozenset({"read_variable_op"})
#: Ops making constants (TF ``Const``, a variable's handle, ONNX
#: ``Constant``): like weights, an operand computed from them only (a batch
#: norm's ``gamma * rsqrt(variance + eps)``) gets no neurons.
CONSTANT_TYPES = frozenset({"const", "constant", "var_handle_op", "variable_v2"})
#: Ops feeding the model's input (TF ``Placeholder``): reported in
#: :attr:`EffectivePath.inputs`, like graph inputs.
INPUT_TYPES = frozenset({"placeholder"})
#: Ops that only change the shape: critical neurons keep their element order.
RESHAPE_TYPES = frozenset({"reshape", "view", "flatten", "squeeze", "unsqueeze"})

#: Canonical op type -> rule ``rule(OpValues) -> Extraction``.
RULES = {
    "linear": _linear,
    "conv2d": _conv2d,
    "max_pool2d": _max_pool2d,
    "avg_pool2d": _average(_pool_windows_avg),
    "adaptive_avg_pool2d": _average(_adaptive_windows),
    "add": _add,
    # a depthwise filter (TF HWIM) is moved to a grouped OIHW one: groups = channels
    "depthwise_conv2d": _conv2d,
    # per-channel affine ops with a weight-derived operand (Keras batch norm)
    **{t: _scale for t in ("mul", "sub", "div", "real_div")},
    # TF Mean, ONNX ReduceMean/GlobalAveragePool, torch mean
    **{t: _mean for t in ("mean", "reduce_mean", "global_avg_pool2d")},
    "pad": _pad,
    "pad_v2": _pad,
    "concat": _concat,
    "concat_v2": _concat,
    "cat": _concat,
    # a class's probability (or log-probability) goes with its logit: the
    # path from the softmax's critical output is the path from that logit
    "softmax": _pass_through,
    "log_softmax": _pass_through,
    **{t: _pass_through for t in PASS_THROUGH_TYPES | RESHAPE_TYPES},
    **{t: (lambda v: Extraction({})) for t in WEIGHT_SOURCE_TYPES},
}


# -- canonical parameters per backend ---------------------------------------------------

def _pair(value, default):
    if value is None or value == []:
        value = default
    if isinstance(value, (list, tuple)):
        value = [int(v) for v in value]
        return (value[0], value[0]) if len(value) == 1 else tuple(value[:2])
    return (int(value), int(value))


def _bind(op, names):
    """Name the non-tensor positional args (``attrs["args"]``) and kwargs of a
    traced PyTorch call. A leading None stands for an absent optional tensor
    (a conv's ``bias=None``) when the op has fewer tensor inputs than usual."""
    args = list(op.attrs.get("args", ()))
    if names and names[0] == "*bias":
        if len(op.inputs) == 2 and args and args[0] is None:
            args = args[1:]
        names = names[1:]
    bound = dict(zip(names, args))
    bound.update(op.attrs.get("kwargs", {}))
    return bound


def _torch_conv_params(op, values):
    bound = _bind(op, ["*bias", "stride", "padding", "dilation", "groups"])
    kernel = np.shape(values[1])[2:]
    dilations = _pair(bound.get("dilation"), 1)
    padding = bound.get("padding", 0)
    if padding == "valid":
        pads = (0, 0, 0, 0)
    elif padding == "same":
        total = [d * (k - 1) for d, k in zip(dilations, kernel)]
        pads = (total[0] // 2, total[1] // 2, total[0] - total[0] // 2, total[1] - total[1] // 2)
    else:
        ph, pw = _pair(padding, 0)
        pads = (ph, pw, ph, pw)
    return {"strides": _pair(bound.get("stride"), 1), "pads": pads, "dilations": dilations,
            "groups": int(bound.get("groups") or 1)}


def _torch_pool_params(names):
    def read(op, values):
        bound = _bind(op, names)
        kernel = _pair(bound.get("kernel_size"), 1)
        ph, pw = _pair(bound.get("padding"), 0)
        params = {"kernel": kernel, "strides": _pair(bound.get("stride"), kernel),
                  "pads": (ph, pw, ph, pw), "dilations": _pair(bound.get("dilation"), 1)}
        for key in ("count_include_pad", "divisor_override"):
            if key in bound:
                params[key] = bound[key]
        return params
    return read


def _onnx_conv_params(op, values):
    attrs, rank = op.attrs, np.ndim(values[1]) - 2
    if attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        raise ToolError(f"effective path: auto_pad={attrs['auto_pad']!r} is not supported",
                        op_name=op.name, namespace=op.namespace)
    return {"strides": tuple(attrs.get("strides", [1] * rank)),
            "pads": tuple(attrs.get("pads", [0] * 2 * rank)),
            "dilations": tuple(attrs.get("dilations", [1] * rank)),
            "groups": int(attrs.get("group", 1))}


def _onnx_pool_params(op, values):
    attrs = op.attrs
    kernel = tuple(attrs["kernel_shape"])
    params = {"kernel": kernel, "strides": tuple(attrs.get("strides", [1] * len(kernel))),
              "pads": tuple(attrs.get("pads", [0] * 2 * len(kernel))),
              "dilations": tuple(attrs.get("dilations", [1] * len(kernel))),
              "count_include_pad": bool(attrs.get("count_include_pad", 0))}
    return params


def _onnx_linear_params(op, values):
    if op.type == "Gemm" and (op.attrs.get("transA", 0) or np.ndim(values[0]) != 2):
        raise ToolError("effective path: Gemm with transA is not supported",
                        op_name=op.name, namespace=op.namespace)
    layout = "OI" if op.type == "Gemm" and op.attrs.get("transB", 0) else "IO"
    return {"layouts": {"weight": layout}}


def _tf_spatial(values):
    """``(height, width)`` of an NHWC attribute list (``[1, h, w, 1]``)."""
    return int(values[1]), int(values[2])


def _tf_pads(op, size, kernel, strides, dilations):
    """``(top, left, bottom, right)`` of TF's ``padding`` attribute on an
    NHWC input of spatial ``size``."""
    padding = op.attrs.get("padding", "VALID")
    if padding == "VALID":
        return (0, 0, 0, 0)
    if padding == "EXPLICIT":
        explicit = [int(p) for p in op.attrs.get("explicit_paddings", [])]
        return (explicit[2], explicit[4], explicit[3], explicit[5])
    if padding != "SAME":
        raise ToolError(f"effective path: padding={padding!r} is not supported",
                        op_name=op.name, namespace=op.namespace)
    before, after = [], []
    for length, k, s, d in zip(size, kernel, strides, dilations):
        total = max((-(-length // s) - 1) * s + (k - 1) * d + 1 - length, 0)
        before.append(total // 2)
        after.append(total - total // 2)
    return (before[0], before[1], after[0], after[1])


def _tf_spec_layouts(op, canonical):
    """The mapping table's layouts of this TF op: ``{"input": "NHWC",
    "weight": "HWIO"}`` for ``Conv2D``."""
    spec = mapping_tables.lookup("tensorflow", op.type, canonical)
    return {} if spec is None else dict(spec.layouts)


def _tf_conv_params(op, values):
    strides = _tf_spatial(op.attrs.get("strides", [1, 1, 1, 1]))
    dilations = _tf_spatial(op.attrs.get("dilations", [1, 1, 1, 1]))
    kernel = np.shape(values[1])[:2]               # HWIO
    size = np.shape(values[0])[1:3]                # NHWC
    groups = np.shape(values[0])[3] // np.shape(values[1])[2]
    return {"strides": strides, "dilations": dilations, "groups": int(groups),
            "pads": _tf_pads(op, size, kernel, strides, dilations),
            "layouts": _tf_spec_layouts(op, "conv2d")}


def _tf_pool_params(canonical):
    def read(op, values):
        kernel = _tf_spatial(op.attrs["ksize"])
        strides = _tf_spatial(op.attrs.get("strides", [1, 1, 1, 1]))
        size = np.shape(values[0])[1:3]
        # TF's average pooling divides by the window's elements inside the input
        return {"kernel": kernel, "strides": strides, "dilations": (1, 1),
                "pads": _tf_pads(op, size, kernel, strides, (1, 1)),
                "count_include_pad": False, "layouts": _tf_spec_layouts(op, canonical)}
    return read


def _tf_linear_params(op, values):
    if op.attrs.get("transpose_a") or np.ndim(values[0]) != 2:
        raise ToolError("effective path: MatMul with transpose_a or a non-matrix input "
                        "is not supported",
                        op_name=op.name, namespace=op.namespace)
    layouts = _tf_spec_layouts(op, "linear")
    if op.attrs.get("transpose_b"):
        layouts["weight"] = "OI"
    return {"layouts": layouts}


def _tf_depthwise_params(op, values):
    params = _tf_conv_params(op, values)
    params["groups"] = int(np.shape(values[1])[2])      # HWIM: one group per channel
    params["layouts"] = _tf_spec_layouts(op, "depthwise_conv2d")
    return params


def _axes(value, rank):
    """Reduction axes (a scalar or a list, maybe negative) as sorted non-negative ints."""
    return tuple(sorted({int(a) % rank for a in np.atleast_1d(np.asarray(value))}))


def _spatial_axes(namespace, op_type):
    """The H and W axes of the input layout the mapping table gives a global
    average pooling spelled ``op_type``, or None."""
    spec = mapping_tables.lookup(namespace, op_type, "global_avg_pool2d")
    layout = None if spec is None else spec.layout("input")
    return None if layout is None else (layout.index("H"), layout.index("W"))


def _tf_mean_params(op, values):
    rank = np.ndim(values[0])
    params = {"axes": _axes(values[1], rank)}
    if rank == 4 and params["axes"] == _spatial_axes("tensorflow", op.type):
        params["type"] = "global_avg_pool2d"   # Keras GlobalAveragePooling2D
    return params


def _tf_pad_params(op, values):
    return {"before": tuple(int(p) for p in np.asarray(values[1]).reshape(-1, 2)[:, 0])}


def _tf_concat_params(op, values):
    return {"axis": int(np.asarray(values[-1])) % np.ndim(values[0]),
            "parts": range(len(values) - 1)}


def _onnx_mean_params(op, values):
    rank = np.ndim(values[0])
    axes = op.attrs.get("axes")
    if axes is None and len(values) > 1 and values[1] is not None:
        axes = values[1]
    if axes is None or np.size(axes) == 0:
        if op.attrs.get("noop_with_empty_axes", 0):
            return {"axes": ()}
        axes = range(rank)
    return {"axes": _axes(list(axes), rank)}


def _onnx_pad_params(op, values):
    if op.attrs.get("mode", "constant") != "constant":
        return {}
    pads = op.attrs.get("pads") if len(values) < 2 else values[1]
    rank = np.ndim(values[0])
    pads = [int(p) for p in np.asarray(pads).reshape(-1)]
    if len(values) > 3 and values[3] is not None:     # pads of the listed axes only
        before = [0] * rank
        axes = _axes(values[3], rank)
        for a, p in zip(axes, pads[:len(axes)]):
            before[a] = p
        return {"before": tuple(before)}
    return {"before": tuple(pads[:rank])}


def _torch_mean_params(op, values):
    bound = _bind(op, ["dim", "keepdim"])
    dim = bound.get("dim")
    rank = np.ndim(values[0])
    return {"axes": _axes(range(rank) if dim is None else dim, rank)}


def _torch_pad_params(op, values):
    bound = _bind(op, ["pad", "mode", "value"])
    if bound.get("mode", "constant") != "constant":
        return {}
    pad, rank = [int(p) for p in bound["pad"]], np.ndim(values[0])
    before = [0] * rank
    for k in range(len(pad) // 2):                     # last axis first
        before[rank - 1 - k] = pad[2 * k]
    return {"before": tuple(before)}


#: ``namespace prefix -> {canonical type: reader(op, input values) -> params}``.
PARAM_READERS = {
    "pytorch": {
        "conv2d": _torch_conv_params,
        "max_pool2d": _torch_pool_params(["kernel_size", "stride", "padding", "dilation",
                                          "ceil_mode", "return_indices"]),
        "avg_pool2d": _torch_pool_params(["kernel_size", "stride", "padding", "ceil_mode",
                                          "count_include_pad", "divisor_override"]),
        "mean": _torch_mean_params,
        "pad": _torch_pad_params,
        "cat": lambda op, values: {"axis": int(_bind(op, ["dim"]).get("dim", 0))
                                   % np.ndim(values[0]), "parts": range(len(values))},
    },
    "onnx": {
        "conv2d": _onnx_conv_params,
        "max_pool2d": _onnx_pool_params,
        "avg_pool2d": _onnx_pool_params,
        "linear": _onnx_linear_params,
        "global_avg_pool2d": lambda op, values: {"axes": _spatial_axes("onnx", op.type)},
        "reduce_mean": _onnx_mean_params,
        "pad": _onnx_pad_params,
        "concat": lambda op, values: {"axis": int(op.attrs.get("axis", 0)) % np.ndim(values[0]),
                                      "parts": range(len(values))},
    },
    "tensorflow": {
        "conv2d": _tf_conv_params,
        "max_pool2d": _tf_pool_params("max_pool2d"),
        "avg_pool2d": _tf_pool_params("avg_pool2d"),
        "linear": _tf_linear_params,
        "depthwise_conv2d": _tf_depthwise_params,
        "mean": _tf_mean_params,
        "pad": _tf_pad_params,
        "pad_v2": _tf_pad_params,
        "concat_v2": _tf_concat_params,
    },
}


def _params(op, op_type, values):
    data_format = op.attrs.get("data_format")
    if op.namespace.startswith("tensorflow") and data_format not in (None, "NHWC"):
        raise ToolError(f"effective path: data_format={data_format!r} is not supported "
                        f"(TensorFlow graphs: NHWC only)", op_name=op.name, namespace=op.namespace)
    for prefix, readers in PARAM_READERS.items():
        if op.namespace.startswith(prefix) and op_type in readers:
            return readers[op_type](op, values)
    return {}


# Where rules see weights: PyTorch's layouts.
_CANONICAL_WEIGHT = {4: "OIHW", 2: "OI"}


def _canonical_call(rule, v, layouts):
    """Run ``rule`` on canonical layouts (activations NCHW, weights OIHW/OI)
    and give input masks back in the backend's layouts; synapses stay
    canonical. ``layouts``: role (``input``, ``weight``) -> backend layout,
    from the mapping tables."""
    inputs = list(v.inputs)
    activation = layouts.get("input")
    moved = activation not in (None, "NCHW") and len(activation) == 4 and np.ndim(inputs[0]) == 4
    output, mask = v.output, v.mask
    if moved:
        inputs[0] = mapping_tables.convert_layout(inputs[0], activation, "NCHW")
        output = mapping_tables.convert_layout(output, activation, "NCHW")
        mask = mapping_tables.convert_layout(mask, activation, "NCHW")
    weight = layouts.get("weight")
    if weight == "HWIM" and len(inputs) > 1 and np.ndim(inputs[1]) == 4:
        # a depthwise filter (TF): output channel c * M + m reads channel c,
        # i.e. a grouped OIHW filter (C * M, 1, H, W), PyTorch's depthwise layout
        kh, kw, channels, multiplier = np.shape(inputs[1])
        inputs[1] = np.transpose(inputs[1], (2, 3, 0, 1)).reshape(
            channels * multiplier, 1, kh, kw)
    elif weight is not None and len(inputs) > 1 and np.ndim(inputs[1]) == len(weight):
        inputs[1] = mapping_tables.convert_layout(inputs[1], weight,
                                                  _CANONICAL_WEIGHT[len(weight)])
    result = rule(OpValues(v.op, v.type, inputs, output, mask, v.params, v.theta, v.constant))
    if result is not None and moved and 0 in result.inputs:
        result.inputs[0] = mapping_tables.convert_layout(result.inputs[0], "NCHW", activation)
    return result


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
                t in constant or (t.producer is None and _is_weight(t)) for t in op.inputs)):
            constant.update(op.outputs)
    return constant


def _is_weight(tensor):
    """Whether a graph input is a weight (an ONNX initializer, a parameter)."""
    return tensor.attrs.get("kind", "input") != "input" or "initializer" in tensor.attrs


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
            if mask is not None and not _is_weight(tensor) and mask.shape[0] == len(labels):
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
            paths = extract_paths(graph, _EagerValues(graph, values), self._type_of,
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
        found = self._types.get(_op_key(op))
        return found if found is not None else mapping_rules.canonical_type(
            op.type, mapping_rules.PYTORCH_TYPES)

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
    step traced op by op (whose ops carry an ``op_id``)."""
    return bool(graph.ops) and "op_id" not in graph.ops[0].attrs


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


def _op_key(op):
    """The stable op id of an IR op: the eager trace's ``op_id`` attr; the
    op name on graph backends (what ``context.get_op_id()`` returns there)."""
    return op.attrs.get("op_id", op.name)


class _EagerValues:
    """``value_of`` for a step: the NumPy copies the tool's routines kept, by
    stable op id; graph inputs through the ops reading them."""

    def __init__(self, graph, values):
        self.values = values
        self.cache = {}

    def __call__(self, tensor):
        found = self.cache.get(tensor)
        if found is not None:
            return found
        if tensor.producer is not None:
            entry = self.values.get(_op_key(tensor.producer))
            value = entry[1][tensor.index] if entry and tensor.index < len(entry[1]) else None
        else:
            value = None
            for op, position in tensor.uses:
                entry = self.values.get(_op_key(op))
                if entry and position < len(entry[0]):
                    value = entry[0][position]
                    break
        if value is not None:
            self.cache[tensor] = value
        return value

