"""A copy of an ONNX model without its large weights, for type and shape inference.

onnx's shape inference and onnxruntime's type resolution serialize the
model they are given (and onnx's returns a new one): on a model of hundreds
of MiB each is several transient copies of the weights. Neither needs a
large weight's values, only its type and shape.
"""

from __future__ import annotations

#: initializers larger than this (bytes) are graph inputs in `weightless_copy`
WEIGHTLESS_BYTES = 1 << 16


def weightless_copy(model):
    """``(copy of model, names)``: its initializers larger than
    `WEIGHTLESS_BYTES` (``names``) become graph inputs of the same element
    type and shape, the others stay constants (shape operands, which data
    propagation reads). Types and shapes inferred for it are the model's (no
    element type or shape depends on so large a tensor's values), and the
    weights are not copied."""
    import onnx
    from onnx import helper

    copy = onnx.ModelProto(ir_version=model.ir_version)
    copy.opset_import.extend(model.opset_import)
    copy.functions.extend(model.functions)
    source, graph = model.graph, copy.graph
    graph.name = source.name
    graph.node.extend(source.node)
    graph.input.extend(source.input)
    graph.output.extend(source.output)
    graph.value_info.extend(source.value_info)
    graph.sparse_initializer.extend(source.sparse_initializer)
    inputs = {i.name for i in source.input}
    names = set()
    for initializer in source.initializer:
        if initializer.ByteSize() <= WEIGHTLESS_BYTES:
            graph.initializer.add().CopyFrom(initializer)
            continue
        names.add(initializer.name)
        if initializer.name not in inputs:
            graph.input.append(helper.make_tensor_value_info(
                initializer.name, initializer.data_type, list(initializer.dims)))
    return copy, names
