"""Compiled PyTorch: tools that ask for whole graphs (``requires_graph``: the
effective path, the graph tracer) in a compiled training step.

Each run of a compiled graph is recorded in the step's eager trace as the
ops it ran (``EagerTrace.splice``), so the step's graph handed to the tools
is eager's. Differential: the same two SGD steps (``_train`` of
``test_compiled_backward``: no eager fallback allowed) eagerly and compiled
on ``aot_eager``, the same tool.
"""

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import amanda  # noqa: E402
from amanda.tools.effective_path import EffectivePathTool  # noqa: E402
from amanda.tools.graph import GraphTracingTool  # noqa: E402
from tests.pytorch.test_compiled_backward import PROGRAMS, _same_parameters, _train  # noqa: E402

pytestmark = pytest.mark.usefixtures("compiled_path_fresh_dynamo")   # tests/conftest.py

#: the module whose output holds the logits, per program (the compiled MLP
#: program's graph ends with the loss: its last op is no logits)
LOGITS = {"mlp": "fc2", "conv": "3"}
#: samples per step
SAMPLES = {"mlp": 6, "conv": 2}


def _masks(masks):
    return {name: mask.tobytes() for name, mask in masks.items()}


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_effective_paths_of_a_compiled_training_step_are_eagers(program):
    eager, compiled = EffectivePathTool(output=LOGITS[program]), \
        EffectivePathTool(output=LOGITS[program])
    eager_model, _ = _train(program, None, eager)
    model, _ = _train(program, "aot_eager", compiled)
    want, got = eager.paths, compiled.paths
    assert len(want) == 2 * SAMPLES[program]          # a path per sample and step
    assert [p.label for p in got] == [p.label for p in want]
    for a, b in zip(got, want):
        assert _masks(a.neurons) == _masks(b.neurons) and a.neurons
        assert _masks(a.synapses) == _masks(b.synapses) and a.synapses
        assert _masks(a.inputs) == _masks(b.inputs)
    assert _same_parameters(model, eager_model)


def _forward(graph):
    """Each forward op: type, eager id, module, what produced its inputs, output shapes."""
    return [(op.type, op.attrs.get("op_id"), op.attrs.get("module"),
             [t.producer.attrs.get("op_id") if t.producer is not None else t.attrs.get("kind")
              for t in op.inputs],
             [t.attrs.get("shape") for t in op.outputs])
            for op in graph.ops if not op.attrs.get("backward")]


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_traced_step_graphs_of_a_compiled_step_are_eagers_forward(program):
    """The forward part of each step's graph equals eager's; backward ops are
    those of the ops that ran eagerly (the conv program's loss): a compiled
    graph's autograd nodes are AOTAutograd's, and the trace lists none."""
    eager, compiled = GraphTracingTool(keep=4), GraphTracingTool(keep=4)
    _train(program, None, eager)
    _train(program, "aot_eager", compiled)
    assert len(compiled.graphs) == len(eager.graphs) == 2
    for got, want in zip(compiled.graphs, eager.graphs):
        assert _forward(got) == _forward(want) and _forward(got)
        eager_only = {op.attrs["forward_op_id"] for op in got.ops if op.attrs.get("backward")}
        losses = {op.attrs["op_id"] for op in want.ops
                  if not op.attrs.get("backward") and op.attrs.get("module") is None}
        assert eager_only == (losses if program == "conv" else set())


def test_a_compiled_graph_run_twice_in_a_step_starts_the_next_step():
    """A graph whose ops the step has seen starts the next step, as an eager
    op would: two calls of a compiled module inside one scope are two steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(2, 4)
    want, got = _step_graphs(model, x), _step_graphs(compiled, x)
    assert len(got) == len(want) == 2
    assert got == want
    assert np.array_equal(compiled(x).detach().numpy(), model(x).detach().numpy())


def _step_graphs(run, x):
    """The forward part of each step graph the graph tracer records for two
    calls of ``run`` in one scope; an eager fallback is an error."""
    tool = GraphTracingTool(keep=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", amanda.EagerFallbackWarning)
        with amanda.apply(tool):
            run(x)
            run(x)
    return [_forward(g) for g in tool.graphs]


class _TwoCalls(torch.nn.Module):
    """An eager model calling one compiled layer twice per step."""

    def __init__(self):
        super().__init__()
        self.layer = torch.compile(torch.nn.Linear(4, 4), backend="aot_eager")

    def forward(self, x):
        return torch.relu(self.layer(torch.relu(self.layer(x))))


def test_a_compiled_layer_called_twice_in_an_eager_step_is_spliced_as_eagerly(monkeypatch):
    """Each call's ops get the occurrence eager gives them: the step graphs
    equal those of the same model with the compiled path off (every op
    eager), and one step is not cut in two by the second call."""
    from amanda.runtime.pytorch import compiled as pytorch_compiled
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    graphs = []
    for enabled in (False, True):
        monkeypatch.setattr(pytorch_compiled, "ENABLED", enabled)
        torch._dynamo.reset()
        torch.manual_seed(1)
        model = _TwoCalls()
        graphs.append(_step_graphs(model, x))
    assert len(graphs[0]) == 2 and len(graphs[0][0]) == 4
    assert graphs[1] == graphs[0]


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_effective_paths_cached_equal_cache_disabled(program):
    """Cached (compiled, spliced) against ``cache_disabled()`` (analysis at
    every execution: the callable runs eagerly, with a warning)."""
    cached = EffectivePathTool(output=LOGITS[program])
    _train(program, "aot_eager", cached)
    uncached = EffectivePathTool(output=LOGITS[program])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", amanda.EagerFallbackWarning)
        with amanda.cache_disabled():
            model, run, (x, y) = PROGRAMS[program]("aot_eager")
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(2):
                optimizer.zero_grad()
                with amanda.apply(uncached):
                    run(x, y).backward()
                optimizer.step()
    want, got = uncached.paths, cached.paths
    assert len(got) == len(want) == 2 * SAMPLES[program]
    for a, b in zip(got, want):
        assert a.label == b.label
        assert _masks(a.neurons) == _masks(b.neurons) and _masks(a.synapses) == _masks(b.synapses)
