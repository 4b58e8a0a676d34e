"""Compiled PyTorch: backward points inside AOTAutograd's backward graphs
(amanda.runtime.pytorch.compiled.backward; docs/pytorch-compiled.md,
"Backward points").

Differential: a training step (forward, ``loss.backward()``, SGD step, two
steps) of a small MLP (the loss compiled with it) and a small conv net (the
module compiled, the loss eager) under the same tool, eagerly and compiled:
the (op id, backward op id, point) executions, the values the routines see
and the parameters after the steps are eager's, bit for bit on
``aot_eager``; on inductor the documented mapping and a tolerance.
"""

import collections
import copy
import warnings

import pytest

torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402

import amanda  # noqa: E402
from amanda.runtime.pytorch import compiled as pytorch_compiled  # noqa: E402
from amanda.runtime.pytorch.compiled import backward  # noqa: E402
from amanda.tools.coverage import CoverageTool  # noqa: E402
from amanda.tools.debugging import NanDetector  # noqa: E402
from amanda.tools.flops import FlopsProfiler  # noqa: E402
from amanda.tools.identity import IdentityTool  # noqa: E402
from amanda.tools.profiler import OpProfiler  # noqa: E402
from amanda.tools.pruning import Pruner  # noqa: E402
from amanda.tools.quantization import QuantizationTool  # noqa: E402

pytestmark = pytest.mark.usefixtures("compiled_path_fresh_dynamo")   # tests/conftest.py


# -- tools ------------------------------------------------------------------------------------

class CountBackward(amanda.Tool):
    """A routine before and after every backward op, keeping a copy of what it sees."""

    def __init__(self):
        super().__init__()
        self.executions = collections.Counter()
        self.values = collections.defaultdict(list)
        self.names = {}
        self.add_inst_for_op(self.before, backward=True)
        self.add_inst_for_op(self.after, backward=True, require_outputs=True)

    def _key(self, context, point):
        key = (context.get_op_id(), context.get_backward_op_id(), point)
        op = context.get_backward_op()
        self.names[key] = (context.get_op_name(), op.name(), op.index)
        return key

    def before(self, context):
        context.insert_before_backward_op(self.seen, key=self._key(context, "before"))

    def after(self, context):
        context.insert_after_backward_op(self.seen, key=self._key(context, "after"))

    def seen(self, *grads, key):
        self.executions[key] += 1
        self.values[key].append([None if g is None else g.clone() for g in grads])


class Identity(amanda.Tool):
    """Returns new copies of its tensors at all four points (forward before
    and after, backward before and after): every point replaces, by equal
    values."""

    def __init__(self):
        super().__init__()
        self.add_inst_for_op(self.forward_before)
        self.add_inst_for_op(self.forward_after, require_outputs=True)
        self.add_inst_for_op(self.backward_before, backward=True)
        self.add_inst_for_op(self.backward_after, backward=True, require_outputs=True)

    def forward_before(self, context):
        context.insert_before_op(_copies)

    def forward_after(self, context):
        context.insert_after_op(_copies)

    def backward_before(self, context):
        context.insert_before_backward_op(_copies)

    def backward_after(self, context):
        context.insert_after_backward_op(_copies)


def _copies(*tensors):
    return [None if t is None else t.clone() for t in tensors]


class MaskGradients(amanda.Tool):
    """Multiplies gradients by fixed masks: the gradient flowing into every
    ``ReluBackward0`` (a group's incoming gradient) and every parameter's
    gradient before it is accumulated (``AccumulateGrad``, as a pruner does)."""

    def __init__(self):
        super().__init__()
        self.add_inst_for_op(self.analysis, backward=True)

    def analysis(self, context):
        name = context.get_backward_op().name()
        if name in ("ReluBackward0", "AccumulateGrad"):
            grad = context.get_grad_outputs()[0]
            context.insert_before_backward_op(_masked, mask=_mask(grad))


def _mask(tensor):
    return (torch.arange(tensor.numel()) % 3 != 0).reshape(tensor.shape).to(tensor.dtype)


def _masked(grad, mask):
    return grad * mask


# -- programs ---------------------------------------------------------------------------------

class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _conv_net():
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(4 * 6 * 6, 5))


def _mlp_program(backend):
    """The MLP with its loss compiled together (the tangent is the loss')."""
    torch.manual_seed(0)
    model = MLP()

    def loss_of(x, y):
        return torch.nn.functional.cross_entropy(model(x), y)
    run = torch.compile(loss_of, backend=backend) if backend else loss_of
    torch.manual_seed(1)
    data = (torch.randn(6, 8), torch.tensor([0, 1, 2, 3, 0, 1]))
    return model, run, data


def _conv_program(backend):
    """The conv net compiled, its loss eager."""
    torch.manual_seed(0)
    model = _conv_net()
    compiled = torch.compile(model, backend=backend) if backend else model

    def run(x, y):
        return torch.nn.functional.cross_entropy(compiled(x), y)
    torch.manual_seed(1)
    data = (torch.randn(2, 3, 8, 8), torch.tensor([1, 2]))
    return model, run, data


class Reuse(torch.nn.Module):
    """A linear whose output four ops read (``benchmarks/compiled.py``'s
    pointwise chain): its gradient is a sum of four."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        x = self.fc(x)
        return torch.relu(x * 1.5 + 0.25) - x.abs() * 0.5 + torch.clamp(x, -1, 1) * x


def _reuse_program(backend):
    """`Reuse` with an MSE loss, compiled together."""
    torch.manual_seed(0)
    model = Reuse()

    def loss_of(x, y):
        return torch.nn.functional.mse_loss(model(x), y)
    run = torch.compile(loss_of, backend=backend) if backend else loss_of
    torch.manual_seed(1)
    data = (torch.randn(6, 8), torch.randn(6, 8))
    return model, run, data


class TanhGelu(torch.nn.Module):
    """GPT-2's ``gelu_new`` after a linear, then dropout with ``p=0`` in
    training: ``1.0 + tanh(...)`` is recomputed by AOTAutograd's
    partitioner in the backward graph (a group of forward values only),
    and dropout hands its input back eagerly (no backward op) where
    AOTAutograd's graph has a ``clone``."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        x = self.fc(x)
        x = 0.5 * x * (1.0 + torch.tanh(0.8 * (x + 0.044715 * torch.pow(x, 3.0))))
        return torch.nn.functional.dropout(x, p=0.0, training=True)


def _gelu_program(backend):
    torch.manual_seed(0)
    model = TanhGelu()

    def loss_of(x, y):
        return torch.nn.functional.mse_loss(model(x), y)
    run = torch.compile(loss_of, backend=backend) if backend else loss_of
    torch.manual_seed(1)
    data = (torch.randn(6, 8), torch.randn(6, 8))
    return model, run, data


PROGRAMS = {"mlp": _mlp_program, "conv": _conv_program}
#: programs a few tests run besides PROGRAMS
MORE_PROGRAMS = {"reuse": _reuse_program, "gelu": _gelu_program}


def _train(program, backend, tool, steps=2):
    """Runs ``steps`` SGD steps inside ``apply(tool)`` (no tool: outside
    amanda; a tuple: those tools together); returns the model and the
    gradients of the last step. An eager fallback is an error."""
    tools = tool if isinstance(tool, tuple) else (tool,)
    model, run, (x, y) = {**PROGRAMS, **MORE_PROGRAMS}[program](backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fallbacks = copy.copy(pytorch_compiled.EAGER_FALLBACKS)
    with warnings.catch_warnings():
        warnings.simplefilter("error", amanda.EagerFallbackWarning)
        for _ in range(steps):
            optimizer.zero_grad()
            if tool is None:
                loss = run(x, y)
                loss.backward()
            else:
                with amanda.apply(*tools):
                    loss = run(x, y)
                    loss.backward()
            grads = [p.grad.clone() for p in model.parameters()]
            optimizer.step()
    assert pytorch_compiled.EAGER_FALLBACKS == fallbacks
    return model, grads


def _same(a, b, exact=True):
    if a is None or b is None:
        return a is None and b is None
    if exact:
        return a.shape == b.shape and torch.equal(a, b)
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def _same_parameters(a, b, exact=True):
    return all(_same(p, q, exact) for p, q in zip(a.parameters(), b.parameters()))


# -- aot_eager: eager's points and values, bit for bit ----------------------------------------

@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_counting_tool_sees_eagers_backward_points_and_values(program):
    eager, compiled = CountBackward(), CountBackward()
    eager_model, _ = _train(program, None, eager)
    compiled_model, _ = _train(program, "aot_eager", compiled)
    assert compiled.executions == eager.executions
    assert compiled.names == eager.names
    assert {n[1] for n in eager.names.values()} >= {"AccumulateGrad", "ReluBackward0",
                                                     "AddmmBackward0", "TBackward0"}
    for key, seen in eager.values.items():
        got = compiled.values[key]
        assert len(got) == len(seen)
        for mine, theirs in zip(got, seen):
            assert len(mine) == len(theirs), (eager.names[key], key[2])
            assert all(_same(a, b) for a, b in zip(mine, theirs)), (eager.names[key], key[2])
    assert _same_parameters(compiled_model, eager_model)


@pytest.mark.parametrize("program", sorted(MORE_PROGRAMS))
def test_sums_of_gradients_and_pass_through_ops_have_eagers_points(program):
    """A value read by four ops, and ops that hand their gradient on
    unchanged. AOTAutograd tagged the sums of the value's gradients with
    the loss' ``seq_nr``, they were put in the loss' group, and its points
    read gradients they made themselves (a cycle: the backward graph could
    not be ordered, every tool with backward routines failed on
    benchmarks/compiled.py's model). ``AddBackward0`` (``a + b``, ``x +
    0.25``) has no node in the backward graph and had no points, the
    pass-through side of ``SubBackward0`` had None for its gradient, and
    the loss' gradient was not matched to its slot. Now the counting
    tool's executions and values (before and after every backward op) and
    the parameters are eager's, bit for bit. ``gelu``: a group of
    recomputed forward values only (``1.0 + tanh``) had no points, and
    dropout with ``p=0`` had a ``CloneBackward0`` eager does not have."""
    eager, compiled = CountBackward(), CountBackward()
    eager_model, _ = _train(program, None, eager)
    compiled_model, _ = _train(program, "aot_eager", compiled)
    assert compiled.executions == eager.executions
    assert compiled.names == eager.names
    assert {n[1] for n in eager.names.values()} >= {"MseLossBackward0", "MulBackward0", "AddBackward0"}
    for key, seen in eager.values.items():
        got = compiled.values[key]
        assert len(got) == len(seen)
        for mine, theirs in zip(got, seen):
            assert len(mine) == len(theirs), (eager.names[key], key[2])
            assert all(_same(a, b) for a, b in zip(mine, theirs)), (eager.names[key], key[2])
    assert _same_parameters(compiled_model, eager_model)


@pytest.mark.parametrize("program", sorted(MORE_PROGRAMS))
def test_masked_gradients_through_pass_through_ops(program):
    """A routine replacing the gradient into every ``AddBackward0`` (a
    backward op of no node) changes what flows on, as eagerly."""
    eager_model, eager_grads = _train(program, None, MaskAdds())
    model, grads = _train(program, "aot_eager", MaskAdds())
    vanilla_model, _ = _train(program, "aot_eager", None)
    assert all(_same(a, b) for a, b in zip(grads, eager_grads))
    assert _same_parameters(model, eager_model)
    assert not _same_parameters(model, vanilla_model)


class MaskAdds(amanda.Tool):
    """Halves the gradient flowing into every ``AddBackward0``, and doubles
    its second produced gradient where it has one."""

    def __init__(self):
        super().__init__()
        self.add_inst_for_op(self.analysis, backward=True)

    def analysis(self, context):
        if context.get_backward_op().name() == "AddBackward0":
            context.insert_before_backward_op(_halved)
            context.insert_after_backward_op(_doubled_second)


def _halved(grad):
    return grad * 0.5


def _doubled_second(*grads):
    return [None if i != 1 or g is None else g * 2 for i, g in enumerate(grads)]


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_identity_routines_keep_gradients_bit_exact(program):
    vanilla_model, vanilla_grads = _train(program, "aot_eager", None)
    model, grads = _train(program, "aot_eager", Identity())
    assert all(_same(a, b) for a, b in zip(grads, vanilla_grads))
    assert _same_parameters(model, vanilla_model)
    eager_model, _ = _train(program, None, Identity())
    assert _same_parameters(model, eager_model)


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_masked_gradients_train_as_eagerly(program):
    eager_model, eager_grads = _train(program, None, MaskGradients())
    model, grads = _train(program, "aot_eager", MaskGradients())
    vanilla_model, _ = _train(program, "aot_eager", None)
    assert all(_same(a, b) for a, b in zip(grads, eager_grads))
    assert _same_parameters(model, eager_model)
    assert not _same_parameters(model, vanilla_model)      # the masks did something
    # a masked entry of a weight's gradient is 0 (its mask's zeros: every third)
    weight_grad = grads[0].flatten()
    assert torch.count_nonzero(weight_grad[::3]) == 0 and torch.count_nonzero(weight_grad) > 0


def test_points_are_in_the_backward_graph_of_an_aot_autograd_backend():
    """A user's ``aot_autograd(...)`` backend: its backward compiler receives
    the graph with amanda's points, and the counts are eager's."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    graphs = []

    def backward_compiler(gm, example_inputs):
        graphs.append(gm.code)
        return boxed_nop(gm, example_inputs)
    backend = aot_autograd(fw_compiler=boxed_nop, bw_compiler=backward_compiler)
    eager, compiled = CountBackward(), CountBackward()
    _train("conv", None, eager)
    _train("conv", backend, compiled)
    assert len(graphs) == 1 and "amanda.backward_point" in graphs[0]
    assert compiled.executions == eager.executions


class CountBackwardAfterIdentity(CountBackward):
    """`CountBackward` beside forward routines that replace every op's
    inputs and outputs by copies (straight-through for autograd)."""

    def __init__(self):
        super().__init__()
        self.add_inst_for_op(self.forward)
        self.add_inst_for_op(lambda context: context.insert_after_op(_copies), require_outputs=True)

    def forward(self, context):
        context.insert_before_op(_copies)
        context.insert_before_op(self.count, key=(context.get_op_id(), None, "forward"))

    def count(self, *tensors, key):
        self.executions[key] += 1


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_forward_replacements_leave_eagers_backward_points(program):
    """Forward routines that replace a parameter input change no backward
    op: eager's accumulator keeps the name of the input it accumulates
    into (``input1``), and the compiled path sees through
    ``amanda::replace`` to the same input. The forward points are eager's
    too: the compiled backward graph's own calls (``aten.mm``...), made
    while ``loss.backward()`` runs under amanda's eager mode, are no ops."""
    eager, compiled = CountBackwardAfterIdentity(), CountBackwardAfterIdentity()
    eager_model, _ = _train(program, None, eager)
    compiled_model, _ = _train(program, "aot_eager", compiled)
    plain = CountBackward()
    _train(program, None, plain)
    assert set(eager.names.values()) == set(plain.names.values())
    assert compiled.executions == eager.executions
    assert _same_parameters(compiled_model, eager_model)


def _tool_summary(name, tool):
    """What each of amanda's tools computed, to compare with eager's."""
    if name == "pruner":
        return {layer.op_id: np.asarray(layer.mask).tobytes() for layer in tool.layers.values()}
    if name == "flops":
        # keyed by (namespace, op id[, backward op id]): the namespaces differ
        return {key[1:]: (r["type"], r["flops"], r["calls"]) for key, r in tool.records.items()}
    if name == "nan":
        return tool.executions, tool.report
    if name == "qat":
        # scales and zero points by (op id, weight | activation), after the steps
        return {(key[1], kind): tuple(np.asarray(t).tobytes() for t in (q.scale, q.zero_point))
                for (key, kind), q in tool.qparams.items()}
    if name.startswith("identity"):
        return dict(tool.calls)
    if name == "profiler":
        # every timed execution: what was timed, not how long it took
        return collections.Counter(
            (i.phase, i.name, i.type, i.op_id, i.backward_op_id, i.module, str(i.shapes))
            for i, _, _ in tool.events)
    return dict(tool.forward), dict(tool.backward)


TOOLS = {"pruner": lambda: Pruner("unstructured", sparsity=0.5, mask_grads=True),
         "flops": lambda: FlopsProfiler(backward=True),
         "nan": NanDetector,
         "coverage": CoverageTool,
         # QAT: fake-quantized weights and activations (portable routines whose
         # scale and zero point the Python trackers before them update in place),
         # straight-through gradients
         "qat": QuantizationTool,
         "profiler": OpProfiler,
         # routines handing back what they received at all four points
         "identity": IdentityTool,
         "identity-portable": lambda: IdentityTool(portable=True)}


@pytest.mark.parametrize("program", sorted(PROGRAMS))
@pytest.mark.parametrize("name", sorted(TOOLS))
def test_amandas_backward_tools_compute_eagers_answer(name, program):
    """amanda's tools with backward routines in a compiled training step
    (``aot_eager``): the pruner's masks and its masked gradients, the FLOPs
    table with backward ops, the NaN finder's checks, the coverage counts,
    QAT's scales and zero points, the profiler's timed executions, the
    identity tool's calls and the parameters after the steps are eager's,
    bit for bit; identity tools leave compiled vanilla's gradients."""
    eager, compiled = TOOLS[name](), TOOLS[name]()
    eager_model, eager_grads = _train(program, None, eager)
    model, grads = _train(program, "aot_eager", compiled)
    recorded = _tool_summary(name, eager)
    if name != "identity-portable":                        # (a portable one counts nothing)
        assert recorded and (name != "identity" or all(recorded.values()))
    assert _tool_summary(name, compiled) == _tool_summary(name, eager)
    assert all(_same(a, b) for a, b in zip(grads, eager_grads))
    assert _same_parameters(model, eager_model)
    if name in ("pruner", "qat", "identity", "identity-portable"):
        vanilla_model, vanilla_grads = _train(program, "aot_eager", None)
        if name.startswith("identity"):                    # bit-exact to compiled vanilla
            assert all(_same(a, b) for a, b in zip(grads, vanilla_grads))
            assert _same_parameters(model, vanilla_model)
        else:                                              # the tool changed the step
            assert not _same_parameters(model, vanilla_model)


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_accumulations_are_eagers_beside_a_pruner(program):
    """The pruner masks each weight with a portable routine (``weight *
    mask`` traced into the graph), whose results carry no value in the
    graph: the owner of the weight's ``AccumulateGrad`` read them as no
    tensor, so the weight had no ``AccumulateGrad`` points and the bias had
    the weight's (``input1`` for ``input2``). Seen through the routine's
    call, both are eager's."""
    def tools():
        return CountBackward(), Pruner("unstructured", sparsity=0.5, mask_grads=True)
    eager, compiled = tools(), tools()
    eager_model, _ = _train(program, None, eager)
    model, _ = _train(program, "aot_eager", compiled)
    assert compiled[0].executions == eager[0].executions
    assert compiled[0].names == eager[0].names
    indices = {n[2] for n in eager[0].names.values() if n[1] == "AccumulateGrad"}
    assert indices == {"input1", "input2"}
    assert _same_parameters(model, eager_model)


class CountForward(amanda.Tool):
    """Forward routines only: a count before every op."""

    def __init__(self):
        super().__init__()
        self.executions = collections.Counter()
        self.add_inst_for_op(self.analysis)

    def analysis(self, context):
        context.insert_before_op(self.count, key=(context.get_op_id(), context.get_op_name()))

    def count(self, *tensors, key):
        self.executions[key] += 1


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_compiled_backward_graphs_are_no_forward_ops(program, backend):
    """Tools without backward routines: ``loss.backward()`` inside ``apply``
    runs under amanda's eager mode, and the compiled backward graph's own
    calls (``aten.t``, ``aten.mm``, inductor's ``mm`` and
    ``convolution_backward``) were forward points with made-up ids (a
    counting tool saw 3 (inductor) to 22 (aot_eager) of them per step); the backward graph now runs
    outside that mode."""
    eager, compiled = CountForward(), CountForward()
    _train(program, None, eager)
    _train(program, backend, compiled)
    assert compiled.executions == eager.executions


def test_other_compilers_still_fall_back_loudly():
    """Backend ``eager`` runs no AOTAutograd: a tool with backward routines
    runs the callable eagerly, with a warning that says why."""
    tool = CountBackward()
    model, run, (x, y) = _conv_program("eager")
    with pytest.warns(amanda.EagerFallbackWarning, match="backward routines.*compiler"):
        with amanda.apply(tool):
            run(x, y).backward()
    eager = CountBackward()
    _train("conv", None, eager, steps=1)
    assert tool.executions == eager.executions


# -- inductor: the documented mapping, within a tolerance -------------------------------------

#: backward ops eager has that inductor's backward graph does not: it
#: decomposes ``t`` into ``permute`` and computes the weight's gradient in
#: ``addmm``'s group (docs/pytorch-compiled.md, "Backward points")
_INDUCTOR_MERGED = {"TBackward0"}


def test_inductor_runs_backward_tools_eagerly_and_says_so_by_default():
    """Off by default (a gradient-masking routine would miss the weights of
    linears on inductor, see INDUCTOR_BACKWARD): eager's answer, loudly."""
    tool = CountBackward()
    model, run, (x, y) = _conv_program("inductor")
    with pytest.warns(amanda.EagerFallbackWarning, match="INDUCTOR_BACKWARD"):
        with amanda.apply(tool):
            run(x, y).backward()
    eager = CountBackward()
    _train("conv", None, eager, steps=1)
    assert tool.executions == eager.executions


@pytest.mark.slow
def test_inductor_counts_and_training_follow_the_documented_mapping(monkeypatch):
    monkeypatch.setattr(backward, "INDUCTOR_BACKWARD", True)
    eager, compiled = CountBackward(), CountBackward()
    eager_model, _ = _train("conv", None, eager)
    compiled_model, _ = _train("conv", "inductor", compiled)
    missing = {eager.names[k][1] for k in set(eager.executions) - set(compiled.executions)}
    assert missing <= _INDUCTOR_MERGED
    assert set(compiled.executions) <= set(eager.executions)
    assert all(compiled.executions[k] == eager.executions[k] for k in compiled.executions)
    assert _same_parameters(compiled_model, eager_model, exact=False)
    masked_eager, _ = _train("conv", None, MaskGradients())
    masked, _ = _train("conv", "inductor", MaskGradients())
    assert _same_parameters(masked, masked_eager, exact=False)


# -- idle points leave the graph (aot_eager) --------------------------------------------------

class _OpNames(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the name of every op dispatched (the backward graph's too)."""

    def __init__(self):
        super().__init__()
        self.names = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class CountRelu(amanda.Tool):
    """Observes the gradient into every ``ReluBackward0`` (nothing else)."""

    def __init__(self):
        super().__init__()
        self.executions = collections.Counter()
        self.add_inst_for_op(self.analysis, backward=True)

    def analysis(self, context):
        if context.get_backward_op().name() == "ReluBackward0":
            context.insert_before_backward_op(self.seen, key=context.get_backward_op_id())

    def seen(self, grad, key):
        self.executions[key] += 1


def _points_per_step(tool, steps=3):
    """The amanda point ops each backward of ``steps`` MLP steps ran (aot_eager)."""
    model, run, (x, y) = _mlp_program("aot_eager")
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", amanda.EagerFallbackWarning)
        for _ in range(steps):
            with amanda.apply(tool):
                loss = run(x, y)
                with _OpNames() as names:
                    loss.backward()
            seen.append({k: v for k, v in names.names.items() if k.startswith("amanda.")})
    return seen


def test_idle_points_leave_the_backward_graph_after_their_analysis():
    """After the first backward, every point whose analysis recorded no
    action is taken out and an observing one passes no gradient
    (`backward._Slimmer`): analysis only leaves no amanda op in the
    backward graph, an observer of ``ReluBackward0`` one
    ``amanda::backward_observe`` and no copying point; the observer still
    runs at every step, as eagerly."""
    from amanda.tools.identity import AnalysisOnlyTool
    first, *later = _points_per_step(AnalysisOnlyTool())
    assert first.get("amanda.backward_point", 0) > 10
    assert all(step == {} for step in later)
    tool = CountRelu()
    first, *later = _points_per_step(tool)
    assert first.get("amanda.backward_point", 0) > 10
    assert all(step == {"amanda.backward_observe": 1} for step in later)
    eager = CountRelu()
    _train("mlp", None, eager, steps=3)
    assert tool.executions == eager.executions and sum(eager.executions.values()) == 3
    # routines that replace (new copies at every point): plain calls, no copying op
    first, *later = _points_per_step(Identity())
    assert first.get("amanda.backward_point", 0) > 10
    assert all("amanda.backward_point" not in step for step in later)


class ChainOnOneOp(amanda.Tool):
    """QAT's chain of routines before a linear: a portable routine replacing
    input 0, then a Python routine and a portable one selecting input 1 (the
    weight), each seeing what the previous one handed on."""

    def __init__(self):
        super().__init__()
        self.seen = []
        self.scale = torch.tensor(0.05)
        self.add_inst_for_op(self.analysis)

    def analysis(self, context):
        if context.get_op_name() != "linear":
            return
        context.insert_before_op(_half_input, inputs=[0])
        context.insert_before_op(self.look, inputs=[1])
        context.insert_before_op(_rounded, inputs=[1], scale=self.scale)
        context.insert_before_op(self.look, inputs=[0, 1])

    def look(self, *tensors):
        self.seen.append([t.detach().clone() for t in tensors])


_half_input = amanda.portable.routine(lambda x: x * 0.5)
_rounded = amanda.portable.routine(lambda w, scale: torch.round(w / scale) * scale)


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_a_routine_after_a_replacement_selects_eagers_positions(program):
    """A replacing routine's results were no tensors for the next routine's
    selection in a compiled graph (no example value): after input 0 was
    replaced, ``inputs=[1]`` received the bias instead of the weight."""
    eager, compiled = ChainOnOneOp(), ChainOnOneOp()
    eager_model, _ = _train(program, None, eager)
    model, _ = _train(program, "aot_eager", compiled)
    assert len(compiled.seen) == len(eager.seen) > 0
    for got, want in zip(compiled.seen, eager.seen):
        assert [t.shape for t in got] == [t.shape for t in want]
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert _same_parameters(model, eager_model)



class _WithPooler(torch.nn.Module):
    """Hidden states and a pooled output, as a transformer returns them."""

    def __init__(self, norm):
        super().__init__()
        self.body = torch.nn.Linear(6, 6)
        # a training batch norm: its running statistics are inputs the
        # compiled function mutates, outputs before the user's
        self.norm = torch.nn.BatchNorm1d(6) if norm else torch.nn.Identity()
        self.pool = torch.nn.Linear(6, 6)

    def forward(self, x):
        hidden = self.norm(torch.relu(self.body(x)))
        return hidden, torch.tanh(self.pool(hidden))


def test_a_backward_that_raised_leaves_no_note_for_another_function():
    """A compiled function's autograd node notes, in its pre-hook, which
    outputs got no gradient, for its backward graph to read. If the
    backward raises between the two (a user's hook on the node), the note
    must not reach the next compiled function's backward: there it would
    skip the points of an output that does get a gradient. Model A's
    backward raises with its pooler unused; model B (another compiled
    function, both outputs used) then runs its pooler's points as eagerly."""
    def step(model, run, tool, raising):
        with amanda.apply(tool):
            hidden, pooled = run(x)
            if raising:
                def fail(grads):
                    raise RuntimeError("the user's hook")
                hidden.grad_fn.register_prehook(fail)
                with pytest.raises(RuntimeError, match="the user's hook"):
                    (hidden ** 2).mean().backward()
                return
            ((hidden ** 2).mean() + pooled.sum()).backward()

    x = torch.randn(5, 6)
    results = {}
    for backend in (None, "aot_eager"):
        torch.manual_seed(0)
        first, second = _WithPooler(False).train(), _WithPooler(False).train()
        runs = [m if backend is None else torch.compile(m, backend=backend)
                for m in (first, second)]
        tool = CountBackward()
        step(first, runs[0], tool, raising=True)
        counted = CountBackward()
        step(second, runs[1], counted, raising=False)
        torch._dynamo.reset()
        results[backend] = counted
    eager, compiled = results[None], results["aot_eager"]
    pooler = {k for k, (op, name, _) in eager.names.items() if name == "TanhBackward0"}
    assert pooler and all(compiled.executions[k] == 1 for k in pooler)
    assert compiled.executions == eager.executions


@pytest.mark.parametrize("norm", [False, True], ids=["plain", "batch-norm"])
def test_an_output_the_step_does_not_use_has_no_backward_points(norm):
    """AOTAutograd's backward graph takes a gradient for the pooled output
    too, zeros where the loss does not read it; eager's engine never
    reaches the pooler's backward ops then. Six SGD steps, the pooler read
    in the fourth only: the same executions and values as eager, and the
    same parameters (docs/pytorch-compiled.md, "Outputs the step does not
    differentiate")."""
    results = {}
    for backend in (None, "aot_eager"):
        torch.manual_seed(0)
        model = _WithPooler(norm).train()
        x = torch.randn(5, 6)
        run = model if backend is None else torch.compile(model, backend=backend)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        tool = CountBackward()
        fallbacks = copy.copy(pytorch_compiled.EAGER_FALLBACKS)
        with warnings.catch_warnings():
            warnings.simplefilter("error", amanda.EagerFallbackWarning)
            for step in range(6):
                optimizer.zero_grad(set_to_none=False)
                with amanda.apply(tool):
                    hidden, pooled = run(x)
                    loss = (hidden ** 2).mean() + (pooled.sum() if step == 3 else 0)
                    loss.backward()
                optimizer.step()
        assert pytorch_compiled.EAGER_FALLBACKS == fallbacks
        torch._dynamo.reset()
        results[backend] = tool, model
    (eager, eager_model), (compiled, compiled_model) = results[None], results["aot_eager"]
    pooler = {k for k, (op, name, _) in eager.names.items() if name == "TanhBackward0"}
    assert pooler and all(eager.executions[k] == 1 for k in pooler)
    assert compiled.executions == eager.executions
    for key, seen in eager.values.items():
        assert all(_same(a, b) for want, got in zip(seen, compiled.values[key])
                   for a, b in zip(want, got)), eager.names[key]
    assert _same_parameters(compiled_model, eager_model)
    if norm:
        assert torch.equal(compiled_model.norm.running_mean, eager_model.norm.running_mean)
