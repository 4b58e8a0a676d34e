"""Numeric diff: run one model in two backends and find where they part.

A PyTorch model and its ONNX export should compute the same function; when
they do not (an exporter bug, a wrong opset translation, a fused op with a
different rounding, a tampered weight) the final outputs only say *that*
they differ. :func:`diff_torch_onnx` says *where*: it records the output of
every module of the PyTorch run with an amanda tool, every intermediate
tensor of the ONNX run, matches them through the module scopes the exporter
writes into node names (``/encoder/stages.0/layers.0/Add`` is module
``encoder.stages.0.layers.0``), and reports the first module to finish whose
output diverges beyond the tolerance (a module finishes after the modules
inside it, so the innermost culprit is named, not its parents).

Exporters fuse ops across modules (a convolution followed by an eval-mode
batch norm becomes one ``Conv``); a module whose scope has no ONNX node is
compared through the module before it, so a fusion is not reported as a
divergence.

:func:`diff_tf_onnx` does the same for a TensorFlow graph (``tf.compat.v1``
session) and its ONNX conversion (``tf2onnx``), op by op: the converter keeps
TF tensor names (``block1_conv/BiasAdd:0``) for the ONNX tensors that compute
the same value, so every TF op on the path from the feeds to the fetches is
matched with the ONNX node writing a tensor of its name, its op type checked
through the mapping tables (``Conv2D`` and ``Conv`` are both ``conv2d``), and
NHWC values are moved to NCHW where the ONNX graph computes in NCHW. TF ops
the converter fused or removed are listed, never guessed. It lives in
:mod:`amanda.tools.diff_tf`; both share :mod:`amanda.tools.diff_values`.

These are cross-framework diagnostics: they read the structure of the
``onnx.ModelProto`` and ``tf.Graph`` they compare, but export, convert, load
and run models through the backends' tool-support modules
(:mod:`amanda.runtime.tool_support`), so they import no framework.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import amanda
from amanda.runtime.tool_support import provider
from amanda.tools.diff_tf import (  # TensorFlow vs its ONNX conversion, importable from here
    OpDiffReport,
    OpDivergence,
    OpMatch,
    OpOutputRecorder,
    diff_tf_onnx,
    tf_to_onnx,
)
from amanda.tools.diff_values import _close, _errors, onnx_tensor_values

__all__ = [
    "DiffReport",
    "Divergence",
    "ModuleRecorder",
    "OpDiffReport",
    "OpDivergence",
    "OpMatch",
    "OpOutputRecorder",
    "diff_tf_onnx",
    "diff_torch_onnx",
    "onnx_scope_outputs",
    "onnx_tensor_values",
    "tf_to_onnx",
]


@dataclasses.dataclass
class Divergence:
    """Where two runs first disagree.

    Attributes:
        module: the module path (PyTorch naming; ``""`` is the root).
        torch_op: the PyTorch op that produced the module's output.
        onnx_node: the ONNX node that produced it there.
        max_abs_error: largest absolute difference.
        max_rel_error: largest difference relative to the PyTorch value.
        shape: the compared tensor's shape.
    """

    module: str
    torch_op: str
    onnx_node: str
    max_abs_error: float
    max_rel_error: float
    shape: tuple

    def describe(self):
        return (f"first divergence at module {self.module!r}: PyTorch op {self.torch_op} vs "
                f"ONNX node {self.onnx_node!r}, max |Δ| = {self.max_abs_error:.3g} "
                f"(relative {self.max_rel_error:.3g}), shape {list(self.shape)}")


@dataclasses.dataclass
class DiffReport:
    """What :func:`diff_torch_onnx` found.

    Attributes:
        first: the first :class:`Divergence`, or None when every compared
            module agrees.
        compared: module paths compared, in execution order.
        fused: modules with no ONNX node of their own, compared through the
            module before them.
        unmatched: modules the ONNX model has no scope for (not compared).
        output_error: largest absolute difference of the final outputs.
    """

    first: Divergence | None
    compared: list
    fused: list
    unmatched: list
    output_error: float

    def describe(self):
        head = self.first.describe() if self.first else "no divergence"
        return (f"{head}; {len(self.compared)} modules compared, {len(self.fused)} fused by the "
                f"exporter, {len(self.unmatched)} without ONNX nodes; final outputs differ by "
                f"at most {self.output_error:.3g}")


class ModuleRecorder(amanda.Tool):
    """Records the value each forward op returns, with its module path, in
    execution order (``records``: list of ``(module_path, op_name, array)``)."""

    def __init__(self):
        super().__init__()
        self.records = []
        self.add_inst_for_op(self._analysis)

    def _analysis(self, context):
        context.insert_after_op(self._record, module=context.get_module_path(),
                                op=context.get_op_name())

    def _record(self, *outputs, module, op):
        if module is not None and outputs:
            self.records.append((module, op, outputs[0].detach().cpu().numpy().copy()))


def _scope_path(node_name):
    """Module path of an exporter scope name (``/layer1/layer1.0/conv1/Conv``
    -> ``layer1.0.conv1``), or None for a node outside every module."""
    parts = node_name.split("/")
    if len(parts) < 3 or parts[0] != "":
        return None
    path = []
    previous = None
    for segment in parts[1:-1]:
        if previous is not None and segment.startswith(previous + "."):
            path.append(segment[len(previous) + 1:])   # child of a container: "layer.0"
        else:
            path.append(segment)
        previous = segment
    return ".".join(path)


def onnx_scope_outputs(model, feeds):
    """Run an ONNX model returning every node's first output.

    Returns:
        ``(outputs, last)``: the model's outputs (a list), and for every
        module path found in node names the ``(node name, value)`` of the last
        node (in graph order) inside that module's scope, sub-scopes included.
    """
    names = [(node.name, node.output[0]) for node in model.graph.node
             if node.output and node.output[0] and _scope_path(node.name) is not None]
    values = onnx_tensor_values(model, feeds, [out for _, out in names])
    last = {}
    for node_name, out in names:
        path = _scope_path(node_name)
        parts = path.split(".") if path else []
        for k in range(len(parts) + 1):
            last[".".join(parts[:k])] = (node_name, values[out])
    return [values[o.name] for o in model.graph.output], last


def _torch_module_outputs(records):
    """Module path -> (op name, value) of its last op (sub-modules included),
    and the module paths in the order they finished (a module after the
    modules it contains)."""
    last, finished = {}, {}
    for index, (module, op, value) in enumerate(records):
        parts = module.split(".") if module else []
        for k in range(len(parts) + 1):
            path = ".".join(parts[:k])
            last[path] = (op, value)
            finished[path] = (index, -k)
    return last, sorted(finished, key=finished.get)


def diff_torch_onnx(model, args, onnx_model=None, rtol=1e-4, atol=1e-5, opset=17):
    """Compare a PyTorch model with its ONNX export, module by module.

    Args:
        model: the ``torch.nn.Module`` (called as ``model(*args)``).
        args: a tuple of example input tensors.
        onnx_model: an ``onnx.ModelProto`` (or path) to compare against; by
            default the model is exported with ``torch.onnx.export`` (the
            TorchScript exporter, which writes module scopes into node names).
        rtol, atol: the tolerance (as ``numpy.allclose``).
        opset: opset of the default export.

    Returns:
        A :class:`DiffReport`.
    """
    torch_support = provider("export_onnx")     # the backend exporting models to ONNX
    if onnx_model is None:
        onnx_model = torch_support.export_onnx(model, args, opset)
    else:
        onnx_model = provider("load_model").load_model(onnx_model)
    recorder = ModuleRecorder()
    with torch_support.no_grad(), amanda.apply(recorder):
        expected = model(*args)
    torch_last, order = _torch_module_outputs(recorder.records)
    inputs = [i.name for i in onnx_model.graph.input
              if i.name not in {t.name for t in onnx_model.graph.initializer}]
    feeds = {name: a.detach().cpu().numpy() for name, a in zip(inputs, args)}
    outputs, onnx_last = onnx_scope_outputs(onnx_model, feeds)
    compared, fused, unmatched = [], [], []
    first = None
    for index, path in enumerate(order):
        if path == "":
            continue
        if path not in onnx_last:
            unmatched.append(path)
            continue
        node, onnx_value = onnx_last[path]
        op, torch_value = torch_last[path]
        compared.append(path)
        if _close(torch_value, onnx_value, rtol, atol):
            continue
        following = _fused_into(path, order[index + 1:], onnx_last, torch_last)
        if following is not None and _close(torch_last[following][1], onnx_value, rtol, atol):
            fused.append(following)
            continue
        if first is None and np.shape(torch_value) == np.shape(onnx_value):
            abs_error, rel_error = _errors(torch_value, onnx_value)
            first = Divergence(path, op, node, abs_error, rel_error, tuple(np.shape(torch_value)))
    final = expected if torch_support.is_tensor(expected) else _first_tensor(expected)
    output_error = _errors(final.detach().numpy(), outputs[0])[0] if final is not None else 0.0
    return DiffReport(first, compared, fused, unmatched, output_error)


def _fused_into(path, later, onnx_last, torch_last):
    """The next module after ``path`` that has no ONNX scope of its own
    (its op was fused into ``path``'s), or None."""
    for candidate in later:
        if candidate.startswith(path + "."):
            continue   # a sub-module of path
        return candidate if candidate not in onnx_last and candidate in torch_last else None
    return None


def _first_tensor(value):
    from amanda.models import first_tensor
    try:
        return first_tensor(value)
    except ValueError:   # no floating-point tensor in the output
        return None
