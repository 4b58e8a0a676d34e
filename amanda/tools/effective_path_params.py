"""Effective path: each backend's op parameters in the rules' canonical form, and the
values a step's routines kept (`StepValues`).

:data:`PARAM_READERS` maps a namespace prefix and a canonical op type to a
reader returning the parameters a rule of
:mod:`amanda.tools.effective_path_rules` needs (strides, pads, dilations,
axes...), whatever the backend calls them; :func:`_canonical_call` runs a
rule on canonical layouts and moves the masks back to the backend's.
"""

from __future__ import annotations

import numpy as np

from amanda.errors import ToolError
from amanda.runtime.tool_support import support_for
from amanda.tools import mapping_tables
from amanda.tools.effective_path_rules import OpValues

__all__ = ["PARAM_READERS"]


def _pair(value, default):
    if value is None or value == []:
        value = default
    if isinstance(value, (list, tuple)):
        value = [int(v) for v in value]
        return (value[0], value[0]) if len(value) == 1 else tuple(value[:2])
    return (int(value), int(value))


def _bind(op, names):
    """Name the non-tensor arguments of a traced PyTorch call (the frontend's
    encoding is decoded by the PyTorch support module)."""
    return support_for("pytorch").call_arguments(op, names)


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


def stable_op_key(op):
    """The stable op id of an IR op (what ``context.get_op_id()`` returned
    for it): the backend says; the op name by default."""
    support = support_for(op.namespace)
    return op.name if support is None else support.stable_op_id(op)


class StepValues:
    """``value_of`` for a step: the NumPy copies the tool's routines kept, by
    stable op id; graph inputs through the ops reading them."""

    def __init__(self, values):
        self.values = values
        self.cache = {}

    def __call__(self, tensor):
        found = self.cache.get(tensor)
        if found is not None:
            return found
        if tensor.producer is not None:
            entry = self.values.get(stable_op_key(tensor.producer))
            value = entry[1][tensor.index] if entry and tensor.index < len(entry[1]) else None
        else:
            value = None
            for op, position in tensor.uses:
                entry = self.values.get(stable_op_key(op))
                if entry and position < len(entry[0]):
                    value = entry[0][position]
                    break
        if value is not None:
            self.cache[tensor] = value
        return value
