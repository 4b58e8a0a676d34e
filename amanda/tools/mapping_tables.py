"""Mapping tables: one common op set across the PyTorch, TensorFlow and ONNX namespaces.

For each canonical op type the table says, per backend, which backend ops it
covers, where its tensors sit (``input``, ``weight``, ``bias``...), in which
layout (``NCHW``/``NHWC`` activations, ``OIHW``/``HWIO`` filters, ``(out, in)``
or ``(in, out)`` matrices), and what its attributes are called. Mapping rules
(:mod:`amanda.tools.mapping_rules`) read it, so a tool written against
canonical names needs one line per backend::

    MappingTool(rules=mapping_rules.RULES)          # pytorch, tensorflow, onnx

and a tool that wants more than the canonical type asks the table directly::

    spec = mapping_tables.lookup("onnx", "Conv")
    spec.canonical, spec.position("weight"), spec.layout("weight"), spec.attr("stride")
    # -> "conv2d", 1, "OIHW", "strides"

TensorFlow has no single op for ``gelu`` or ``layer_norm`` (Keras builds them
from ``Erf``/``Mul`` and ``Mean``/``Rsqrt`` ops), so those rows have no TF
entry; the subgraph rewriting tool is the way to recognise such compositions.
Keras' ``GlobalAveragePooling2D`` is one TF op, a ``Mean`` over the ``H`` and
``W`` axes of an NHWC map, so the ``global_avg_pool2d`` row lists ``Mean``
(ambiguous: other means are not pooling; the user checks the axes), and a
depthwise convolution is an ONNX ``Conv`` whose group is its channel count
(``lookup("onnx", "Conv")`` stays ``conv2d``; ``lookup("onnx", "Conv",
"depthwise_conv2d")`` gives the depthwise row).

Layouts are strings of axis letters; :func:`convert_layout` moves an array
between two of them (e.g. a TF ``HWIO`` filter to PyTorch's ``OIHW``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["BACKENDS", "TABLE", "OpSpec", "backend_ops", "convert_layout", "lookup", "specs"]

BACKENDS = ("pytorch", "tensorflow", "onnx")


@dataclass(frozen=True)
class OpSpec:
    """How one backend spells one canonical op.

    Attributes:
        canonical: the canonical op type (``"conv2d"``).
        backend: ``"pytorch"``, ``"tensorflow"`` or ``"onnx"``.
        ops: the backend's op names it covers (PyTorch function names,
            TF op types, ONNX op types).
        inputs: tensor role -> position among the op's inputs.
        layouts: tensor role -> layout (axis letters, ``N`` batch, ``C``
            channels, ``H``/``W`` spatial, ``O``/``I`` filter out/in channels,
            ``M`` depth multiplier, ``T`` tokens/features).
        attrs: canonical attribute name -> the backend's name (for PyTorch
            the function's parameter name).
    """

    canonical: str
    backend: str
    ops: tuple
    inputs: dict = field(default_factory=dict)
    layouts: dict = field(default_factory=dict)
    attrs: dict = field(default_factory=dict)

    def position(self, role):
        """Input position of ``role`` (``"weight"``...), or None."""
        return self.inputs.get(role)

    def layout(self, role):
        """Layout of the tensor in ``role``, or None when it has none."""
        return self.layouts.get(role)

    def attr(self, name):
        """The backend's name for canonical attribute ``name``, or None."""
        return self.attrs.get(name)


def _spec(canonical, **backends):
    return {backend: OpSpec(canonical, backend, *entry) for backend, entry in backends.items()}


_CONV = {"stride": "stride", "padding": "padding", "dilation": "dilation", "groups": "groups"}
_POOL_TORCH = {"kernel": "kernel_size", "stride": "stride", "padding": "padding"}
_POOL_TF = {"kernel": "ksize", "stride": "strides", "padding": "padding",
            "data_format": "data_format"}
_POOL_ONNX = {"kernel": "kernel_shape", "stride": "strides", "padding": "pads"}
_ADD = {"input": 0, "other": 1}

#: canonical type -> backend -> OpSpec
TABLE = {
    "conv2d": _spec(
        "conv2d",
        pytorch=(("conv2d",), {"input": 0, "weight": 1, "bias": 2},
                 {"input": "NCHW", "weight": "OIHW"}, _CONV),
        tensorflow=(("Conv2D",), {"input": 0, "weight": 1},
                    {"input": "NHWC", "weight": "HWIO"},
                    {"stride": "strides", "padding": "padding", "dilation": "dilations",
                     "data_format": "data_format"}),
        onnx=(("Conv",), {"input": 0, "weight": 1, "bias": 2},
              {"input": "NCHW", "weight": "OIHW"},
              {"stride": "strides", "padding": "pads", "dilation": "dilations",
               "groups": "group", "kernel": "kernel_shape"})),
    "depthwise_conv2d": _spec(
        "depthwise_conv2d",
        tensorflow=(("DepthwiseConv2dNative",), {"input": 0, "weight": 1},
                    {"input": "NHWC", "weight": "HWIM"},
                    {"stride": "strides", "padding": "padding", "dilation": "dilations"}),
        # a Conv whose group is its input channel count (``lookup("onnx", "Conv")``
        # stays conv2d: the conv2d row comes first)
        onnx=(("Conv",), {"input": 0, "weight": 1, "bias": 2},
              {"input": "NCHW", "weight": "OIHW"},
              {"stride": "strides", "padding": "pads", "dilation": "dilations",
               "groups": "group", "kernel": "kernel_shape"})),
    "linear": _spec(
        "linear",
        pytorch=(("linear",), {"input": 0, "weight": 1, "bias": 2},
                 {"input": "NT", "weight": "OI"}, {}),
        tensorflow=(("MatMul",), {"input": 0, "weight": 1}, {"input": "NT", "weight": "IO"},
                    {"transpose_weight": "transpose_b"}),
        onnx=(("Gemm", "MatMul"), {"input": 0, "weight": 1, "bias": 2},
              {"input": "NT", "weight": "IO"}, {"transpose_weight": "transB"})),
    "matmul": _spec(
        "matmul",
        pytorch=(("matmul", "mm", "bmm", "__matmul__"), {"input": 0, "other": 1}, {}, {}),
        tensorflow=(("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"),
                    {"input": 0, "other": 1}, {}, {"transpose_other": "transpose_b"}),
        onnx=(("MatMul", "Gemm"), {"input": 0, "other": 1}, {}, {})),
    "relu": _spec("relu", pytorch=(("relu", "relu_"), {"input": 0}),
                  tensorflow=(("Relu",), {"input": 0}), onnx=(("Relu",), {"input": 0})),
    "gelu": _spec("gelu", pytorch=(("gelu",), {"input": 0}, {}, {"approximate": "approximate"}),
                  onnx=(("Gelu",), {"input": 0}, {}, {"approximate": "approximate"})),
    "softmax": _spec("softmax", pytorch=(("softmax",), {"input": 0}, {}, {"axis": "dim"}),
                     tensorflow=(("Softmax",), {"input": 0}, {}, {}),
                     onnx=(("Softmax",), {"input": 0}, {}, {"axis": "axis"})),
    "add": _spec("add", pytorch=(("add", "__add__", "__radd__", "add_", "__iadd__"), _ADD),
                 tensorflow=(("AddV2", "Add"), _ADD), onnx=(("Add",), _ADD)),
    "mul": _spec("mul", pytorch=(("mul", "__mul__", "__rmul__", "mul_", "__imul__"), _ADD),
                 tensorflow=(("Mul",), _ADD), onnx=(("Mul",), _ADD)),
    "bias_add": _spec("bias_add", tensorflow=(("BiasAdd",), {"input": 0, "bias": 1},
                                              {"input": "NHWC"}, {"data_format": "data_format"})),
    "max_pool2d": _spec(
        "max_pool2d",
        pytorch=(("max_pool2d",), {"input": 0}, {"input": "NCHW"}, _POOL_TORCH),
        tensorflow=(("MaxPool",), {"input": 0}, {"input": "NHWC"}, _POOL_TF),
        onnx=(("MaxPool",), {"input": 0}, {"input": "NCHW"}, _POOL_ONNX)),
    "avg_pool2d": _spec(
        "avg_pool2d",
        pytorch=(("avg_pool2d",), {"input": 0}, {"input": "NCHW"}, _POOL_TORCH),
        tensorflow=(("AvgPool",), {"input": 0}, {"input": "NHWC"}, _POOL_TF),
        onnx=(("AveragePool",), {"input": 0}, {"input": "NCHW"}, _POOL_ONNX)),
    "global_avg_pool2d": _spec(
        "global_avg_pool2d",
        pytorch=(("adaptive_avg_pool2d",), {"input": 0}, {"input": "NCHW"}, {}),
        # a Mean over the H and W axes of an NHWC map (Keras GlobalAveragePooling2D)
        tensorflow=(("Mean",), {"input": 0, "axes": 1}, {"input": "NHWC"},
                    {"keepdims": "keep_dims"}),
        onnx=(("GlobalAveragePool",), {"input": 0}, {"input": "NCHW"}, {})),
    "batch_norm": _spec(
        "batch_norm",
        pytorch=(("batch_norm",), {"input": 0, "mean": 1, "variance": 2, "weight": 3, "bias": 4},
                 {"input": "NCHW"}, {"epsilon": "eps", "momentum": "momentum"}),
        tensorflow=(("FusedBatchNormV3", "FusedBatchNorm"),
                    {"input": 0, "weight": 1, "bias": 2, "mean": 3, "variance": 4},
                    {"input": "NHWC"}, {"epsilon": "epsilon", "data_format": "data_format"}),
        onnx=(("BatchNormalization",), {"input": 0, "weight": 1, "bias": 2, "mean": 3,
                                        "variance": 4},
              {"input": "NCHW"}, {"epsilon": "epsilon", "momentum": "momentum"})),
    "layer_norm": _spec(
        "layer_norm",
        pytorch=(("layer_norm",), {"input": 0, "weight": 1, "bias": 2}, {},
                 {"epsilon": "eps", "shape": "normalized_shape"}),
        onnx=(("LayerNormalization",), {"input": 0, "weight": 1, "bias": 2}, {},
              {"epsilon": "epsilon", "axis": "axis"})),
    "reshape": _spec("reshape", pytorch=(("reshape", "view"), {"input": 0}, {}, {"shape": "shape"}),
                     tensorflow=(("Reshape",), {"input": 0, "shape": 1}),
                     onnx=(("Reshape",), {"input": 0, "shape": 1})),
    "flatten": _spec("flatten", pytorch=(("flatten",), {"input": 0}, {}, {"axis": "start_dim"}),
                     onnx=(("Flatten",), {"input": 0}, {}, {"axis": "axis"})),
    "transpose": _spec(
        "transpose",
        pytorch=(("permute", "transpose", "t"), {"input": 0}, {}, {"perm": "dims"}),
        tensorflow=(("Transpose",), {"input": 0, "perm": 1}),
        onnx=(("Transpose",), {"input": 0}, {}, {"perm": "perm"})),
    "concat": _spec("concat", pytorch=(("cat", "concat", "concatenate"), {}, {}, {"axis": "dim"}),
                    tensorflow=(("ConcatV2",), {}, {}, {}),
                    onnx=(("Concat",), {}, {}, {"axis": "axis"})),
    "embedding": _spec(
        "embedding",
        pytorch=(("embedding",), {"indices": 0, "weight": 1}, {"weight": "VT"}, {}),
        tensorflow=(("ResourceGather", "GatherV2"), {"weight": 0, "indices": 1},
                    {"weight": "VT"}, {}),
        onnx=(("Gather",), {"weight": 0, "indices": 1}, {"weight": "VT"}, {"axis": "axis"})),
}

# names the op type alone cannot decide: the mapping rule looks at the inputs
AMBIGUOUS = {"tensorflow": {"MatMul": ("linear", "matmul"), "GatherV2": ("embedding", None),
                            "Mean": ("global_avg_pool2d", None)},
             "onnx": {"MatMul": ("linear", "matmul"), "Gemm": ("linear", "matmul"),
                      "Gather": ("embedding", None), "Conv": ("conv2d", "depthwise_conv2d")}}


def _index():
    index = {backend: {} for backend in BACKENDS}
    for backends in TABLE.values():
        for backend, spec in backends.items():
            for name in spec.ops:
                index[backend].setdefault(name, spec)
    return index


_INDEX = _index()


def _backend(namespace):
    return namespace.split("/", 1)[0]


def lookup(namespace, op_name, canonical=None):
    """The :class:`OpSpec` of a backend op, or None when the table has none.

    Args:
        namespace: a backend (``"onnx"``) or a full context namespace.
        op_name: the backend's op name (``"Conv"``, ``"conv2d"``, ``"Conv2D"``).
        canonical: pick this canonical type where the name is ambiguous
            (a ``MatMul`` is ``"linear"`` when its second input is a weight).
    """
    backend = _backend(namespace)
    if canonical is not None:
        spec = TABLE.get(canonical, {}).get(backend)
        return spec if spec is not None and op_name in spec.ops else None
    return _INDEX.get(backend, {}).get(op_name)


def backend_ops(backend):
    """``{op name: OpSpec}`` of every op of one backend that the table names.

    Args:
        backend: ``"pytorch"``, ``"tensorflow"`` or ``"onnx"`` (or a full
            context namespace).

    Returns:
        A new dict; empty for a backend the table does not know.
    """
    return dict(_INDEX.get(_backend(backend), {}))


def specs(canonical):
    """backend -> :class:`OpSpec` for one canonical type."""
    return dict(TABLE.get(canonical, {}))


def convert_layout(array, source, target):
    """Transpose ``array`` from one layout to another (same axis letters).

    >>> convert_layout(np.zeros((3, 3, 16, 32)), "HWIO", "OIHW").shape
    (32, 16, 3, 3)
    """
    if sorted(source) != sorted(target):
        raise ValueError(f"layouts {source!r} and {target!r} do not have the same axes")
    return np.transpose(np.asarray(array), [source.index(axis) for axis in target])
