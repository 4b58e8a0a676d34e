"""Effective path: selecting critical neurons, and the per-op rules that
trace a mask of critical output neurons back to the critical inputs and
synapses (:data:`RULES`, keyed by canonical op type, plus the op-type sets
the path extraction treats specially). Rules see canonical layouts (NCHW
activations, OIHW/OI weights); :mod:`amanda.tools.effective_path_params`
reads each backend's parameters and moves layouts. See
:mod:`amanda.tools.effective_path`, which re-exports these names.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["CONSTANT_TYPES", "INPUT_TYPES", "PASS_THROUGH_TYPES", "RESHAPE_TYPES", "RULES",
           "WEIGHT_SOURCE_TYPES", "Extraction", "OpValues", "select_contributions"]

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
