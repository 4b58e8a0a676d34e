"""Compiled PyTorch: ``replace_op`` and ``replace_backward_op`` inside
compiled graphs (amanda.runtime.pytorch.compiled.lowering,
``_insert_replacement``; docs/pytorch-compiled.md, "Replacing ops").

Differential: the same tool on the eager model and on the compiled one
gives the same (op id, point) executions, the same outputs and the same
gradients (bit for bit on ``aot_eager`` and ``eager``, within a tolerance
on inductor), with no eager fallback; what compiled graphs cannot carry
still falls back, loudly.
"""

import collections
import copy
import warnings

import pytest

torch = pytest.importorskip("torch")

import amanda  # noqa: E402
from amanda import portable  # noqa: E402
from amanda.runtime.pytorch import compiled as pytorch_compiled  # noqa: E402

pytestmark = pytest.mark.usefixtures("compiled_path_fresh_dynamo")   # tests/conftest.py


# -- routines ---------------------------------------------------------------------------------

@portable.hosted
def _halved_plus_one(x):
    """A Python routine for a one-input, shape-keeping op (``gelu``)."""
    return x * 0.5 + 1


@portable.routine
def _portable_halved_plus_one(x):
    return x * 0.5 + 1


@portable.routine
def _portable_handed_back(x):
    """Hands its input back: the op becomes the identity (its gradient
    passes through, as eagerly)."""
    return x


@portable.hosted
def _linear_by_hand(x, weight, bias):
    """``linear`` computed by hand, a quarter added."""
    return torch.addmm(bias, x, weight.t()) + 0.25


@portable.hosted
def _swapped_halves(x):
    """For ``chunk(x, 2, -1)``: the two halves, each doubled, in reverse order."""
    a, b = x.chunk(2, -1)
    return [b * 2, a * 2]


# -- tools ------------------------------------------------------------------------------------

class Replacing(amanda.Tool):
    """Replaces the ops named in ``routines`` (op name -> (routine, inputs,
    ad)) and counts every forward op before and after (its op id, name and
    point), and, with ``backward``, every backward op."""

    def __init__(self, routines, backward=False):
        super().__init__()
        self.routines = routines
        self.executions = collections.Counter()
        self.calls = collections.Counter()
        self.add_inst_for_op(self.before)
        self.add_inst_for_op(self.after, require_outputs=True)
        if backward:
            self.add_inst_for_op(self.backward, backward=True)

    def before(self, context):
        name = context.get_op_name()
        context.insert_before_op(self.count, key=(context.get_op_id(), name, "before"))
        if name in self.routines:
            routine, inputs, ad = self.routines[name]
            if ad:
                with amanda.ad_enabled():
                    context.replace_op(routine, inputs=inputs)
            else:
                context.replace_op(routine, inputs=inputs)

    def after(self, context):
        context.insert_after_op(self.count, key=(context.get_op_id(), context.get_op_name(), "after"))

    def backward(self, context):
        key = (context.get_op_id(), context.get_backward_op_id(), context.get_backward_op().name())
        context.insert_before_backward_op(self.count, key=key)

    def count(self, *tensors, key):
        self.executions[key] += 1


# -- programs ---------------------------------------------------------------------------------

class Net(torch.nn.Module):
    """A linear, ``gelu``, ``chunk`` (two outputs), a second linear and a
    scale (which keeps a gradient when every linear is replaced)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(8, 4)
        self.scale = torch.nn.Parameter(torch.full((4,), 1.5))

    def forward(self, x):
        h = torch.nn.functional.gelu(self.fc1(x))
        a, b = h.chunk(2, -1)
        return self.fc2(a * b + a) * self.scale


def _run(backend, tool, steps=2, train=True):
    """``steps`` calls of ``Net`` (compiled with ``backend``; None: eager)
    inside ``apply(tool)``, each followed by ``backward`` and an SGD step
    when ``train``. Returns the outputs, the gradients (None where a
    parameter got none) and the model. An eager fallback is an error."""
    torch.manual_seed(0)
    model = Net()
    run = torch.compile(model, backend=backend) if backend else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    x, outputs, grads = torch.randn(6, 8), [], []
    fallbacks = copy.copy(pytorch_compiled.EAGER_FALLBACKS)
    with warnings.catch_warnings():
        warnings.simplefilter("error", amanda.EagerFallbackWarning)
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            with amanda.apply(tool):
                if train:
                    out = run(x)
                    out.square().mean().backward()
                else:
                    with torch.no_grad():
                        out = run(x)
            outputs.append(out.detach())
            grads.append({name: None if p.grad is None else p.grad.clone()
                          for name, p in model.named_parameters()})
            if train:
                optimizer.step()
    assert pytorch_compiled.EAGER_FALLBACKS == fallbacks
    return outputs, grads, model


def _same(a, b, exact=True):
    if a is None or b is None:
        return a is None and b is None
    if exact:
        return a.shape == b.shape and torch.equal(a, b)
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def _same_runs(got, expected, exact=True):
    (outputs, grads, model), (eager_outputs, eager_grads, eager_model) = got, expected
    assert all(_same(a, b, exact) for a, b in zip(outputs, eager_outputs))
    for mine, theirs in zip(grads, eager_grads):
        assert mine.keys() == theirs.keys()
        assert all(_same(mine[name], theirs[name], exact) for name in mine)
    assert all(_same(p, q, exact) for p, q in zip(model.parameters(), eager_model.parameters()))


#: op name -> (routine, inputs, ad): the replacements each case makes
CASES = {
    "python gelu": {"gelu": (_halved_plus_one, None, False)},
    "portable gelu": {"gelu": (_portable_halved_plus_one, None, False)},
    "portable identity": {"gelu": (_portable_handed_back, None, False)},
    "portable gelu, ad": {"gelu": (_portable_halved_plus_one, None, True)},
    "python linear": {"linear": (_linear_by_hand, None, False)},
    "python chunk": {"chunk": (_swapped_halves, [0], False)},
}


@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_replaced_ops_train_as_eagerly(case, backend):
    """Two training steps: the executions of every forward point (the
    replaced op's included), the outputs, the gradients (None where eager
    has none: a replaced op's inputs get no gradient through it unless
    the routine is differentiated) and the parameters are eager's, bit for
    bit, and differ from the model without the tool."""
    eager = Replacing(CASES[case])
    expected = _run(None, eager)
    compiled = Replacing(CASES[case])
    got = _run(backend, compiled)
    assert compiled.executions == eager.executions
    assert eager.executions and sum(eager.executions.values()) % 2 == 0
    _same_runs(got, expected)
    if case != "portable identity":
        vanilla_outputs = _run(backend, Replacing({}))[0]
        assert not torch.equal(got[0][0], vanilla_outputs[0])


@pytest.mark.parametrize("case", ["python gelu", "python linear", "portable gelu, ad", "python chunk"])
def test_replaced_ops_beside_backward_points(case):
    """The same, with the tool counting every backward op too (backward
    points, ``aot_eager``): a replaced op outside ``ad_enabled`` has no
    backward op, the accumulators belong to the ops eager gives them,
    and every (op id, backward op id, name) runs as often as eagerly."""
    eager = Replacing(CASES[case], backward=True)
    expected = _run(None, eager)
    compiled = Replacing(CASES[case], backward=True)
    got = _run("aot_eager", compiled)
    assert compiled.executions == eager.executions
    assert any(key[2] == "AccumulateGrad" for key in eager.executions)
    _same_runs(got, expected)


def test_replaced_op_has_no_gradient_unless_differentiated():
    """The check behind the gradients above: outside ``ad_enabled`` the
    first linear gets no gradient through the replaced ``gelu``; inside it
    does, and the replaced op hands its input's gradient on as the
    identity."""
    isolated = _run("aot_eager", Replacing(CASES["portable gelu"]))[1][0]
    differentiated = _run("aot_eager", Replacing(CASES["portable gelu, ad"]))[1][0]
    identity = _run("aot_eager", Replacing(CASES["portable identity"]))[1][0]
    assert isolated["fc1.weight"] is None and isolated["fc2.weight"] is not None
    assert differentiated["fc1.weight"] is not None and identity["fc1.weight"] is not None


@pytest.mark.parametrize("case", ["python gelu", "portable gelu", "python linear", "python chunk"])
def test_replaced_ops_under_inductor(case):
    """Forward only (``torch.no_grad``), inductor: eager's executions and
    outputs within a tolerance."""
    eager = Replacing(CASES[case])
    expected = _run(None, eager, train=False)
    compiled = Replacing(CASES[case])
    got = _run("inductor", compiled, train=False)
    assert compiled.executions == eager.executions
    assert all(_same(a, b, exact=False) for a, b in zip(got[0], expected[0]))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["python gelu", "portable gelu", "python chunk"])
def test_replaced_ops_train_under_inductor(case):
    """Two training steps on inductor (a tool without backward routines
    runs there compiled): eager's executions, outputs, gradients (None
    where eager has none) and parameters within a tolerance."""
    eager = Replacing(CASES[case])
    expected = _run(None, eager)
    compiled = Replacing(CASES[case])
    got = _run("inductor", compiled)
    assert compiled.executions == eager.executions
    _same_runs(got, expected, exact=False)


class CountBackwardReplacing(amanda.Tool):
    """Replaces every ``ReluBackward0`` by a routine computing the
    gradient from the incoming one (half of it where the input was
    positive); counts every backward op before and after."""

    def __init__(self):
        super().__init__()
        self.executions = collections.Counter()
        self.add_inst_for_op(self.backward, backward=True)

    def backward(self, context):
        key = (context.get_op_id(), context.get_backward_op_id())
        context.insert_before_backward_op(self.count, key=key + ("before",))
        context.insert_after_backward_op(self.count, key=key + ("after",))
        if context.get_backward_op().name() == "ReluBackward0":
            context.replace_backward_op(self.half_relu_grad)

    def half_relu_grad(self, grad):
        return [grad * 0.5]

    def count(self, *grads, key):
        self.executions[key] += 1


class ReluNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _train_relu_net(backend, tool, steps=2):
    torch.manual_seed(0)
    model = ReluNet()
    run = torch.compile(model, backend=backend) if backend else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    x, grads = torch.randn(6, 8), []
    with warnings.catch_warnings():
        warnings.simplefilter("error", amanda.EagerFallbackWarning)
        for _ in range(steps):
            optimizer.zero_grad()
            with amanda.apply(tool):
                run(x).square().mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            optimizer.step()
    return grads, model


def test_replace_backward_op_runs_in_the_compiled_backward_graph():
    """``replace_backward_op`` on ``aot_eager``: the routine computes
    ``ReluBackward0``'s gradient in the compiled backward graph; the
    backward points' executions, the gradients and the parameters are
    eager's, bit for bit, and not the vanilla model's."""
    eager, compiled = CountBackwardReplacing(), CountBackwardReplacing()
    eager_grads, eager_model = _train_relu_net(None, eager)
    grads, model = _train_relu_net("aot_eager", compiled)
    vanilla_grads, _ = _train_relu_net("aot_eager", amanda.Tool())
    assert compiled.executions == eager.executions and eager.executions
    for mine, theirs, plain in zip(grads, eager_grads, vanilla_grads):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
        assert not torch.equal(mine[0], plain[0])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), eager_model.parameters()))


# -- what still falls back, and errors -------------------------------------------------------

class ReplaceInPlace(amanda.Tool):
    """Replaces ``h += 1`` (``add_``), which compiled graphs do not carry."""

    def __init__(self):
        super().__init__()
        self.add_inst_for_op(self.analysis)

    def analysis(self, context):
        if context.get_op_name() == "add_":
            context.replace_op(_halved_plus_one)


class InPlace(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        h += 1
        return h * 2


@pytest.mark.parametrize("tool", ["in-place", "python ad"])
def test_replacements_compiled_graphs_cannot_carry_fall_back_loudly(tool):
    """An in-place op's replacement and a Python routine under
    ``ad_enabled`` run the call eagerly, with a warning naming the reason,
    and give eager's outputs."""
    torch.manual_seed(0)
    if tool == "in-place":
        model, x, make = InPlace(), torch.randn(2, 4), ReplaceInPlace
        reason = "writes into its argument"
    else:
        model, x = Net(), torch.randn(2, 8)

        def make():
            return Replacing({"gelu": (_halved_plus_one, None, True)})
        reason = "ad_enabled"
    with torch.no_grad(), amanda.apply(make()):
        expected = model(x)
    compiled = torch.compile(model, backend="aot_eager")
    before = sum(pytorch_compiled.EAGER_FALLBACKS.values())
    with torch.no_grad(), pytest.warns(amanda.EagerFallbackWarning, match=reason):
        with amanda.apply(make()):
            out = compiled(x)
    assert torch.equal(out, expected)
    assert sum(pytorch_compiled.EAGER_FALLBACKS.values()) == before + 1


def test_python_replacement_under_dynamic_shapes_falls_back_loudly():
    """A Python routine's custom op tells the compiler its results' sizes,
    which dynamic shapes leave symbolic: the call runs eagerly, saying
    why, with eager's outputs; a portable one is traced and runs compiled."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(3, 8)
    with torch.no_grad(), amanda.apply(Replacing(CASES["python gelu"])):
        expected = model(x)
    compiled = torch.compile(model, backend="aot_eager", dynamic=True)
    with torch.no_grad(), pytest.warns(amanda.EagerFallbackWarning, match="symbolic shape"):
        with amanda.apply(Replacing(CASES["python gelu"])):
            out = compiled(x)
    assert torch.equal(out, expected)
    torch._dynamo.reset()
    with torch.no_grad(), amanda.apply(Replacing(CASES["portable gelu"])):
        expected = model(x)
    compiled = torch.compile(model, backend="aot_eager", dynamic=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", amanda.EagerFallbackWarning)
        with torch.no_grad(), amanda.apply(Replacing(CASES["portable gelu"])):
            out = compiled(x)
    assert torch.equal(out, expected)


@portable.hosted
def _wrong_shape(x):
    return x[:, :1]


@portable.routine
def _portable_wrong_shape(x):
    return x.sum()


@pytest.mark.parametrize("routine", [_wrong_shape, _portable_wrong_shape])
def test_a_replacement_of_another_shape_is_a_tool_error(routine):
    """As eagerly: a ``ToolError`` naming the tool, the routine and the op."""
    model = torch.compile(Net(), backend="aot_eager")
    tool = Replacing({"gelu": (routine, None, False)})
    with pytest.raises(amanda.ToolError) as error:
        with torch.no_grad(), amanda.apply(tool):
            model(torch.randn(2, 8))
    message = str(error.value)
    assert "Replacing" in message and routine.__name__ in message and "gelu" in message
    assert "shape" in message
