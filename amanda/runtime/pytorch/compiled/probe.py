"""Compiled PyTorch: the analysis of a Dynamo graph, on real tensors.

`analyse` runs the tools' forward analysis routines on every lifted op of a
graph Dynamo hands amanda's backend, once, during one eager run of that graph
on the real inputs of the call being compiled (`_Probe`), which leaves
nothing behind (no autograd, copies of the inputs it may write, the random
number generators put back). `_own_copy` makes the copy of Dynamo's graph
module the routines go into. Split from `compiled` (the callback and
the calls); docs/pytorch-compiled.md, "Analysis sees real tensors".
"""

from __future__ import annotations

import copy

import torch

from amanda.context import OpContext
from amanda.errors import BackendError
from amanda.runtime.pytorch.compiled.graphs import NAMESPACE, CompiledGraphBackend, _tensor_args

__all__ = ["analyse"]


# -- analysis ------------------------------------------------------------------------------

def analyse(lifted, session, gm, example_inputs):
    """Runs the session's forward analysis routines on every op, once, through
    the one instrumentation pipeline (`amanda.passes.pipeline.instrument_graph`).

    The pipeline walks the lifted graph in order while `_Probe`, its backend,
    runs ``gm`` eagerly on ``example_inputs`` (the real tensors of the call
    Dynamo compiles for) one node ahead of it, so each op's routines receive
    real tensors, as an eager op's first execution gives them: the
    before-routines its inputs before it runs, the after-routines its inputs
    and outputs after.

    Returns:
        The :class:`~amanda.passes.instrumentation.InstrumentationPlan`.
    """
    from torch.utils._python_dispatch import _disable_current_modes

    from amanda.passes.pipeline import instrument_graph
    probe = _Probe(gm, lifted)
    probe.start(example_inputs)
    try:
        # a compiled graph is a part of a step: tools that want whole graphs
        # get the step's trace, into which its runs are spliced (`_Spliced`)
        with _disable_current_modes(), torch.no_grad():
            plan, _ = instrument_graph(lifted.graph, session, probe, name="compiled graph",
                                       whole=False)
    finally:
        probe.finish()
    return plan


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


class _Probe(CompiledGraphBackend):
    """The backend of a compiled graph's analysis: one eager run of the Dynamo
    graph on the real inputs of the call being compiled, stepped node by node
    as the instrumentation pass asks for an op's values (`inputs` runs the
    graph up to the op, `outputs` runs the op), that leaves no trace: it runs
    without autograd (where the graph does not turn it on itself), on copies
    of every input that is no parameter, and of every parameter the graph may
    write to (`_mutated_roots`); the random number generators are put back as
    they were (`finish`), so the compiled call draws what it would have
    drawn. Values are freed as soon as no later node reads them (the fx
    interpreter's own collection), so its peak memory is an eager forward's
    without autograd. Nodes after the last op the pass asks for are not run."""

    def __init__(self, gm, lifted):
        super().__init__(lifted)
        self.interpreter = torch.fx.Interpreter(gm, garbage_collect_values=True)
        self.interpreter.extra_traceback = False   # a routine's error keeps its own message
        self.gm = gm
        self.nodes = None
        self.kept = []
        self.rng = self.cuda_rng = None
        self.seen = {}       # IR op name -> [tensor inputs, outputs or None until it ran]
        self.pending = None  # the node the run stopped before

    def start(self, example_inputs):
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        written = _mutated_roots(self.gm)
        args = []
        for node, value in zip(placeholders, example_inputs):
            if isinstance(value, torch.Tensor) and not (
                    isinstance(value, torch.nn.Parameter) and node not in written):
                value = value.detach().clone()
            elif isinstance(value, torch.Tensor):
                self.kept.append((value, value._version))
            args.append(value)
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        interpreter = self.interpreter
        interpreter.env = {}
        interpreter.args_iter = iter(self.gm.graph.process_inputs(*args))
        self.nodes = iter(self.gm.graph.nodes)

    def finish(self):
        self.nodes = self.pending = None
        self.interpreter.env = {}
        self.seen.clear()
        if self.rng is not None:
            torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        for value, version in self.kept:
            if value._version != version:      # never seen: `_mutated_roots` is conservative
                raise BackendError("amanda's analysis run of a compiled graph modified a parameter "
                                   f"of shape {tuple(value.shape)} [namespace {NAMESPACE}]")

    def _run(self, node):
        interpreter = self.interpreter
        interpreter.env[node] = result = interpreter.run_node(node)
        for done in interpreter.user_to_last_uses.get(node, ()):
            del interpreter.env[done]
        return result

    def _run_pending(self):
        """Runs the op the graph stopped before, if the pass did not ask for
        its outputs; returns its result."""
        node, self.pending = self.pending, None
        if node is None:
            return None
        first = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
        first = self.interpreter.env.get(first) if first is not None else None
        result = self._run(node)
        if isinstance(result, torch.Tensor):
            return [result]
        if result is None:
            return [] if first is None else [first]   # an in-place op returning None (x[i] = v)
        if isinstance(result, (tuple, list)):
            return [v for v in result if isinstance(v, torch.Tensor)]
        return []

    def context(self, op):
        return OpContext(NAMESPACE, self.raw_op(op), self.lifted.op_ids[op.name], op.type,
                         module_path=self.lifted.module_paths[op.name])

    def inputs(self, op):
        seen = self.seen.get(op.name)
        if seen is None:
            self._run_pending()
            target = self.lifted.nodes[op.name]
            for node in self.nodes:
                if node is target:
                    break
                self._run(node)
            env = self.interpreter.env
            seen = self.seen[op.name] = [[env[a] for a in _tensor_args(target)], None]
            self.pending = target
        return list(seen[0])

    def outputs(self, op):
        seen = self.seen[op.name]
        if seen[1] is None:
            seen[1] = self._run_pending()
        return list(seen[1])


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
