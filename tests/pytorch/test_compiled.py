"""Compiled PyTorch: tools run inside torch.compile'd graphs (amanda.runtime.pytorch.compiled)."""

import collections
import io
import zlib

import pytest

torch = pytest.importorskip("torch")

import amanda  # noqa: E402
from amanda import portable  # noqa: E402
from amanda.runtime.pytorch import compiled as pytorch_compiled  # noqa: E402

_DEFAULT = pytorch_compiled.ENABLED      # as imported, before any test sets it


@pytest.fixture(autouse=True)
def compiled_path():
    """These tests are about the compiled path (the default; set again in case
    another test changed it)."""
    saved, pytorch_compiled.ENABLED = pytorch_compiled.ENABLED, True
    yield
    pytorch_compiled.ENABLED = saved


def test_the_compiled_path_is_the_default():
    """Compiled callables inside ``apply`` run instrumented compiled graphs
    unless a user turns the path off (docs/pytorch-compiled.md)."""
    assert _DEFAULT is True


class ConvAndInPlace(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.conv(x)
        h += 1
        return self.lin(h.mean((2, 3)))


def test_compiled_ops_have_the_ids_of_eager():
    model = torch.compile(ConvAndInPlace(), backend="eager")
    x = torch.randn(1, 3, 8, 8)
    assert _points(model, x, compiled_path=True) == _points(model, x, compiled_path=False)


class CountBefore(amanda.Tool):
    """A Python routine before every forward op (or the ops named ``name``)."""

    def __init__(self, name=None):
        super().__init__()
        self.name = name
        self.executions = collections.Counter()
        self.names = {}
        self.namespaces = set()
        self.add_inst_for_op(self.analysis)

    def analysis(self, context):
        self.namespaces.add(context.namespace)
        if self.name is None or context.get_op_name() == self.name:
            self.names[context.get_op_id()] = context.get_op_name()
            context.insert_before_op(self.count, key=context.get_op_id())

    def count(self, *tensors, key):
        self.executions[key] += 1


class Scale(amanda.Tool):
    """Replaces the output of every ``gelu`` by twice it (Python or portable routine)."""

    def __init__(self, portable_routine):
        super().__init__()
        self.routine = _double if portable_routine else self.double
        self.add_inst_for_op(self.analysis, require_outputs=True)

    def analysis(self, context):
        if context.get_op_name() == "gelu":
            context.insert_after_op(self.routine)

    @portable.hosted   # pure arithmetic, but this variant is the Python-routine path
    def double(self, x):
        return x * 2


@portable.routine
def _double(x):
    return x * 2


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 8)
        self.fc2 = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)) + x)


class Broken(Block):
    def forward(self, x):
        y = torch.nn.functional.gelu(self.fc1(x))
        torch._dynamo.graph_break()
        return self.fc2(y + x)


class CompileCounter:
    """A backend that counts the graphs it compiles, then runs them with ``inner``."""

    def __init__(self, inner="eager"):
        from torch._dynamo.backends.registry import lookup_backend
        self.inner = lookup_backend(inner)
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return self.inner(gm, example_inputs)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _eager_counts(model, x, name=None):
    tool = CountBefore(name)
    with amanda.apply(tool):
        model(x)
    return tool


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_counts_and_outputs_equal_eager_and_vanilla(backend):
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 8)
    compiled = torch.compile(model, backend=backend)
    expected = compiled(x)
    eager = _eager_counts(model, x)
    tool = CountBefore()
    with amanda.apply(tool):
        out = compiled(x)
        compiled(x)
    assert torch.equal(out, expected)
    assert sorted(tool.names.values()) == sorted(eager.names.values()) == ["add", "gelu", "linear", "linear"]
    # ops of torch's layers have eager's ids; see docs/pytorch-compiled.md for the others
    linears = {k for k, v in eager.names.items() if v == "linear"}
    assert linears <= set(tool.names)
    assert {k: tool.executions[k] for k in linears} == {k: 2 * eager.executions[k] for k in linears}
    assert sum(tool.executions.values()) == 2 * sum(eager.executions.values())
    assert tool.namespaces == {pytorch_compiled.NAMESPACE}


def test_no_recompilation_on_reentry_and_vanilla_outside():
    model, x = Block(), torch.randn(2, 8)
    backend = CompileCounter()
    compiled = torch.compile(model, backend=backend)
    compiled(x)
    assert backend.graphs == 1
    tool = CountBefore("linear")
    for _ in range(3):
        with amanda.apply(tool):
            compiled(x)
        compiled(x)                      # outside: the vanilla compiled code
    assert backend.graphs == 2           # one vanilla, one instrumented, each compiled once
    assert sum(tool.executions.values()) == 6
    with amanda.apply(CountBefore("gelu")):
        compiled(x)
    assert backend.graphs == 3           # other tools, their own version
    with amanda.apply(tool):
        with amanda.disabled():
            compiled(x)                  # disabled: vanilla code, nothing counted, no compile
    assert backend.graphs == 3 and sum(tool.executions.values()) == 6


def test_graph_break():
    model, x = Broken(), torch.randn(2, 8)
    backend = CompileCounter()
    compiled = torch.compile(model, backend=backend)
    expected = compiled(x)
    eager = _eager_counts(model, x)
    tool = CountBefore()
    with amanda.apply(tool):
        out = compiled(x)
    assert torch.equal(out, expected)
    assert sorted(tool.names.values()) == sorted(eager.names.values())
    assert sum(tool.executions.values()) == sum(eager.executions.values()) == 4


def test_dynamic_shapes():
    model = Block()
    compiled = torch.compile(model, backend="aot_eager", dynamic=True)
    tool = CountBefore("linear")
    with amanda.apply(tool):
        for batch in (2, 3, 5):
            x = torch.randn(batch, 8)
            assert torch.equal(compiled(x), model(x)) or torch.allclose(compiled(x), model(x))
    assert sum(tool.executions.values()) >= 6


@pytest.mark.parametrize("portable_routine", [False, True])
def test_replacing_routines(portable_routine):
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 8)
    with amanda.apply(Scale(portable_routine)):
        expected = model(x)
    compiled = torch.compile(model, backend="aot_eager")
    with amanda.apply(Scale(portable_routine)):
        out = compiled(x)
    assert torch.allclose(out, expected)
    assert not torch.allclose(out, model(x))


def test_backward_tools_fall_back_to_eager():
    """Backward points are put in AOTAutograd's backward graphs: with a
    compiler that runs none (a counting backend), such tools run the model
    eagerly (tests/pytorch/test_compiled_backward.py for the compiled ones)."""
    from tests.pytorch.test_eager_trust import Counter, mlp
    model, x = mlp(), torch.rand(2, 8)
    backend = CompileCounter()
    compiled = torch.compile(model, backend=backend)
    eager_tool, compiled_tool = Counter(), Counter()

    def step(module, tool):
        with amanda.apply(tool):
            module(x).sum().backward()
    step(model, eager_tool)
    step(compiled, compiled_tool)
    assert compiled_tool.executions == eager_tool.executions
    assert backend.graphs == 0


def test_state_restored_after_apply():
    from torch._dynamo import eval_frame
    from torch._dynamo.output_graph import SubgraphTracer
    model, x = Block(), torch.randn(2, 8)
    compiled = torch.compile(model, backend="eager")
    original = eval_frame._callback_from_stance
    create_proxy = SubgraphTracer.create_proxy
    with pytest.raises(RuntimeError):
        with amanda.apply(CountBefore()):
            compiled(x)
            assert SubgraphTracer.create_proxy is not create_proxy   # sites read while tracing
            raise RuntimeError("tool code failed")
    assert eval_frame._callback_from_stance is original
    assert SubgraphTracer.create_proxy is create_proxy
    assert not torch.overrides._get_current_function_mode_stack()
    assert not torch.nn.modules.module._global_forward_pre_hooks
    assert eval_frame._stance.stance == "default"


class BreakOnNonzero(torch.nn.Module):
    """``torch.nonzero`` has a data-dependent output shape: Dynamo breaks the
    graph there and runs it outside any graph."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = torch.relu(self.fc(x))
        return h + torch.nonzero(h > 0.1).shape[0]


def test_disabled_compiled_path_gives_exactly_the_points_of_eager():
    pytorch_compiled.ENABLED = False      # force_eager inside apply (the fixture restores it)
    torch.manual_seed(0)
    model, x = BreakOnNonzero(), torch.rand(2, 4)
    counts = []
    for module in (model, torch.compile(model, backend="eager")):
        tool = CountBefore()
        with torch.no_grad(), amanda.apply(tool):
            module(x)
            module(x)
        counts.append(collections.Counter(tool.names[k] for k in tool.executions.elements()))
    assert counts[0] == counts[1] and counts[0]["nonzero"] == 2


# -- differential harness: graph breaks ---------------------------------------------------
#
# Every program below makes Dynamo run some code outside its graphs. Under the
# compiled path, the multiset of (op id, point) executions of a counting tool
# must equal the eager run's, and identity routines must keep outputs
# bit-identical. (A compiled callable with a graph break runs eagerly inside
# apply: pytorch_compiled.EAGER_FALLBACKS.)


class CountPoints(amanda.Tool):
    """Counts every (op id, point) execution, before and after every forward op.

    (Not ``require_outputs``: eager then analyses an op after its first
    execution, so that execution has no before-point, while compiled graphs
    are analysed before they run.)"""

    def __init__(self):
        super().__init__()
        self.executions = collections.Counter()
        self.add_inst_for_op(self.analysis)

    def analysis(self, context):
        op_id = context.get_op_id()
        context.insert_before_op(self.count, key=(op_id, "before"))
        context.insert_after_op(self.count, key=(op_id, "after"))

    def count(self, *tensors, key):
        self.executions[key] += 1


class Identity(amanda.Tool):
    """A Python routine before and after every op that returns its tensors unchanged."""

    def __init__(self):
        super().__init__()
        self.add_inst_for_op(self.analysis, require_outputs=True)

    def analysis(self, context):
        context.insert_before_op(self.same)
        context.insert_after_op(self.same)

    @portable.hosted    # a Python routine (amanda::replace), never inferred portable
    def same(self, *tensors):
        return list(tensors)


def _item_branch(x):
    y = torch.sin(x)
    if y.sum().item() > 0:            # data-dependent control flow
        return torch.cos(y)
    return torch.tanh(y)


def _printing(x):
    y = torch.sin(x)
    print(y, file=_SINK)              # print of a tensor: formatted eagerly
    return torch.cos(y)


def _builtin(x):
    y = torch.sin(x)
    n = zlib.crc32(b"amanda")         # a builtin Dynamo cannot trace
    return torch.cos(y) + (n % 3)


@torch._dynamo.disable
def _skipped(y):
    return torch.exp(y) * 2           # a frame Dynamo skips: runs as plain Python


def _calls_skipped(x):
    return torch.cos(_skipped(torch.sin(x)))


_inner = torch.compile(lambda y: torch.nonzero(y > 0.5).float().sum() + y, backend="eager")


def _nested(x):
    return torch.cos(_inner(torch.sin(x)))


class Hooked(torch.nn.Module):
    """A module with a forward hook of the user's, which computes."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.fc.register_forward_hook(lambda module, args, out: out * 2 + torch.nonzero(out).shape[0])

    def forward(self, x):
        return torch.relu(self.fc(x))


class Tree(torch.nn.Module):
    """User modules inside user modules, no graph break."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.Sequential(Block(), torch.nn.ReLU(), torch.nn.Linear(4, 8), Block())

    def forward(self, x):
        return torch.tanh(self.blocks(x)) * 2


_tree = Tree()


def _calls_module(x):
    return torch.sigmoid(_tree(x)) + 1


class Operators(torch.nn.Module):
    """Several ops of one name on one line, Python operators (reflected and
    in-place), an item assignment and an op with a tuple result."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x) + 1 + x * 2 + (1 - x)
        y += 1
        y[:, 0] = 0.5
        a, b = torch.split(y, 4, dim=1)
        return torch.cat([b, a], dim=1) * 2


_block = Block()


def _calls_a_module_twice(x):
    return torch.tanh(_block(x)) + _block(torch.sin(x))


def _make_nested_function():
    def nested_function(x):
        return torch.cos(torch.sin(x)) * 3
    return nested_function


def _make_function_with_a_nested_helper():
    def helper(y):
        return torch.exp(y) - 1

    def with_helper(x):
        return helper(torch.sin(x)) * helper(x)
    return with_helper


_SINK = io.StringIO()
#: programs without a graph break: they run compiled, and must give eager's points too
UNBROKEN = {
    "no break: module tree": lambda: Tree(),
    "no break: function calling a module": lambda: _calls_module,
    "no break: nested function": _make_nested_function,
    "no break: nested helper": _make_function_with_a_nested_helper,
    "no break: operators": lambda: Operators(),
    "no break: a module called twice": lambda: _calls_a_module_twice,
}
PROGRAMS = {
    **UNBROKEN,
    "nonzero": lambda: BreakOnNonzero(),
    "item": lambda: _item_branch,
    "print": lambda: _printing,
    "graph_break": lambda: Broken(),
    "builtin": lambda: _builtin,
    "skipped frame": lambda: _calls_skipped,
    "nested compiled": lambda: _nested,
    "module hook": lambda: Hooked(),
}


def _input(name):
    return torch.rand(2, 8) if name == "graph_break" or name in UNBROKEN else torch.rand(2, 4)


def _points(module, x, compiled_path):
    pytorch_compiled.ENABLED = compiled_path
    tool = CountPoints()
    with torch.no_grad(), amanda.apply(tool):
        module(x)
        module(x)
    return tool.executions


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_graph_breaks_lose_no_point(name):
    torch.manual_seed(0)
    program, x = PROGRAMS[name](), _input(name)
    compiled = torch.compile(program, backend="eager")
    eager = _points(compiled, x, compiled_path=False)
    assert len(eager) >= 4
    fallbacks = sum(pytorch_compiled.EAGER_FALLBACKS.values())
    assert _points(compiled, x, compiled_path=True) == eager
    if name in UNBROKEN:
        assert sum(pytorch_compiled.EAGER_FALLBACKS.values()) == fallbacks   # ran compiled


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_graph_breaks_identity_routines_keep_outputs(name):
    torch.manual_seed(0)
    program, x = PROGRAMS[name](), _input(name)
    compiled = torch.compile(program, backend="eager")
    with torch.no_grad():
        expected = program(x)
        with amanda.apply(Identity()):
            out = compiled(x)
    assert torch.equal(out, expected)


def test_graph_break_falls_back_to_eager_once_per_callable():
    model, x = BreakOnNonzero(), torch.rand(2, 4)
    backend = CompileCounter()
    compiled = torch.compile(model, backend=backend)
    before = sum(pytorch_compiled.EAGER_FALLBACKS.values())
    tool = CountBefore("nonzero")
    for _ in range(3):
        with amanda.apply(tool):
            compiled(x)
    assert sum(tool.executions.values()) == 3
    assert sum(pytorch_compiled.EAGER_FALLBACKS.values()) == before + 1
    assert pytorch_compiled.EAGER_FALLBACKS["graph break"] >= 1
    compiled(x)                       # outside apply: Dynamo's own compiled code, graph break and all
    assert backend.graphs >= 2


class ReplaceGelu(amanda.Tool):
    """``replace_op`` with a Python routine under ``amanda.ad_enabled()``:
    compiled graphs differentiate portable routines only, so this is not
    carried (tests/pytorch/test_compiled_replace.py has the ones that are)."""

    def __init__(self):
        super().__init__()
        self.add_inst_for_op(self.analysis)

    def analysis(self, context):
        if context.get_op_name() == "gelu":
            with amanda.ad_enabled():
                context.replace_op(torch.relu)


def test_actions_compiled_graphs_cannot_carry_fall_back_to_eager():
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 8)
    with amanda.apply(ReplaceGelu()):
        expected = model(x)
    compiled = torch.compile(model, backend="eager")
    before = sum(pytorch_compiled.EAGER_FALLBACKS.values())
    with amanda.apply(ReplaceGelu()):
        out = compiled(x)
        again = compiled(x)
    assert torch.equal(out, expected) and torch.equal(again, expected)
    assert not torch.equal(out, model(x))
    assert sum(pytorch_compiled.EAGER_FALLBACKS.values()) == before + 1
    assert any("replace_op" in reason and "ad_enabled" in reason
               for reason in pytorch_compiled.EAGER_FALLBACKS)


def _helper(x):
    return torch.nn.functional.gelu(x) * 2


class CallsCompiledParts(torch.nn.Module):
    """An eager module calling a compiled function twice and a compiled submodule."""

    def __init__(self, backend):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.out = torch.compile(torch.nn.Linear(8, 8), backend=backend)
        self.helper = torch.compile(_helper, backend=backend)

    def forward(self, x):
        return self.out(self.helper(self.fc(x)) + self.helper(x))


def test_compiled_parts_of_an_eager_module_have_the_ids_of_eager():
    """Eager names these ops by the calling module's path and counts the
    helper's two calls as two occurrences: the instrumented code is cached per
    caller (module path, earlier calls in the step), and runs compiled."""
    torch.manual_seed(0)
    backend = CompileCounter()
    model, x = CallsCompiledParts(backend), torch.rand(2, 8)
    eager = _points(model, x, compiled_path=False)
    before = sum(pytorch_compiled.EAGER_FALLBACKS.values())
    assert backend.graphs == 0
    assert _points(model, x, compiled_path=True) == eager
    assert sum(pytorch_compiled.EAGER_FALLBACKS.values()) == before
    assert backend.graphs == 3     # the helper for each of its two calls, the submodule
    tool = CountPoints()
    for _ in range(2):              # re-entering apply with the same tool compiles nothing
        with torch.no_grad(), amanda.apply(tool):
            model(x)
    assert backend.graphs == 6
    with torch.no_grad():
        expected = model(x)
        with amanda.apply(Identity()):
            assert torch.equal(model(x), expected)


def _calls_a_module(x):
    return _block(x) * 2


class CallsACompiledFunctionCallingAModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.part = torch.compile(_calls_a_module, backend="eager")

    def forward(self, x):
        return self.part(self.fc(x))


def test_compiled_function_calling_a_module_inside_an_eager_module_runs_eagerly():
    """Eager names ``_block`` by where it sits among the caller's modules,
    which Dynamo's access path does not say: that call runs eagerly."""
    torch.manual_seed(0)
    model, x = CallsACompiledFunctionCallingAModule(), torch.rand(2, 8)
    eager = _points(model, x, compiled_path=False)
    before = sum(pytorch_compiled.EAGER_FALLBACKS.values())
    assert _points(model, x, compiled_path=True) == eager
    assert sum(pytorch_compiled.EAGER_FALLBACKS.values()) == before + 1


class SizesInOperators(torch.nn.Module):
    """Sizes (symbolic under dynamic shapes) on both sides of Python
    operators; the first argument of forward is not named ``self``."""

    def __init__(this):
        super().__init__()
        this.fc = torch.nn.Linear(4, 4)

    def forward(this, x):
        n = x.shape[0]
        y = this.fc(x) * n + n * x
        return (2 ** y - n)[1:]


def test_dynamic_shapes_have_the_ids_and_names_of_eager():
    torch.manual_seed(0)
    model = SizesInOperators()
    compiled = torch.compile(model, backend="aot_eager", dynamic=True)
    before = sum(pytorch_compiled.EAGER_FALLBACKS.values())
    for rows in (3, 5):
        x = torch.rand(rows, 4)
        eager = _points(compiled, x, compiled_path=False)
        assert _points(compiled, x, compiled_path=True) == eager
    assert sum(pytorch_compiled.EAGER_FALLBACKS.values()) == before


def test_module_compile_in_place_has_the_ids_of_eager():
    """``module.compile()``: Dynamo compiles the module's ``_call_impl``."""
    torch.manual_seed(0)
    model, x = ConvAndInPlace(), torch.randn(1, 3, 8, 8)
    backend = CompileCounter()
    model.compile(backend=backend)
    before = sum(pytorch_compiled.EAGER_FALLBACKS.values())
    eager = _points(model, x, compiled_path=False)
    assert backend.graphs == 0
    assert _points(model, x, compiled_path=True) == eager
    assert sum(pytorch_compiled.EAGER_FALLBACKS.values()) == before
    assert backend.graphs == 1                 # the instrumented graph, compiled once


def test_ops_without_a_site_run_eagerly(monkeypatch):
    """A Dynamo layout where the site cannot be read: the call runs eagerly
    (its ids would be unknown), never with ids that may not be eager's."""
    from amanda.runtime.pytorch.compiled import sites as pytorch_compiled_sites

    def unreadable(tx):
        raise AttributeError("a layout amanda does not know")
    monkeypatch.setattr(pytorch_compiled_sites, "_site", unreadable)
    torch.manual_seed(0)
    model, x = ConvAndInPlace(), torch.randn(1, 3, 8, 8)
    compiled = torch.compile(model, backend="eager")
    eager = _points(compiled, x, compiled_path=False)
    before = sum(pytorch_compiled.EAGER_FALLBACKS.values())
    assert _points(compiled, x, compiled_path=True) == eager
    assert sum(pytorch_compiled.EAGER_FALLBACKS.values()) == before + 1
    assert any("calling site" in reason for reason in pytorch_compiled.EAGER_FALLBACKS)


_zeros = torch.zeros     # a torch function under another global name: no torch module in sight


def _from_sizes(n):
    return _zeros(n) + torch.ones(n).sum()


def _no_torch_name(n):
    return _zeros(n) * 2


def test_functions_of_sizes_have_the_points_of_eager():
    """Compiled functions given no tensor, one reading torch only through a
    function imported under another name (Dynamo still compiles both)."""
    for function in (_from_sizes, _no_torch_name):
        compiled = torch.compile(function, backend="eager")
        eager = _points(compiled, 3, compiled_path=False)
        assert len(eager) >= 4
        assert _points(compiled, 3, compiled_path=True) == eager


def test_more_sessions_than_dynamo_allows_versions_keep_eager_ids():
    """Each session (tools applied anew) is a cache entry of Dynamo's for the
    compiled code; past its recompile limit the calls run eagerly from the
    start, and every session's points stay eager's."""
    torch.manual_seed(0)
    model, x = ConvAndInPlace(), torch.randn(1, 3, 8, 8)
    compiled = torch.compile(model, backend="eager")
    eager = _points(compiled, x, compiled_path=False)
    for _ in range(torch._dynamo.config.recompile_limit + 2):
        assert _points(compiled, x, compiled_path=True) == eager
    assert pytorch_compiled.EAGER_FALLBACKS[pytorch_compiled._TOO_MANY] >= 1


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


class _Paths(amanda.Tool):
    def __init__(self):
        super().__init__()
        self.seen = []
        self.add_inst_for_op(self.analysis)

    def analysis(self, context):
        self.seen.append((context.get_op_id(), context.get_op_name(),
                          context.get_module_path()))


@pytest.mark.parametrize("compiled_path", [False, True])
def test_compiling_a_layer_changes_no_op_id_or_module_path(compiled_path):
    """A layer compiled in place of itself (``layers[i] = torch.compile(...)``)
    is named as before: the ``OptimizedModule`` wrapper and its ``_orig_mod``
    are one module in paths, so ids and paths equal the uncompiled model's."""
    torch.manual_seed(0)
    model, x = _Stack(), torch.randn(2, 8)

    def seen():
        # the parameter shadows the module's fixture of the same name: restore by hand
        saved, pytorch_compiled.ENABLED = pytorch_compiled.ENABLED, compiled_path
        tool = _Paths()
        try:
            with torch.no_grad(), amanda.apply(tool):
                model(x)
        finally:
            pytorch_compiled.ENABLED = saved
        return sorted(tool.seen, key=repr)

    plain = seen()
    assert {path for _, _, path in plain} >= {"layers.0.0", "layers.2.1"}
    for i, layer in enumerate(model.layers):
        model.layers[i] = torch.compile(layer, backend="eager")
    assert seen() == plain
