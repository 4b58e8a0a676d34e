"""PyTorch knowledge for the built-in tools (see :mod:`amanda.runtime.tool_support`).

What the PyTorch runtime records (module paths, stable op ids) and how the
PyTorch frontends encode a call's non-tensor arguments in IR attributes
(``attrs["args"]``/``attrs["kwargs"]``, a tensor argument written as
``{"$input": position}``) are read here, so tools never decode them
themselves. The PyTorch parts of the PyTorch-only pruning projects
(:mod:`amanda.tools.pruning_projects`) are served from here too:
``activation_mask`` (:mod:`amanda.runtime.pytorch.pruning_activation`),
``new_predictor``, ``wta_gate`` and ``fbs_saliency``
(:mod:`amanda.runtime.pytorch.pruning_feature_boosting`), and the docs
figure's model, ``random_bert`` (:mod:`amanda.runtime.pytorch.examples`). Importing this
module does not import torch.
"""

from __future__ import annotations

import io
import sys

from amanda.runtime.pytorch.examples import random_bert
from amanda.runtime.pytorch.pruning_activation import activation_mask
from amanda.runtime.pytorch.pruning_feature_boosting import fbs_saliency, new_predictor, wta_gate

__all__ = ["ANALYSED_PER_CALL_SITE", "COUNTS_AT_RUN_TIME", "MODULE_PATH_SEPARATOR",
           "OTHER_BACKWARD_FLOPS", "ROUTINES_ORDERED_BY_DATAFLOW", "accumulates_gradient",
           "activation_mask", "as_tensor_like", "backward_flop_factor", "backward_flop_operands",
           "call_argument", "call_arguments", "call_attrs", "export_onnx", "fbs_saliency",
           "has_nonfinite", "is_tensor", "is_weight_input", "is_whole_graph", "kernel_profiler",
           "module_path_from_op", "new_predictor", "no_grad", "operand_grad", "parameter_operand",
           "random_bert", "stable_op_id", "static_shape", "tensor_stats",
           "trainable_parameters", "weight_value", "wta_gate"]

_INPUT = "$input"   # how a captured call refers to its tensor inputs


def module_path_from_op(context):
    """None: the runtime records the module path of every op run inside a
    module (``OpContext.get_module_path``), so an op without one is outside
    every module."""
    return None


def is_whole_graph(graph):
    """Whether ``graph`` is a whole captured program rather than an eager
    step traced op by op (whose ops carry the runtime's ``op_id``)."""
    return bool(graph.ops) and "op_id" not in graph.ops[0].attrs


def stable_op_id(op):
    """The stable op id of a lifted op: the eager trace's ``op_id``, else its name."""
    return op.attrs.get("op_id", op.name)


def call_arguments(op, names):
    """Name the non-tensor positional arguments and keyword arguments of a
    lifted PyTorch call.

    Args:
        op: an IR op lifted from a PyTorch call.
        names: the names of its positional non-tensor arguments, in order. A
            leading ``"*bias"`` stands for an optional tensor that may be
            absent (written as None, as a conv's ``bias=None``) when the op
            has fewer than three tensor inputs.

    Returns:
        ``{name: value}``, keyword arguments included.
    """
    args = list(op.attrs.get("args", ()))
    if names and names[0] == "*bias":
        if len(op.inputs) == 2 and args and args[0] is None:
            args = args[1:]
        names = names[1:]
    bound = dict(zip(names, args))
    bound.update(op.attrs.get("kwargs", {}))
    return bound


def call_attrs(target, args, kwargs=None):
    """The attributes and tensor inputs of a new captured-PyTorch call.

    Args:
        target: the operator (``"aten.mul.Tensor"``).
        args, kwargs: the call's arguments, IR tensors and constants mixed.

    Returns:
        ``(attrs, inputs)``: ``attrs`` holds ``target``, ``args`` and
        ``kwargs`` with each IR tensor replaced by a reference to its
        position in ``inputs``.
    """
    inputs = []

    def encode(value):
        if hasattr(value, "producer") and hasattr(value, "uses"):  # an IR tensor
            inputs.append(value)
            return {_INPUT: len(inputs) - 1}
        if isinstance(value, (list, tuple)):
            return [encode(v) for v in value]
        return value

    attrs = {"target": target, "args": encode(list(args)), "kwargs": encode(dict(kwargs or {}))}
    return attrs, inputs


def call_argument(op, position, default=None):
    """Positional argument ``position`` of a captured call: the IR tensor or the constant."""
    args = op.attrs.get("args", [])
    if position >= len(args):
        return default
    value = args[position]
    if isinstance(value, dict) and set(value) == {_INPUT}:
        return op.inputs[value[_INPUT]]
    return value


def as_tensor_like(tensor):
    """A function turning an array into a torch tensor of ``tensor``'s dtype and device."""
    dtype, device = tensor.dtype, tensor.device

    def as_tensor(array):
        import numpy as np
        import torch
        return torch.as_tensor(np.asarray(array), dtype=dtype, device=device)

    return as_tensor


def weight_value(context, position):
    """``(NumPy copy, as_tensor)`` of the parameter the op reads at input
    ``position`` (mapping rules: ``context["weight"]``)."""
    weight = context.get_inputs()[position]
    return weight.detach().cpu().numpy().copy(), as_tensor_like(weight)


def parameter_operand(context, position):
    """``(NumPy copy, as_tensor)`` of the op's input ``position`` where it
    is a 2-D parameter (a matrix product reading a weight laid out
    ``(in, out)``: transformers' ``Conv1D``, ``torch.addmm(b, x, W)``), else None."""
    inputs = context.get_inputs()
    operand = inputs[position] if position < len(inputs) else None
    if operand is None or len(getattr(operand, "shape", ())) != 2 \
            or not trainable_parameters([operand]):
        return None
    return operand.detach().cpu().numpy().copy(), as_tensor_like(operand)


# autograd nodes of matrix products -> the position of the gradient of their
# parameter operand (``parameter_operand``)
_OPERAND_GRADS = {"AddmmBackward0": 2, "MmBackward0": 1}


def operand_grad(backward_op):
    """The position, among a matrix product's backward op's gradients, of
    its parameter operand's gradient, or None."""
    return _OPERAND_GRADS.get(getattr(backward_op, "__name__", None))


def _stored(tensor):
    """``(values, implicit zeros)``: the values a tensor stores, flat, and how
    many of its elements are zeros it does not store. A strided tensor stores
    all of them; a sparse one (COO, coalesced first; CSR/CSC/BSR/BSC) its
    specified values; a nested one the values of its components."""
    import torch
    if tensor.layout is torch.strided and not tensor.is_nested:
        return tensor, 0
    if tensor.is_nested:
        parts = [part.reshape(-1) for part in tensor.unbind()]
        return (torch.cat(parts) if parts else tensor.new_zeros(0)), 0
    if tensor.layout is torch.sparse_coo:
        tensor = tensor.coalesce()
    values = tensor.values().reshape(-1)
    return values, tensor.numel() - values.numel()


def has_nonfinite(tensor):
    """Whether a floating-point torch tensor (strided, sparse or nested)
    holds a NaN or an Inf."""
    import torch
    with torch.no_grad():
        values, _ = _stored(tensor.detach())
        return not bool(torch.isfinite(values).all())


def tensor_stats(tensor):
    """Statistics of a numeric torch tensor, computed in float64 without autograd.

    Returns:
        ``(shape, dtype, numel, nan, inf, zeros, min, max, mean, std)``:
        ``nan``/``inf``/``zeros`` are counts; ``min`` to ``std`` are over the
        finite elements (of the magnitude, for a complex tensor), None when
        there is none; ``std`` is the population one.
    """
    import torch
    with torch.no_grad():
        t, implicit = _stored(tensor.detach())
        if t.is_complex():
            t = t.abs()
        t = t.to(torch.float64)
        numel = t.numel() + implicit
        nan = int(torch.isnan(t).sum())
        inf = int(torch.isinf(t).sum())
        zeros = int((t == 0).sum()) + implicit
        finite = t[torch.isfinite(t)]
        count = finite.numel() + implicit   # the zeros a sparse tensor does not store count too
        if count and not implicit:
            mn, mx = float(finite.min()), float(finite.max())
            mean = float(finite.mean())
            std = float(finite.std(unbiased=False))
        elif count:
            mean = float(finite.sum()) / count
            spread = float(((finite - mean) ** 2).sum()) + implicit * mean * mean
            std = (spread / count) ** 0.5
            mn = min(float(finite.min()), 0.0) if finite.numel() else 0.0
            mx = max(float(finite.max()), 0.0) if finite.numel() else 0.0
        else:
            mn = mx = mean = std = None
    return tuple(tensor.shape), str(tensor.dtype), numel, nan, inf, zeros, mn, mx, mean, std


def kernel_profiler(activities=None):
    """A ``torch.profiler.profile`` (not started) and torch's ``record_function``.

    Args:
        activities: ``torch.profiler.ProfilerActivity`` values to record
            (default: CPU, plus CUDA where available).

    Returns:
        ``(profile, record_function)``.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile
    if activities is None:
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
    return profile(activities=activities), torch.autograd.profiler.record_function


def no_grad():
    """``torch.no_grad()``."""
    import torch
    return torch.no_grad()


def is_tensor(value):
    """Whether ``value`` is a ``torch.Tensor`` (False while torch is not loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def export_onnx(model, args, opset):
    """``model`` exported with ``torch.onnx.export``'s TorchScript exporter
    (which writes module scopes into node names), as an ``onnx.ModelProto``."""
    import onnx
    import torch
    buffer = io.BytesIO()
    torch.onnx.export(model, tuple(args), buffer, dynamo=False, opset_version=opset)
    return onnx.load_from_string(buffer.getvalue())


#: How module paths are joined (``"encoder.layer.0"``).
MODULE_PATH_SEPARATOR = "."

# Autograd nodes that compute the gradients of a convolution / matrix
# product, and how many forward-FLOPs each is charged (FLOPs profiler).
_BACKWARD_FLOP_FACTORS = {"ConvolutionBackward0": 2, "AddmmBackward0": 2, "MmBackward0": 2,
                          "BmmBackward0": 2, "BaddbmmBackward0": 2, "LinearBackward0": 2,
                          "MvBackward0": 2, "ConvolutionBackwardBackward0": 2}


#: backward node -> the positions of its gradients (its next edges) that are
#: products as costly as the forward op: the gradient of each operand of a
#: convolution or matrix product. torch computes only the gradients some
#: input needs (``output_mask``): the first layer of a network (whose input
#: needs no gradient), a frozen weight.
_BACKWARD_FLOP_OPERANDS = {"ConvolutionBackward0": (0, 1), "AddmmBackward0": (1, 2),
                           "MmBackward0": (0, 1), "BmmBackward0": (0, 1),
                           "BaddbmmBackward0": (1, 2), "LinearBackward0": (0, 1),
                           "MvBackward0": (0, 1)}


def backward_flop_operands(backward_op):
    """The positions of the backward op's gradients (``grad_inputs``) that
    each cost the forward op's FLOPs when they are computed (None where a
    gradient is not computed); None: charge ``backward_flop_factor`` at
    every execution."""
    return _BACKWARD_FLOP_OPERANDS.get(type(backward_op).__name__,
                                       _BACKWARD_FLOP_OPERANDS.get(
                                           getattr(backward_op, "__name__", ""), None))


def backward_flop_factor(backward_op):
    """How many forward-FLOPs of its op a backward op (an autograd node, or
    the object naming it) is charged; 0 when it is not one of those counted."""
    factors = _BACKWARD_FLOP_FACTORS
    return factors.get(type(backward_op).__name__,
                       factors.get(getattr(backward_op, "__name__", ""), 0))


def trainable_parameters(inputs):
    """``{id: element count}`` of the inputs that are ``torch.nn.Parameter`` objects."""
    return {id(value): value.numel() for value in inputs if type(value).__name__ == "Parameter"}


def is_weight_input(tensor):
    """Whether a graph input is a weight: a parameter, buffer or attribute
    of a captured program (an eager step's inputs are never told apart)."""
    return tensor.attrs.get("kind", "input") != "input"


#: Whether an inserted routine runs in order with its op only through the
#: tensors it hands back (False: routines run where they were inserted).
ROUTINES_ORDERED_BY_DATAFLOW = False


#: FLOPs profiler: whether the backward formulas of ops other than products
#: (element-wise, normalisations, lookups...) apply to this backend's backward
#: ops (PyTorch: one autograd node per forward op).
OTHER_BACKWARD_FLOPS = True

#: Whether analysis runs once per call site, so that a later execution there
#: may have other shapes (the FLOPs profiler checks them at run time).
ANALYSED_PER_CALL_SITE = True

#: Whether ops whose shapes are not static are counted from the arrays their
#: routines receive (``hosted(value)`` says which values can reach one).
COUNTS_AT_RUN_TIME = False


def static_shape(value):
    """None: this backend's values carry their shape (``value.shape``)."""
    return None


def accumulates_gradient(backward_op):
    """Whether a backward op stores a leaf's gradient into its ``.grad``
    (autograd's ``AccumulateGrad``) rather than computing a gradient."""
    name = getattr(backward_op, "__name__", None) or type(backward_op).__name__
    return name == "AccumulateGrad" or "AccumulateGrad" in str(
        getattr(backward_op, "name", None) or name)
