"""Where an op sits in the model, as the built-in tools report it.

The FLOPs profiler, the op profiler and the pruning tool (and anything else
that groups ops by module) call :func:`module_path_of`, so one op gets the
same module path in all of them.
"""

from __future__ import annotations

__all__ = ["module_path_of", "onnx_module_path"]


def module_path_of(context):
    """The module path of the op an analysis routine is looking at.

    - PyTorch: the dotted path of the innermost module running the op, as the
      runtime recorded it (``"encoder.layer.0.attention"``; ``""`` is the
      root module itself).
    - TensorFlow: the op's name scope, ``/``-separated (``"dense_1"`` for
      ``"dense_1/MatMul"``); for a backward context without a forward op,
      the backward op's name scope.
    - ONNX: the module path a PyTorch exporter encoded in the node name
      (see :func:`onnx_module_path`).

    Args:
        context: an :class:`amanda.OpContext`, forward or backward.

    Returns:
        The path as a string, or None when the op is outside any module: a
        PyTorch op called outside every module, a TF op without a name
        scope, an ONNX node whose name carries no scope. ``""`` only ever
        means PyTorch's root module, never "unknown".
    """
    namespace = context.namespace or ""
    if namespace.startswith("tensorflow"):
        op = context.get_op() if context.get_op() is not None else context.get_backward_op()
        name = getattr(op, "name", None) or ""
        scope = name.rpartition("/")[0]
        return scope or None
    if namespace.startswith("onnx"):
        return onnx_module_path(getattr(context.get_op(), "name", None) or "")
    return context.get_module_path()


def onnx_module_path(node_name):
    """The module path a PyTorch exporter encoded in an ONNX node's name, or None.

    ``"/encoder/stages.0/layer/layer.1/conv/Conv"`` -> ``"encoder.stages.0.layer.1.conv"``:
    the last segment is the op, and a called container's segment (``layer``)
    is followed by its child's as ``layer.1``, which replaces it.
    """
    segments = [s for s in node_name.split("/") if s][:-1]
    if not segments:
        return None
    path = []
    for segment in segments:
        if path and segment.startswith(path[-1] + "."):
            path[-1] = segment
        else:
            path.append(segment)
    return ".".join(path)
