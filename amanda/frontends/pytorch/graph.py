"""Lift PyTorch graph captures (``torch.export`` programs, ``torch.fx`` graphs) into the IR.

    from amanda.frontends.pytorch.graph import lift_exported_program

    ep = torch.export.export(model, (x,))
    ir = lift_exported_program(ep)

One IR op per ``call_function`` node, named like the node. The op ``type`` is the
operator's name without namespace and overload (``conv2d``, ``batch_norm``,
``add_``); operators outside ``aten`` keep their namespace
(``quantized_decomposed.quantize_per_tensor``). Attrs:

* ``target``: the qualified overload, ``"aten.conv2d.default"`` (or
  ``"operator.add"`` for a Python function), resolved again when lowering,
  only within the table of `amanda.frontends.pytorch.targets` (a graph read
  from a file naming anything else is refused when it is read);
* ``args`` / ``kwargs``: the call's arguments as JSON-able data in which the
  ``k``-th tensor input appears as ``{"$input": k}`` and dtypes, devices, memory
  formats and layouts as ``{"$dtype": "float32"}`` and the like;
* ``tuple_output``: present (True) when the call returns a tuple or list; its
  elements are the op's outputs (the ``getitem`` nodes that read them are folded
  into the wiring).

Graph inputs are the placeholders, in order, with attrs ``kind``
(``"parameter"``, ``"buffer"``, ``"constant"`` or ``"input"``), ``target`` (the
parameter's or buffer's qualified name) and, like every tensor, ``dtype`` and
``shape`` from the node's ``meta["val"]`` (symbolic dims become None). Graph
outputs are the program's outputs in order (buffer mutations first, as
``torch.export`` orders them); ``graph.attrs["output_kinds"]`` says which is which.

The namespace is ``"pytorch/<version>/graph"``.
"""

from __future__ import annotations

import operator

import torch

from amanda.errors import BackendError
from amanda.frontends.pytorch import targets  # noqa: F401 - registers the table of call targets
from amanda.ir import Graph, IRError
from amanda.ir.targets import resolve_target as _resolve_in_table

__all__ = ["NAMESPACE", "decode_args", "encode_args", "lift_exported_program", "lift_fx_graph",
           "op_type_of", "resolve_target", "target_name"]

#: The namespace of lifted ops.
NAMESPACE = "pytorch/" + torch.__version__.split("+")[0] + "/graph"

_MARKERS = {torch.dtype: "$dtype", torch.device: "$device", torch.memory_format: "$memory_format",
            torch.layout: "$layout"}
# markers decoded by name lookup in torch, with the type the value must have
_MARKER_KINDS = {"$dtype": torch.dtype, "$memory_format": torch.memory_format, "$layout": torch.layout}


def target_name(target):
    """The qualified name of a call target: ``"aten.conv2d.default"``, ``"operator.getitem"``.

    Native functions are named where users find them (``"torch.relu"``,
    ``"torch.Tensor.add"``), which is also how the table of call targets
    (`amanda.frontends.pytorch.targets`) lists them.
    """
    if isinstance(target, torch._ops.OpOverload):
        namespace, name = target.name().split("::")
        return f"{namespace}.{name.split('.')[0]}.{target._overloadname}"
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.__name__}"
    name = getattr(target, "__name__", None)
    if isinstance(name, str):
        if getattr(torch._C.TensorBase, name, None) is target or getattr(torch.Tensor, name, None) is target:
            return f"torch.Tensor.{name}"
        if getattr(torch, name, None) is target:
            return f"torch.{name}"
    module = getattr(target, "__module__", None) or ""
    if module == "_operator":
        module = "operator"
    return f"{module}.{getattr(target, '__qualname__', getattr(target, '__name__', repr(target)))}"


def op_type_of(target):
    """The IR op type of a call target (see the module docstring)."""
    if isinstance(target, torch._ops.OpOverload):
        namespace, name = target.name().split("::")
        name = name.split(".")[0]
        return name if namespace == "aten" else f"{namespace}.{name}"
    return getattr(target, "__name__", str(target))


def resolve_target(name, op=None):
    """Inverts `target_name`, within the table of `amanda.frontends.pytorch.targets`.

    The name may come from a graph file, so it is never imported or walked
    freely: only the operators of the table resolve.

    Args:
        name: the qualified target name.
        op: the IR op naming it, for the message (optional).

    Raises:
        BackendError: the name is not in the table (the message names the op
            and the target).
    """
    try:
        return _resolve_in_table(NAMESPACE, name, op)
    except IRError as error:
        raise BackendError(f"cannot resolve the call target of a PyTorch graph op: {error}") from None


def encode_args(value, tensor_index):
    """JSON-able form of call arguments.

    Args:
        value: an argument (nested lists/tuples/dicts allowed).
        tensor_index: maps an fx ``Node`` (a tensor argument) to its input position.

    Raises:
        BackendError: an argument has no JSON-able form.
    """
    if isinstance(value, torch.fx.Node):
        return {"$input": tensor_index(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [encode_args(v, tensor_index) for v in value]
    if isinstance(value, dict):
        return {str(k): encode_args(v, tensor_index) for k, v in value.items()}
    for cls, marker in _MARKERS.items():
        if isinstance(value, cls):
            return {marker: str(value).replace("torch.", "")}
    raise BackendError(f"cannot lift an argument of type {type(value).__name__} ({value!r}) into the IR")


def decode_args(data, inputs):
    """Inverts `encode_args`: ``{"$input": k}`` becomes ``inputs[k]``.

    Markers name only values of their own kind (``{"$dtype": "load"}`` is not
    ``torch.load``), since the data may come from a graph file.

    Raises:
        BackendError: a marker names something that is not a value of its kind,
            or an input position is out of range.
    """
    if isinstance(data, list):
        return [decode_args(v, inputs) for v in data]
    if isinstance(data, dict):
        if len(data) == 1:
            (key, inner), = data.items()
            if key == "$input":
                if not isinstance(inner, int) or isinstance(inner, bool) or not 0 <= inner < len(inputs):
                    raise BackendError(f"argument marker {data!r} refers to no input of the op")
                return inputs[inner]
            if key == "$device":
                if not isinstance(inner, str):
                    raise BackendError(f"argument marker {data!r} is not a device name")
                try:
                    return torch.device(inner)
                except (RuntimeError, ValueError) as error:
                    raise BackendError(f"argument marker {data!r} is not a device: {error}") from None
            kind = _MARKER_KINDS.get(key)
            if kind is not None:
                value = getattr(torch, inner, None) if isinstance(inner, str) and inner.isidentifier() else None
                if not isinstance(value, kind):
                    raise BackendError(f"argument marker {data!r} names no torch.{kind.__name__}")
                return value
        return {k: decode_args(v, inputs) for k, v in data.items()}
    return data


def tensor_attrs(value):
    """``{"dtype", "shape"}`` of a (fake) tensor; empty for anything else."""
    if isinstance(value, torch.Tensor):
        shape = [int(d) if isinstance(d, int) or str(d).isdigit() else None for d in value.shape]
        return {"dtype": str(value.dtype).replace("torch.", ""), "shape": shape}
    return {}


def lift_exported_program(ep, namespace=None):
    """Lifts a ``torch.export.ExportedProgram`` into an IR graph.

    Args:
        ep: the exported program (its graph is read, not modified).
        namespace: the ops' namespace (`NAMESPACE` if None).

    Returns:
        An `amanda.ir.Graph`; inputs carry ``kind`` and ``target`` from the
        graph signature.
    """
    kinds = {}
    for spec in ep.graph_signature.input_specs:
        name = getattr(spec.arg, "name", None)
        kind = spec.kind.name.lower()
        kinds[name] = ({"parameter": "parameter", "buffer": "buffer", "constant_tensor": "constant",
                        "user_input": "input"}.get(kind, kind), spec.target)
    output_kinds = [spec.kind.name.lower() for spec in ep.graph_signature.output_specs]
    output_targets = [spec.target for spec in ep.graph_signature.output_specs]
    graph = lift_fx_graph(ep.graph, namespace, kinds)
    graph.attrs["output_kinds"] = output_kinds
    graph.attrs["output_targets"] = output_targets
    return graph


def lift_fx_graph(fx_graph, namespace=None, input_kinds=None):
    """Lifts a ``torch.fx.Graph`` (or a ``GraphModule``'s graph) into an IR graph.

    Args:
        fx_graph: the graph.
        namespace: the ops' namespace (`NAMESPACE` if None).
        input_kinds: placeholder name -> ``(kind, target)``; placeholders not
            listed are user inputs. ``get_attr`` nodes become inputs of kind
            ``"attr"`` whose target is the attribute path.

    Returns:
        An `amanda.ir.Graph`.

    Raises:
        BackendError: a node is neither a placeholder, a call of a function, an
            attribute read nor the output (``call_module``/``call_method`` nodes
            of a symbolic trace: lift a ``torch.export`` or ``make_fx`` graph).
    """
    graph = Graph("pytorch_graph", namespace=namespace or NAMESPACE)
    values = {}  # fx node -> IR tensor, or list of IR tensors for tuple results
    input_kinds = input_kinds or {}
    for node in fx_graph.nodes:
        if node.op == "placeholder":
            kind, target = input_kinds.get(node.name, ("input", None))
            values[node] = graph.add_input(node.name, kind=kind, target=target,
                                           **tensor_attrs(node.meta.get("val")))
        elif node.op == "get_attr":
            values[node] = graph.add_input(node.name, kind="attr", target=node.target,
                                           **tensor_attrs(node.meta.get("val")))
        elif node.op == "call_function":
            if node.target is operator.getitem and isinstance(values.get(node.args[0]), list):
                values[node] = values[node.args[0]][node.args[1]]
                continue
            values[node] = _lift_call(graph, node, values)
        elif node.op == "output":
            graph.set_outputs(_flat_outputs(node.args[0], values))
        else:
            raise BackendError(f"cannot lift fx node {node.name!r} ({node.op}): lift a torch.export or "
                               "make_fx graph, whose nodes call functions")
    return graph


def _lift_call(graph, node, values):
    inputs = []

    def index(arg):
        inputs.append(values[arg])
        return len(inputs) - 1

    args = encode_args(list(node.args), index)
    kwargs = encode_args(dict(node.kwargs), index)
    val = node.meta.get("val")
    is_tuple = isinstance(val, (tuple, list))
    outputs = list(val) if is_tuple else [val]
    attrs = {"target": target_name(node.target), "args": args, "kwargs": kwargs}
    if is_tuple:
        attrs["tuple_output"] = True
    stack = node.meta.get("nn_module_stack")
    if stack:
        attrs["module_path"] = list(stack.values())[-1][0]
    op = graph.create_op(op_type_of(node.target), inputs, num_outputs=len(outputs), attrs=attrs,
                         name=node.name, output_names=[node.name] if not is_tuple else None)
    for tensor, value in zip(op.outputs, outputs):
        tensor.attrs = tensor_attrs(value)
    return list(op.outputs) if is_tuple else op.outputs[0]


def _flat_outputs(result, values):
    flat = []
    for item in (result if isinstance(result, (tuple, list)) else [result]):
        if not isinstance(item, torch.fx.Node):
            raise BackendError(f"graph output {item!r} is not a tensor computed by the graph")
        value = values[item]
        if isinstance(value, list):
            raise BackendError(f"graph output {item.name!r} is a tuple; outputs must be flat")
        flat.append(value)
    return flat
