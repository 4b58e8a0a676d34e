"""Portable routines as ONNX nodes: the ONNX lowering of ``amanda/portable`` graphs.

:mod:`amanda.portable` traces a routine written with its vocabulary into a
small IR graph; :class:`PortableEmitter` writes that graph as ONNX nodes and
initializers into the model being lowered by :mod:`amanda.runtime.onnx`
(int8/uint8 ``fake_quant`` as a QuantizeLinear/DequantizeLinear pair, other
ops one by one). What has no ONNX counterpart at the model's opset raises
:class:`NotNative`, and the routine is hosted as a Python callback instead.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper


def elem_type(dtype):
    """The ONNX element type of a dtype name or NumPy dtype."""
    return _ELEM_TYPES[dtype] if dtype in _ELEM_TYPES else helper.np_dtype_to_tensor_dtype(
        np.dtype(dtype))


_T = TensorProto
_ELEM_TYPES = {"float32": _T.FLOAT, "float64": _T.DOUBLE, "float16": _T.FLOAT16,
               "bfloat16": _T.BFLOAT16, "int8": _T.INT8, "int16": _T.INT16,
               "int32": _T.INT32, "int64": _T.INT64, "uint8": _T.UINT8,
               "uint16": _T.UINT16, "uint32": _T.UINT32, "uint64": _T.UINT64,
               "bool": _T.BOOL, "string": _T.STRING}


class NotNative(Exception):
    """A portable routine uses something the model's opset cannot express."""


class PortableEmitter:
    """Writes one traced portable routine (an ``amanda/portable`` IR graph)
    as ONNX nodes and initializers of the graph being lowered."""

    def __init__(self, lowering, routine_op, where):
        self.lowering = lowering
        self.routine = routine_op
        self.where = where
        self.opset = lowering.opset
        self.base = f"{where[1]}/amanda.{routine_op.attrs['kind']}"
        self.values = {}     # traced tensor -> ONNX name, or _Constant
        self.constants = {}  # traced tensor -> ndarray

    def emit(self, traced):
        lowering, routine = self.lowering, self.routine
        for tensor, source in zip(traced.inputs, routine.inputs):
            self.values[tensor] = lowering.name(source)
        final = {}
        for position, tensor in enumerate(traced.outputs):
            if tensor not in final and tensor.producer is not None \
                    and tensor.producer.type != "constant":
                final[tensor] = position
        for op in traced.ops:
            out = op.outputs[0]
            if op.type == "constant":
                self.constants[out] = np.asarray(op.attrs["value"])
                continue
            rule = _RULES.get(op.type)
            if rule is None:
                raise NotNative(f"no ONNX lowering for portable op {op.type!r}")
            target = (lowering.name(routine.outputs[final[out]]) if out in final
                      else lowering.fresh(f"{self.base}/{op.type}"))
            rule(self, op, target)
            self.values[out] = target
        for position, tensor in enumerate(traced.outputs):
            if final.get(tensor) != position:
                lowering._alias(routine.outputs[position], self.name(tensor))

    # helpers for rules
    def name(self, tensor):
        """The ONNX name of a traced tensor (constants become initializers)."""
        value = self.values.get(tensor)
        if value is None:
            value = self.values[tensor] = self.lowering.add_initializer(
                self.constants[tensor], f"{self.base}/const")
        return value

    def const(self, array, dtype=None):
        array = np.asarray(array) if dtype is None else np.asarray(array, dtype=dtype)
        return self.lowering.add_initializer(array, f"{self.base}/const")

    def node(self, op_type, inputs, output=None, **attrs):
        output = output or self.lowering.fresh(f"{self.base}/{op_type}")
        self.lowering.add_node(op_type, inputs, [output], f"{self.base}/{op_type}", **attrs)
        return output

    def need(self, version, what):
        if self.opset < version:
            raise NotNative(f"{what} needs ONNX opset {version}, the model uses {self.opset}")


def _simple(onnx_type, version=1):
    def rule(emitter, op, target):
        emitter.need(version, onnx_type)
        emitter.node(onnx_type, [emitter.name(t) for t in op.inputs], target)
    return rule


def _negated(onnx_type, version=1):
    def rule(emitter, op, target):
        emitter.need(version, onnx_type)
        inner = emitter.node(onnx_type, [emitter.name(t) for t in op.inputs])
        emitter.node("Not", [inner], target)
    return rule


def _ordered(newer, fallback, version):
    """LessOrEqual/GreaterOrEqual from opset 12, Not(Greater)/Not(Less) before."""
    def rule(emitter, op, target):
        inputs = [emitter.name(t) for t in op.inputs]
        if emitter.opset >= version:
            emitter.node(newer, inputs, target)
        else:
            emitter.node("Not", [emitter.node(fallback, inputs)], target)
    return rule


def _min_max_version(op):
    return 8 if op.outputs[0].attrs.get("dtype") in ("float32", "float64", "float16") else 12


def _clip(emitter, op, target):
    emitter.need(_min_max_version(op), "Min/Max")
    x, lo, hi = (emitter.name(t) for t in op.inputs)
    emitter.node("Min", [emitter.node("Max", [x, lo]), hi], target)


def _minmax(onnx_type):
    def rule(emitter, op, target):
        emitter.need(_min_max_version(op), onnx_type)
        emitter.node(onnx_type, [emitter.name(t) for t in op.inputs], target)
    return rule


def _cast(emitter, op, target):
    emitter.node("Cast", [emitter.name(op.inputs[0])], target, to=elem_type(op.attrs["dtype"]))


def _quant_params(emitter, op, dtype):
    """Names of (scale, zero point) for Q/DQ: scale float32, zero point of
    ``dtype``, both scalars (per tensor) or 1-D (per axis)."""
    _, scale, zero = op.inputs
    axis = op.attrs.get("axis")
    if axis is not None:
        emitter.need(13, "per-axis QuantizeLinear")
    if scale in emitter.constants:
        value = emitter.constants[scale].astype(np.float32)
        scale_name = emitter.const(value.reshape(()) if axis is None else value.reshape(-1))
    else:
        if scale.attrs.get("dtype") != "float32":
            raise NotNative("QuantizeLinear needs a float32 scale")
        scale_name = emitter.name(scale)
    if zero in emitter.constants:
        value = np.round(emitter.constants[zero]).astype(dtype)
        zero_name = emitter.const(value.reshape(()) if axis is None else value.reshape(-1))
    else:
        zero_name = emitter.node("Cast", [emitter.name(zero)], to=elem_type(dtype))
    return scale_name, zero_name, ({} if axis is None else {"axis": axis})


def _quantize(emitter, op, target):
    emitter.need(10, "QuantizeLinear")
    dtype = op.attrs["dtype"]
    if dtype not in ("int8", "uint8"):
        emitter.need(21, f"QuantizeLinear to {dtype}")
    if op.inputs[0].attrs.get("dtype") != "float32":
        raise NotNative("QuantizeLinear here needs a float32 input")
    scale, zero, axis = _quant_params(emitter, op, dtype)
    emitter.node("QuantizeLinear", [emitter.name(op.inputs[0]), scale, zero], target, **axis)


def _dequantize(emitter, op, target):
    emitter.need(10, "DequantizeLinear")
    dtype = op.inputs[0].attrs.get("dtype")
    if dtype not in ("int8", "uint8", "int32"):
        raise NotNative(f"DequantizeLinear of {dtype}")
    scale, zero, axis = _quant_params(emitter, op, dtype)
    out_dtype = op.attrs.get("dtype", "float32")
    if out_dtype == "float32":
        emitter.node("DequantizeLinear", [emitter.name(op.inputs[0]), scale, zero], target, **axis)
    else:
        value = emitter.node("DequantizeLinear", [emitter.name(op.inputs[0]), scale, zero], **axis)
        emitter.node("Cast", [value], target, to=elem_type(out_dtype))


_QDQ_RANGES = {(-128, 127): "int8", (0, 255): "uint8"}


def _fake_quant(emitter, op, target):
    qrange = (op.attrs["qmin"], op.attrs["qmax"])
    dtype = _QDQ_RANGES.get(qrange)
    axis = op.attrs.get("axis")
    x = op.inputs[0]
    if (dtype is not None and emitter.opset >= (13 if axis is not None else 10)
            and x.attrs.get("dtype") == "float32"
            and (op.inputs[1] in emitter.constants or op.inputs[1].attrs.get("dtype") == "float32")):
        scale, zero, axis_attr = _quant_params(emitter, op, dtype)
        q = emitter.node("QuantizeLinear", [emitter.name(x), scale, zero], **axis_attr)
        emitter.node("DequantizeLinear", [q, scale, zero], target, **axis_attr)
        return
    _fake_quant_arithmetic(emitter, op, target)


def _fake_quant_arithmetic(emitter, op, target):
    """``(clip(round(x / scale) + zp, qmin, qmax) - zp) * scale`` in float ops."""
    emitter.need(11, "Round")
    x, scale, zero = op.inputs
    dtype = x.attrs.get("dtype") or "float32"
    axis = op.attrs.get("axis")
    names = []
    for tensor in (scale, zero):
        if tensor in emitter.constants:
            value = emitter.constants[tensor].astype(dtype)
            if axis is not None and value.ndim:
                value = value.reshape(_channel_shape(x, axis))
            names.append(emitter.const(value))
        elif axis is not None:
            shape = emitter.const(np.array(_channel_shape(x, axis), np.int64))
            names.append(emitter.node("Reshape", [emitter.name(tensor), shape]))
        else:
            names.append(emitter.name(tensor))
    scale_name, zero_name = names
    qmin = emitter.const(np.array(op.attrs["qmin"], dtype))
    qmax = emitter.const(np.array(op.attrs["qmax"], dtype))
    value = emitter.node("Round", [emitter.node("Div", [emitter.name(x), scale_name])])
    value = emitter.node("Add", [value, zero_name])
    value = emitter.node("Min", [emitter.node("Max", [value, qmin]), qmax])
    emitter.node("Mul", [emitter.node("Sub", [value, zero_name]), scale_name], target)


def _channel_shape(x, axis):
    shape = x.attrs.get("shape")
    if shape is None:
        raise NotNative("per-channel fake_quant needs the input's rank")
    shape = [1] * len(shape)
    shape[axis % len(shape)] = -1
    return shape


_RULES = {
    "add": _simple("Add"), "sub": _simple("Sub"), "mul": _simple("Mul"), "div": _simple("Div"),
    "pow": _simple("Pow"), "neg": _simple("Neg"), "abs": _simple("Abs"),
    "lt": _simple("Less"), "gt": _simple("Greater"), "eq": _simple("Equal"),
    "le": _ordered("LessOrEqual", "Greater", 12), "ge": _ordered("GreaterOrEqual", "Less", 12),
    "ne": _negated("Equal"), "and": _simple("And"), "or": _simple("Or"), "not": _simple("Not"),
    "where": _simple("Where", 9), "clip": _clip, "minimum": _minmax("Min"),
    "maximum": _minmax("Max"), "cast": _cast, "round": _simple("Round", 11),
    "floor": _simple("Floor"), "ceil": _simple("Ceil"), "sqrt": _simple("Sqrt"),
    "exp": _simple("Exp"), "log": _simple("Log"), "sign": _simple("Sign", 9),
    "identity": _simple("Identity"), "quantize": _quantize, "dequantize": _dequantize,
    "fake_quant": _fake_quant,
}
