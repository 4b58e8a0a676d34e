"""PyTorch graph mode: capture a model once, instrument or rewrite its graph, run it many times.

    import amanda
    from amanda.runtime.pytorch.capture import capture

    program = capture(model, (x,))          # torch.export -> amanda IR
    y = program(x)                          # runs the lowered GraphModule
    with amanda.apply(tool):
        y = program(x)                      # runs the instrumented graph (cached;
                                            # analysed per call in cache_disabled())
    fast = program.rewrite(rules)           # subgraph rewriting, see amanda.tools.rewrite

`capture` exports the model with ``torch.export`` (the training IR: aten ops such as
``conv2d``, ``batch_norm``, ``linear``; nothing decomposed), lifts the graph with
`amanda.frontends.pytorch.graph` and lowers it back to a ``torch.fx.GraphModule``
with `lower_to_graph_module`. The program reads the model's own parameters and
buffers on every call, so gradients reach them through ordinary autograd over
the lowered forward graph (``loss.backward()`` after a call), training-mode
buffer updates land in the model's buffers, and later weight updates are seen.
Backward ops are not part of the captured graph, so backward instrumentation
points do not exist in this mode.

Instrumentation uses the shared graph pass: analysis routines run once per
(structural hash of the graph, applied tools) and see contexts whose
``get_op()`` is the aten operator (``torch.ops.aten.conv2d``, ``__name__``
``"conv2d"``), ``get_inputs()``/``get_outputs()`` the fx nodes of the exported
graph (``node.meta["val"]`` holds a fake tensor with shape and dtype) and
``get_ir_op()``/``get_graph()`` the IR. Each action becomes an ``amanda.routine``
op, lowered to a call of the routine inside the graph: a portable routine
(``amanda.portable.routine``) is called as is, so tracing the lowered module
(``make_fx``, ``torch.export``) sees its aten ops; any other routine runs as a
Python callback on the tensors, isolated from autodiff unless recorded under
``amanda.ad_enabled()``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
import torch.utils._pytree as pytree

from amanda import controls
from amanda.errors import BackendError
from amanda.frontends.pytorch.graph import NAMESPACE, decode_args, lift_exported_program, resolve_target
from amanda.frontends.pytorch.targets import check_attr_path
from amanda.passes.instrumentation import GraphBackend
from amanda.passes.lower_actions import ROUTINE
from amanda.passes.pipeline import instrument_graph
from amanda.runtime.pytorch.eager.records import _StraightThrough
from amanda.runtime.routines import call_routine

__all__ = ["NAMESPACE", "CapturedProgram", "capture", "lower_to_graph_module"]


def capture(model, args, kwargs=None, strict=False):
    """Captures ``model`` called on example inputs as an amanda IR graph.

    Args:
        model: a ``torch.nn.Module`` (or a plain function, wrapped in one).
        args: a tuple of example positional inputs.
        kwargs: example keyword inputs.
        strict: passed to ``torch.export.export``.

    Returns:
        A `CapturedProgram`.

    Raises:
        BackendError: ``torch.export`` failed (the message says why).
    """
    module = model if isinstance(model, torch.nn.Module) else _FunctionModule(model)
    try:
        with controls.disabled():
            ep = torch.export.export(module, tuple(args), kwargs=kwargs or None, strict=strict)
    except Exception as exc:
        raise BackendError(f"torch.export could not capture {type(model).__name__}: "
                           f"{type(exc).__name__}: {exc}") from exc
    graph = lift_exported_program(ep)
    return CapturedProgram(graph, module, ep.call_spec.in_spec, ep.call_spec.out_spec,
                           dict(ep.constants), [n for n in ep.graph.nodes])


class _FunctionModule(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class CapturedProgram:
    """A captured model: an IR graph plus what is needed to run it.

    Calling it runs the lowered graph on the model's current parameters and
    buffers; inside ``amanda.apply(...)`` the graph instrumented by the applied
    tools runs instead (the instrumented module is cached by the graph's
    structural hash and the tools).

    Attributes:
        graph: the amanda IR graph (inputs: parameters, buffers and constants
            first, then the flattened user inputs).
        module: the captured ``torch.nn.Module`` (parameters and buffers are
            read from it at each call).
    """

    def __init__(self, graph, module, in_spec, out_spec, constants, fx_nodes=None):
        self.graph = graph
        self.module = module
        self.in_spec = in_spec
        self.out_spec = out_spec
        self.constants = constants
        self._fx_nodes = {n.name: n for n in fx_nodes or ()}
        self._modules = {}   # (structural hash, session token) -> GraphModule
        self._hash = None    # (number of ops, structural hash of self.graph)

    @property
    def graph_module(self):
        """The uninstrumented lowered ``GraphModule``."""
        return self._lowered(None)

    def instrument(self, *tools):
        """A new program whose graph is instrumented by ``tools``.

        Returns:
            A `CapturedProgram` whose graph holds ``amanda.routine`` ops.
        """
        from amanda.tool import session_for

        session = session_for(tools)
        return self._with_graph(self._instrumented_graph(session))

    def rewrite(self, rules, max_iterations=10):
        """A new program rewritten by subgraph rules (`amanda.passes.rewrite`).

        Returns:
            ``(program, result)``: the new `CapturedProgram` and the `RewriteResult`.
        """
        from amanda.passes.rewrite import apply_rules

        result = apply_rules(self.graph, rules, max_iterations=max_iterations)
        return self._with_graph(result.graph), result

    def __call__(self, *args, **kwargs):
        from amanda.tool import current_session

        session = current_session()
        if controls.state.disabled or session is None or not (
                _has_forward_routines(session) or session.requires_graph):
            session = None
        module = self._lowered(session)
        flat = self._flat_inputs(args, kwargs)
        with controls.disabled():  # the eager driver must not instrument the graph's ops again
            outputs = module(*flat)
        return self._unflatten(outputs)

    def _with_graph(self, graph):
        program = CapturedProgram(graph, self.module, self.in_spec, self.out_spec, self.constants)
        program._fx_nodes = self._fx_nodes
        return program

    def _instrumented_graph(self, session):
        return instrument_graph(self.graph, session, TorchGraphBackend(self._fx_nodes),
                                name="pytorch capture")[1]

    def structural_hash(self):
        """The graph's structural hash, the cache key of lowered modules.

        Computed once per graph size: ``rewrite``/``instrument`` return new
        programs; after editing ``program.graph`` in place without changing its
        number of ops, call `refresh`.
        """
        if self._hash is None or self._hash[0] != len(self.graph):
            self._hash = (len(self.graph), self.graph.structural_hash())
        return self._hash[1]

    def refresh(self):
        """Forget the cached hash (after editing ``program.graph`` in place)."""
        self._hash = None

    def _lowered(self, session):
        """The lowered module for ``session``'s tools (None: uninstrumented),
        cached by the graph's structural hash and the tools; inside
        ``amanda.cache_disabled()`` instrumented anew at every call (the one
        cache rule: analysis at every execution), replacing the cached one."""
        key = (self.structural_hash(), session.token if session is not None else None)
        module = self._modules.get(key)
        if module is None or (session is not None and not controls.state.cache):
            graph = self.graph if session is None else self._instrumented_graph(session)
            module = self._modules[key] = lower_to_graph_module(graph)
        return module

    def _flat_inputs(self, args, kwargs):
        flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        if self.in_spec is not None and spec != self.in_spec:
            raise BackendError(f"the inputs do not have the structure the program was captured with: "
                               f"got {spec}, expected {self.in_spec}")
        state = dict(self.module.named_parameters(remove_duplicate=False))
        state.update(self.module.named_buffers(remove_duplicate=False))
        values = []
        user = iter(flat)
        for tensor in self.graph.inputs:
            kind, target = tensor.attrs.get("kind"), tensor.attrs.get("target")
            if kind in ("parameter", "buffer"):
                values.append(state[target])
            elif kind == "constant":
                values.append(self.constants[target])
            elif kind == "attr":
                values.append(_get_attr(self.module, target))
            else:
                values.append(next(user))
        return values

    def _unflatten(self, outputs):
        kinds = self.graph.attrs.get("output_kinds") or ["user_output"] * len(outputs)
        targets = self.graph.attrs.get("output_targets") or [None] * len(outputs)
        user = []
        for value, kind, target in zip(outputs, kinds, targets):
            if kind == "buffer_mutation":
                with torch.no_grad():
                    _get_attr(self.module, target).copy_(value)
            elif kind == "user_output":
                user.append(value)
        if self.out_spec is None:
            return user[0] if len(user) == 1 else tuple(user)
        return pytree.tree_unflatten(user, self.out_spec)

    def __repr__(self):
        return f"<CapturedProgram {type(self.module).__name__}: {len(self.graph)} ops>"


def _get_attr(module, path):
    """The submodule, parameter, buffer or tensor attribute at ``path`` of ``module``.

    The path comes from the graph (possibly a file), so it is walked through
    submodules only and refused when a part is a dunder name: otherwise
    ``"forward.__globals__"`` would hand the model's globals to the graph.
    """
    try:
        check_attr_path(path)
    except LookupError as error:
        raise BackendError(str(error)) from None
    value = module
    for part in path.split("."):
        if not isinstance(value, torch.nn.Module):
            raise BackendError(f"{path!r} walks through a {type(value).__name__}, not a submodule")
        value = getattr(value, part)
    if not isinstance(value, (torch.Tensor, torch.nn.Module, torch.ScriptObject)):
        raise BackendError(f"{path!r} is a {type(value).__name__}, not a tensor or module")
    return value


def _has_forward_routines(session):
    from amanda.tool import FORWARD_AFTER, FORWARD_BEFORE

    return bool(session.routines[FORWARD_BEFORE] or session.routines[FORWARD_AFTER])


class TorchGraphBackend(GraphBackend):
    """Contexts of captured graphs: ``get_op()`` is the aten operator (an
    ``OpOverloadPacket`` such as ``torch.ops.aten.conv2d``), tensors are the fx
    nodes of the exported graph (or the IR tensors for ops added later)."""

    namespace = NAMESPACE

    def __init__(self, fx_nodes):
        super().__init__()
        self.fx_nodes = fx_nodes

    def raw_op(self, ir_op):
        target = ir_op.attrs.get("target")
        if target is None:
            return ir_op
        resolved = resolve_target(target, ir_op)
        return getattr(resolved, "overloadpacket", resolved)

    def values(self, ir_tensors):
        return [self.fx_nodes.get(t.name, t) for t in ir_tensors]


# -- lowering --------------------------------------------------------------------------


def lower_to_graph_module(graph):
    """Lowers an IR graph lifted by `amanda.frontends.pytorch.graph` back to a ``GraphModule``.

    Its placeholders are the IR graph's inputs in order; it returns a tuple of
    the IR graph's outputs. ``amanda.routine`` ops become calls of their routine.

    Args:
        graph: the IR graph (possibly rewritten or instrumented).

    Returns:
        A ``torch.fx.GraphModule``.

    Raises:
        BackendError: an op has no ``target`` attr and is not a routine.
    """
    fx_graph = torch.fx.Graph()
    env = {}
    for tensor in graph.inputs:
        env[id(tensor)] = fx_graph.placeholder(_fx_name(tensor.name))
    for op in graph:
        if op.type == ROUTINE:
            _lower_routine(fx_graph, op, env)
        else:
            _lower_call(fx_graph, op, env)
    fx_graph.output(tuple(env[id(t)] for t in graph.outputs))
    return torch.fx.GraphModule(torch.nn.Module(), fx_graph, class_name="AmandaGraphModule")


def _fx_name(name):
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name) or "v"


def _lower_call(fx_graph, op, env):
    target_name = op.attrs.get("target")
    if target_name is None:
        raise BackendError(f"op {op.name!r} ({op.type}) has no 'target' attr: PyTorch graph ops need the "
                           "qualified operator, e.g. 'aten.mul.Tensor'")
    target = resolve_target(target_name, op)  # only operators of the table, see frontends.pytorch.targets
    inputs = [env[id(t)] for t in op.inputs]
    args = tuple(decode_args(op.attrs.get("args", []), inputs))
    kwargs = decode_args(op.attrs.get("kwargs", {}), inputs)
    node = fx_graph.call_function(target, args, kwargs)
    node.name = fx_graph._graph_namespace.create_name(_fx_name(op.name), node)
    if op.attrs.get("tuple_output"):
        for i, tensor in enumerate(op.outputs):
            if tensor.uses or tensor.is_graph_output:
                env[id(tensor)] = fx_graph.call_function(operator.getitem, (node, i))
    else:
        env[id(op.outputs[0])] = node


def _lower_routine(fx_graph, op, env):
    action = op.attrs.get("action")
    if not callable(getattr(action, "func", None)):
        # read back from a file, the action is only its repr: routines are code and
        # are never restored from a graph's data
        raise BackendError(f"routine op {op.name!r} ({op.attrs.get('routine')}) has no routine to run: "
                           "routines are not restored from graph files; instrument the graph again")
    call = _RoutineCall(action, op)
    inputs = [env[id(t)] for t in op.inputs]
    node = fx_graph.call_function(call, tuple(inputs))
    for i, tensor in enumerate(op.outputs):
        env[id(tensor)] = fx_graph.call_function(operator.getitem, (node, i))


def _is_portable(func):
    try:
        from amanda import portable
    except ImportError:
        return False
    return portable.is_portable(func)


class _RoutineCall:
    """The call target of one lowered routine: runs it and returns its tensors.

    Returns a tuple with one tensor per IR output of the routine op: the
    replacements, or the inputs the routine kept.
    """

    def __init__(self, action, op):
        self.action = action
        self.replacing = op.attrs["kind"].startswith("replace")
        self.num_outputs = len(op.outputs)
        self.where = (op.attrs.get("target"), op.attrs.get("target"), NAMESPACE)
        self.portable = _is_portable(action.func)
        self.__name__ = f"amanda_routine_{getattr(action.func, '__name__', 'routine')}"
        self.__qualname__ = self.__name__

    def __call__(self, *tensors):
        action = self.action
        differentiate = action.ad
        with torch.set_grad_enabled(torch.is_grad_enabled() and differentiate):
            given = tensors if differentiate else tuple(t.detach() if isinstance(t, torch.Tensor) else t
                                                        for t in tensors)
            new = call_routine(action, list(given), lambda v: isinstance(v, torch.Tensor), self.where)
        if self.replacing:
            if new is None or len(new) != self.num_outputs or any(v is None for v in new):
                raise BackendError(f"replace routine of op {self.where[0]!r} must return "
                                   f"{self.num_outputs} tensors")
            return tuple(new)
        if new is None:
            return tuple(tensors)
        result = []
        for old, value in zip(tensors, new):
            if value is None:
                result.append(old)
            elif differentiate or not isinstance(old, torch.Tensor) or not old.requires_grad:
                result.append(value)
            else:
                result.append(_StraightThrough.apply(old, [value.detach()]))
        return tuple(result)
