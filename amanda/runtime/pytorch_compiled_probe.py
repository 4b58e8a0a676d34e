"""Compiled PyTorch: the analysis of a Dynamo graph, on real tensors.

`analyse` runs the tools' forward analysis routines on every lifted op of a
graph Dynamo hands amanda's backend, once, during one eager run of that graph
on the real inputs of the call being compiled (`_Probe`), which leaves
nothing behind (no autograd, copies of the inputs it may write, the random
number generators put back). `_own_copy` makes the copy of Dynamo's graph
module the routines go into. Split from `pytorch_compiled` (the callback and
the calls); docs/pytorch-compiled.md, "Analysis sees real tensors".
"""

from __future__ import annotations

import copy

import torch

from amanda import controls
from amanda.context import OpContext
from amanda.errors import BackendError
from amanda.runtime.pytorch_compiled_graphs import NAMESPACE, CompiledGraphBackend, _tensor_args
from amanda.tool import FORWARD_AFTER, FORWARD_BEFORE

__all__ = ["analyse"]


# -- analysis ------------------------------------------------------------------------------

def analyse(lifted, session, gm, example_inputs):
    """Runs the session's forward analysis routines on every op, once.

    The graph ``gm`` is run once eagerly on ``example_inputs`` (the real
    tensors of the call Dynamo compiles for; `_Probe`) and each op's
    routines receive real tensors, as an eager op's first execution gives
    them: the before-routines its inputs before it runs, the after-routines
    its inputs and outputs after.

    Returns:
        ``{fx node name: OpActions}`` of the ops that carry actions.
    """
    from amanda.passes.instrumentation import OpActions, _absorb
    backend = CompiledGraphBackend(lifted)
    plan = {}
    ops = {op.name: op for op in lifted.graph.ops}
    before, after = session.routines[FORWARD_BEFORE], session.routines[FORWARD_AFTER]

    def visit_before(node, inputs):
        op = ops[node.name]
        context = _context(lifted, backend, op)
        context._set_ir(op, lifted.graph)
        if before:
            context._set_values(inputs=inputs)
            session.analyse(FORWARD_BEFORE, context)
        return context

    def visit_after(node, context, inputs, outputs):
        if after:
            context._set_values(inputs=inputs, outputs=outputs)
            session.analyse(FORWARD_AFTER, context)
        entry = OpActions(ops[node.name], context)
        _absorb(entry, context)
        if entry:
            plan[node.name] = entry

    with controls.muted():
        _Probe(gm, lifted, visit_before, visit_after).probe(example_inputs)
    return plan


def _context(lifted, backend, op):
    return OpContext(NAMESPACE, backend.raw_op(op), lifted.op_ids[op.name], op.type,
                     module_path=lifted.module_paths[op.name])


#: Python's item and augmented assignments (``operator.iadd``, ``Tensor.__iadd__``...)
_AUGMENTED = frozenset(["setitem", "iadd", "isub", "imul", "imatmul", "itruediv", "ifloordiv", "imod",
                        "ipow", "ilshift", "irshift", "iand", "ior", "ixor"])


def _mutated_roots(gm):
    """Placeholders a node of ``gm`` may write to: the start of the chain of
    first arguments of every call that may modify its first argument (a
    method or function whose name ends in ``_``, ``inplace=True``, an
    augmented assignment or item assignment). Conservative: the chain is
    followed through any call, views or not."""
    roots = set()
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method") or not node.args:
            continue
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        writes = ((name.endswith("_") and not name.endswith("__")) or node.kwargs.get("inplace") is True
                  or name.strip("_") in _AUGMENTED)
        if not writes:
            continue
        arg = node.args[0]
        while isinstance(arg, torch.fx.Node) and arg.op in ("call_function", "call_method") and arg.args:
            arg = arg.args[0]
        if isinstance(arg, torch.fx.Node) and arg.op == "placeholder":
            roots.add(arg)
    return roots


class _Probe(torch.fx.Interpreter):
    """One eager run of a Dynamo graph for its analysis, on the real inputs of
    the call being compiled, that leaves no trace: it runs without autograd
    (where the graph does not turn it on itself), on copies of every input
    that is no parameter, and of every parameter the graph may write to
    (`_mutated_roots`); the random number generators are put back as they
    were, so the compiled call draws what it would have drawn. Values are
    freed as soon as no later node reads them (the interpreter's own
    collection), so its peak memory is an eager forward's without autograd."""

    def __init__(self, gm, lifted, visit_before, visit_after):
        super().__init__(gm, garbage_collect_values=True)
        self.extra_traceback = False     # a routine's error keeps its own message
        self.lifted = lifted
        self.visit_before = visit_before
        self.visit_after = visit_after

    def probe(self, example_inputs):
        from torch.utils._python_dispatch import _disable_current_modes
        placeholders = [n for n in self.module.graph.nodes if n.op == "placeholder"]
        written = _mutated_roots(self.module)
        args, kept = [], []
        for node, value in zip(placeholders, example_inputs):
            if isinstance(value, torch.Tensor) and not (
                    isinstance(value, torch.nn.Parameter) and node not in written):
                value = value.detach().clone()
            elif isinstance(value, torch.Tensor):
                kept.append((value, value._version))
            args.append(value)
        rng = torch.get_rng_state()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        try:
            with _disable_current_modes(), torch.no_grad():
                self.run(*args)
        finally:
            torch.set_rng_state(rng)
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)
        for value, version in kept:
            if value._version != version:      # never seen: `_mutated_roots` is conservative
                raise BackendError("amanda's analysis run of a compiled graph modified a parameter "
                                   f"of shape {tuple(value.shape)} [namespace {NAMESPACE}]")

    def run_node(self, node):
        if node.name not in self.lifted.nodes:
            return super().run_node(node)
        inputs = [self.env[a] for a in _tensor_args(node)]
        context = self.visit_before(node, inputs)
        result = super().run_node(node)
        if isinstance(result, torch.Tensor):
            outputs = [result]
        elif result is None and node.args and isinstance(node.args[0], torch.fx.Node):
            outputs = [self.env[node.args[0]]]   # an in-place op that returns None (x[i] = v)
        else:
            outputs = [v for v in result if isinstance(v, torch.Tensor)] \
                if isinstance(result, (tuple, list)) else []
        self.visit_after(node, context, inputs, outputs)
        return result



def _own_copy(gm, lifted):
    """A copy of Dynamo's graph module for the routines to go into: Dynamo
    reads its own graph (its placeholders) after the backend returns, to make
    the code that calls the compiled graph. The copy keeps the attributes
    Dynamo and AOTAutograd read (the module's ``meta``, its parameters'
    sources, each placeholder's source); ``lifted`` is moved to its nodes."""
    memo = {}
    graph = torch.fx.Graph(tracer_cls=gm.graph._tracer_cls)
    result, output = graph.graph_copy(gm.graph, memo, return_output_node=True)
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    graph.output(result, type_expr=getattr(output, "type", None)).meta = copy.copy(output.meta)
    new = torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    new.meta = dict(gm.meta)
    for name in ("_param_name_to_source", "compile_subgraph_reason"):
        if hasattr(gm, name):
            setattr(new, name, getattr(gm, name))
    for node in gm.graph.nodes:
        if hasattr(node, "_dynamo_source"):
            memo[node]._dynamo_source = node._dynamo_source
    lifted.nodes = {name: memo[node] for name, node in lifted.nodes.items()}
    return new
