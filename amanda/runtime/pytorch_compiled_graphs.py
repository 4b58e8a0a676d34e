"""Dynamo's FX graphs lifted into the amanda IR, for the compiled path
(`amanda.runtime.pytorch_compiled`): which FX nodes are instrumentation
points, and the op ids, module paths and call sites eager PyTorch would give
them; and whether the code Dynamo made for a frame runs anything outside its
graphs (`_outside_graphs`).
"""

from __future__ import annotations

import operator
import os
import re
import sys
import threading

import torch
import torch.fx

from amanda.ir import Graph
from amanda.passes.instrumentation import GraphBackend

NAMESPACE = "pytorch/" + torch.__version__.split("+")[0] + "/compiled"

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_LAYER_DIR = os.path.join(_TORCH_DIR, "nn", "modules") + os.sep
_MODULE_FILE = os.path.join(_LAYER_DIR, "module.py")
#: per-thread state of the compiled call in progress (owner and code of the
#: frame Dynamo compiles, graph breaks seen...), shared with pytorch_compiled
_tls = threading.local()

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>\S+)')


# -- lifting Dynamo's graphs --------------------------------------------------------------

def _tensors_in(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def _value(node):
    return node.meta.get("example_value", node.meta.get("val"))


def _raw_op(node):
    """The torch callable an eager run would see (``get_op()``) and its name."""
    target = node.target
    if node.op == "call_method":
        raw = getattr(torch.Tensor, target, None)
        return raw, target
    if getattr(target, "__module__", None) in ("_operator", "operator"):
        name = target.__name__.rstrip("_")
        raw = getattr(torch.Tensor, name, None) or getattr(torch.Tensor, f"__{name}__", None)
        if raw is not None:      # x + y reaches an eager run as Tensor.add: named "add"
            return raw, getattr(raw, "__name__", target.__name__)
    return target, getattr(target, "__name__", str(target))


def _is_point(node):
    if node.op not in ("call_function", "call_method"):
        return False
    if not _tensors_in(_value(node)):
        return False
    if node.target is operator.getitem and isinstance(_value(node.args[0]), (tuple, list)):
        return False           # an element of a tuple result: wiring, not an op
    from amanda.runtime.pytorch import _QUERIES
    return _raw_op(node)[1] not in _QUERIES


def _tensor_args(node):
    """The tensor arguments in the order an eager routine sees them."""
    found = []

    def visit(value):
        if isinstance(value, torch.fx.Node):
            if isinstance(_value(value), torch.Tensor):
                found.append(value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.fx.Node) and isinstance(_value(item), torch.Tensor):
                    found.append(item)
    for a in node.args:
        visit(a)
    for a in node.kwargs.values():
        if isinstance(a, torch.fx.Node) and isinstance(_value(a), torch.Tensor):
            found.append(a)
    return found


def _module_path(node, root):
    """(path below the compiled module, class) of the innermost module calling
    ``node``; ``root`` is (path, class) for nodes Dynamo gives no module stack."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return root
    path, cls = list(stack.values())[-1]
    path = re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", path)   # L['self'].layers[0] -> L.self.layers.0
    parts = path.split(".")
    return ".".join(parts[2:]), cls   # below the root (L.self / L.fn)


#: ``owner`` of a graph Dynamo captured from a function (no module around it).
_FUNCTION = object()


def _root(gm, owner=None):
    """(path, class) of the compiled module: ("", its class), or (None, None) for a
    compiled function (its ops are outside any module, as in eager). ``owner`` is
    the module whose method Dynamo compiles, when known (Dynamo's module stacks
    start below it)."""
    if owner is _FUNCTION:
        return None, None
    if owner is not None:
        return "", owner
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            return "", list(stack.values())[0][1]
    return None, None


def _site(node, cls, name):
    """(qualified function, line) of the frame that calls the op, as eager picks it.

    Dynamo records user frames only; an op inside one of torch's own layers
    (``nn.Linear.forward``) has no stack trace, so the layer's source is read
    for the first line that calls the op by name."""
    if cls is not None and getattr(sys.modules.get(cls.__module__), "__file__", "").startswith(_LAYER_DIR):
        return _layer_site(cls, name)      # ops of torch's own layers
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    for file, line, function in reversed(frames):
        if file.startswith(_TORCH_DIR) and (file == _MODULE_FILE or not file.startswith(_LAYER_DIR)):
            continue     # torch internals Dynamo inlined (F.relu's body): the site is further up
        return _qualname(cls, file, function), int(line)
    return _layer_site(cls, name)


_LAYER_SITES = {}


def _layer_site(cls, name):
    key = (cls, name)
    if key not in _LAYER_SITES:
        _LAYER_SITES[key] = _find_layer_site(cls, name)
    return _LAYER_SITES[key]


def _find_layer_site(cls, name):
    import inspect
    call = re.compile(r"[.\s(]" + re.escape(name) + r"\(")
    for klass in getattr(cls, "__mro__", ()):
        for value in vars(klass).values():
            code = getattr(value, "__code__", None)
            if code is None or not code.co_filename.startswith(_LAYER_DIR):
                continue
            try:
                lines, first = inspect.getsourcelines(value)
            except (OSError, TypeError):
                continue
            for offset, text in enumerate(lines):
                if call.search(text):
                    return code.co_qualname, first + offset
    return None, None


def _qualname(cls, file, name):
    for klass in getattr(cls, "__mro__", ()):
        for value in vars(klass).values():
            code = getattr(value, "__code__", None)
            if code is not None and code.co_name == name and code.co_filename == file:
                return code.co_qualname
    code = getattr(_tls, "code", None)      # the frame Dynamo compiles (a nested function...)
    if code is not None and code.co_name == name and code.co_filename == file:
        return code.co_qualname
    return name


class CompiledGraphBackend(GraphBackend):
    """Contexts of compiled graphs: ``get_op()`` is the torch callable an eager
    run calls, tensors are the fx nodes (``node.meta["example_value"]`` is a fake
    tensor with shape and dtype)."""

    namespace = NAMESPACE

    def __init__(self, lifted):
        super().__init__()
        self.lifted = lifted

    def raw_op(self, ir_op):
        return self.lifted.raw_ops[ir_op.name]

    def values(self, ir_tensors):
        return [self.lifted.fx_nodes[t.name] for t in ir_tensors]


class LiftedGraph:
    """A Dynamo graph as IR: ``graph``, and per IR op its fx node, id and raw op."""

    def __init__(self):
        self.graph = Graph("pytorch_compiled", namespace=NAMESPACE)
        self.nodes = {}      # IR op name -> fx node
        self.fx_nodes = {}   # IR tensor name -> fx node
        self.op_ids = {}     # IR op name -> op id (eager's formula)
        self.raw_ops = {}
        self.module_paths = {}


def lift_dynamo_graph(gm, owner=None):
    """Lifts the FX graph Dynamo captured into the IR: one op per call that an
    eager run would see as a point, ids computed like eager ids (module path,
    calling function, line, op name, occurrence).

    Args:
        gm: the ``GraphModule`` Dynamo captured.
        owner: the class of the module whose method Dynamo compiles (the root of
            the module paths), `_FUNCTION` for a function, or None (unknown: read
            from Dynamo's module stacks).

    Returns:
        A `LiftedGraph`.
    """
    from amanda.frontends.pytorch_graph import tensor_attrs
    from amanda.runtime.pytorch import _stable_id

    lifted = LiftedGraph()
    values, counts, used = {}, {}, set()
    root = _root(gm, owner)
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            values[node] = lifted.graph.add_input(node.name, **tensor_attrs(_value(node)))
            lifted.fx_nodes[node.name] = node
        elif _is_point(node):
            inputs = [values[a] for a in _tensor_args(node) if a in values]
            raw, name = _raw_op(node)
            op = lifted.graph.create_op(name, inputs, num_outputs=1, name=node.name,
                                        output_names=[node.name])
            values[node] = op.outputs[0]
            lifted.fx_nodes[node.name] = node
            lifted.nodes[node.name] = node
            lifted.raw_ops[node.name] = raw
            path, cls = _module_path(node, root)
            qualname, line = _site(node, cls, name)
            parts = [path, qualname, line, name]
            n = counts.get(tuple(parts), 0)
            counts[tuple(parts)] = n + 1
            parts.append(n)
            op_id = _stable_id(*parts)
            while op_id in used:
                parts.append("+")
                op_id = _stable_id(*parts)
            used.add(op_id)
            lifted.op_ids[node.name] = op_id
            lifted.module_paths[node.name] = path
        elif isinstance(_value(node), torch.Tensor):
            # a tensor made by a call that is no point (a getitem of a tuple result):
            # it stands for its producer's output in the wiring
            producers = [values[a] for a in node.all_input_nodes if a in values]
            if producers:
                values[node] = producers[0]
    return lifted


# -- code Dynamo makes for a frame -------------------------------------------------------

_PLAIN_FRAMES = frozenset([(_MODULE_FILE, "_wrapped_call_impl"), (_MODULE_FILE, "_call_impl")])


def _graph_breaks():
    from torch._dynamo.utils import counters
    return sum(counters["graph_break"].values())


def _outside_graphs(frame, result, breaks, call):
    """Why the code Dynamo made for a frame would run code outside its graphs
    (None if it would not): a graph break (counted by Dynamo, or a resume
    function in the code), or no code at all for a frame of the user's
    (Dynamo skips it, and it would run without amanda's mode).

    Frames Dynamo skips that are no user code are not counted: the wrappers
    of ``Module.__call__`` (`_PLAIN_FRAMES`), and, once a frame of the call got
    code, the frames in Dynamo's skip list that this code calls (Dynamo's
    machinery that runs the compiled graphs): the user's code reaches a skipped
    function only through a graph break, which falls back first."""
    if _graph_breaks() != breaks:
        return "graph break"
    code = getattr(getattr(result, "guarded_code", None), "code", None)
    if code is None:
        if (frame.f_code.co_filename, frame.f_code.co_name) in _PLAIN_FRAMES:
            return None
        reason = getattr(result, "skip_reason", None) or "no reason given"
        if call.compiled and reason == "frame is in the Dynamo skipfiles list":
            return None
        return "frame skipped by Dynamo: " + reason
    if any(name.startswith("__resume_at_") for name in code.co_names):
        return "graph break"
    call.compiled = True
    return None
