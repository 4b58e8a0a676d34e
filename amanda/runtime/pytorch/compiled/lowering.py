"""Compiled PyTorch: the recorded actions lowered into Dynamo's FX graph
(`insert_actions`), for `amanda.runtime.pytorch.compiled`.

Python routines become calls of opaque ``torch.library`` custom ops
(``amanda::observe``, side-effectful, used when every ``return`` of the
routine returns None, and ``amanda::replace``, which returns new tensors and
is straight-through for autograd), so they cause no graph break; portable
routines (`amanda.portable.routine`) are called inside the graph and traced
by the compiler like model code. Before-routines take the op's tensor
arguments; after-routines its outputs as eager's after-point has them (the
tensor, the tensors of a tuple result, or the first argument of an in-place
op that returns None). A ``replace_op`` routine takes the op's place in the
graph (`_insert_replacement`): a Python one as ``amanda::replace_op`` on
detached inputs, a portable one traced without autograd unless recorded
under ``amanda.ad_enabled()``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from amanda import controls
from amanda.context import Action
from amanda.errors import BackendError
from amanda.runtime.pytorch.compiled.graphs import NAMESPACE, _tensor_args, _value
from amanda.runtime.routines import call_routine, invoke

_ROUTINES = []    # handle -> _Routine, for the custom ops


# -- lowering actions into the graph -------------------------------------------------------

class _Routine:
    """One recorded action, called at run time (by a custom op, or inside the
    graph for portable routines)."""

    def __init__(self, action, where):
        self.action = action
        self.where = where
        self.__name__ = f"amanda_{getattr(action.func, '__name__', 'routine')}"

    def __call__(self, tensors):
        new = call_routine(self.action, list(tensors), lambda v: isinstance(v, torch.Tensor), self.where,
                           meta=lambda t: (t.shape, t.dtype) if isinstance(t, torch.Tensor) else None)
        return new


def _observe_impl(handle: int, tensors: list[torch.Tensor], anchors: list[torch.Tensor]) -> None:
    routine = _ROUTINES[handle]
    new = routine(tensors)
    if new is not None:
        raise BackendError(f"routine {routine.__name__} of op {routine.where[0]!r} returned tensors "
                           "where the analysis routine ran it as an observer")


def _replace_impl(handle: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    new = _ROUTINES[handle](tensors)
    if new is None:
        new = [None] * len(tensors)
    return [_copy(t if v is None else v.detach(), t) for t, v in zip(tensors, new)]


def _strided_like(t):
    """An empty tensor with the layout of ``t`` where a copy can have it: its
    very sizes and strides when its elements do not overlap (also a slice,
    ``x[..., :-1]``, whose ``clone()`` would be contiguous); otherwise (an
    expanded tensor) what ``empty_like`` gives. A replacement the routine
    gives back as it is must not change the layout the next ops see: a
    contiguous copy of Wav2Vec2's ``hidden_states[:, :, :-1]`` gave outputs
    5e-7 away from the vanilla compiled model's. The fake implementation
    uses the same rule, so the compiler sees the layout that runs."""
    dims = sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size != 1)
    extent = 1
    for stride, size in dims:
        if stride < extent:
            return torch.empty_like(t)
        extent = stride * size
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)


def _copy(value, like):
    if value.shape != like.shape or value.dtype != like.dtype or value.device != like.device:
        return value.clone()
    return _strided_like(like).copy_(value)


_OPS = {}


def _custom_ops():
    if not _OPS:
        # nondeterministic_seeded: fake tensor mode must not fold a routine on
        # constant inputs (``torch.tensor(2.0)``) by running it while tracing
        # cudagraph_unsafe: a CUDA graph replay runs kernels only, so a
        # routine captured into one would run once, at capture; marked, the
        # op stays out of ``mode="reduce-overhead"``'s graphs
        tags = (torch.Tag.nondeterministic_seeded,) + tuple(
            getattr(torch.Tag, name) for name in ("cudagraph_unsafe",) if hasattr(torch.Tag, name))
        observe = torch.library.custom_op("amanda::observe", mutates_args=(), tags=tags)(_observe_impl)
        observe.register_fake(lambda handle, tensors, anchors: None)
        torch.fx.node.has_side_effect(torch.ops.amanda.observe.default)
        replace = torch.library.custom_op("amanda::replace", mutates_args=(), tags=tags)(_replace_impl)

        @replace.register_fake
        def _(handle, tensors):
            return [_strided_like(t) for t in tensors]

        def backward(ctx, grads):
            return None, list(grads)        # straight-through: the routine is no model code

        replace.register_autograd(backward)
        replace_op = torch.library.custom_op("amanda::replace_op", mutates_args=(),
                                             tags=tags)(_replace_op_impl)
        replace_op.register_fake(_replace_op_fake)
        _OPS["replace_op"] = torch.ops.amanda.replace_op.default
        _OPS["observe"] = torch.ops.amanda.observe.default
        _OPS["replace"] = torch.ops.amanda.replace.default
    return _OPS


def _portable_call(routine, count, names):
    """The function a portable routine's node calls: its first ``count``
    arguments are the selected tensors, the rest the tensors of the routine's
    keyword arguments ``names`` (graph attributes, see `_constants`)."""
    action = routine.action

    def call(*args):
        tensors = args[:count]
        if names:
            routine.action = Action(action.kind, action.func, action.positions,
                                    {**action.kwargs, **dict(zip(names, args[count:]))},
                                    action.ad, action.tool)
        with torch.set_grad_enabled(torch.is_grad_enabled() and action.ad):
            given = tensors if action.ad else [t.detach() for t in tensors]
            new = routine(given)
        if new is None:
            return tuple(tensors)
        # a tensor handed back as it was given keeps the original (no
        # straight-through arithmetic for the compiler to trace)
        return tuple(old if v is None or v is g else (v if routine.action.ad else _straight(old, v))
                     for old, g, v in zip(tensors, given, new))
    call.__name__ = routine.__name__
    call.amanda_portable = True     # its results replace its first arguments (backward._first_readers)
    return call


def _straight(old, new):
    if not old.requires_grad:
        return new
    return old + (new - old).detach()


def _emit(graph, action, selected, where, observe_only, anchors):
    """Inserts the call of one routine at the graph's cursor; returns the nodes of
    its results (one per selected node), or None when it only observes.

    ``anchors``: the op's tensors at this point (its inputs before it, its
    outputs after it), which an observer reads whatever it selects. They tie
    the side-effectful call to the op's dataflow: inductor scheduled an
    observer that read no tensor (``inputs=[]``) into the middle of a fused
    kernel's buffers and generated code that used a buffer it had freed
    (UnboundLocalError at run time)."""
    from amanda.portable import is_portable

    routine = _Routine(action, where)
    if is_portable(action.func):
        names, constants = _constants(graph, action)
        call = graph.call_function(_portable_call(routine, len(selected), names),
                                   tuple(selected) + tuple(constants))
        return _items(graph, call, len(selected), selected)
    if action.ad:
        raise BackendError(f"routine {routine.__name__} of op {where[0]!r} was recorded under "
                           "amanda.ad_enabled(), but compiled graphs can differentiate portable "
                           f"routines only [namespace {NAMESPACE}]")
    ops = _custom_ops()
    _ROUTINES.append(routine)
    handle = len(_ROUTINES) - 1
    if observe_only:
        graph.call_function(ops["observe"], (handle, list(selected), list(anchors)))
        return None
    call = graph.call_function(ops["replace"], (handle, list(selected)))
    return _items(graph, call, len(selected), selected)


def _constants(graph, action):
    """The tensors among a portable routine's keyword arguments (a pruning
    mask), made inputs of the graph: new placeholders after Dynamo's, whose
    tensors are kept in the module's ``amanda_constants`` list and passed
    on every call (`with_constants`). The compiler then sees them as the
    graph's inputs; a tensor held in the routine's closure would meet the
    compiler's fake tensors. Returns (names, placeholder nodes)."""
    names = [k for k, v in action.kwargs.items() if isinstance(v, torch.Tensor)]
    module, nodes = graph.owning_module, []
    constants = module.__dict__.setdefault("amanda_constants", [])
    for name in names:
        last = [n for n in graph.nodes if n.op == "placeholder"][-1]
        with graph.inserting_after(last):
            node = graph.placeholder(f"amanda_constant_{len(constants)}")
        node.meta["example_value"] = action.kwargs[name]
        node._dynamo_source = None     # no user variable: AOTAutograd accepts a None source
        constants.append(action.kwargs[name])
        nodes.append(node)
    return names, nodes


def with_constants(compiled, constants):
    """The compiled graph called with the routines' constant tensors after the
    arguments Dynamo passes (Dynamo calls it with the arguments unpacked)."""
    if not constants:
        return compiled

    def call(*args):
        return compiled(*args, *constants)
    return call


def _items(graph, call, count, like=()):
    """getitem nodes reading the results of ``call``, placed right after it;
    the i-th has the example value of ``like[i]`` (the tensor it replaces:
    a replacement has its original's metadata), so later passes over the
    graph see it as a tensor."""
    items, previous = [], call
    for i in range(count):
        item = graph.call_function(operator.getitem, (call, i))
        if i < len(like) and "example_value" in like[i].meta:
            item.meta["example_value"] = like[i].meta["example_value"]
        previous.append(item)
        items.append(item)
        previous = item
    return items


def _observes(action):
    """Whether a Python routine only observes: every ``return`` of its code returns
    None (read from its bytecode). Such a routine becomes ``amanda::observe``,
    which copies nothing; any other becomes ``amanda::replace``, whose results
    are new tensors (copies of the inputs it kept)."""
    func = getattr(action.func, "__func__", action.func)
    code = getattr(func, "__code__", None)
    if code is None:
        return False
    import dis
    previous = None
    for instruction in dis.get_instructions(code):
        if instruction.opname == "RETURN_VALUE":
            if previous is None or previous.opname != "LOAD_CONST" or previous.argval is not None:
                return False
        elif instruction.opname == "RETURN_CONST" and instruction.argval is not None:
            return False
        if instruction.opname not in ("CACHE", "EXTENDED_ARG", "NOP"):
            previous = instruction
    return True


def _selected(values, action, where):
    from amanda.runtime.routines import select
    return select(values, action.positions, action, where)


def insert_actions(gm, lifted, plan):
    """Inserts the actions of ``plan`` (the instrumentation pipeline's
    `InstrumentationPlan`) into ``gm``'s graph (in place) and recompiles it."""
    graph = gm.graph
    for entry in plan.actions():
        name = entry.op.name
        node = lifted.nodes[name]
        where = (entry.op.type, lifted.op_ids[name], NAMESPACE)
        if entry.replace:
            _check_replaceable(node, where)
        # the op's tensor inputs, positions fixed by the op itself: a routine
        # that replaced some of them hands the next one the replacements at
        # the same positions (as eagerly)
        inputs = _tensor_args(node)
        for action in entry.before:
            chosen = _selected(inputs, action, where)
            with graph.inserting_before(node):
                new = _emit(graph, action, chosen, where, _observes(action), inputs)
            if new is not None:
                mapping = dict(zip(chosen, new))
                node.args = torch.fx.node.map_arg(node.args, lambda n: mapping.get(n, n))
                node.kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: mapping.get(n, n))
                inputs = [mapping.get(n, n) for n in inputs]
        if entry.replace:
            node = _insert_replacement(graph, node, entry.replace[0], where)
            if entry.replace[0].ad:
                lifted.replacements[_made_by(node).name] = name
        if entry.after:
            _insert_after(graph, node, entry.after, where)
    graph.lint()
    gm.recompile()
    return gm


def _outputs(graph, node):
    """Nodes standing for the op's outputs, as eager's after-point sees them:
    the node, or for a tuple result one new ``getitem`` per tensor placed
    right after it (with the existing getitem nodes each one replaces), or for
    an in-place op that returns None (``x[i] = v``) its first argument."""
    value = _value(node)
    if isinstance(value, torch.Tensor):
        return [node], [[]], False
    if value is None:
        return [node.args[0]], [[]], True
    outputs, old, cursor = [], [], node
    for i, item in enumerate(value):
        if isinstance(item, torch.Tensor):
            with graph.inserting_after(cursor):
                cursor = graph.call_function(operator.getitem, (node, i))
            cursor.meta.update(example_value=item)
            outputs.append(cursor)
            old.append([u for u in node.users if u.target is operator.getitem and u.args[1:] == (i,)
                        and u is not cursor])
    return outputs, old, False


def _insert_after(graph, node, actions, where):
    """The after-routines of one op, in order, each on the outputs the previous
    one left; a replacement takes the place of the output in every later use."""
    cursors, olds, no_result = _outputs(graph, node)
    for action in actions:
        chosen = _selected(cursors, action, where)
        observe = _observes(action)
        if no_result and not observe:
            raise BackendError(f"insert_after_op on op {where[0]!r} (id {where[1]}), which returns "
                               "None, with a routine that may replace its output, is not supported in "
                               f"compiled graphs [namespace {NAMESPACE}]")
        last = max(cursors, key=_position(graph))
        if no_result:
            last = node
        users = {c: [u for u in c.users] + [u for o in old for u in o.users]
                 for c, old in zip(cursors, olds)}
        with graph.inserting_after(last):
            new = _emit(graph, action, chosen, where, observe, cursors)
        if new is None:
            continue
        mapping = dict(zip(chosen, new))
        for i, cursor in enumerate(cursors):
            if cursor in mapping:
                for user in users[cursor]:
                    user.replace_input_with(cursor, mapping[cursor])
                    for old in olds[i]:
                        user.replace_input_with(old, mapping[cursor])
                for old in olds[i]:
                    if not old.users:
                        graph.erase_node(old)
                cursors[i], olds[i] = mapping[cursor], []


# -- replace_op ---------------------------------------------------------------------------------

def _writes_in_place(node):
    """Whether ``node`` may modify its first argument (the rule of the
    analysis run's `_mutated_roots`: a name ending in ``_``,
    ``inplace=True``, an augmented or item assignment)."""
    from amanda.runtime.pytorch.compiled.probe import _AUGMENTED
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return ((name.endswith("_") and not name.endswith("__")) or node.kwargs.get("inplace") is True
            or name.strip("_") in _AUGMENTED)


def _check_replaceable(node, where):
    """Raises `BackendError` (the call then runs eagerly, loudly) for an op
    whose ``replace_op`` a compiled graph cannot carry: an op that writes
    into its first argument (eagerly the routine runs instead, so the
    argument keeps its values while the op's result is the routine's; the
    graph has one node for both the write and the result, and what reads
    the written tensor later reads that node or an alias of it, which the
    graph does not tell apart), an op whose result is not a tensor or a
    tuple of tensors, a tuple result read otherwise than by indexing."""
    value = _value(node)
    if _writes_in_place(node) or value is None:
        raise BackendError(f"replace_op on op {where[0]!r} (id {where[1]}), which writes into its "
                           f"argument, is not supported in compiled graphs [namespace {NAMESPACE}]")
    if isinstance(value, torch.Tensor):
        return
    if not isinstance(value, (tuple, list)) or not value or not all(
            isinstance(v, torch.Tensor) for v in value) or any(
            u.target is not operator.getitem for u in node.users):
        raise BackendError(f"replace_op on op {where[0]!r} (id {where[1]}), whose result is not a "
                           "tensor or a tuple of tensors read by index, is not supported in compiled "
                           f"graphs [namespace {NAMESPACE}]")


def _static_layouts(outputs, where):
    """(shape, stride, dtype, device) of each output, all sizes and strides
    known numbers: what ``amanda::replace_op`` tells the compiler it returns.
    A symbolic size (dynamic shapes) is refused (`BackendError`)."""
    layouts = []
    for value in outputs:
        shape, stride = tuple(value.shape), tuple(value.stride())
        if not all(type(n) is int for n in shape + stride):
            raise BackendError(f"replace_op with a Python routine on op {where[0]!r} (id {where[1]}) "
                               "of symbolic shape (dynamic shapes) is not supported in compiled "
                               f"graphs [namespace {NAMESPACE}]")
        layouts.append((shape, stride, value.dtype, value.device))
    return layouts


class _Replacement:
    """A Python ``replace_op`` routine, called by ``amanda::replace_op`` in
    place of the op: it receives the selected inputs (detached in the graph:
    no autograd history, as eager's ``no_grad`` gives its results), its
    result is checked as eagerly (`_check_replacement`: a tensor for a
    one-output op, else as many tensors, each of the op's shape and dtype)
    and copied into the layout the op's output has in the graph (a custom
    op's results are new tensors, of the layout its fake implementation
    gave the compiler)."""

    def __init__(self, action, where, spec, layouts):
        self.action = action
        self.where = where
        self.spec = spec
        self.layouts = layouts
        self.__name__ = f"amanda_{getattr(action.func, '__name__', 'routine')}"

    def __call__(self, tensors):
        from amanda.runtime.pytorch.eager.routines import _check_replacement
        with controls.muted(), torch.no_grad():
            result = invoke(self.action, list(tensors), self.where)
        result = _check_replacement(self.action, result, self.spec, self.where)
        results = [result] if isinstance(self.spec, tuple) else list(result)
        return [torch.empty_strided(shape, stride, dtype=dtype, device=device).copy_(value)
                for value, (shape, stride, dtype, device) in zip(results, self.layouts)]


def _replace_op_impl(handle: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return _ROUTINES[handle](tensors)


def _replace_op_fake(handle, tensors):
    return [torch.empty_strided(shape, stride, dtype=dtype, device=device)
            for shape, stride, dtype, device in _ROUTINES[handle].layouts]


def _portable_replacement(action, where, count, names, spec):
    """The function a portable ``replace_op`` routine's node calls (traced
    by the compiler like model code): its first ``count`` arguments are the
    op's selected inputs, the rest the tensors of the routine's keyword
    arguments ``names`` (`_constants`). Outside ``amanda.ad_enabled()`` it
    runs without autograd, as eagerly: its results have no history unless
    it hands back an input as it is. Returns a tuple of the outputs."""
    from amanda.runtime.pytorch.eager.routines import _check_replacement

    def call(*args):
        tensors = list(args[:count])
        chosen = action
        if names:
            chosen = Action(action.kind, action.func, action.positions,
                            {**action.kwargs, **dict(zip(names, args[count:]))}, action.ad, action.tool)
        with controls.muted(), torch.set_grad_enabled(torch.is_grad_enabled() and action.ad):
            result = invoke(chosen, tensors, where)
        result = _check_replacement(chosen, result, spec, where)
        return (result,) if isinstance(spec, tuple) else tuple(result)
    call.__name__ = f"amanda_{getattr(action.func, '__name__', 'routine')}"
    return call


def _insert_replacement(graph, node, action, where):
    """Puts a ``replace_op`` routine in place of ``node``, on the op's tensor
    arguments as the before-routines left them; returns the node standing
    for the op's result (the routine's output, or a ``tuple`` of its
    outputs for an op with several), which after-routines then see. The
    op's node is erased: eagerly the op does not run."""
    from amanda.portable import is_portable
    from amanda.runtime.pytorch.eager.routines import _meta
    value = _value(node)
    single = isinstance(value, torch.Tensor)
    outputs = [value] if single else list(value)
    spec = _meta(value) if single else [_meta(v) for v in outputs]
    selected = _selected(_tensor_args(node), action, where)
    with graph.inserting_before(node):
        if is_portable(action.func):
            names, constants = _constants(graph, action)
            call = graph.call_function(_portable_replacement(action, where, len(selected), names, spec),
                                       tuple(selected) + tuple(constants))
        else:
            if action.ad:
                raise BackendError(f"replace_op routine {getattr(action.func, '__name__', action.func)} "
                                   f"of op {where[0]!r} was recorded under amanda.ad_enabled(), but "
                                   "compiled graphs can differentiate portable routines only "
                                   f"[namespace {NAMESPACE}]")
            routine = _Replacement(action, where, spec, _static_layouts(outputs, where))
            detached = []
            for tensor in selected:
                detached.append(graph.call_method("detach", (tensor,)))
                detached[-1].meta["example_value"] = _value(tensor)
            _ROUTINES.append(routine)
            call = graph.call_function(_custom_ops()["replace_op"], (len(_ROUTINES) - 1, detached))
        # a node with meta is one AOTAutograd names as the source
        # (``from_node``) of the aten ops traced from it: backward.py reads
        # which op a differentiated routine's backward ops belong to
        call.meta["amanda_replaces"] = where[1]
        items = _items(graph, call, len(outputs))
        for item, output in zip(items, outputs):
            item.meta["example_value"] = output
        if single:
            result = items[0]
        else:
            result = graph.call_function(tuple, (items,))
            result.meta["example_value"] = value
    node.replace_all_uses_with(result)
    graph.erase_node(node)
    return result


def _made_by(node):
    """The call that made a replacement's result (through its ``getitem``
    and ``tuple`` nodes)."""
    while node.target in (operator.getitem, tuple):
        node = node.args[0] if node.target is operator.getitem else node.args[0][0]
    return node


def _position(graph):
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__
