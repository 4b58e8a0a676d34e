"""Dynamo's FX graphs lifted into the amanda IR, for the compiled path
(`amanda.runtime.pytorch.compiled`): which FX nodes are instrumentation
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
import weakref

import torch
import torch.fx

from amanda.ir import Graph
from amanda.passes.instrumentation import GraphBackend
from amanda.runtime.pytorch.compiled.sites import MACHINERY, META_KEY

NAMESPACE = "pytorch/" + torch.__version__.split("+")[0] + "/compiled"

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_LAYER_DIR = os.path.join(_TORCH_DIR, "nn", "modules") + os.sep
_MODULE_FILE = os.path.join(_LAYER_DIR, "module.py")
#: per-thread state of the compiled call in progress (owner and code of the
#: frame Dynamo compiles, graph breaks seen...), shared with compiled/__init__.py
_tls = threading.local()



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
    """The torch callable an eager run would see (``get_op()``) and its name:
    for a Python operator (``operator.iadd``...), the callable amanda's eager
    mode receives when Python runs it on tensors (``h += 1`` is ``Tensor.add_``,
    ``1 + x`` is ``Tensor.__radd__``), else the node's target."""
    target = node.target
    if node.op == "call_method":
        raw = getattr(torch.Tensor, target, None)
        return raw, target
    if target is getattr:
        return _property_read(node)
    if getattr(target, "__module__", None) in ("_operator", "operator"):
        from amanda.runtime.pytorch.compiled.sites import eager_callable
        raw = eager_callable(target, node.args, _value)
        if raw is None:    # not runnable on meta tensors: the method of the same name
            name = target.__name__.strip("_")
            raw = getattr(torch.Tensor, name, None) or getattr(torch.Tensor, f"__{name}__", None)
        if raw is not None:
            return raw, getattr(raw, "__name__", target.__name__)
    return target, getattr(target, "__name__", str(target))


def _property_read(node):
    """``getattr(x, name)`` on a tensor (FX's record of ``x.real``): eager's
    mode receives the property's ``__get__``, a point named after the
    property for the view properties (``real``, ``imag``, ``T``, ``mT``...),
    no point for the others (``__get__`` is a query). FNet's ``x.real`` was
    named ``getattr``, with another id than eager's."""
    from amanda.runtime.pytorch.eager.sites import _TENSOR_PROPERTIES
    name = node.args[1] if len(node.args) > 1 else None
    descriptor = getattr(torch.Tensor, name, None) if isinstance(name, str) else None
    if descriptor is None or not hasattr(descriptor, "__get__"):
        return getattr, "getattr"
    return descriptor.__get__, name if name in _TENSOR_PROPERTIES else "__get__"


def _in_place_without_result(node):
    """A call that returns None after modifying its first argument, a tensor
    (``x[i] = v``): eager sees it as an op whose output is that tensor."""
    return (_value(node) is None and node.args and isinstance(node.args[0], torch.fx.Node)
            and isinstance(_value(node.args[0]), torch.Tensor))


def _is_point(node):
    if node.op not in ("call_function", "call_method"):
        return False
    if not _tensors_in(_value(node)) and not _in_place_without_result(node):
        return False
    if node.target is operator.getitem and isinstance(_value(node.args[0]), (tuple, list)):
        return False           # an element of a tuple result: wiring, not an op
    from amanda.runtime.pytorch.eager.sites import _QUERIES
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


def _source_path(entry):
    """A module stack entry's source, dotted: ``L['self'].layers[0]`` -> ``L.self.layers.0``."""
    return re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", entry[0])


def _module_path(node, root):
    """(path below the root module, class) of the innermost module calling
    ``node``; ``root`` is (path, class[, source, module]) for nodes Dynamo
    gives no module stack.

    **Rule:** a module's path is the one eager's `eager.mode._module_path`
    gives the chain of modules being called: the root module, then each
    module of Dynamo's stack, found as objects from their sources among the
    compiled frame's locals and globals (``L['self'].layers[0]``); the root
    is the compiled module (``module``, `_owner`), or in a compiled function
    the outermost module of the stack. So a module reached through a
    wrapper's ``args[0]``, through another object's attribute, a global, or
    registered under two names gets eager's name. Where a source does not
    resolve, the path is its source below the root's (``source``:
    ``L.self``, ``L.args.0``; the stack's first entry in a function), and a
    module outside the root's attributes then has no known eager path:
    `NoSite`, the call runs eagerly."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return root[:2]
    entries = list(stack.values())
    cls = entries[-1][1]
    source = root[2] if len(root) > 2 else None
    module = root[3] if len(root) > 3 else None
    found = _resolved(entries, module)
    if found is not None:
        return found, cls
    path = _source_path(entries[-1])
    if source is None:
        if root[0] == "":         # the compiled module is not known: below L.self / L.fn
            return ".".join(path.split(".")[2:]), cls
        source = _source_path(entries[0])    # a compiled function: its root module call
    if path == source or path.startswith(source + "."):
        return path[len(source) + 1:], cls
    raise NoSite(f"fx node {node.name} is in a module ({entries[-1][0]}) that is not reached "
                 f"through the attributes of the root module ({source}), which eager names "
                 "its path from")


def _resolved(entries, module):
    """Eager's path of the innermost of ``entries`` below ``module`` (None:
    a compiled function, whose root is the first entry), from the module
    objects their sources name in the frame Dynamo compiles; None when a
    source does not resolve to a module."""
    from amanda.runtime.pytorch.eager.mode import _module_path as eager_path
    scope = getattr(_tls, "scope", None)
    if not scope:
        return None
    cache = scope.setdefault("amanda sources", {})
    chain = [] if module is None else [module]
    for entry in entries:
        found = cache.get(entry[0], _UNRESOLVED)
        if found is _UNRESOLVED:
            try:
                found = eval(entry[0], {"__builtins__": {}}, scope)   # noqa: S307 (Dynamo's own source text)
            except Exception:   # noqa: BLE001 - a source form not known here
                found = None
            cache[entry[0]] = found = found if isinstance(found, torch.nn.Module) else None
        if found is None:
            return None
        if not chain or found is not chain[-1]:
            chain.append(found)
    return eager_path([weakref.ref(m) for m in chain])


_UNRESOLVED = object()


#: ``owner`` of a graph Dynamo captured from a function (no module around it).
_FUNCTION = object()


def _root(gm, owner=None):
    """(path, class, source, module) of the compiled module: ("", and
    `_owner`'s class, source and module), or Nones for a compiled function
    (its ops are outside any module, as in eager). ``owner`` is `_owner`'s
    answer for the frame Dynamo compiles, when known (Dynamo's module
    stacks start below it)."""
    if owner is _FUNCTION:
        return None, None, None, None
    if owner is not None:
        return ("", *owner)
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            return "", list(stack.values())[0][1], None, None
    return None, None, None, None


class NoSite(Exception):
    """A point node without the site amanda reads while Dynamo traces (a node
    Dynamo made some other way, a layout not known here): its eager id is
    unknown, so the graph is not instrumented and the call runs eagerly."""


class NotLifted(NoSite):
    """A graph with ops amanda cannot lift as eager's points: the graph is
    not instrumented and the call runs eagerly (the message is the reason)."""


def _unliftable(gm):
    """Why the ops of ``gm`` cannot all be points of a compiled graph, or None.

    * A functorch transform traced inline (``torch.func.vmap``, also inside
      ``associative_scan``'s generic mode, which transformers' Mamba uses
      when compiled): the ops between ``_vmap_increment_nesting`` and its
      decrement run on batched tensors, which amanda's custom ops have no
      batching rule for (Mamba failed with "Batching rule not implemented
      for amanda::observe").
    * A higher-order op with a body (``torch.cond``, ``scan``,
      ``torch.utils.checkpoint``, an ``autograd.Function``): the body's ops
      are a subgraph that is not lifted, while eager sees each as a point."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = getattr(node.target, "__name__", "")
        if name.endswith("_increment_nesting"):
            return (f"a functorch transform traced into the graph ({name}, e.g. torch.func.vmap): "
                    "routines cannot run on its batched tensors in compiled graphs")
        if isinstance(node.target, torch._ops.HigherOrderOperator):
            for arg in node.all_input_nodes:
                if arg.op == "get_attr" and isinstance(getattr(gm, str(arg.target), None),
                                                       torch.fx.GraphModule):
                    return (f"higher-order op {node.target.name()} with a body: its ops are "
                            "not points of compiled graphs")
    return None


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
        #: (path below the module the graph's ops are counted from, site code id,
        #: instruction offset, callable) -> executions per run of the graph: what
        #: eager's occurrence counts gain when the graph runs (`_Call.count_graphs`)
        self.counts = {}
        #: node name of a routine that replaces an op and is differentiated
        #: (``replace_op`` under ``amanda.ad_enabled()``) -> that op's IR name:
        #: eagerly the autograd nodes it makes are the op's backward ops
        self.replacements = {}
        #: fx node -> the IR tensor standing for its value (placeholders,
        #: points' outputs, the getitems of their tuple results)
        self.tensors = {}


def lift_dynamo_graph(gm, owner=None, caller=None):
    """Lifts the FX graph Dynamo captured into the IR: one op per call that an
    eager run would see as a point, ids computed like eager ids (module path,
    calling function, line, op name, occurrence).

    Args:
        gm: the ``GraphModule`` Dynamo captured.
        owner: (class, source, module) of the module whose method Dynamo
            compiles (the root of the module paths; `_owner`), `_FUNCTION` for a function, or
            None (unknown: read from Dynamo's module stacks).
        caller: None for a call outside eager modules, or (eager path of the
            module the compiled code runs in, its earlier calls there in the
            step, whether the compiled callable is that module) for a
            compiled part of an eager module.

    Returns:
        A `LiftedGraph`.
    """
    from amanda.frontends.pytorch.graph import tensor_attrs

    reason = _unliftable(gm)
    if reason is not None:
        raise NotLifted(reason)
    lifted = LiftedGraph()
    values = {}
    root = _root(gm, owner)
    ids = _Ids(root, caller, gm.graph)
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            values[node] = lifted.graph.add_input(node.name, **tensor_attrs(_value(node)))
            lifted.fx_nodes[node.name] = node
        elif _is_point(node) and node.meta.get(META_KEY) != MACHINERY:
            inputs = [values[a] for a in _tensor_args(node) if a in values]
            raw, name = _raw_op(node)
            op = lifted.graph.create_op(name, inputs, num_outputs=1, name=node.name,
                                        output_names=[node.name])
            values[node] = op.outputs[0]
            lifted.fx_nodes[node.name] = node
            lifted.nodes[node.name] = node
            lifted.raw_ops[node.name] = raw
            lifted.op_ids[node.name], lifted.module_paths[node.name] = ids.of(node, raw, name)
            # as an eager trace's op: tools keying ops by stable id (graph
            # tools, `amanda.runtime.pytorch.tools.stable_op_id`) find eager's
            op.attrs.update(op_id=lifted.op_ids[node.name], module=lifted.module_paths[node.name])
            op.outputs[0].attrs.update(tensor_attrs(_value(node)))
            below = _module_path(node, root)[0]
            if below is None and caller is not None:
                below = ""       # a compiled function's ops are in the calling module
            if below is not None:
                code, _, offset = node.meta[META_KEY]
                key = (below, id(code), offset, raw)
                lifted.counts[key] = lifted.counts.get(key, 0) + 1
        elif isinstance(_value(node), torch.Tensor):
            # a tensor made by a call that is no point (a getitem of a tuple result):
            # it stands for its producer's output in the wiring
            producers = [values[a] for a in node.all_input_nodes if a in values]
            if producers:
                values[node] = producers[0]
    lifted.tensors = values
    return lifted


class _Ids:
    """Op ids of one graph's nodes, in execution order, as eager's
    ``_Mode``/``_new_record`` give them: an op is keyed by (innermost module,
    site code, instruction, callable); inside a module, its occurrence is the
    number of earlier executions of that key in the step (a root module call
    starts a step); outside any module it is 0; the id hashes (module path,
    site's qualified name, site's line, op name, occurrence), and a second key
    with the same parts appends "+" until the id is free.

    In a compiled part of an eager module (``caller``: that module's eager
    path, and the part's ``calls`` there earlier in the step), paths are
    below the caller's and an op's occurrence starts after those calls'
    executions of its key (``calls`` times the graph's own)."""

    def __init__(self, root, caller=None, graph=None):
        self.root = root
        self.counts = {}
        self.keys = {}          # op id -> key
        self.step = None        # Dynamo's key of the root module call of the step
        self.caller = caller
        self.totals = {}
        if caller is not None:
            self.root = (caller[0],) + tuple(root[1:])
            for node in graph.nodes:     # executions of each key in one call
                if node.meta.get(META_KEY) not in (None, MACHINERY) and _is_point(node):
                    key = self._key(node, _raw_op(node)[0])
                    self.totals[key] = self.totals.get(key, 0) + 1

    def _path(self, node):
        path = _module_path(node, self.root)[0]
        if self.caller is not None and node.meta.get("nn_module_stack"):
            if not self.caller[2]:
                # a module called by a compiled function inside an eager module:
                # eager names it by where it sits among the caller's modules,
                # which Dynamo's access path does not say
                raise NoSite(f"fx node {node.name} is in a module that a compiled function "
                             "called inside an eager module calls")
            path = ".".join(p for p in (self.caller[0], path) if p)
        return path

    def _key(self, node, raw):
        code, line, offset = node.meta[META_KEY]
        return (self._path(node), id(code), offset, raw)

    def of(self, node, raw, name):
        from amanda.runtime.pytorch.eager.records import _stable_id
        site = node.meta.get(META_KEY)
        if site is None:
            raise NoSite(f"op {name!r} (fx node {node.name}) has no calling site")
        code, line, offset = site
        qualname = code.co_qualname
        key = self._key(node, raw)
        path = key[0]
        if path is None:
            n = 0               # outside modules, an op is its site
        else:
            stack = node.meta.get("nn_module_stack")
            first = next(iter(stack)) if stack else None
            if self.root[0] is None and first != self.step:
                self.step = first          # a root module call of a compiled function
                self.counts.clear()
            n = self.counts.get(key, 0)
            self.counts[key] = n + 1
            if self.caller is not None:
                n += self.caller[1] * self.totals.get(key, 0)
        parts = [path, qualname, line, name, n]
        op_id = _stable_id(*parts)
        while self.keys.setdefault(op_id, key) != key:
            parts.append("+")                # distinct sites, distinct ids
            op_id = _stable_id(*parts)
        return op_id, path


# -- code Dynamo makes for a frame -------------------------------------------------------

_PLAIN_FRAMES = frozenset([(_MODULE_FILE, "_wrapped_call_impl"), (_MODULE_FILE, "_call_impl")])


#: Dynamo's reason for running a frame that holds no tensor, module or torch
#: import as plain Python (``PreTrainedConfig.__getattribute__``, read by the
#: code Dynamo makes for transformers' output wrappers)
_NO_TENSOR = "no tensor-related objects found in frame"


def _torch_object(value):
    try:
        module = value.__name__ if isinstance(value, type(sys)) else getattr(value, "__module__", None)
    except Exception:
        return True          # an object that will not say: taken for torch's
    return isinstance(module, str) and (module == "torch" or module.startswith("torch."))


def _reaches_torch(frame):
    """Whether a frame Dynamo runs as plain Python could call torch itself: a
    global or builtin name it reads, or a variable of its closure, is a torch
    module or an object of torch's (``zeros`` imported from torch). The
    functions it calls are frames of their own, which Dynamo compiles or this
    module watches; only a torch callable reached through an attribute of an
    argument (``self.f = torch.zeros``) is not seen here."""
    code = frame.f_code
    scopes = (frame.f_globals, frame.f_builtins)
    for name in code.co_names:
        for scope in scopes:
            if name in scope and _torch_object(scope[name]):
                return True
    for name in code.co_freevars:
        try:
            value = frame.f_locals.get(name)
        except Exception:
            return True
        if _torch_object(value):
            return True
    return False


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
        if reason == _NO_TENSOR and not _reaches_torch(frame):
            return None
        return "frame skipped by Dynamo: " + reason
    if any(name.startswith("__resume_at_") for name in code.co_names):
        return "graph break"
    call.compiled = True
    return None
