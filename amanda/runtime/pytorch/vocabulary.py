"""PyTorch's op vocabulary (see :mod:`amanda.runtime.vocabulary`): how
PyTorch calls spell the canonical ops. Ops are the functions a call runs
(``get_op().__name__``: ``conv2d``, ``__add__``, ``relu_``). Importing this
module does not import torch.
"""

from __future__ import annotations

import numpy as np

from amanda.runtime.pytorch.tools import call_arguments
from amanda.runtime.vocabulary import axes, pair, snake_case

__all__ = ["FOLDED_TYPES", "INITIALISER_SCOPES", "INITIALISER_TYPES", "PARAM_READERS", "SPECS",
           "TYPES", "VARIADIC_ELEMENTWISE", "WEIGHT_CHANNELS", "check_params", "contracted",
           "formula_type", "kernel_elements", "op_type", "variable_of", "weight_grad",
           "weight_layout"]

_CONV = {"stride": "stride", "padding": "padding", "dilation": "dilation", "groups": "groups"}
_POOL = {"kernel": "kernel_size", "stride": "stride", "padding": "padding"}
_BINARY = {"input": 0, "other": 1}

#: canonical type -> (ops, input roles, layouts, attribute names)
SPECS = {
    "conv2d": (("conv2d",), {"input": 0, "weight": 1, "bias": 2},
               {"input": "NCHW", "weight": "OIHW"}, _CONV),
    "linear": (("linear",), {"input": 0, "weight": 1, "bias": 2},
               {"input": "NT", "weight": "OI"}, {}),
    "matmul": (("matmul", "mm", "bmm", "__matmul__"), {"input": 0, "other": 1}, {}, {}),
    "relu": (("relu", "relu_"), {"input": 0}),
    "gelu": (("gelu",), {"input": 0}, {}, {"approximate": "approximate"}),
    "softmax": (("softmax",), {"input": 0}, {}, {"axis": "dim"}),
    "add": (("add", "__add__", "__radd__", "add_", "__iadd__"), _BINARY),
    "mul": (("mul", "__mul__", "__rmul__", "mul_", "__imul__"), _BINARY),
    "max_pool2d": (("max_pool2d",), {"input": 0}, {"input": "NCHW"}, _POOL),
    "avg_pool2d": (("avg_pool2d",), {"input": 0}, {"input": "NCHW"}, _POOL),
    "global_avg_pool2d": (("adaptive_avg_pool2d",), {"input": 0}, {"input": "NCHW"}, {}),
    "batch_norm": (("batch_norm",), {"input": 0, "mean": 1, "variance": 2, "weight": 3,
                                     "bias": 4},
                   {"input": "NCHW"}, {"epsilon": "eps", "momentum": "momentum"}),
    "layer_norm": (("layer_norm",), {"input": 0, "weight": 1, "bias": 2}, {},
                   {"epsilon": "eps", "shape": "normalized_shape"}),
    "reshape": (("reshape", "view"), {"input": 0}, {}, {"shape": "shape"}),
    "flatten": (("flatten",), {"input": 0}, {}, {"axis": "start_dim"}),
    "transpose": (("permute", "transpose", "t"), {"input": 0}, {}, {"perm": "dims"}),
    "concat": (("cat", "concat", "concatenate"), {}, {}, {"axis": "dim"}),
    "embedding": (("embedding",), {"indices": 0, "weight": 1}, {"weight": "VT"}, {}),
}

#: op name -> the canonical type the mapping rule reports. Other ops keep
#: their own name (``__rmul__``, ``adaptive_avg_pool2d``, ``cat``: the FLOPs
#: and effective-path tables know them by it).
TYPES = {
    "conv2d": "conv2d", "linear": "linear", "matmul": "matmul", "mm": "matmul",
    "bmm": "matmul", "relu": "relu", "relu_": "relu", "add": "add", "__add__": "add",
    "__radd__": "add", "add_": "add", "__iadd__": "add", "mul": "mul", "__mul__": "mul",
    "max_pool2d": "max_pool2d", "avg_pool2d": "avg_pool2d", "softmax": "softmax",
    "reshape": "reshape", "view": "reshape", "flatten": "flatten",
    "layer_norm": "layer_norm", "batch_norm": "batch_norm",
}


def op_type(context, op):
    """The canonical type of the function a call ran."""
    name = op.__name__
    return TYPES.get(name) or snake_case(name)


def weight_layout(op, op_type, layout):
    """PyTorch weights are in their row's layout (``OIHW``, ``(out, in)``)."""
    return layout


def weight_grad(op_type, forward_op, backward_op):
    """ConvolutionBackward0 returns (input, weight, bias) gradients; a linear
    layer's weight gradient leaves AddmmBackward0/MmBackward0 transposed and
    TBackward0 turns it back into the weight's layout."""
    name = backward_op.__name__
    if op_type == "conv2d" and name == "ConvolutionBackward0":
        return 1
    if op_type == "linear" and name == "TBackward0":
        return 0
    return None


def formula_type(op_type):
    """Dunder and in-place names fold onto the plain op (``__iadd__`` ->
    ``iadd``, ``relu_`` -> ``relu``)."""
    return op_type.strip("_")


def kernel_elements(op_type, weight):
    """A weight ``(Cout, Cin/groups, k...)``: ``Cin/groups * k...``."""
    return _numel(weight[1:])


def contracted(op_type, ins, op):
    """``linear``: the weight ``(out, in)``'s ``in``; ``addmm``/``baddbmm``:
    the last axis of the first product operand (input 1); others: the last
    axis of input 0."""
    if op_type == "linear":
        return ins[1][-1]
    return (ins[1] if op_type in ("addmm", "baddbmm") else ins[0])[-1]


#: Whether the pruning and quantization tools slice this backend's weights
#: by channel (the axes come from the weight layouts).
WEIGHT_CHANNELS = True

VARIADIC_ELEMENTWISE = False


def _numel(shape):
    count = 1
    for d in shape:
        count *= d
    return count


# -- effective path: a traced call's parameters ----------------------------------------
# (the frontend's encoding of a call's non-tensor arguments is decoded by
# ``tools.call_arguments``)


def _conv_params(op, values):
    bound = call_arguments(op, ["*bias", "stride", "padding", "dilation", "groups"])
    kernel = np.shape(values[1])[2:]
    dilations = pair(bound.get("dilation"), 1)
    padding = bound.get("padding", 0)
    if padding == "valid":
        pads = (0, 0, 0, 0)
    elif padding == "same":
        total = [d * (k - 1) for d, k in zip(dilations, kernel)]
        pads = (total[0] // 2, total[1] // 2, total[0] - total[0] // 2, total[1] - total[1] // 2)
    else:
        ph, pw = pair(padding, 0)
        pads = (ph, pw, ph, pw)
    return {"strides": pair(bound.get("stride"), 1), "pads": pads, "dilations": dilations,
            "groups": int(bound.get("groups") or 1)}


def _pool_params(names):
    def read(op, values):
        bound = call_arguments(op, names)
        kernel = pair(bound.get("kernel_size"), 1)
        ph, pw = pair(bound.get("padding"), 0)
        params = {"kernel": kernel, "strides": pair(bound.get("stride"), kernel),
                  "pads": (ph, pw, ph, pw), "dilations": pair(bound.get("dilation"), 1)}
        for key in ("count_include_pad", "divisor_override"):
            if key in bound:
                params[key] = bound[key]
        return params
    return read


def _mean_params(op, values):
    dim = call_arguments(op, ["dim", "keepdim"]).get("dim")
    rank = np.ndim(values[0])
    return {"axes": axes(range(rank) if dim is None else dim, rank)}


def _pad_params(op, values):
    bound = call_arguments(op, ["pad", "mode", "value"])
    if bound.get("mode", "constant") != "constant":
        return {}
    pad, rank = [int(p) for p in bound["pad"]], np.ndim(values[0])
    before = [0] * rank
    for k in range(len(pad) // 2):                     # last axis first
        before[rank - 1 - k] = pad[2 * k]
    return {"before": tuple(before)}


def _cat_params(op, values):
    return {"axis": int(call_arguments(op, ["dim"]).get("dim", 0)) % np.ndim(values[0]),
            "parts": range(len(values))}


#: canonical type -> reader(op, input values) -> the effective-path rule's parameters
PARAM_READERS = {
    "conv2d": _conv_params,
    "max_pool2d": _pool_params(["kernel_size", "stride", "padding", "dilation",
                                "ceil_mode", "return_indices"]),
    "avg_pool2d": _pool_params(["kernel_size", "stride", "padding", "ceil_mode",
                                "count_include_pad", "divisor_override"]),
    "mean": _mean_params,
    "pad": _pad_params,
    "cat": _cat_params,
}


def check_params(op):
    """Every traced call is read as it is."""

# -- graph drawing (amanda.tools.graph_view): nothing hidden or folded ------------------

INITIALISER_TYPES = INITIALISER_SCOPES = FOLDED_TYPES = frozenset()


def variable_of(op):
    """None: weights are graph inputs here, not ops reading variables."""
    return None
