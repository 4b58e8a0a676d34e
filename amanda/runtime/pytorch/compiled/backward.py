"""Compiled PyTorch: backward points inside AOTAutograd's backward graphs.

For tools with backward routines, amanda runs AOTAutograd itself with the
user's compiler as its inner compilers (`backward_compiler`): the forward
graph is read on its way to the user's forward compiler (which autograd
node each forward aten op makes, `_read_forward`), and the backward graph
gets its points before it reaches the user's backward compiler
(`_insert_points`).

**What a backward op is.** AOTAutograd's backward graph is made of aten
ops, each carrying the ``seq_nr`` of the forward aten op it differentiates,
i.e. of the autograd node eager would have made for it. The nodes of one
``seq_nr`` are one backward op. Its forward aten op's ``from_node`` is the
Dynamo node, the lifted op, so the backward op belongs to that op (its id
is eager's). Its name is the class of the autograd node the forward aten op
makes (`_autograd_node`: the op is run on meta tensors that require grad:
``AddmmBackward0``, ``TBackward0``), its index the occurrence of that name
among the op's backward ops, and its id eager's formula on them. Gradient
accumulation into a parameter (eager's ``AccumulateGrad``, claimed by the
first op that reads the parameter) is the point on the backward graph's
output for that parameter. An op with no node in the backward graph (it
hands its gradient on unchanged: ``a + b``) gets its points on the
gradient of its output (`_Flows`), and what reads that gradient for one
of its inputs reads it from its after-point (`_passing`).

**Values.** ``get_grad_outputs()`` are the gradients flowing into the
group (one per output of the forward aten op that has a gradient);
``get_grad_inputs()`` the gradients it produces, one per input of the
forward aten op as autograd's node has them (None where it produces none).
Each produced gradient is matched to the forward input it differentiates
by where it flows: into the group of the op that made that input, or into
the graph's output for a primal.

**Routines** run in one opaque op per point, ``amanda::backward_point``,
which runs the analysis at its first execution (with the real gradients,
as eagerly) and the recorded actions at every one; what it returns takes
the place of the gradients (straight-through: the backward graph is not
differentiated again). On ``aot_eager`` the graph is compiled again once
every point ran its analysis, without the idle ones (`_Slimmer`).
"""

from __future__ import annotations

import copy
import operator
import threading

import torch
import torch.fx

from amanda import controls
from amanda.context import OpContext
from amanda.runtime.pytorch.compiled.distributed import WHOLE_NAME
from amanda.runtime.pytorch.compiled.graphs import NAMESPACE
from amanda.runtime.pytorch.compiled.lowering import _items
from amanda.runtime.pytorch.eager.records import BackwardOp, _stable_id
from amanda.runtime.pytorch.eager.routines import _analyse, _apply_actions, _invoke, _meta
from amanda.runtime.routines import check_replacements, routine_error, select
from amanda.tool import BACKWARD_AFTER, BACKWARD_BEFORE

__all__ = ["backward_compiler", "runs_aot_autograd", "supports_backward"]


# -- the user's compiler, with amanda's inner compilers ------------------------------------

def _unwrapped(compiler):
    """The compiler behind Dynamo's wrappers (``WrapBackendDebug``,
    ``torch.compile``'s wrapper of a named backend without options)."""
    for _ in range(8):
        inner = getattr(compiler, "_torchdynamo_orig_backend", None)
        if inner is None and type(compiler).__name__ == "_TorchCompileWrapper" \
                and not compiler.kwargs:
            inner = compiler.compiler_fn
        if inner is None:
            return compiler
        compiler = inner
    return compiler


def _aot_kind(compiler):
    """How amanda runs AOTAutograd for ``compiler``: ``"aot"`` (an
    ``aot_autograd(...)`` backend, whose inner compilers are wrapped),
    ``"aot_eager"`` (Dynamo's ``aot_eager``, which takes inner compilers as
    arguments), ``"inductor"`` (``compile_fx`` with an ``inner_compile`` of
    amanda's), or None: a compiler amanda cannot put backward points in."""
    from torch._dynamo.backends import common, debugging
    compiler = _unwrapped(compiler)
    if isinstance(compiler, common.AotAutograd):
        return "aot"
    if compiler is debugging.aot_eager:
        return "aot_eager"
    if _inductor_config(compiler) is not None:
        return "inductor"
    return None


def _inductor_config(compiler):
    """The config patches of an inductor compiler (``torch.compile``'s
    default wrapper or the registered ``inductor`` backend), else None."""
    import torch._dynamo
    if type(compiler).__name__ == "_TorchCompileInductorWrapper":
        return dict(getattr(compiler, "config", {}) or {})
    try:
        if compiler is torch._dynamo.lookup_backend("inductor"):
            return {}
    except Exception:   # noqa: BLE001 - no inductor in this build
        return None
    return None


#: Whether tools with backward routines compile with inductor too. Off by
#: default: inductor computes a linear's weight gradient in ``addmm``'s
#: backward group (its ``t`` decomposes into ``permute``), so
#: ``TBackward0`` has no point and a routine replacing ``AddmmBackward0``'s
#: gradients does not reach the weight's (a Pruner masking gradients would
#: leave linear weights unmasked without a word). Off, such calls run
#: eagerly with an ``EagerFallbackWarning``, as for compilers amanda runs no
#: AOTAutograd for; on, they compile with that mapping
#: (docs/pytorch-compiled.md, "Backward points").
INDUCTOR_BACKWARD = False


def runs_aot_autograd(compiler):
    """Whether amanda runs AOTAutograd for ``compiler`` (then the backward
    graph runs outside eager's mode, with or without backward points)."""
    return _aot_kind(compiler) is not None


def supports_backward(compiler):
    """Whether amanda puts backward points in what ``compiler`` compiles
    (inductor only with `INDUCTOR_BACKWARD`)."""
    kind = _aot_kind(compiler)
    return kind is not None and (kind != "inductor" or INDUCTOR_BACKWARD)


def backward_compiler(compiler, session, lifted, plan):
    """A Dynamo compiler that compiles with ``compiler`` a graph whose
    backward graph has the backward points of ``session``'s tools (none
    for tools without backward routines), and runs outside amanda's eager
    mode (`_OutsideEagerMode`).

    Args:
        compiler: the user's compiler (`supports_backward`).
        session: the applied tools.
        lifted: the `LiftedGraph` of the Dynamo graph.
        plan: the forward analysis' plan (its contexts are the parents of
            the backward contexts, as eagerly).
    """
    kind = _aot_kind(compiler)
    compiler = _unwrapped(compiler)

    def compile_graph(gm, example_inputs, **kwargs):
        with _no_caches(keep_each_op=session.has_backward):
            compiled = compile_joint(gm, example_inputs, **kwargs)
        return _Unreached(compiled) if session.has_backward else compiled

    def compile_joint(gm, example_inputs, **kwargs):
        joint = _Joint(session, lifted, plan, gm)
        if kind == "inductor":
            return _inductor(compiler, joint)(gm, example_inputs)
        if kind == "aot_eager":
            from torch._dynamo.backends.debugging import boxed_nop
            return compiler(gm, example_inputs, fw_compiler=joint.forward(boxed_nop),
                            bw_compiler=joint.backward(boxed_nop, slims=True), **kwargs)
        from torch._dynamo.backends.common import AotAutograd
        options = dict(compiler.kwargs)
        fw = options["fw_compiler"]
        bw = options.get("bw_compiler") or fw
        options["fw_compiler"] = joint.forward(fw)
        options["bw_compiler"] = joint.backward(bw)
        if options.get("inference_compiler") is None:
            options["inference_compiler"] = fw
        return AotAutograd(**options)(gm, example_inputs, **kwargs)
    return compile_graph


def _no_caches(keep_each_op=False):
    """AOTAutograd's and inductor's caches off while amanda compiles: a hit
    (a graph compiled in another process, or the vanilla one: backward
    points change no Dynamo graph) would skip amanda's inner compilers, and
    the points' handles are this process' own.

    ``keep_each_op`` (a session with backward points): AOTAutograd's common
    subexpression elimination off too. **Rule: each op keeps its own aten
    ops**, as eager's autograd keeps its own nodes: CSE computed the ``t``
    of a weight shared by several calls of one layer (ALBERT) once, in the
    group of the first call, and merged Swin's equal slices, so the later
    calls' ``TBackward0``/``SliceBackward0`` had no points. The duplicates
    are views and equal values (gradients stay vanilla compiled's, bit for
    bit: tests/pytorch/test_compiled_families.py)."""
    import contextlib
    from torch._functorch import config as functorch_config
    stack = contextlib.ExitStack()
    stack.enter_context(functorch_config.patch(enable_autograd_cache=False,
                                               **({"cse": False} if keep_each_op else {})))
    stack.enter_context(torch.compiler.config.patch(force_disable_caches=True))
    return stack


def _inductor(compiler, joint):
    from torch._inductor import compile_fx as inductor

    def inner_compile(gm, example_inputs, **kwargs):
        if kwargs.get("is_backward"):
            _insert_points(gm, joint)
        elif not kwargs.get("is_inference"):
            _read_forward(gm, joint)
            joint.read_outputs()
        # the backward graph is compiled at the first backward, under eager's
        # mode: inductor's own torch calls (torch.empty in its dtype
        # propagation) were taken for forward ops
        with _no_caches(), _eager_mode_out():
            compiled = inductor.compile_fx_inner(gm, example_inputs, **kwargs)
        return _OutsideEagerMode(compiled, joint) if kwargs.get("is_backward") else compiled

    def compile_graph(gm, example_inputs):
        return inductor.compile_fx(gm, example_inputs, inner_compile=inner_compile,
                                   config_patches=_inductor_config(compiler) or None,
                                   compile_region_name=getattr(compiler, "name", None))
    return compile_graph


class _Joint:
    """What amanda knows of one AOTAutograd compilation: the session, the
    lifted Dynamo graph and its forward plan, and (once the forward graph
    went by) what each ``seq_nr`` differentiates."""

    def __init__(self, session, lifted, plan, gm):
        self.session = session
        self.lifted = lifted
        self.plan = plan
        self.dynamo_placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        # node -> its name in the instrumented Dynamo graph, which the lifted
        # ops name: ``gm`` may be a piece of it that DDPOptimizer cut, whose
        # nodes have other names (compiled.distributed)
        self.whole_names = {n.name: n.meta.get(WHOLE_NAME, n.name) for n in gm.graph.nodes}
        self.ops = {}          # seq_nr -> _ForwardOp
        # the forward graph, by node name (`_destination`)
        self.primal_positions = {}   # placeholder -> position
        self.getitems = {}     # getitem -> (source, index)
        self.replaced = {}     # amanda::replace call -> what it replaces
        self.made_by = {}      # value a lifted op's aten op made -> its seq_nr
        self.kinds = {}        # call -> target's name
        self.inputs = {}       # call -> its tensor inputs
        self.fw_outputs = []   # the forward graph's outputs (the first ones have tangents)
        self.read = False
        self.rank = {}         # seq_nr -> index, where eager's walk numbers them (`_eager_order`)
        # per tangent of the backward graph, the gradient of the compiled
        # function's autograd node it is (None: one no user output has), and
        # per point handle the tangents its gradients are computed from
        # (`_Unreached`)
        self.tangent_outputs = []
        self.tangents = []
        self.masks = []

    def read_outputs(self):
        """Which output of the compiled function's autograd node each
        tangent is the gradient of, from AOTAutograd's metadata (read while
        it compiles the forward graph): the node's outputs are the mutated
        inputs, then the user's outputs."""
        from torch._guards import TracingContext
        context = TracingContext.try_get()
        meta = getattr(context, "fw_metadata", None)
        descs = getattr(meta, "traced_tangents_descs", None)
        if meta is None or descs is None:
            return
        front = meta.num_mutated_inp_runtime_indices
        self.tangent_outputs = [front + d.output.idx
                                if type(getattr(d, "output", None)).__name__ == "PlainAOTOutput"
                                else None for d in descs]

    def forward(self, inner):
        def fw_compiler(gm, example_inputs, *args, **kwargs):
            _read_forward(gm, self)
            self.read_outputs()
            return inner(gm, example_inputs, *args, **kwargs)
        return fw_compiler

    def backward(self, inner, slims=False):
        """``slims``: compiling again is free (``boxed_nop``), so the graph
        is compiled again without its idle points once they are known
        (`_Slimmer`); another compiler (a user's ``aot_autograd(...)``
        backward compiler) gets the graph once, as it expects."""
        def bw_compiler(gm, example_inputs, *args, **kwargs):
            _insert_points(gm, self)

            def compile_graph(module):
                with _eager_mode_out():     # compiled at the first backward
                    return inner(_eager_graph_module(module), example_inputs, *args, **kwargs)
            slimmer = _Slimmer(gm, compile_graph) if slims else None
            return _OutsideEagerMode(compile_graph(gm), self, slimmer)
        return bw_compiler


class _OutsideEagerMode:
    """A compiled backward graph, run with amanda's eager ``TorchFunctionMode``
    out of the way. ``loss.backward()`` inside ``apply`` runs under that mode
    (the engine entry pushes it, for the Python code autograd runs), and the
    mode took the backward graph's own calls (``aten.mm``, ``aten.t``,
    ``amanda::backward_point``...) for forward ops of the model: points
    with made-up ids (a NaN finder checked 98 ops where eager checks 32).
    Everything else of the compiled callable (its attributes, the boxed
    calling convention) is the compiler's."""

    def __init__(self, compiled, joint, slimmer=None):
        self.compiled = compiled
        self.joint = joint
        self.slimmer = slimmer
        if getattr(compiled, "_boxed_call", False):
            # in the instance's dict: Dynamo's disable() wraps the compiled
            # backward with functools.wraps, which copies the dict only
            self._boxed_call = True

    def __getattr__(self, name):
        return getattr(self.compiled, name)

    def __call__(self, *args, **kwargs):
        skipped = _unreached(self.joint)
        previous = getattr(_tls, "unreached", None)
        _tls.unreached = skipped
        try:
            with _eager_mode_out():
                result = self.compiled(*args, **kwargs)
        finally:
            _tls.unreached = previous
        if self.slimmer is not None:
            slim = self.slimmer()
            if slim is not None:
                self.slimmer = None
                if slim is not False:
                    self.compiled = slim
        return result


class _Slimmer:
    """**Rule: once every point of a backward graph has run its analysis,
    the graph is compiled again without the idle points** (``aot_eager``):
    a point whose side recorded no action is taken out (its gradients go
    straight on), a point whose actions only observe (every routine's
    ``return`` returns None, read from its bytecode) becomes
    ``amanda::backward_observe``, which reads the gradients and passes
    nothing, and any other becomes a plain Python call that hands on what
    its routines return (`_passing_point`: ``boxed_nop`` runs the graph
    as Python). A custom op's results may not alias its arguments, so a
    point copies every gradient it passes, and a tool with routines on a
    few backward ops (a counter of matmuls, a pruner's gradient masks)
    copied every gradient of the step. The analysis is cached (an op's
    actions never change after it ran), so the slim graph runs the same
    routines on the same values. Called after every run of the graph
    until it is ready (a point that has not run, e.g. while its session
    was not applied, keeps the full graph); returns the new compiled
    graph, False when nothing changes (or a step failed: the full graph
    stays), or None when not ready."""

    def __init__(self, gm, compile_graph):
        self.gm = gm
        self.compile_graph = compile_graph
        point = _custom_ops()["point"]
        self.nodes = [(n, _POINTS[n.args[0]], n.args[1]) for n in gm.graph.nodes
                      if n.op == "call_function" and n.target is point]

    def __call__(self):
        from amanda.runtime.routines import returns_only_none
        for _, point, side in self.nodes:
            if not (point.post_done if side else point.pre_done) and not point.unreached:
                return None
        if not self.nodes:
            return False
        memo = {}
        graph = torch.fx.Graph()
        graph._codegen = copy.deepcopy(self.gm.graph._codegen)
        graph.output(graph.graph_copy(self.gm.graph, memo))
        changed = False
        for node, point, side in self.nodes:
            if not point.pre_done or (side and not point.post_done):
                # no gradient reached it yet (`_Unreached`): it stays whole, both
                # sides (its before-analysis may record after-actions)
                continue
            actions = point.after + point.replace if side else point.before
            call = memo[node]
            if actions and (point.replace or not all(returns_only_none(a.func) for a in actions)):
                call.target = _passing_point      # a Python call: no copies
                changed = True
                continue
            if actions:
                with graph.inserting_before(call):
                    graph.call_function(_custom_ops()["observe"], call.args)
            passed = [v for v in (call.args[3] if side else call.args[2]) if v is not None]
            for user in list(call.users):
                user.replace_all_uses_with(passed[user.args[1]])
                graph.erase_node(user)
            graph.erase_node(call)
            changed = True
        if not changed:
            return False
        try:
            graph.lint()
            module = torch.fx.GraphModule(self.gm, graph)
            module.meta = dict(getattr(self.gm, "meta", {}))
            return self.compile_graph(module)
        except Exception:   # noqa: BLE001 - the full graph is correct, only slower
            return False


class _eager_mode_out:
    """amanda's eager ``TorchFunctionMode`` off the top of the thread's mode
    stack for the block (where it is there: during ``backward()``)."""

    __slots__ = ("mode",)

    def __enter__(self):
        from amanda.runtime.pytorch.eager.mode import _Mode
        stack = torch.overrides._get_current_function_mode_stack()
        self.mode = None
        if stack and isinstance(stack[-1], _Mode):
            self.mode = torch._C._pop_torch_function_stack()
        return self

    def __exit__(self, *exc):
        if self.mode is not None:
            torch._C._push_on_torch_function_stack(self.mode)
        return False


def _eager_graph_module(gm):
    """``gm`` as a plain ``GraphModule``. A lazy one's ``forward`` (which
    ``boxed_nop`` keeps) calls the module through ``Module.__call__`` at
    every run, and during backward amanda's eager module hooks take such a
    call for a module recomputed by activation checkpointing and mute it:
    the points would not run."""
    from torch.fx._lazy_graph_module import _LazyGraphModule
    if not isinstance(gm, _LazyGraphModule):
        return gm
    plain = torch.fx.GraphModule(gm, gm.graph)
    plain.meta = dict(getattr(gm, "meta", {}))
    return plain


# -- outputs the step does not differentiate --------------------------------------------------

_tls = threading.local()    # .unreached: the point handles no gradient reaches in this run
_pending = threading.local()    # .none: the node outputs without a gradient, from its pre-hook


class _Unreached:
    """A compiled function whose backward points skip what eager's autograd
    would not reach. **Rule: a backward op runs its routines when a
    gradient reaches it**, as eagerly. AOTAutograd's backward graph takes a
    gradient for every output of the compiled function, and autograd hands
    it zeros for an output the step does not use (a model's pooler when the
    loss reads only the hidden states): eager's engine never reaches the
    backward ops of such an output, so the points that only such zeros
    reach are skipped (their gradients pass on unchanged, no analysis).
    Each run's autograd node gets a pre-hook that notes which of its
    outputs got no gradient (`_note_missing`); the backward graph maps
    them to its tangents (`_Joint.read_outputs`) and each point to the
    tangents it is computed from (`_tangent_masks`)."""

    __slots__ = ("compiled",)

    def __init__(self, compiled):
        self.compiled = compiled

    def __getattr__(self, name):
        return getattr(self.compiled, name)

    def __call__(self, *args, **kwargs):
        result = self.compiled(*args, **kwargs)
        if torch.is_grad_enabled():
            seen = set()
            for value in (result if isinstance(result, (list, tuple)) else (result,)):
                node = getattr(value, "grad_fn", None) if isinstance(value, torch.Tensor) \
                    else None
                if node is not None and id(node) not in seen \
                        and type(node).__name__ == "CompiledFunctionBackward":
                    seen.add(id(node))
                    node.register_prehook(_note_missing)
        return result


def _note_missing(grads):
    """Pre-hook of a compiled function's autograd node: which of its
    outputs have no gradient in this backward (autograd then hands the
    function zeros), for the backward graph it runs next on this thread.

    A note left behind (the backward raised between this hook and its
    graph, e.g. in a user's hook on the node) reaches no other function:
    every node with points has this hook, which overwrites the note right
    before its own graph runs (tests/pytorch/test_compiled_backward.py,
    ``test_a_backward_that_raised_leaves_no_note_for_another_function``)."""
    _pending.none = frozenset(i for i, g in enumerate(grads) if g is None) or None


def _tangent_masks(gm, joint):
    """Per point handle of backward graph ``gm``, the tangents (bit ``k``
    for the ``k``-th) its gradients are computed from."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    joint.tangents = [i for i, n in enumerate(placeholders) if n.name.startswith("tangents")]
    if len(joint.tangents) != len(joint.tangent_outputs):
        joint.tangents = []     # not the tangents AOTAutograd described: nothing is skipped
        return
    bits = {placeholders[p]: 1 << k for k, p in enumerate(joint.tangents)}
    point = _custom_ops()["point"]
    depends, masks = {}, {}
    for node in gm.graph.nodes:
        mask = bits.get(node, 0)
        for arg in node.all_input_nodes:
            mask |= depends.get(arg, 0)
        depends[node] = mask
        if node.op == "call_function" and node.target is point:
            masks[node.args[0]] = masks.get(node.args[0], 0) | mask
    joint.masks = [(handle, mask) for handle, mask in masks.items() if mask]


def _unreached(joint):
    """The point handles of ``joint``'s backward graph that only gradients
    of outputs without one reach in this run (None: every point runs)."""
    missing = getattr(_pending, "none", None)
    _pending.none = None
    if missing is None or not joint.tangents:
        return None
    unused = 0
    for k, output in enumerate(joint.tangent_outputs):
        if output is not None and output in missing:
            unused |= 1 << k
    if not unused:
        return None
    return frozenset(handle for handle, mask in joint.masks if not mask & ~unused)


# -- the forward graph -----------------------------------------------------------------------

class _ForwardOp:
    """The forward aten op of one ``seq_nr``: its node's name, the lifted op
    it comes from, the autograd node eager makes for it (name, and per input
    of that node the forward value it differentiates, or None), and how
    many gradients flow into that node."""

    __slots__ = ("name", "lifted", "node_name", "slots", "grad_outputs")

    def __init__(self, name, lifted, node_name, slots, grad_outputs):
        self.name = name
        self.lifted = lifted
        self.node_name = node_name
        self.slots = slots
        self.grad_outputs = grad_outputs


_PLUMBING = frozenset(["detach", "getitem", "alias"])


def _read_forward(gm, joint):
    if not joint.session.has_backward:
        return        # no points: the backward graph only runs outside eager's mode
    joint.read = True
    nodes = list(gm.graph.nodes)
    joint.fw_outputs = [a.name if isinstance(a, torch.fx.Node) else None
                        for a in nodes[-1].args[0]]
    joint.primal_positions = {n.name: i for i, n in enumerate(n for n in nodes
                                                             if n.op == "placeholder")}
    by_seq = {}
    for node in nodes:
        if node.op == "call_function":
            joint.kinds[node.name] = getattr(node.target, "__name__", "").split(".")[0]
            joint.inputs[node.name] = [a.name for a in node.all_input_nodes
                                       if isinstance(a.meta.get("val"), torch.Tensor)]
        if node.op == "call_function" and node.target is operator.getitem:
            joint.getitems[node.name] = (node.args[0].name, node.args[1])
        elif node.op == "call_function" and str(node.target) == str(_replace_op()):
            joint.replaced[node.name] = [t.name for t in node.args[1]]
        seq = node.meta.get("seq_nr")
        if node.op != "call_function" or seq is None:
            continue
        name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        if name in _PLUMBING:
            continue
        by_seq.setdefault(seq, []).append(node)
    for seq, group in by_seq.items():
        # the op autograd saw: a node that is its own ``original_aten`` (a
        # compiler's decompositions make several nodes of one seq_nr, each
        # naming the op they decompose)
        node = next((n for n in group if _is_own_aten(n)), None)
        lifted = _lifted_name(node or group[0], joint)
        if lifted is None:
            continue           # amanda's routines, or a node of AOTAutograd's own
        if node is None:
            node_name, slots, grad_outputs = _decomposed_node(group)
            node = group[-1]
        else:
            node_name, slots, grad_outputs = _autograd_node(node)
        node_name = _EAGERS_NAME.get(node_name, node_name)
        joint.ops[seq] = _ForwardOp(node.name, lifted, node_name, slots, grad_outputs)
        joint.made_by.update((n.name, seq) for n in group)
    joint.rank = _eager_order(nodes, joint)


def _eager_order(nodes, joint):
    """``{seq_nr: index}`` for the backward ops of an op that makes several
    of one kind (two ``ExpandBackward0`` of a decomposed attention).
    **Rule: such backward ops are numbered in the order eager's walk meets
    them**: breadth first from the op's outputs, each node's inputs in
    argument order (`eager.backward._walk_new_nodes`), not by creation
    (Swin's attention had the gradients of its query and key expansions
    swapped between ``#0`` and ``#1``). An op the walk does not cover
    whole keeps the creation order."""
    by_name = {n.name: n for n in nodes}
    position = {name: i for i, name in enumerate(by_name)}
    per_op = {}
    for seq, fop in joint.ops.items():
        per_op.setdefault(fop.lifted, []).append(seq)
    rank = {}
    for op, seqs in per_op.items():
        kinds = [joint.ops[s].node_name for s in seqs]
        if len(set(kinds)) == len(kinds):
            continue
        wanted = set(seqs)
        mine = {name for name, s in joint.made_by.items() if s in wanted}
        seq_of = {joint.ops[s].name: s for s in seqs}
        # its outputs: read by other ops (the graph's output also lists the
        # values saved for backward), else its last value
        mine_known = sorted((n for n in mine if n in by_name), key=position.__getitem__)
        queue = [n for n in mine_known if any(u.name not in mine and u.op != "output"
                                              for u in by_name[n].users)] or mine_known[-1:]
        order, seen = [], set()
        while queue:
            name = queue.pop(0)
            if name in seen:
                continue
            seen.add(name)
            if name in seq_of:
                order.append(seq_of[name])
            queue.extend(a.name for a in by_name[name].all_input_nodes if a.name in mine)
        if set(order) != wanted:
            continue
        counts = {}
        for seq in order:
            kind = joint.ops[seq].node_name
            rank[seq] = counts.get(kind, 0)
            counts[kind] = rank[seq] + 1
    return rank


#: **Rule: an op AOTAutograd traces in a functional variant of eager's is
#: named as eager's CPU call names it**: ``batch_norm`` is
#: ``_native_batch_norm_legit_functional`` (training) or ``_no_training``
#: (evaluating) in AOTAutograd's graph, ``native_batch_norm`` eagerly on the
#: CPU (cuDNN's ``CudnnBatchNormBackward0`` on CUDA is not mapped)
_EAGERS_NAME = {name: "NativeBatchNormBackward0" for name in (
    "NativeBatchNormLegitBackward0", "NativeBatchNormLegitFunctionalBackward0",
    "NativeBatchNormLegitNoTrainingBackward0")}


def _is_own_aten(node):
    """Whether ``node`` is the op autograd saw, not a piece of a compiler's
    decomposition of it (compared by name: ``meta["original_aten"]`` is
    another ``OpOverload`` object for the same op)."""
    original = node.meta.get("original_aten")
    return original is None or str(original) == str(node.target)


def _lifted_name(node, joint):
    """The lifted op a forward aten node comes from (``meta["from_node"]``:
    the Dynamo node), or None."""
    lifted = joint.lifted
    sources = node.meta.get("from_node") or []
    for source in reversed(sources):
        name = getattr(source, "name", None)
        name = joint.whole_names.get(name, name)
        if name in lifted.nodes:
            return name
        if name in lifted.replacements:
            return lifted.replacements[name]   # a differentiated replace_op routine: its op's
    return None


def _autograd_node(node):
    """(name of the autograd node eager makes for forward aten ``node``, the
    forward value name each of its inputs differentiates or None, how many
    gradients flow into it): the op is run on meta tensors that require
    grad, no data is read. Where it cannot run there, its name is made from
    the op's and its inputs are its tensor arguments in order."""
    try:
        result, values = _run_on_meta(node.target, node, lambda arg: arg.meta.get("val"))
        results = result if isinstance(result, (tuple, list)) else [result]
        grad_fn = next(r.grad_fn for r in results if isinstance(r, torch.Tensor)
                       and r.grad_fn is not None)
        by_id = {id(t): name for t, name in values}
        slots = []
        for child, _ in grad_fn.next_functions:
            variable = getattr(child, "variable", None)
            slots.append(by_id.get(id(variable)) if variable is not None else None)
        return type(grad_fn).__name__, slots, len(grad_fn._input_metadata)
    except Exception:   # noqa: BLE001 - symbolic sizes, an op without a meta kernel
        return _decomposed_node([node])


def _decomposed_node(group):
    """(name, inputs, gradients in) of the autograd node of an op a
    compiler decomposed (``group``: its forward aten nodes, none of them the
    op itself), or of an op that cannot run on meta tensors. **Rule:** the
    name is made from ``meta["original_aten"]``'s: camel case, a trailing
    ``_forward`` dropped, ``Backward0`` (``_log_softmax`` ->
    ``LogSoftmaxBackward0``, ``nll_loss_forward`` -> ``NllLossBackward0``);
    the inputs are the tensors the group reads from outside it, in order."""
    first = group[0]
    target = first.meta.get("original_aten") or first.target
    name = getattr(target, "__name__", "op").split(".")[0].strip("_")
    name = name[:-len("_forward")] if name.endswith("_forward") else name
    camel = "".join(part[:1].upper() + part[1:] for part in name.split("_"))
    members = set(group)
    tensors = []
    for node in group:
        for arg in node.all_input_nodes:
            if arg not in members and arg.name not in tensors \
                    and isinstance(arg.meta.get("val"), torch.Tensor):
                tensors.append(arg.name)
    return f"{camel}Backward0", tensors, 1


# -- the backward graph ----------------------------------------------------------------------

def _insert_points(gm, joint):
    """Puts the backward points of the session into backward graph ``gm``
    (in place): a ``amanda::backward_point`` call before and after each
    group of nodes of one forward aten op of a lifted op, and before the
    output for each parameter's gradient (eager's ``AccumulateGrad``)."""
    if not joint.read:
        return
    graph = gm.graph
    nodes = list(graph.nodes)
    output = nodes[-1]
    grads = _gradients(nodes)
    groups = _groups(nodes, joint, grads)
    group_of = {n: seq for seq, members in groups.items() for n in members}
    counts = {}
    reach = _Reach(joint)
    flows = _Flows(graph, output, joint, group_of)
    # eager names a node by its occurrence among its op's nodes of one kind,
    # met walking from the op's outputs: the latest made first. Gradients
    # flow from later ops to earlier ones, so a group is wired after the
    # groups whose gradients it receives (through their after-points). An
    # op with no group hands its gradient on unchanged (below).
    for seq in sorted(joint.ops, reverse=True):
        fop = joint.ops[seq]
        key = (fop.lifted, fop.node_name)
        members = groups.get(seq, [])
        if any(n in grads for n in members):
            incoming = _incoming(members, group_of, seq, grads)
            produced = _produced(members, output, group_of, seq, grads)
        else:
            # no gradient node: the op hands its gradient on unchanged (its
            # group, if any, is forward values the partitioner recomputes)
            if _eager_makes_node(joint, fop.lifted):
                incoming = flows.into(fop)
            else:
                # eagerly no node (``dropout`` with ``p=0``): its output's
                # gradient is its input's, for the op that made the input
                flows.hand_on(fop)
                incoming = []
            if not incoming:
                if members:
                    counts[key] = counts.get(key, 0) + 1
                continue    # no gradient reaches it: eager makes no backward op either
            members, produced = [], []
        index = counts.get(key, 0)
        counts[key] = index + 1
        index = joint.rank.get(seq, index)
        if not incoming and not produced:
            continue    # forward values a compiler recomputes: no gradient flows here
        slots = _match(produced, fop, joint, output, group_of, reach)
        passing = _passing(incoming, members, slots, fop, output, group_of, reach)
        point = _Point(joint, fop.lifted, fop.node_name, index)
        passed, by_slot = _wire(graph, point, members, incoming, slots, fop.grad_outputs, passing)
        grads.update(passed)
        flows.note(fop, by_slot)
    _accumulations(graph, output, joint)
    _stable_sort(graph)
    graph.lint()
    gm.recompile()
    _tangent_masks(gm, joint)


def _groups(nodes, joint, grads):
    """``seq_nr`` -> the nodes of that forward op's backward group, in graph
    order. **Rule:** a gradient node is no member of group ``s`` when it
    is made from a gradient that a group of a lower ``seq_nr`` produced:
    gradients flow from later ops to earlier ones, so group ``s`` runs
    before every such group and cannot read what they make. Such nodes are
    the sums of the gradients of a value read by several ops, which
    AOTAutograd may tag with the ``seq_nr`` of another op (the loss' in a
    training step where a value is read four times: the sums were put in
    the loss' group, whose points then read gradients they produce
    themselves, a cycle no order of the graph could run)."""
    groups, group_of, lowest = {}, {}, {}
    for node in nodes:
        seq = node.meta.get("seq_nr")
        made = None
        if node in grads:
            found = [group_of.get(a, lowest.get(a)) for a in node.all_input_nodes if a in grads]
            found = [f for f in found if f is not None]
            made = min(found) if found else None
        if node.op == "call_function" and seq in joint.ops and (made is None or made >= seq):
            groups.setdefault(seq, []).append(node)
            group_of[node] = seq
        elif made is not None:
            lowest[node] = made
    return groups


def _stable_sort(graph):
    """Reorders ``graph`` so that every node follows its inputs, keeping the
    present order wherever it already does (the points' calls were put
    beside their groups, whose gradients may be made later)."""
    import heapq
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    waiting = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [position[n] for n in nodes if not waiting[n]]
    heapq.heapify(ready)
    order = []
    while ready:
        node = nodes[heapq.heappop(ready)]
        order.append(node)
        for user in node.users:
            waiting[user] -= 1
            if not waiting[user]:
                heapq.heappush(ready, position[user])
    if order == nodes:
        return
    cursor = order[0]
    if cursor is not nodes[0]:
        nodes[0].prepend(cursor)
    for node in order[1:]:
        cursor.append(node)
        cursor = node


def _gradients(nodes):
    """The nodes whose values depend on a tangent (gradients, not values the
    forward saved)."""
    found = set()
    for node in nodes:
        if node.op == "placeholder":
            if node.name.startswith("tangents"):
                found.add(node)
        elif node.op == "call_function" and any(a in found for a in node.all_input_nodes):
            found.add(node)
    return found


def _incoming(members, group_of, seq, grads):
    seen = []
    for node in members:
        for arg in node.all_input_nodes:
            if arg in grads and group_of.get(arg) != seq and arg not in seen:
                seen.append(arg)
    return seen


def _produced(members, output, group_of, seq, grads):
    return [n for n in members if n in grads and any(
        u is output or group_of.get(u) != seq for u in n.users)]


def _flows_to(node, output, group_of, seq):
    """Where gradient ``node`` of group ``seq`` flows: ``("group", seq')`` or
    ``("output", position)``, through nodes of no group (the sums of
    gradients of a value used twice)."""
    queue, seen = [node], set()
    while queue:
        current = queue.pop(0)
        for user in current.users:
            if user is output:
                flat = output.args[0]
                for i, value in enumerate(flat):
                    if value is current:
                        return ("output", i)
                continue
            other = group_of.get(user)
            if other is not None and other != seq:
                return ("group", other)
            if other is None and user not in seen:
                seen.add(user)
                queue.append(user)
    return None


def _destination(joint, name, seen=None):
    """Where the gradient of forward value ``name`` flows in the backward
    graph: ``("group", seq_nr)`` for a value a lifted op's forward aten
    ops made, ``("output", position)`` for a primal, else (a value amanda's
    routines made: ``amanda::replace``, a portable routine's
    straight-through arithmetic) where the gradient of the first of its
    inputs that has one flows; None for no gradient (``detach``)."""
    seen = set() if seen is None else seen
    if name in seen:
        return None
    seen.add(name)
    if name in joint.primal_positions:
        return ("output", joint.primal_positions[name])
    if name in joint.made_by:
        return ("group", joint.made_by[name])
    if name in joint.getitems:
        source, index = joint.getitems[name]
        if source in joint.replaced:
            return _destination(joint, joint.replaced[source][index], seen)
        return _destination(joint, source, seen)
    if joint.kinds.get(name) in _PLUMBING:
        return None
    for arg in joint.inputs.get(name, ()):
        found = _destination(joint, arg, seen)
        if found is not None:
            return found
    return None


def _eager_makes_node(joint, name):
    """Whether the lifted op ``name``, run eagerly, makes an autograd node:
    read by running its torch callable on meta tensors that require grad
    (``dropout`` with ``p=0`` hands its input back, no node, where
    AOTAutograd's graph has a ``clone``). True where it cannot run there."""
    cache = joint.__dict__.setdefault("eager_nodes", {})
    if name not in cache:
        cache[name] = _runs_with_node(joint.lifted.raw_ops.get(name), joint.lifted.nodes.get(name))
    return cache[name]


def _runs_with_node(raw, node):
    found = _eager_grad_fn(raw, node)
    return found is not False and (found is None or found[0] is not None)


def _eager_grad_fn(raw, node):
    """(the autograd node the torch callable ``raw`` makes on meta copies
    of ``node``'s arguments that require grad, or None when it makes none,
    e.g. hands an input back), or None where it cannot run there."""
    from amanda.runtime.pytorch.compiled.graphs import _value
    if raw is None or node is None:
        return None
    try:
        result, made = _run_on_meta(raw, node, _value)
    except Exception:   # noqa: BLE001 - symbolic sizes, no meta kernel: unknown
        return None
    results = result if isinstance(result, (tuple, list)) else [result]
    for r in results:
        if isinstance(r, torch.Tensor) and r.grad_fn is not None \
                and not any(r is t for t, _ in made):
            return (r.grad_fn,)
    return (None,)


def _run_on_meta(func, node, value_of):
    """``func`` called on meta copies of ``node``'s arguments, floating ones
    requiring grad, so that it makes the autograd node eager would without
    reading data: ``(result, [(meta tensor, argument name)])``.
    ``value_of(arg)`` is the example value of an argument node. Raises
    whatever ``func`` raises there (symbolic sizes, no meta kernel)."""
    made = []

    def meta(arg):
        if isinstance(arg, torch.fx.Node):
            value = value_of(arg)
            if isinstance(value, torch.Tensor):
                tensor = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                             device="meta")
                if tensor.is_floating_point() or tensor.is_complex():
                    tensor.requires_grad_()
                made.append((tensor, arg.name))
                return tensor
            return value
        if isinstance(arg, (list, tuple)):
            return type(arg)(meta(a) for a in arg)
        return arg
    args = [meta(a) for a in node.args]
    kwargs = {k: meta(v) for k, v in node.kwargs.items()}
    with torch.enable_grad():
        return func(*args, **kwargs), made


class _Reach:
    """Where the gradient of a forward value may be read in the backward
    graph: ``{destination: depth}``, its `_destination` at depth 0 and,
    through the op whose group that is, the destinations of that op's
    inputs one deeper: an op that hands its gradient on unchanged has no
    node (``a + b``), so what reads the gradient of its output is the
    group of the op that made one of its inputs, or further."""

    def __init__(self, joint, limit=6):
        self.joint = joint
        self.limit = limit
        self.memo = {}

    def __call__(self, name):
        if name is None:
            return {}
        found = self.memo.get(name)
        if found is None:
            found = self.memo[name] = self._walk(name)
        return found

    def _walk(self, name):
        found, frontier = {}, [name]
        for depth in range(self.limit):
            following = []
            for value in frontier:
                where = _destination(self.joint, value)
                if where is None or where in found:
                    continue
                found[where] = depth
                if where[0] == "group" and where[1] in self.joint.ops:
                    following.extend(v for v in self.joint.ops[where[1]].slots if v is not None)
            frontier = following
        return found


def _best_slot(where, names, free, reach):
    """The input (index into ``names``, among ``free``) whose gradient is
    read at ``where`` nearest (`_Reach`), or None."""
    best, depth = None, None
    for i in free:
        d = reach(names[i]).get(where)
        if d is not None and (depth is None or d < depth):
            best, depth = i, d
    return best


def _match(produced, fop, joint, output, group_of, reach):
    """The produced gradients in the order of the autograd node's inputs
    (None where it produces none), each matched to the input whose
    gradient is read nearest where it flows (`_Reach`: through ops that
    hand gradients on unchanged); gradients matched to no input follow."""
    slots = [None] * len(fop.slots)
    extra = []
    for node in produced:
        where = _flows_to(node, output, group_of, group_of[node])
        free = [i for i, n in enumerate(slots) if n is None]
        best = _best_slot(where, fop.slots, free, reach) if where is not None else None
        if best is None:
            extra.append(node)
        else:
            slots[best] = node
    return slots + extra


def _passing(incoming, members, slots, fop, output, group_of, reach):
    """The inputs of the op whose gradient is an incoming one handed on
    unchanged (``a + b``: both; ``a - b``: ``a``'s): ``[(reader, incoming
    index, slot)]`` for each node outside the group that reads an incoming
    gradient, matched to an input the group produces nothing for by where
    the reader sends it (`_Reach`). Gradients flow from later ops to
    earlier ones and each op is wired in turn, so what reads the gradient
    of this op's output is this op's group or, unchanged, what reads its
    inputs' gradients."""
    point = _custom_ops()["point"]
    free = [i for i in range(len(fop.slots)) if slots[i] is None and fop.slots[i] is not None]
    found = []
    if not free:
        return found
    for k, grad in enumerate(incoming):
        for user in list(grad.users):
            if user in members or user.target is point or user.target is operator.getitem:
                continue
            if user is output:
                flat = output.args[0]
                where = next((("output", i) for i, v in enumerate(flat) if v is grad), None)
            elif user in group_of:
                where = ("group", group_of[user])
            else:
                where = _flows_to(user, output, group_of, None)
            slot = _best_slot(where, fop.slots, free, reach) if where is not None else None
            if slot is not None:
                found.append((user, k, slot))
    return found


class _Flows:
    """The gradient of each forward value as the wiring makes it: what the
    after-points hand on for it (``note``), summed where several ops read
    the value, or the tangent of a graph output (``into``)."""

    def __init__(self, graph, output, joint, group_of):
        self.graph = graph
        self.output = output
        self.group_of = group_of
        self.made = {}      # forward value name -> gradient nodes handed on for it
        tangents = [n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")]
        self.tangents = dict(zip(joint.fw_outputs, tangents))

    def note(self, fop, by_slot):
        for i, node in by_slot.items():
            if i < len(fop.slots) and fop.slots[i] is not None:
                self.made.setdefault(fop.slots[i], []).append(node)

    def hand_on(self, fop):
        """``fop`` makes no autograd node eagerly: the gradient of its
        output is that of the values it reads (so an op before it that
        makes none in the backward graph either gets its points on it)."""
        flowing = self.into(fop)
        for value in dict.fromkeys(v for v in fop.slots if v is not None):
            self.made.setdefault(value, []).extend(flowing)

    def into(self, fop):
        """[the gradient of ``fop``'s output], or [] when none flows: the
        sum of what its readers hand on and, for a graph output, its
        tangent (a value the graph returns and reads, e.g. hidden states a
        pooler reads: before, only the pooler's part was taken)."""
        made = list(self.made.get(fop.name, []))
        tangent = self.tangents.get(fop.name)
        if tangent is not None and tangent.users:
            made.append(tangent)
        if len(made) <= 1:
            return made
        total = self._sum(made)
        if total is not None:
            return [total]
        return made[:1]     # no common sum found: the first reader's, as before

    def _sum(self, nodes):
        """The first node of no group that every one of ``nodes`` flows into
        (the sum of the gradients of a value read by several ops)."""
        point = _custom_ops()["point"]
        reached = None
        for node in nodes:
            seen, queue = set(), [node]
            while queue:
                current = queue.pop()
                for user in current.users:
                    if user in seen or user in self.group_of or user is self.output \
                            or user.target is point:
                        continue
                    seen.add(user)
                    queue.append(user)
            reached = seen if reached is None else reached & seen
        if not reached:
            return None
        order = {n: i for i, n in enumerate(self.graph.nodes)}
        return min(reached, key=order.__getitem__)


def _wire(graph, point, members, incoming, slots, width, passing=()):
    """The point's two calls: before the group on its incoming gradients,
    after it on the gradients it produces (each replacing what it passes).
    ``passing`` (`_passing`): readers of an incoming gradient handed on
    unchanged for an input, which get it from the after-point, as that
    input's gradient (so a group of no node has its two points too).
    Returns the nodes of the gradients the calls pass on and the
    after-point's result per input slot."""
    ops = _custom_ops()
    grad_outputs = list(incoming) + [None] * max(0, width - len(incoming))
    handle = _register(point)
    before = []
    cursor = members[-1] if members else max(incoming, key=_position_in(graph))
    if incoming:     # also for after-routines only: they may record before-actions
        if members:
            with graph.inserting_before(members[0]):
                call = graph.call_function(ops["point"], (handle, 0, grad_outputs, []))
        else:
            with graph.inserting_after(cursor):
                call = graph.call_function(ops["point"], (handle, 0, grad_outputs, []))
        news = before = _items(graph, call, len(incoming))
        if not members:
            cursor = news[-1]
        mapping = dict(zip(incoming, news))
        for node in members:
            node.args = torch.fx.node.map_arg(node.args, lambda n: mapping.get(n, n))
            node.kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: mapping.get(n, n))
        grad_outputs = [mapping.get(n, n) if n is not None else None for n in grad_outputs]
    slots = list(slots)
    for _, k, slot in passing:
        slots[slot] = before[k]
    produced = [n for n in slots if n is not None]
    users = {n: [u for u in n.users if u not in members] for n in produced if n not in before}
    with graph.inserting_after(cursor):
        call = graph.call_function(ops["point"], (handle, 1, grad_outputs, list(slots)))
    news = _items(graph, call, len(produced))
    by_slot, position = {}, 0
    for i, node in enumerate(slots):
        if node is not None:
            by_slot[i] = news[position]
            position += 1
    for node, new in zip(produced, news):
        for user in users.get(node, ()):
            user.replace_input_with(node, new)
    for user, k, slot in passing:
        user.replace_input_with(incoming[k], by_slot[slot])
    return news + before, by_slot


def _position_in(graph):
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__


def _accumulations(graph, output, joint):
    """Eager's ``AccumulateGrad`` points: the gradient of each parameter (a
    leaf that requires grad among the Dynamo graph's inputs), owned by the
    first lifted op that reads it, at the input position it has there."""
    values = list(output.args[0])
    owners = _first_readers(joint)
    ops = _custom_ops()
    changed = False
    for position, value in enumerate(values):
        if not isinstance(value, torch.fx.Node) or position >= len(joint.dynamo_placeholders):
            continue
        owner = owners.get(position)
        if owner is None:
            continue
        op_name, index = owner
        point = _Point(joint, op_name, "AccumulateGrad", f"input{index}")
        handle = _register(point)
        with graph.inserting_before(output):
            call = graph.call_function(ops["point"], (handle, 0, [value], []))
            value = _items(graph, call, 1)[0]
            graph.call_function(ops["point"], (handle, 1, [value], []))
        values[position] = value
        changed = True
    if changed:
        output.args = (tuple(values),) + tuple(output.args[1:])


def _first_readers(joint):
    """Dynamo placeholder position -> (lifted op name, input position) of
    the first lifted op that reads it, for the parameters (leaves that
    require grad), seen through amanda's forward routines."""
    from amanda.runtime.pytorch.compiled.graphs import _value
    params = {}      # name in the whole Dynamo graph -> position
    for position, node in enumerate(joint.dynamo_placeholders):
        value = _value(node)
        if isinstance(value, torch.Tensor) and value.requires_grad and value.is_leaf:
            params[joint.whole_names[node.name]] = position
    owners = {}
    for name, node in joint.lifted.nodes.items():
        args = []
        for arg in list(node.args) + list(node.kwargs.values()):
            args.extend(arg if isinstance(arg, (list, tuple)) else [arg])
        index = 0
        for arg in args:
            if not isinstance(arg, torch.fx.Node):
                continue
            arg = _before_routines(arg)
            if not isinstance(_value(arg), torch.Tensor):
                continue
            position = params.get(arg.name)
            if position is not None and position not in owners:
                owners[position] = (name, index)
            index += 1
    return owners


def _before_routines(arg):
    """What ``arg`` was before amanda's forward routines replaced it, seen
    through the results of ``amanda::replace`` (a Python routine) and of a
    portable routine's call (the pruner's ``weight * mask``). The latter's
    ``getitem`` results carry no value: read as no tensor, the weight was
    skipped, and the bias got the weight's input position."""
    replace = _replace_op()
    while arg.target is operator.getitem and isinstance(arg.args[0], torch.fx.Node):
        call, index = arg.args
        if call.target is replace:
            arg = call.args[1][index]
        elif getattr(call.target, "amanda_portable", False):
            arg = call.args[index]
        else:
            break
    return arg


def _replace_op():
    from amanda.runtime.pytorch.compiled.lowering import _custom_ops as forward_ops
    return forward_ops()["replace"]


# -- the points at run time ------------------------------------------------------------------

_POINTS = []      # handle -> _Point, for the custom op


def _register(point):
    _POINTS.append(point)
    return len(_POINTS) - 1


class _Point:
    """One backward op of a compiled graph: its context, whether its
    analysis ran, and the actions it recorded (eager's ``_BackwardRecord``)."""

    __slots__ = ("joint", "op", "name", "index", "op_id", "context", "pre_done", "post_done",
                 "before", "after", "replace", "where", "unreached")

    def __init__(self, joint, op, name, index):
        session = joint.session
        self.joint = joint
        self.op = op
        self.name = name
        self.index = index
        self.op_id = _stable_id(joint.lifted.op_ids[op], index, name)
        self.context = None
        self.pre_done = not session.routines[BACKWARD_BEFORE]
        self.post_done = not session.routines[BACKWARD_AFTER]
        self.before, self.after, self.replace = [], [], []
        self.where = (name, self.op_id, NAMESPACE)
        self.unreached = False      # skipped in a run: no gradient reached it (`_Unreached`)

    def get_context(self):
        if self.context is None:
            lifted, op = self.joint.lifted, self.op
            entry = self.joint.plan.ops.get(op) if self.joint.plan is not None else None
            parent = entry.context if entry is not None else None
            self.context = OpContext(NAMESPACE, lifted.raw_ops[op], lifted.op_ids[op],
                                     _op_type(lifted, op), backward_op=BackwardOp(self.name, self.index),
                                     backward_op_id=self.op_id, module_path=lifted.module_paths[op],
                                     parent=parent)
        return self.context

    def run_before(self, grad_outputs):
        session = self.joint.session
        if not session.active or controls.state.disabled:
            return grad_outputs
        if not self.pre_done:
            context = self.get_context()
            context._set_values(grad_outputs=tuple(grad_outputs))
            try:
                _analyse(session, BACKWARD_BEFORE, context, self)
            finally:
                context._set_values(grad_outputs=None)
            self.pre_done = True
        values = list(grad_outputs)
        if self.before:
            _apply_actions(self.before, values, self.where)
        return values

    def run_after(self, grad_outputs, grad_inputs):
        session = self.joint.session
        if not session.active or controls.state.disabled:
            return grad_inputs
        if not self.post_done:
            context = self.get_context()
            context._set_values(grad_outputs=tuple(grad_outputs), grad_inputs=tuple(grad_inputs))
            try:
                _analyse(session, BACKWARD_AFTER, context, self)
            finally:
                context._set_values(grad_outputs=None, grad_inputs=None)
            self.post_done = True
        values = list(grad_inputs)
        if self.replace:
            action = self.replace[0]
            new = _invoke(action, select(list(grad_outputs), action.positions, action, self.where),
                          self.where, meta=None)
            if new is not None:
                if len(new) != len(values):
                    raise routine_error(action, self.where, f"returned {len(new)} gradients; the "
                                        f"backward op produces {len(values)}",
                                        what="replace_backward_op routine")
                check_replacements(action, values, new, _meta, self.where)
                values = list(new)
        if self.after:
            _apply_actions(self.after, values, self.where)
        return values


def _op_type(lifted, op):
    for ir_op in lifted.graph.ops:
        if ir_op.name == op:
            return ir_op.type
    return op


def _passing_point(handle, point, grad_outputs, grad_inputs):
    """A point whose routines may replace gradients, in a slim graph
    (`_Slimmer`): ``boxed_nop`` runs the graph as Python, so the point is
    a plain call that hands on what the routines return (or the gradients
    themselves), as eagerly, without the copies a custom op must make."""
    old, new = _run_point(handle, point, grad_outputs, grad_inputs)
    return [o if n is None else n for o, n in zip(old, new) if o is not None]


def _run_point(handle, point, grad_outputs, grad_inputs):
    """``(the gradients the point passes on, what its routines returned for
    them)``: point 0 runs the before-routines on ``grad_outputs``, point 1
    the after-routines on ``grad_inputs``, outside autograd."""
    record = _POINTS[handle]
    unreached = getattr(_tls, "unreached", None)
    if unreached is not None and handle in unreached:
        record.unreached = True
        old = grad_outputs if point == 0 else grad_inputs
        return old, [None] * len(old)
    with torch.no_grad():
        if point == 0:
            return grad_outputs, record.run_before(grad_outputs)
        return grad_inputs, record.run_after(grad_outputs, grad_inputs)


def _observe_impl(handle: int, point: int, grad_outputs: list[torch.Tensor | None],
                  grad_inputs: list[torch.Tensor | None]) -> None:
    """A point whose actions only observe (`_Slimmer`): the routines run on
    the gradients, nothing is passed on."""
    _run_point(handle, point, grad_outputs, grad_inputs)


def _point_impl(handle: int, point: int, grad_outputs: list[torch.Tensor | None],
                grad_inputs: list[torch.Tensor | None]) -> list[torch.Tensor]:
    old, new = _run_point(handle, point, grad_outputs, grad_inputs)
    return [_fresh(n if n is not None else o, o) for o, n in zip(old, new) if o is not None]


def _fresh(value, like):
    """A tensor of its own (a custom op's results may not alias its
    arguments), in the layout of the gradient it stands for."""
    if value.shape != like.shape or value.dtype != like.dtype:
        return value.clone()
    return torch.empty_strided(like.shape, like.stride(), dtype=like.dtype,
                               device=like.device).copy_(value)


_OPS = {}


def _custom_ops():
    if not _OPS:
        tags = (torch.Tag.nondeterministic_seeded,) + tuple(
            getattr(torch.Tag, name) for name in ("cudagraph_unsafe",) if hasattr(torch.Tag, name))
        op = torch.library.custom_op("amanda::backward_point", mutates_args=(), tags=tags)(_point_impl)

        @op.register_fake
        def _(handle, point, grad_outputs, grad_inputs):
            old = grad_outputs if point == 0 else grad_inputs
            return [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
                    for t in old if t is not None]

        torch.fx.node.has_side_effect(torch.ops.amanda.backward_point.default)
        _OPS["point"] = torch.ops.amanda.backward_point.default
        observe = torch.library.custom_op("amanda::backward_observe", mutates_args=(),
                                          tags=tags)(_observe_impl)
        observe.register_fake(lambda handle, point, grad_outputs, grad_inputs: None)
        torch.fx.node.has_side_effect(torch.ops.amanda.backward_observe.default)
        _OPS["observe"] = torch.ops.amanda.backward_observe.default
    return _OPS
