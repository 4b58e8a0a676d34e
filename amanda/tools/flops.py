"""FLOPs profiler: count the floating-point operations every op executes.

:class:`FlopsProfiler` depends on a :class:`~amanda.tools.mapping.MappingTool`
with :data:`amanda.tools.mapping_rules.RULES`, so it reads backend-neutral op
types (``context["type"]``) and works on PyTorch (eager) and TensorFlow
(``tf.compat.v1`` graphs) alike. Its forward analysis routine (registered with
``require_outputs=True``) computes the op's FLOPs once, from the shapes of
``context.get_inputs()`` / ``get_outputs()`` (PyTorch tensors, or TF symbolic
tensors with static shapes, or the ``onnx.ValueInfoProto`` symbols of an ONNX
model, whose shapes the ONNX frontend infers when the model does not declare
them), and inserts an observe-only instrumentation routine that adds them each
time the op executes: counts are per execution, with amanda's analysis cache
on. On ONNX, an op whose shapes are not static (a symbolic batch dimension
``N``) is counted at run time instead, from the shapes of the NumPy arrays its
routines receive.

Conventions (see docs/tools/flops.md):

* a multiply-add counts as 2 FLOPs, as in ``torch.utils.flop_counter.FlopCounterMode``;
* biases of convolutions and linear layers are not counted (as in
  ``FlopCounterMode``); a separate ``BiasAdd`` op (TF) is element-wise;
* backward: each backward op that computes a gradient of a convolution or
  matrix product is charged the forward FLOPs of its op once per gradient
  operand it computes (input and weight: 2x forward). In PyTorch the single
  ``ConvolutionBackward0`` / ``AddmmBackward0`` / ``MmBackward0`` /
  ``BmmBackward0`` node gets 2x forward; in TF ``Conv2DBackpropInput`` and
  ``Conv2DBackpropFilter`` (and the two gradient ``MatMul`` ops) get 1x each.
  The autograd nodes of other PyTorch ops are charged by
  :data:`~amanda.tools.flops_formulas.BACKWARD_FORMULAS` per gradient they
  compute (element-wise: the product with the incoming gradient plus the
  derivative; normalisations, softmax, attention, reductions, lookups); a
  backward without a formula (and TF's gradient ops of those ops) is listed in
  :attr:`FlopsProfiler.unknown_backward`, never counted as zero. ONNX models
  are inference graphs: forward only.
* op types without a formula are counted in :attr:`FlopsProfiler.unknown`
  (type -> executions), never silently as zero; ops without arithmetic
  (views, reshapes, copies, lookups) are in :data:`ZERO_FLOP_TYPES`.

The formula table (op type -> formula, aliases, backward charges) lives in
:mod:`amanda.tools.flops_formulas`; its public names are importable from here.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import amanda
from amanda.runtime import vocabulary
from amanda.runtime.tool_support import support_for
from amanda.tools import mapping_rules
from amanda.tools._module_path import module_path_of
from amanda.tools.flops_formulas import (  # the formula table; public names re-exported
    BACKWARD_TYPES,
    CONV_TYPES,
    ELEMENTWISE_TYPES,
    FORMULAS,
    MATMUL_TYPES,
    NORM_TYPES,
    REDUCTION_TYPES,
    RNN_ELEMENTWISE,
    SOFTMAX_TYPES,
    ZERO_FLOP_TYPES,
    SCATTER_BACKWARD_TYPES,
    PLAIN_VOCABULARY,
    _apply,
    _needed_inputs,
    _numel,
    _shape,
    backward_costs,
    normalise_type,
)
from amanda.tools.mapping import MappingTool

__all__ = ["BACKWARD_TYPES", "CONV_TYPES", "FORMULAS", "MATMUL_TYPES", "RNN_ELEMENTWISE",
           "ZERO_FLOP_TYPES", "FlopsProfiler", "format_count"]


def format_count(value):
    """A count in auto-scaled units: ``512``, ``1.23K``, ``45.60M``, ``7.89G``."""
    for factor, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= factor:
            return f"{value / factor:.2f}{unit}"
    return f"{value:,}" if isinstance(value, int) else f"{value:.3g}"


def _parameters(inputs, support):
    """``{key: element count}`` of the inputs that are trainable parameters
    (the backend says which: ``torch.nn.Parameter`` objects; TF values read
    from a variable)."""
    return {} if support is None else support.trainable_parameters(inputs)


def _words(namespace):
    """The vocabulary the formulas ask about an op of ``namespace``."""
    found = vocabulary.of(namespace)
    return PLAIN_VOCABULARY if found is None else found


def _flag(support, name):
    """A yes/no fact of a backend's tool support (False without one)."""
    return bool(getattr(support, name, False)) if support is not None else False


class FlopsProfiler(amanda.Tool):
    """Count forward (and backward) FLOPs per op execution.

    Args:
        backward: also count the backward FLOPs of convolutions and matrix
            products (see the module doc for the convention).
        other_backward: also count the backward of the other PyTorch ops by
            :data:`~amanda.tools.flops_formulas.BACKWARD_FORMULAS` (what
            ``amanda flops`` does). Off, the totals are those of
            ``FlopCounterMode`` (products only) and the other backward ops
            that ran are listed in :attr:`unknown_backward`.

    Attributes:
        unknown: ``Counter`` of op types without a formula -> executions.
        unknown_backward: ``Counter`` of op types whose backward has no
            formula (see :data:`~amanda.tools.flops_formulas.BACKWARD_FORMULAS`)
            -> backward ops of theirs analysed (noted by the analysis, which
            is cached: no routine runs for them, and :meth:`reset` keeps it).
        records: (namespace, op id) -> dict(name, type, module, flops, calls)
            for every forward op with a nonzero count. For an ONNX op counted
            at run time (shapes not static), ``flops`` is that of its latest
            execution and ``dynamic`` is True.
    """

    def __init__(self, backward=True, other_backward=False):
        super().__init__()
        self.other_backward = other_backward
        self.depends_on(MappingTool(rules=mapping_rules.RULES))
        self.unknown = Counter()
        self.unknown_backward = Counter()
        self.records = {}
        # phase -> module paths with an op counted as unknown (shown as "?")
        self._unknown_modules = {"forward": set(), "backward": set()}
        self._unknown_types = {"forward": Counter()}
        # phase -> executions counted per op type, and modules with one: a 0
        # that was computed, told apart from a phase that never ran ("-")
        self._ran = {"forward": Counter(), "backward": Counter()}
        self._ran_modules = {"forward": set(), "backward": set()}
        self._flops = {"forward": defaultdict(int), "backward": defaultdict(int)}
        self._by_module = {"forward": defaultdict(int), "backward": defaultdict(int)}
        self._dynamic = {}    # key -> (formula, type, module, op, input count)
        self._modules = {}    # module -> {"params": {key: numel}, "shape", "last"}
        self._analysed = 0    # forward ops analysed so far (orders the modules' outputs)
        self._pending = {}    # key -> input shapes stashed before the op ran
        self._skip = set()     # backward ops whose incoming gradient changed shape, this execution
        self.add_inst_for_op(self.forward_analysis, require_outputs=True)
        if backward:
            self.add_inst_for_op(self.backward_analysis, backward=True)

    # -- analysis ------------------------------------------------------------
    def forward_analysis(self, context):
        namespace = context.namespace
        support = support_for(namespace)
        op_type = normalise_type(context.get("type"), namespace)
        if op_type is None:
            op_type = normalise_type(context.get_op_name(), namespace)
        module = module_path_of(context)
        self._note_module(context, support, module)
        if op_type in ZERO_FLOP_TYPES:
            if op_type in SCATTER_BACKWARD_TYPES and _flag(support, "OTHER_BACKWARD_FLOPS") \
                    and context.get_outputs():
                # no arithmetic forward; its gradient is scattered or summed
                context["flops"], context["flops_type"] = 0, op_type
                context["flops_module"] = module
                context["flops_shape"] = _shape(context.get_outputs()[0], support)
            return
        formula = FORMULAS.get(op_type)
        flops = None
        if formula is not None:
            flops = self._compute(formula, op_type, context, support)
            if flops is None and _flag(support, "COUNTS_AT_RUN_TIME") \
                    and self._count_at_run_time(context, formula, op_type, module, support):
                return
        if flops is None:
            label = op_type if formula is None else f"{op_type} (shape unknown)"
            # its backward is unknown too
            context["flops"], context["flops_type"], context["flops_module"] = 0, op_type, module
            context["flops_shape"] = None
            context.insert_after_op(self._count_unknown, outputs=[], label=label,
                                    op_type=op_type, module=module)
            return
        # PyTorch: analysis runs once per call site; if a later execution
        # there has another output shape, the cached count would be stale, so
        # the routines check the output's (or its gradient's) shape (no copy:
        # the tensor itself)
        check = _flag(support, "ANALYSED_PER_CALL_SITE") and len(context.get_outputs()) > 0
        shape = _shape(context.get_outputs()[0], support) if check else None
        context["flops"] = flops
        context["flops_type"] = op_type
        context["flops_module"] = module
        context["flops_shape"] = shape
        inputs = context.get_inputs()
        context["flops_input_shape"] = _shape(inputs[0], support) if inputs else None
        if flops == 0:
            return
        key = (context.namespace, context.get_op_id())
        self.records[key] = {"name": context.get_op_name(), "type": op_type,
                             "module": module, "flops": flops, "calls": 0}
        context.insert_after_op(self._count, outputs=[0] if check else [], key=key,
                                op_type=op_type, module=module, flops=flops, shape=shape)

    def backward_analysis(self, context):
        flops = context.get("flops")
        op_type = context.get("flops_type")
        if op_type is None:
            return     # no arithmetic, forward or backward (views, copies), or not analysed
        if op_type not in BACKWARD_TYPES or not flops:
            self._other_backward(context, op_type, flops or 0)
            return
        support = support_for(context.namespace)
        factor = 0 if support is None else support.backward_flop_factor(context.get_backward_op())
        if not factor:
            return
        module, shape = context.get("flops_module"), context.get("flops_shape")
        operands = support.backward_flop_operands(context.get_backward_op())
        if operands is not None:
            # charged per operand gradient autograd computes (None where
            # no input needs it: a first layer, a frozen weight), read at
            # every execution
            key = (context.namespace, context.get_op_id(), str(context.get_backward_op_id()))
            if shape is not None:
                context.insert_before_backward_op(self._check_backward, grad_outputs=[0],
                                                  key=key, op_type=op_type,
                                                  numel=_numel(shape))
            context.insert_after_backward_op(self._count_operands, grad_inputs=list(operands),
                                             key=key if shape is not None else None,
                                             op_type=op_type, module=module, flops=flops)
            return
        if shape is not None:
            # the incoming gradient has the forward output's size: checked
            # like the forward count (PyTorch only, a reference, no copy)
            context.insert_before_backward_op(self._count_backward, grad_outputs=[0],
                                              op_type=op_type, module=module,
                                              flops=factor * flops, numel=_numel(shape))
        else:
            context.insert_after_backward_op(self._count_backward, grad_inputs=[],
                                             op_type=op_type, module=module,
                                             flops=factor * flops)

    def _other_backward(self, context, op_type, flops):
        """The autograd node of an op other than a convolution or matrix
        product: charged by :data:`~amanda.tools.flops_formulas.BACKWARD_FORMULAS`
        per gradient it computes; without a formula (or on TF, whose gradient
        ops are counted by no formula yet) listed in :attr:`unknown_backward`,
        never zero."""
        backward_op = context.get_backward_op()
        support = support_for(context.namespace)
        if support is not None and support.accumulates_gradient(backward_op):
            return    # stores a parameter's gradient: no arithmetic on the first step
        module, shape = context.get("flops_module"), context.get("flops_shape")
        inputs = context.get("flops_input_shape")
        costs = None
        if self.other_backward and _flag(support, "OTHER_BACKWARD_FLOPS") and shape is not None:
            costs = backward_costs(op_type, _numel(shape),
                                   None if inputs is None else _numel(inputs), flops)
        if costs is None:
            # noted once per backward op analysed (no routine: no cost per step)
            self.unknown_backward[op_type] += 1
            self._unknown_modules["backward"].add(module)
            return
        key = (context.namespace, context.get_op_id(), str(context.get_backward_op_id()))
        if op_type not in RNN_ELEMENTWISE:   # an RNN's first gradient is not its output's
            context.insert_before_backward_op(self._check_backward, grad_outputs=[0], key=key,
                                              op_type=op_type, numel=_numel(shape))
        context.insert_after_backward_op(self._count_gradients, key=key, op_type=op_type,
                                         module=module, costs=costs)

    def _note_module(self, context, support, module):
        """Remember the module's parameters (the op's inputs that are
        parameters) and the output shape of its latest op (analysis runs in
        execution order, so at the end: its last op's)."""
        if module is None:
            return
        entry = self._modules.setdefault(module, {"params": {}, "shape": None, "last": -1})
        entry["params"].update(_parameters(context.get_inputs(), support))
        outputs = context.get_outputs()
        self._analysed += 1
        if outputs:
            entry["shape"], entry["last"] = _shape(outputs[0], support), self._analysed

    @staticmethod
    def _compute(formula, op_type, context, support):
        ins = [_shape(t, support) for t in context.get_inputs()]
        outs = [_shape(t, support) for t in context.get_outputs()]
        return _apply(formula, op_type, ins, outs[0] if outs else None, context.get_op(),
                      _words(context.namespace))

    def _count_at_run_time(self, context, formula, op_type, module, support):
        """ONNX ops whose shapes are not static: routines receive the arrays
        the formula needs and count from their shapes. False when a needed
        tensor cannot be handed to a Python routine (float16, unknown type)."""
        inputs, outputs = context.get_inputs(), context.get_outputs()
        needed = _needed_inputs(formula, op_type)
        values = list(inputs[:needed]) + list(outputs[:1])
        if len(inputs) < needed or not outputs or any(not support.hosted(v) for v in values):
            return False
        key = (context.namespace, context.get_op_id())
        self._dynamic[key] = (formula, op_type, module, context.get_op(), len(inputs),
                              _words(context.namespace))
        self.records[key] = {"name": context.get_op_name(), "type": op_type, "module": module,
                             "flops": None, "calls": 0, "dynamic": True}
        if needed:
            context.insert_before_op(self._stash_shapes, inputs=list(range(needed)), key=key)
        context.insert_after_op(self._count_dynamic, outputs=[0], key=key)
        return True

    # -- instrumentation routines (observe only) -----------------------------
    def _count(self, *tensors, key, op_type, module, flops, shape=None):
        if shape is not None and tensors and _shape(tensors[0]) not in (None, shape):
            # never a stale count: listed (see docs/tools/flops.md)
            self.unknown[f"{op_type} (shape changed)"] += 1
            return
        self.records[key]["calls"] += 1
        self._add("forward", op_type, module, flops)

    def _count_backward(self, *tensors, op_type, module, flops, numel=None):
        # numel, not shape: autograd may see the output through a view (a 3-D
        # linear's MmBackward0 gets a 2-D gradient)
        if numel is not None and tensors and tensors[0] is not None \
                and tensors[0].numel() != numel:
            self.unknown[f"{op_type} backward (shape changed)"] += 1
            return
        self._add("backward", op_type, module, flops)

    def _check_backward(self, grad, key, op_type, numel):
        if grad is not None and grad.numel() != numel:
            self.unknown[f"{op_type} backward (shape changed)"] += 1
            self._skip.add(key)

    def _count_operands(self, *grads, key, op_type, module, flops):
        if key is not None and key in self._skip:
            self._skip.discard(key)
            return
        computed = sum(g is not None for g in grads)
        self._add("backward", op_type, module, computed * flops)

    def _add(self, phase, op_type, module, flops):
        if flops:
            self._flops[phase][op_type] += flops
            self._by_module[phase][module] += flops
        self._ran[phase][op_type] += 1
        self._ran_modules[phase].add(module)

    def _count_unknown(self, *tensors, label, op_type=None, module=None):
        self.unknown[label] += 1
        self._unknown_types["forward"][op_type or label] += 1
        self._unknown_modules["forward"].add(module)

    def _count_gradients(self, *grads, key, op_type, module, costs):
        if key in self._skip:
            self._skip.discard(key)
            return
        flops = sum(costs[min(i, len(costs) - 1)] for i, g in enumerate(grads) if g is not None)
        self._add("backward", op_type, module, flops)

    def _stash_shapes(self, *arrays, key):
        self._pending[key] = [tuple(a.shape) for a in arrays]

    def _count_dynamic(self, output, key):
        formula, op_type, module, op, count, words = self._dynamic[key]
        ins = self._pending.pop(key, [])
        ins = ins + [None] * (count - len(ins))
        flops = _apply(formula, op_type, ins, tuple(output.shape), op, words)
        if flops is None:
            self.unknown[f"{op_type} (shape unknown)"] += 1
            return
        record = self.records[key]
        record["flops"] = flops
        record["calls"] += 1
        self._add("forward", op_type, module, flops)

    # -- report --------------------------------------------------------------
    def _phases(self, phase):
        if phase == "all":
            return ("forward", "backward")
        if phase not in ("forward", "backward"):
            raise ValueError(f"phase must be 'forward', 'backward' or 'all', got {phase!r}")
        return (phase,)

    def total(self, phase="all"):
        """Total FLOPs counted: ``phase`` is "forward", "backward" or "all"."""
        return sum(sum(self._flops[p].values()) for p in self._phases(phase))

    def by_type(self, phase="all"):
        """Canonical op type -> FLOPs, largest first."""
        return self._merge(self._flops, phase)

    def unknown_types(self, phase="all"):
        """Op type -> executions without a FLOP formula in ``phase`` (their
        counts are not in the totals: shown as ``?``, never as 0)."""
        merged = Counter()
        for p in self._phases(phase):
            merged.update(self.unknown_backward if p == "backward" else self._unknown_types[p])
        return dict(sorted(merged.items()))

    def ran(self, phase):
        """Op type -> executions counted in ``phase`` ("forward" or
        "backward"); a type with a 0 count that is not here never ran in that
        phase (e.g. no gradient reached it)."""
        return dict(self._ran[phase])

    def by_module(self, phase="all"):
        """Module path (PyTorch; TF: the op's name scope) -> FLOPs, largest
        first. Ops outside any module are under None."""
        return self._merge(self._by_module, phase)

    def _merge(self, table, phase):
        merged = Counter()
        for p in self._phases(phase):
            merged.update(table[p])
        return dict(sorted(merged.items(), key=lambda item: -item[1]))

    def modules(self, max_depth=None):
        """FLOPs per module, with every module's children summed into it.

        One row per module path seen (PyTorch module path; TF name scope;
        ONNX: the exporter's node-name scopes) and per ancestor of one, the
        root (``""``) first, in the order the modules first ran. Ops outside
        any module are not in it (see :meth:`by_module`, key None).

        Args:
            max_depth: leave out rows deeper than this (the root is 0);
                their numbers still add up in their ancestors.

        Returns:
            A list of dicts ``{"module", "depth", "parameters",
            "output_shape", "forward", "backward", "forward_unknown",
            "backward_unknown"}`` (``*_unknown``: an op of the module or of a
            descendant has no formula in that phase, so its count is a lower
            bound; ``*_ran``: an op of it was counted in that phase):
            ``parameters`` counts
            the elements of the parameters the module's ops read (each
            once), ``output_shape`` is the shape of the first output of the
            module's last op.
        """
        rows, params = {}, {}
        for module, entry in self._modules.items():
            namespace_sep = "/" if "/" in module else "."
            parts = module.split(namespace_sep) if module else []
            for depth in range(len(parts) + 1):
                path = namespace_sep.join(parts[:depth])
                row = rows.setdefault(path, {"module": path, "depth": depth, "parameters": 0,
                                             "output_shape": None, "forward": 0, "backward": 0,
                                             "forward_unknown": False,
                                             "backward_unknown": False, "forward_ran": False,
                                             "backward_ran": False, "last": -1})
                params.setdefault(path, {}).update(entry["params"])
                if entry["last"] > row["last"]:
                    row["output_shape"], row["last"] = entry["shape"], entry["last"]
                for phase in ("forward", "backward"):
                    row[phase] += self._by_module[phase].get(module, 0)
                    if module in self._unknown_modules[phase]:
                        row[f"{phase}_unknown"] = True
                    if module in self._ran_modules[phase]:
                        row[f"{phase}_ran"] = True
        result = []
        for path, row in rows.items():
            row["parameters"] = sum(params[path].values())
            del row["last"]
            if max_depth is None or row["depth"] <= max_depth:
                result.append(row)
        return result

    def module_table(self, max_depth=None):
        """:meth:`modules` as text: the module tree indented, parameters and
        FLOPs in K/M/G/T units."""
        rows = self.modules(max_depth)
        labels = [("  " * r["depth"]) + (r["module"] or "model") for r in rows]
        cells = [[label, format_count(r["parameters"]),
                  "-" if r["output_shape"] is None else str(tuple(r["output_shape"])),
                  format_count(r["forward"]), format_count(r["backward"])]
                 for label, r in zip(labels, rows)]
        headers = ["module", "parameters", "output shape", "forward FLOPs", "backward FLOPs"]
        widths = [max(len(line[i]) for line in [headers] + cells) for i in range(5)]
        lines = ["  ".join(f"{c:{'<' if i < 1 else '>'}{w}}"
                           for i, (c, w) in enumerate(zip(line, widths))).rstrip()
                 for line in [headers] + cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def reset(self):
        """Forget all counts (the analysis stays cached: ops keep counting)."""
        for table in (self._flops, self._by_module):
            for p in table.values():
                p.clear()
        for record in self.records.values():
            record["calls"] = 0
        self.unknown.clear()
        self._unknown_types["forward"].clear()
        self._unknown_modules["forward"].clear()
        for phase in ("forward", "backward"):
            self._ran[phase].clear()
            self._ran_modules[phase].clear()
        self._pending.clear()

    def table(self, top=None):
        """A readable text report: FLOPs by type (forward/backward), totals and
        unknown op types."""
        forward, backward = self._flops["forward"], self._flops["backward"]
        types = sorted(set(forward) | set(backward),
                       key=lambda t: -(forward.get(t, 0) + backward.get(t, 0)))
        if top is not None:
            types = types[:top]
        width = max([len("type")] + [len(t) for t in types])
        lines = [f"{'type':<{width}}  {'forward':>16}  {'backward':>16}",
                 f"{'-' * width}  {'-' * 16}  {'-' * 16}"]
        for t in types:
            lines.append(f"{t:<{width}}  {forward.get(t, 0):>16,}  {backward.get(t, 0):>16,}")
        lines.append(f"{'-' * width}  {'-' * 16}  {'-' * 16}")
        lines.append(f"{'total':<{width}}  {self.total('forward'):>16,}  "
                     f"{self.total('backward'):>16,}")
        if self.unknown:
            listed = ", ".join(f"{t} x{n}" for t, n in sorted(self.unknown.items()))
            lines.append(f"unknown (not counted): {listed}")
        if self.unknown_backward:
            listed = ", ".join(f"{t} x{n}" for t, n in sorted(self.unknown_backward.items()))
            lines.append(f"unknown backward (not counted): {listed}")
        return "\n".join(lines)

    def __repr__(self):
        return (f"FlopsProfiler(forward={self.total('forward'):,}, "
                f"backward={self.total('backward'):,}, unknown={len(self.unknown)} types)")
