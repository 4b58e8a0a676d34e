"""ONNX's op vocabulary (see :mod:`amanda.runtime.vocabulary`): how ONNX
nodes (``NodeProto.op_type``) spell the canonical ops. Importing this module
imports neither onnx nor onnxruntime.

A depthwise convolution is a ``Conv`` whose group is its channel count:
``Conv`` reads as ``conv2d`` (its first row), and the ``depthwise_conv2d``
row is found by asking for it. ``MatMul``/``Gemm``/``Gather`` are decided by
whether their weight input is an initializer.
"""

from __future__ import annotations

import numpy as np

from amanda.runtime.onnx.tools import initializer, int_attribute
from amanda.runtime.vocabulary import Unsupported, axes, snake_case

__all__ = ["FOLDED_TYPES", "INITIALISER_SCOPES", "INITIALISER_TYPES", "PARAM_READERS", "SPECS",
           "TYPES", "VARIADIC_ELEMENTWISE", "WEIGHT_CHANNELS", "check_params", "contracted",
           "formula_type", "kernel_elements", "op_type", "variable_of", "weight_grad",
           "weight_layout"]

_CONV = ({"input": 0, "weight": 1, "bias": 2}, {"input": "NCHW", "weight": "OIHW"},
         {"stride": "strides", "padding": "pads", "dilation": "dilations",
          "groups": "group", "kernel": "kernel_shape"})
_POOL = {"kernel": "kernel_shape", "stride": "strides", "padding": "pads"}
_BINARY = {"input": 0, "other": 1}

#: canonical type -> (ops, input roles, layouts, attribute names)
SPECS = {
    "conv2d": (("Conv",), *_CONV),
    "depthwise_conv2d": (("Conv",), *_CONV),
    "linear": (("Gemm", "MatMul"), {"input": 0, "weight": 1, "bias": 2},
               {"input": "NT", "weight": "IO"}, {"transpose_weight": "transB"}),
    "matmul": (("MatMul", "Gemm"), {"input": 0, "other": 1}, {}, {}),
    "relu": (("Relu",), {"input": 0}),
    "gelu": (("Gelu",), {"input": 0}, {}, {"approximate": "approximate"}),
    "softmax": (("Softmax",), {"input": 0}, {}, {"axis": "axis"}),
    "add": (("Add",), _BINARY),
    "mul": (("Mul",), _BINARY),
    "max_pool2d": (("MaxPool",), {"input": 0}, {"input": "NCHW"}, _POOL),
    "avg_pool2d": (("AveragePool",), {"input": 0}, {"input": "NCHW"}, _POOL),
    "global_avg_pool2d": (("GlobalAveragePool",), {"input": 0}, {"input": "NCHW"}, {}),
    "batch_norm": (("BatchNormalization",), {"input": 0, "weight": 1, "bias": 2, "mean": 3,
                                             "variance": 4},
                   {"input": "NCHW"}, {"epsilon": "epsilon", "momentum": "momentum"}),
    "layer_norm": (("LayerNormalization",), {"input": 0, "weight": 1, "bias": 2}, {},
                   {"epsilon": "epsilon", "axis": "axis"}),
    "reshape": (("Reshape",), {"input": 0, "shape": 1}),
    "flatten": (("Flatten",), {"input": 0}, {}, {"axis": "axis"}),
    "transpose": (("Transpose",), {"input": 0}, {}, {"perm": "perm"}),
    "concat": (("Concat",), {}, {}, {"axis": "axis"}),
    "embedding": (("Gather",), {"weight": 0, "indices": 1}, {"weight": "VT"}, {"axis": "axis"}),
}


def _types():
    found = {}
    for canonical, (ops, *_) in SPECS.items():
        for name in ops:
            found.setdefault(name, canonical)
    return found


#: op type -> the canonical type the mapping rule reports: each op's first row
TYPES = _types()


def _initializer(context, position):
    """The initializer (the frontend's holder of an ``onnx.TensorProto``)
    feeding input ``position`` of the context's node, or None."""
    ir_op = context.get_ir_op()
    if ir_op is None or position >= len(ir_op.inputs):
        return None
    return initializer(ir_op.inputs[position])


def op_type(context, node):
    """The canonical type of a node: a ``MatMul``/``Gemm`` whose second input
    is an initializer is ``"linear"`` (else ``"matmul"``), a ``Gather`` of an
    initializer ``"embedding"`` (else ``"gather"``)."""
    if node.op_type in ("MatMul", "Gemm"):
        return "linear" if _initializer(context, 1) is not None else "matmul"
    if node.op_type == "Gather":
        return "embedding" if _initializer(context, 0) is not None else "gather"
    return TYPES.get(node.op_type) or snake_case(node.op_type)


def weight_layout(node, op_type, layout):
    """A ``Gemm`` with ``transB`` reads its weight as ``(out, in)``."""
    if op_type == "linear" and node.op_type == "Gemm" and int_attribute(node, "transB"):
        return "OI"
    return layout


def weight_grad(op_type, forward_op, backward_op):
    """None: ONNX graphs are inference graphs, without backward ops."""
    return None


# snake-case ONNX types whose name means something else in the FLOPs table:
# the variadic element-wise Sum/Max/Min/Mean, the Reduce* ops, the normalisations
_FORMULA_NAMES = {"sum": "add", "max": "maximum", "min": "minimum", "mean": "average",
                  "reduce_sum": "sum", "reduce_mean": "mean", "reduce_max": "max",
                  "reduce_min": "min", "reduce_prod": "prod", "reduce_l2": "norm",
                  "arg_max": "argmax", "arg_min": "argmin",
                  "instance_normalization": "instance_norm",
                  "group_normalization": "group_norm"}


def formula_type(op_type):
    """The FLOPs table's name of an ONNX type (``reduce_mean`` -> ``mean``)."""
    return _FORMULA_NAMES.get(op_type, op_type)


def kernel_elements(op_type, weight):
    """A weight ``(Cout, Cin/group, k...)``: ``Cin/group * k...``."""
    count = 1
    for d in weight[1:]:
        count *= d
    return count


def contracted(op_type, ins, node):
    """``Gemm``: A ``(M, K)``, or ``(K, M)`` with ``transA``; ``MatMul``
    (NumPy semantics): A's last axis."""
    a = ins[0]
    if getattr(node, "op_type", None) == "Gemm":
        return a[0] if int_attribute(node, "transA") else a[1]
    return a[-1]


#: Whether the pruning and quantization tools slice this backend's weights
#: by channel (the axes come from the weight layouts; ONNX: not yet).
WEIGHT_CHANNELS = False

VARIADIC_ELEMENTWISE = True


# -- effective path: a lifted node's parameters (its attributes, ``op.attrs``) ----------


def _conv_params(op, values):
    attrs, rank = op.attrs, np.ndim(values[1]) - 2
    if attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        raise Unsupported(f"auto_pad={attrs['auto_pad']!r} is not supported")
    return {"strides": tuple(attrs.get("strides", [1] * rank)),
            "pads": tuple(attrs.get("pads", [0] * 2 * rank)),
            "dilations": tuple(attrs.get("dilations", [1] * rank)),
            "groups": int(attrs.get("group", 1))}


def _pool_params(op, values):
    attrs = op.attrs
    kernel = tuple(attrs["kernel_shape"])
    return {"kernel": kernel, "strides": tuple(attrs.get("strides", [1] * len(kernel))),
            "pads": tuple(attrs.get("pads", [0] * 2 * len(kernel))),
            "dilations": tuple(attrs.get("dilations", [1] * len(kernel))),
            "count_include_pad": bool(attrs.get("count_include_pad", 0))}


def _linear_params(op, values):
    if op.type == "Gemm" and (op.attrs.get("transA", 0) or np.ndim(values[0]) != 2):
        raise Unsupported("Gemm with transA is not supported")
    layout = "OI" if op.type == "Gemm" and op.attrs.get("transB", 0) else "IO"
    return {"layouts": {"weight": layout}}


def _global_pool_params(op, values):
    ops, _, layouts, _ = SPECS["global_avg_pool2d"]
    layout = layouts["input"] if op.type in ops else None       # NCHW
    return {"axes": None if layout is None else (layout.index("H"), layout.index("W"))}


def _mean_params(op, values):
    rank = np.ndim(values[0])
    found = op.attrs.get("axes")
    if found is None and len(values) > 1 and values[1] is not None:
        found = values[1]
    if found is None or np.size(found) == 0:
        if op.attrs.get("noop_with_empty_axes", 0):
            return {"axes": ()}
        found = range(rank)
    return {"axes": axes(list(found), rank)}


def _pad_params(op, values):
    if op.attrs.get("mode", "constant") != "constant":
        return {}
    pads = op.attrs.get("pads") if len(values) < 2 else values[1]
    rank = np.ndim(values[0])
    pads = [int(p) for p in np.asarray(pads).reshape(-1)]
    if len(values) > 3 and values[3] is not None:     # pads of the listed axes only
        before = [0] * rank
        listed = axes(values[3], rank)
        for a, p in zip(listed, pads[:len(listed)]):
            before[a] = p
        return {"before": tuple(before)}
    return {"before": tuple(pads[:rank])}


def _concat_params(op, values):
    return {"axis": int(op.attrs.get("axis", 0)) % np.ndim(values[0]),
            "parts": range(len(values))}


#: canonical type -> reader(op, input values) -> the effective-path rule's parameters
PARAM_READERS = {
    "conv2d": _conv_params,
    "max_pool2d": _pool_params,
    "avg_pool2d": _pool_params,
    "linear": _linear_params,
    "global_avg_pool2d": _global_pool_params,
    "reduce_mean": _mean_params,
    "pad": _pad_params,
    "concat": _concat_params,
}


def check_params(op):
    """Every node is read as it is (readers refuse what they do not cover)."""

# -- graph drawing (amanda.tools.graph_view): nothing hidden or folded ------------------

INITIALISER_TYPES = INITIALISER_SCOPES = FOLDED_TYPES = frozenset()


def variable_of(op):
    """None: weights are graph inputs here, not ops reading variables."""
    return None
