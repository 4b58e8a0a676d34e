"""Where an op sits in the model, as the built-in tools report it.

The FLOPs profiler, the op profiler and the pruning tool (and anything else
that groups ops by module) call :func:`module_path_of`, so one op gets the
same module path in all of them. The rule is the backend's, applied by
:meth:`amanda.OpContext.get_module_path` (see
:mod:`amanda.runtime.tool_support`); this module keeps the tools' import path.
"""

from __future__ import annotations

__all__ = ["module_path_of"]


def module_path_of(context):
    """The module path of the op an analysis routine is looking at.

    - PyTorch: the dotted path of the innermost module running the op, as the
      runtime recorded it (``"encoder.layer.0.attention"``; ``""`` is the
      root module itself).
    - TensorFlow: the op's name scope, ``/``-separated (``"dense_1"`` for
      ``"dense_1/MatMul"``); for a backward context without a forward op,
      the backward op's name scope.
    - ONNX: the module path a PyTorch exporter encoded in the node name
      (``amanda.runtime.onnx.tools.onnx_module_path``).

    Args:
        context: an :class:`amanda.OpContext`, forward or backward.

    Returns:
        The path as a string, or None when the op is outside any module: a
        PyTorch op called outside every module, a TF op without a name
        scope, an ONNX node whose name carries no scope. ``""`` only ever
        means PyTorch's root module, never "unknown".
    """
    return context.get_module_path()
