"""Tracers and TorchScript inside `amanda.apply` (eager runtime).

A tracer (``make_fx``, ``torch.export``, ``torch.jit.trace``) records torch
calls instead of executing them: those calls are not points, no routine sees
a fake tensor or a proxy, and the traced program is the plain one. A
TorchScript module's ops never reach amanda: it says so. Checked by
difference with the same tracer outside `apply`."""

import warnings

import pytest
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

import amanda


class Doubling(amanda.Tool):
    """Replaces every forward op's first output with twice its value and
    records what its routines receive."""

    def __init__(self):
        super().__init__()
        self.received = []
        self.add_inst_for_op(self.analysis)

    def analysis(self, context):
        context.insert_after_op(self.double)

    def double(self, *outputs):
        self.received.append(tuple(type(t) for t in outputs))
        if len(outputs) == 1 and isinstance(outputs[0], torch.Tensor) \
                and outputs[0].is_floating_point():
            return (outputs[0] * 2,)
        return None


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval()


def _targets(graph):
    return [(node.op, str(node.target)) for node in graph.nodes]


def _traced_inside(trace):
    model, x = _model(), torch.randn(3, 4)
    plain = trace(model, x)
    tool = Doubling()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with amanda.apply(tool):
            traced = trace(model, x)
    return model, x, plain, traced, tool, caught


def _said_not_instrumented(caught):
    return [w for w in caught if issubclass(w.category, amanda.NotInstrumentedWarning)]


@pytest.mark.parametrize("trace, said", [
    # both run the model with torch-function modes off: amanda sees only their
    # own calls (a fake copy of a parameter...), which are not points
    pytest.param(lambda m, x: make_fx(m)(x), 0, id="make_fx"),
    pytest.param(lambda m, x: torch.export.export(m, (x,)).graph_module, 0, id="export"),
])
def test_an_fx_trace_inside_apply_is_the_plain_trace(trace, said):
    model, x, plain, traced, tool, caught = _traced_inside(trace)
    assert _targets(traced.graph) == _targets(plain.graph)
    assert tool.received == []          # no routine ran on a fake tensor or a proxy
    assert len(_said_not_instrumented(caught)) == said


def test_an_exported_program_run_inside_apply_is_instrumented():
    model, x = _model(), torch.randn(3, 4)
    program = torch.export.export(model, (x,)).module()
    tool = Doubling()
    with amanda.apply(tool):
        out = program(x)
    assert tool.received and all(t is torch.Tensor for r in tool.received for t in r)
    assert not torch.equal(out, model(x))   # its ops ran with the doubling routines


def test_a_jit_trace_inside_apply_runs_like_the_plain_trace():
    model, x, plain, traced, tool, caught = _traced_inside(
        lambda m, x: torch.jit.trace(m, x, check_trace=False))
    assert torch.equal(traced(x), plain(x))
    assert ([n.kind() for n in traced.inlined_graph.nodes()]
            == [n.kind() for n in plain.inlined_graph.nodes()])
    assert tool.received == []
    assert len(_said_not_instrumented(caught)) == 1


def test_tracing_inside_a_scope_leaves_the_eager_steps_ids_alone():
    model, x = _model(), torch.randn(3, 4)

    class Ids(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.ids = []
            self.add_inst_for_op(lambda c: c.insert_before_op(
                lambda *a, i=c.get_op_id(): self.ids.append(i)))

    def steps(trace_between):
        tool = Ids()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", amanda.NotInstrumentedWarning)
            with amanda.apply(tool):
                model(x).sum()
                if trace_between:
                    make_fx(model)(x)
                    torch.export.export(model, (x,))
                model(x).sum()
        return tool.ids

    assert steps(True) == steps(False)


@pytest.mark.parametrize("script", [torch.jit.script, lambda m: torch.jit.trace(m, torch.randn(3, 4))],
                         ids=["script", "trace"])
def test_a_torchscript_module_inside_apply_is_named_once_per_scope(script):
    scripted = script(_model())

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = scripted

        def forward(self, x):
            return self.inner(x) + 1

    outer, x = Outer(), torch.randn(3, 4)
    tool = Doubling()
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with amanda.apply(tool):
                outer(x)
                outer(x)
        said = _said_not_instrumented(caught)
        assert len(said) == 1
        assert "TorchScript" in str(said[0].message) and "(inner)" in str(said[0].message)
        assert said[0].filename == __file__     # the user's line, not amanda's or torch's
    with warnings.catch_warnings():
        warnings.simplefilter("error", amanda.NotInstrumentedWarning)
        with amanda.apply(tool):
            _model()(x)                 # an eager model: nothing to say


def test_tensor_queries_that_return_no_tensor_are_not_points():
    x = torch.randn(3)
    tool = Doubling()
    names = []
    tool.add_inst_for_op(lambda c: names.append(c.get_op().__name__))
    with amanda.apply(tool):
        x.is_conj(), x.is_neg(), torch.is_conj(x)
        x.neg()
    assert names == ["neg"]
