"""``amanda.export``: an instrumented model as a runnable ONNX model.

The backend-neutral entry point; the work is done by the runtime of the
model's framework (``amanda.runtime.pytorch.export`` for PyTorch), loaded on
first use so that importing amanda imports no framework.
"""

from __future__ import annotations

from amanda.errors import BackendError
from amanda.runtime import backends

# top-level module of a class in the model's MRO -> (module, function)


def export(model, args, *tools, f=None, kwargs=None, opset=None, input_names=None,
           output_names=None, dynamic_axes=None, ir_version=10):
    """Export ``model`` instrumented by ``tools`` as a runnable ONNX model.

    The exported model computes what ``model(*args, **kwargs)`` computes in
    eval mode inside ``amanda.apply(*tools)``: the tools' forward
    instrumentation routines are part of the graph, lowered to ONNX ops (a
    weight mask to a ``Mul`` folded into the weight, ``portable.fake_quant``
    to ``QuantizeLinear``/``DequantizeLinear``). Analysis routines run once,
    on the real example inputs, before the model is traced. Backward routines
    are not exported (an ONNX model runs inference only). Only portable
    routines (``@amanda.portable.routine``) can be exported.

    Example::

        proto = amanda.export(model, (x,), PruningTool(), f="pruned.onnx")

    Args:
        model: a ``torch.nn.Module``. It is left as it was: parameters,
            train/eval flags, no hook or mode behind.
        args: the example positional arguments: a tuple, or one tensor. Their
            tensors become the ONNX model's inputs; other values (ints,
            ``None``...) are fixed in the graph.
        *tools: the amanda tools to apply (with their dependencies; tools of
            enclosing ``amanda.apply`` scopes apply too). None exports the
            plain model.
        f: where to write the model: a path or a binary file object; None
            writes nothing.
        kwargs: example keyword arguments, treated like ``args``.
        opset: the ONNX opset (default 17).
        input_names: names of the graph inputs (default: the ``forward``
            parameter names, or the keyword names).
        output_names: names of the graph outputs. Outputs are the tensors of
            the result flattened depth first (``None`` skipped); by default
            they are named ``output`` for one tensor, ``output_0``... for a
            tuple, and by key for a dict or a transformers ``ModelOutput``
            (``last_hidden_state``, ``pooler_output``).
        dynamic_axes: as in ``torch.onnx.export``, keyed by input/output name.
        ir_version: the highest ONNX IR version to write (onnxruntime 1.31
            reads at most 10).

    Returns:
        The ``onnx.ModelProto``; it passes ``onnx.checker`` (full check).

    Raises:
        ToolError: a routine is not portable or leaves the portable
            vocabulary, or an analysis routine failed; the message names tool,
            routine and op.
        BackendError: no exporter for this kind of model, or the framework's
            exporter cannot express it.
        AmandaError: ``args``/``kwargs`` are not what export takes.
    """
    exporter = _exporter_for(model)
    return exporter(model, args, tools, f=f, kwargs=kwargs, opset=opset,
                    input_names=input_names, output_names=output_names,
                    dynamic_axes=dynamic_axes, ir_version=ir_version)


def _exporter_for(model):
    """The ``export`` part of the backend whose models ``model`` is one of."""
    backend = backends.for_model(model)
    if backend is None:
        supported = [b.name for b in backends.all_backends() if b.export is not None]
        raise BackendError(f"amanda.export cannot export a {type(model).__name__} "
                           f"(supported: {', '.join(supported)} models)")
    return backend.part("export")
