"""Compiled PyTorch on real models, by difference with eager: the same
(op id, op name, point) executions, and identity routines that leave the
compiled outputs bit-identical (amanda.runtime.pytorch.compiled)."""

import collections

import pytest

torch = pytest.importorskip("torch")

import amanda  # noqa: E402
from amanda import portable  # noqa: E402
from amanda.runtime.pytorch import compiled as pytorch_compiled  # noqa: E402


pytestmark = pytest.mark.usefixtures("compiled_path_fresh_dynamo")   # tests/conftest.py


class CountPoints(amanda.Tool):
    """Counts every (op id, op name, point) execution, before and after every forward op."""

    def __init__(self):
        super().__init__()
        self.executions = collections.Counter()
        self.add_inst_for_op(self.analysis)

    def analysis(self, context):
        key = (context.get_op_id(), context.get_op_name())
        context.insert_before_op(self.count, key=key + ("before",))
        context.insert_after_op(self.count, key=key + ("after",))

    def count(self, *tensors, key):
        self.executions[key] += 1


class Identity(amanda.Tool):
    """A routine before and after every op that gives its tensors back: a
    Python routine (``amanda::replace`` in the graph) or a portable one."""

    def __init__(self, portable_routine):
        super().__init__()
        self.routine = _same if portable_routine else self.same
        self.add_inst_for_op(self.analysis)

    def analysis(self, context):
        context.insert_before_op(self.routine)
        context.insert_after_op(self.routine)

    @portable.hosted    # a Python routine (amanda::replace), never inferred portable
    def same(self, *tensors):
        return list(tensors)


@portable.routine
def _same(*tensors):
    return list(tensors)


def _points(model, x, compiled_path, calls=2):
    pytorch_compiled.ENABLED = compiled_path
    tool = CountPoints()
    with torch.no_grad(), amanda.apply(tool):
        for _ in range(calls):
            model(x)
    return tool.executions


def _constants(x):
    flag = torch.tensor(True)
    return torch.where(flag, x, x * 2) + torch.tensor(2.0)


def test_routines_on_constants_run_once_per_call():
    """Fake tensor mode folds ops on constants (``torch.tensor(2.0)``) by
    running them while AOTAutograd traces; a routine must not run then."""
    compiled = torch.compile(_constants, backend="aot_eager")
    x = torch.rand(3)
    eager = _points(compiled, x, compiled_path=False)
    assert _points(compiled, x, compiled_path=True) == eager
    assert eager and set(eager.values()) == {2}


# -- transformers models from small random configs --------------------------------------

def _model(name):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "bert":
        config = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2,
                                         intermediate_size=128)
        return transformers.BertModel(config).eval(), torch.randint(0, 1000, (2, 8))
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2)
        return transformers.GPT2Model(config).eval(), torch.randint(0, 1000, (2, 8))
    if name == "resnet":
        config = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1])
        return transformers.ResNetModel(config).eval(), torch.rand(2, 3, 32, 32)
    if name == "vit":
        config = transformers.ViTConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2,
                                        intermediate_size=128, image_size=32, patch_size=8)
        return transformers.ViTModel(config).eval(), torch.rand(2, 3, 32, 32)
    raise KeyError(name)


def _tensors(output):
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _tensors(item)]
    return []


MODELS = ["bert", "gpt2", "resnet", "vit"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("name", MODELS)
def test_models_have_the_points_and_ids_of_eager(name, backend):
    model, x = _model(name)
    compiled = torch.compile(model, backend=backend)
    eager = _points(compiled, x, compiled_path=False)
    fallbacks = collections.Counter(pytorch_compiled.EAGER_FALLBACKS)
    observed = _points(compiled, x, compiled_path=True)
    assert pytorch_compiled.EAGER_FALLBACKS == fallbacks      # it ran compiled
    assert len(eager) >= 50          # points of tens of ops (before and after)
    assert observed == eager


@pytest.mark.slow
@pytest.mark.parametrize("portable_routine", [False, True], ids=["python", "portable"])
@pytest.mark.parametrize("name", MODELS)
def test_models_identity_routines_keep_compiled_outputs(name, portable_routine):
    model, x = _model(name)
    compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        expected = _tensors(compiled(x))          # vanilla compiled
        fallbacks = collections.Counter(pytorch_compiled.EAGER_FALLBACKS)
        with amanda.apply(Identity(portable_routine)):
            outputs = [_tensors(compiled(x)) for _ in range(2)]
        again = _tensors(compiled(x))             # vanilla again, after apply
    assert pytorch_compiled.EAGER_FALLBACKS == fallbacks
    assert expected
    for out in outputs + [again]:
        assert len(out) == len(expected)
        assert all(torch.equal(a, b) for a, b in zip(out, expected))


def _compile_layers(model, backend):
    """Compiles the items of the model's first ``ModuleList`` (its layers or
    stages) in place; the model itself stays eager."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            for i, layer in enumerate(module):
                module[i] = torch.compile(layer, backend=backend)
            return len(module)
    raise AssertionError("no ModuleList")


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_compiled_layers_of_eager_models_have_the_points_and_ids_of_eager(name):
    """Each layer compiled, the model eager: the layers' ops get the paths and
    occurrences eager gives them (the ``OptimizedModule`` wrapper is not part
    of paths), and the layers run compiled."""
    from torch._dynamo.backends.registry import lookup_backend
    inner, graphs = lookup_backend("aot_eager"), []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return inner(gm, example_inputs)
    model, x = _model(name)
    layers = _compile_layers(model, backend)
    assert layers >= 2
    eager = _points(model, x, compiled_path=False)      # the compiled layers run eagerly
    assert len(eager) >= 50 and not graphs
    fallbacks = collections.Counter(pytorch_compiled.EAGER_FALLBACKS)
    assert _points(model, x, compiled_path=True) == eager
    assert pytorch_compiled.EAGER_FALLBACKS == fallbacks
    assert len(graphs) >= layers                         # they ran compiled


@pytest.mark.slow
def test_more_sessions_than_dynamo_allows_versions_keep_eager_ids():
    """Every session is a version Dynamo caches; past its recompile limit it
    would refuse to compile in the middle of a call, and that late fallback
    gave BERT's layer_norm, dropout and embedding ops other ids: calls past
    the limit run eagerly from the start."""
    model, x = _model("bert")
    compiled = torch.compile(model, backend="aot_eager")
    eager = _points(compiled, x, compiled_path=False)
    for _ in range(torch._dynamo.config.recompile_limit + 1):
        assert _points(compiled, x, compiled_path=True) == eager


@pytest.mark.slow
def test_more_compiled_layers_than_dynamo_allows_versions_keep_eager_ids():
    """12 compiled BERT layers of one class: 12 versions of one code; those
    past Dynamo's limit run eagerly from the start, all with eager's ids."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(num_hidden_layers=12, hidden_size=64, num_attention_heads=2,
                                     intermediate_size=128)
    model, x = transformers.BertModel(config).eval(), torch.randint(0, 1000, (2, 8))
    assert _compile_layers(model, "aot_eager") > torch._dynamo.config.recompile_limit
    eager = _points(model, x, compiled_path=False)
    for _ in range(2):
        assert _points(model, x, compiled_path=True) == eager


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert", "gpt2", "resnet"])
def test_a_refusal_in_the_middle_of_a_call_keeps_eager_ids(name, monkeypatch):
    """amanda's recompile guard off: Dynamo refuses the third session's
    version in the middle of its call (the recompile limit), the rest of the
    call and the next one run eagerly, all with eager's ids (the ops of
    Python torch functions, ``F.layer_norm``, ``F.dropout``, ``F.embedding``,
    had other ids on the next call: docs/pytorch-compiled.md)."""
    monkeypatch.setattr(pytorch_compiled, "_within_dynamo_limit", lambda *args: True)
    model, x = _model(name)
    compiled = torch.compile(model, backend="aot_eager")
    eager = _points(compiled, x, compiled_path=False)
    before = sum(pytorch_compiled.EAGER_FALLBACKS.values())
    with torch._dynamo.config.patch(recompile_limit=2):
        for _ in range(3):
            assert _points(compiled, x, compiled_path=True) == eager
    assert sum(pytorch_compiled.EAGER_FALLBACKS.values()) == before + 1
