"""TensorFlow's op vocabulary (see :mod:`amanda.runtime.vocabulary`): how
TF graph ops (``tf.Operation.type``) spell the canonical ops. Importing this
module does not import TensorFlow.

TensorFlow has no single op for ``gelu`` or ``layer_norm`` (Keras builds
them from ``Erf``/``Mul`` and ``Mean``/``Rsqrt`` ops), so those rows are
missing; the subgraph rewriting tool is the way to recognise such
compositions. Keras' ``GlobalAveragePooling2D`` is one ``Mean`` over the
``H`` and ``W`` axes of an NHWC map, so the ``global_avg_pool2d`` row lists
``Mean`` (ambiguous: other means are not pooling; the user checks the axes).
"""

from __future__ import annotations

import numpy as np

from amanda.runtime.vocabulary import Unsupported, axes, snake_case

__all__ = ["FOLDED_TYPES", "INITIALISER_SCOPES", "INITIALISER_TYPES", "PARAM_READERS", "SPECS",
           "TYPES", "VARIADIC_ELEMENTWISE", "WEIGHT_CHANNELS", "check_params", "contracted",
           "formula_type", "kernel_elements", "op_type", "variable_of", "weight_grad",
           "weight_layout"]

_POOL = {"kernel": "ksize", "stride": "strides", "padding": "padding",
         "data_format": "data_format"}
_BINARY = {"input": 0, "other": 1}
_CONV = {"stride": "strides", "padding": "padding", "dilation": "dilations"}

#: canonical type -> (ops, input roles, layouts, attribute names)
SPECS = {
    "conv2d": (("Conv2D",), {"input": 0, "weight": 1}, {"input": "NHWC", "weight": "HWIO"},
               {**_CONV, "data_format": "data_format"}),
    "linear": (("MatMul",), {"input": 0, "weight": 1}, {"input": "NT", "weight": "IO"},
               {"transpose_weight": "transpose_b"}),
    "matmul": (("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"),
               {"input": 0, "other": 1}, {}, {"transpose_other": "transpose_b"}),
    "relu": (("Relu",), {"input": 0}),
    "softmax": (("Softmax",), {"input": 0}, {}, {}),
    "add": (("AddV2", "Add"), _BINARY),
    "mul": (("Mul",), _BINARY),
    "max_pool2d": (("MaxPool",), {"input": 0}, {"input": "NHWC"}, _POOL),
    "avg_pool2d": (("AvgPool",), {"input": 0}, {"input": "NHWC"}, _POOL),
    "global_avg_pool2d": (("Mean",), {"input": 0, "axes": 1}, {"input": "NHWC"},
                          {"keepdims": "keep_dims"}),
    "batch_norm": (("FusedBatchNormV3", "FusedBatchNorm"),
                   {"input": 0, "weight": 1, "bias": 2, "mean": 3, "variance": 4},
                   {"input": "NHWC"}, {"epsilon": "epsilon", "data_format": "data_format"}),
    "reshape": (("Reshape",), {"input": 0, "shape": 1}),
    "transpose": (("Transpose",), {"input": 0, "perm": 1}),
    "concat": (("ConcatV2",), {}, {}, {}),
    "embedding": (("ResourceGather", "GatherV2"), {"weight": 0, "indices": 1},
                  {"weight": "VT"}, {}),
    "depthwise_conv2d": (("DepthwiseConv2dNative",), {"input": 0, "weight": 1},
                         {"input": "NHWC", "weight": "HWIM"}, _CONV),
    "bias_add": (("BiasAdd",), {"input": 0, "bias": 1}, {"input": "NHWC"},
                 {"data_format": "data_format"}),
}

#: op type -> the canonical type the mapping rule reports (``MatMul`` is
#: decided by its inputs); other ops keep their type in snake case.
TYPES = {
    "Conv2D": "conv2d", "DepthwiseConv2dNative": "depthwise_conv2d",
    "BatchMatMul": "matmul", "BatchMatMulV2": "matmul", "BatchMatMulV3": "matmul",
    "Relu": "relu", "AddV2": "add", "Add": "add", "Mul": "mul", "MaxPool": "max_pool2d",
    "AvgPool": "avg_pool2d", "Softmax": "softmax", "Reshape": "reshape",
    "FusedBatchNormV3": "batch_norm", "BiasAdd": "bias_add",
}

# Gradient ops computing a convolution's filter gradient (output 0).
_FILTER_GRADS = frozenset({"Conv2DBackpropFilter", "Conv2DBackpropFilterV2",
                           "DepthwiseConv2dNativeBackpropFilter"})
# Ops a weight passes through between its variable and its reader.
_VARIABLE_READS = frozenset({"ReadVariableOp", "VariableV2", "VarHandleOp"})
_PASS_THROUGH = frozenset({"Identity", "Cast"})


def op_type(context, op):
    """The canonical type of a ``tf.Operation``: a ``MatMul`` whose second
    input is read from a variable is ``"linear"``, other ``MatMul``s
    ``"matmul"``."""
    if op.type == "MatMul":
        return "linear" if _reads_variable(op.inputs[1]) else "matmul"
    return TYPES.get(op.type) or snake_case(op.type)


def _reads_variable(tensor):
    """Whether ``tensor`` is a variable's value (through Identity/Cast)."""
    op = tensor.op
    while op.type in _PASS_THROUGH and op.inputs:
        op = op.inputs[0].op
    return op.type in _VARIABLE_READS


def weight_layout(op, op_type, layout):
    """A ``MatMul`` with ``transpose_b`` reads its weight as ``(out, in)``."""
    if op_type == "linear" and op.get_attr("transpose_b"):
        return "OI"
    return layout


def weight_grad(op_type, forward, backward):
    """Output 0 of a filter-gradient op; output 0 of the gradient ``MatMul``
    that reads the forward ``MatMul``'s activation input."""
    if op_type in ("conv2d", "depthwise_conv2d") and backward.type in _FILTER_GRADS:
        return 0
    if op_type == "linear" and backward.type == "MatMul":
        # MatMul's gradient function makes two MatMuls: the one reading the
        # activation (input 0) computes the weight's gradient, the one reading
        # the weight computes the activation's
        # (names, not ``in``: ``==`` on a graph tensor would add an op)
        reads = {t.name for t in backward.inputs}
        if forward.inputs[0].name in reads and forward.inputs[1].name not in reads:
            return 0
    return None


# snake-case TF op types whose formula-table name differs
_FORMULA_NAMES = {"batch_mat_mul_v2": "matmul", "batch_mat_mul_v3": "matmul",
                  "fused_batch_norm": "batch_norm", "fused_batch_norm_v2": "batch_norm",
                  "add_v2": "add", "real_div": "div", "max_pool2d": "max_pool2d",
                  "conv2_d": "conv2d", "identity": "identity"}


def formula_type(op_type):
    """The FLOPs table's name of a TF type (``add_v2`` -> ``add``)."""
    name = op_type.strip("_")
    return _FORMULA_NAMES.get(name, name)


def kernel_elements(op_type, weight):
    """A filter ``HWIO``: ``KH*KW*Cin``; a depthwise filter ``HWIM``: ``KH*KW``."""
    kept = weight[:2] if op_type == "depthwise_conv2d" else weight[:-1]
    count = 1
    for d in kept:
        count *= d
    return count


def contracted(op_type, ins, op):
    """``MatMul``: A's columns (rows with ``transpose_a``); ``BatchMatMul*``:
    A's last axis (second to last with ``adj_x``)."""
    a = ins[0]
    if op.type == "MatMul":
        return a[0] if _attr(op, "transpose_a") else a[1]
    return a[-2] if _attr(op, "adj_x") else a[-1]


def _attr(op, name, default=False):
    try:
        return op.get_attr(name)
    except Exception:  # noqa: BLE001 - any TF error means "no such attr"
        return default


#: Whether the pruning and quantization tools slice this backend's weights
#: by channel (the axes come from the weight layouts).
WEIGHT_CHANNELS = True

VARIADIC_ELEMENTWISE = False


# -- effective path: a lifted op's parameters (its attributes, ``op.attrs``) ------------


def _spatial(values):
    """``(height, width)`` of an NHWC attribute list (``[1, h, w, 1]``)."""
    return int(values[1]), int(values[2])


def _pads(op, size, kernel, strides, dilations):
    """``(top, left, bottom, right)`` of the ``padding`` attribute on an
    NHWC input of spatial ``size``."""
    padding = op.attrs.get("padding", "VALID")
    if padding == "VALID":
        return (0, 0, 0, 0)
    if padding == "EXPLICIT":
        explicit = [int(p) for p in op.attrs.get("explicit_paddings", [])]
        return (explicit[2], explicit[4], explicit[3], explicit[5])
    if padding != "SAME":
        raise Unsupported(f"padding={padding!r} is not supported")
    before, after = [], []
    for length, k, s, d in zip(size, kernel, strides, dilations):
        total = max((-(-length // s) - 1) * s + (k - 1) * d + 1 - length, 0)
        before.append(total // 2)
        after.append(total - total // 2)
    return (before[0], before[1], after[0], after[1])


def _layouts(op, canonical):
    """The row's layouts of this op (``{"input": "NHWC", "weight": "HWIO"}``
    for ``Conv2D``), or ``{}`` when the row does not name it."""
    ops, _, layouts, _ = SPECS[canonical]
    return dict(layouts) if op.type in ops else {}


def _conv_params(op, values):
    strides = _spatial(op.attrs.get("strides", [1, 1, 1, 1]))
    dilations = _spatial(op.attrs.get("dilations", [1, 1, 1, 1]))
    kernel = np.shape(values[1])[:2]               # HWIO
    size = np.shape(values[0])[1:3]                # NHWC
    groups = np.shape(values[0])[3] // np.shape(values[1])[2]
    return {"strides": strides, "dilations": dilations, "groups": int(groups),
            "pads": _pads(op, size, kernel, strides, dilations),
            "layouts": _layouts(op, "conv2d")}


def _pool_params(canonical):
    def read(op, values):
        kernel = _spatial(op.attrs["ksize"])
        strides = _spatial(op.attrs.get("strides", [1, 1, 1, 1]))
        size = np.shape(values[0])[1:3]
        # average pooling divides by the window's elements inside the input
        return {"kernel": kernel, "strides": strides, "dilations": (1, 1),
                "pads": _pads(op, size, kernel, strides, (1, 1)),
                "count_include_pad": False, "layouts": _layouts(op, canonical)}
    return read


def _linear_params(op, values):
    if op.attrs.get("transpose_a") or np.ndim(values[0]) != 2:
        raise Unsupported("MatMul with transpose_a or a non-matrix input is not supported")
    layouts = _layouts(op, "linear")
    if op.attrs.get("transpose_b"):
        layouts["weight"] = "OI"
    return {"layouts": layouts}


def _depthwise_params(op, values):
    params = _conv_params(op, values)
    params["groups"] = int(np.shape(values[1])[2])      # HWIM: one group per channel
    params["layouts"] = _layouts(op, "depthwise_conv2d")
    return params


def _mean_params(op, values):
    rank = np.ndim(values[0])
    params = {"axes": axes(values[1], rank)}
    layout = _layouts(op, "global_avg_pool2d").get("input")
    if rank == 4 and layout is not None \
            and params["axes"] == (layout.index("H"), layout.index("W")):
        params["type"] = "global_avg_pool2d"   # Keras GlobalAveragePooling2D
    return params


def _pad_params(op, values):
    return {"before": tuple(int(p) for p in np.asarray(values[1]).reshape(-1, 2)[:, 0])}


def _concat_params(op, values):
    return {"axis": int(np.asarray(values[-1])) % np.ndim(values[0]),
            "parts": range(len(values) - 1)}


#: canonical type -> reader(op, input values) -> the effective-path rule's parameters
PARAM_READERS = {
    "conv2d": _conv_params,
    "max_pool2d": _pool_params("max_pool2d"),
    "avg_pool2d": _pool_params("avg_pool2d"),
    "linear": _linear_params,
    "depthwise_conv2d": _depthwise_params,
    "mean": _mean_params,
    "pad": _pad_params,
    "pad_v2": _pad_params,
    "concat_v2": _concat_params,
}


def check_params(op):
    """Only NHWC graphs are read (a ``data_format`` attribute of ``NCHW`` is refused)."""
    data_format = op.attrs.get("data_format")
    if data_format not in (None, "NHWC"):
        raise Unsupported(f"data_format={data_format!r} is not supported "
                          f"(TensorFlow graphs: NHWC only)")

# -- graph drawing (amanda.tools.graph_view) -------------------------------------------

#: ops that initialise or save variables: hidden, with every op only they read
INITIALISER_TYPES = frozenset({"Assign", "AssignVariableOp", "VarIsInitializedOp",
                               "IsVariableInitialized", "NoOp"})
#: name scopes of initialisers and savers (``dense/kernel/Initializer/...``)
INITIALISER_SCOPES = frozenset({"Initializer", "IsInitialized", "Assign", "save", "init"})
#: ops drawn as parameters of the ops reading them: constants, variables
FOLDED_TYPES = frozenset({"Const", "VarHandleOp", "VariableV2", "Variable"})


def variable_of(op):
    """The variable handle op a ``ReadVariableOp`` IR op reads, or None."""
    if op.type == "ReadVariableOp" and op.inputs and op.inputs[0].producer is not None \
            and op.inputs[0].producer.type == "VarHandleOp":
        return op.inputs[0].producer
    return None
