"""Call targets in graph files: only names in a registered table resolve, checked at read time.

The registry tests use a toy namespace and need no backend; the PyTorch table
tests skip without torch.
"""

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from amanda.errors import AmandaError
from amanda.ir import Graph, IRError, graph_from_json, graph_to_json
from amanda.ir import targets


class ToyTable(targets.TargetResolver):
    """A table of two names; remembers every name it was asked about."""

    table = {"toy.double": lambda x: 2 * x, "toy.neg": lambda x: -x}

    def __init__(self):
        self.asked = []

    def resolve(self, name):
        self.asked.append(name)
        if name not in self.table:
            raise LookupError(f"{name!r} is not a toy op")
        return self.table[name]


@pytest.fixture
def toy():
    resolver = ToyTable()
    targets.register_target_resolver("toy", resolver)
    yield resolver
    targets._resolvers.pop("toy", None)


def toy_graph(target="toy.double", namespace="toy/1/graph"):
    g = Graph("g", namespace=namespace)
    x = g.add_input("x")
    op = g.create_op("double", [x], attrs={"target": target}, name="d")
    g.set_outputs(op.outputs)
    return json.loads(json.dumps(graph_to_json(g)))


def test_names_in_the_table_resolve(toy):
    graph = graph_from_json(toy_graph())
    assert toy.asked == ["toy.double"]
    assert targets.resolve_target(graph.namespace, "toy.double")(3) == 6


@pytest.mark.parametrize("name", ["os.system", "builtins.eval", "subprocess.Popen", "toy.double.__globals__"])
def test_names_outside_the_table_are_refused_when_read(toy, name):
    with pytest.raises(IRError, match=r"op 'd' \(double\) names call target") as info:
        graph_from_json(toy_graph(name))
    assert repr(name) in str(info.value) and isinstance(info.value, AmandaError)


def test_op_namespace_or_graph_namespace_selects_the_table(toy):
    data = toy_graph("os.system", namespace="other")
    graph_from_json(data)  # no backend resolves targets of "other": nothing will call them
    data["ops"][0]["namespace"] = "toy/1/graph"
    with pytest.raises(IRError, match="os.system"):
        graph_from_json(data)
    data = toy_graph("os.system", namespace="toy/1/graph")
    data["ops"][0]["namespace"] = "elsewhere"  # an op cannot leave its graph's table by renaming itself
    with pytest.raises(IRError, match="os.system"):
        graph_from_json(data)


def test_prefix_matches_by_segment(toy):
    assert targets.resolver_for("toy") is toy and targets.resolver_for("toy/2/eager") is toy
    assert targets.resolver_for("toyx/1") is None
    graph_from_json(toy_graph("os.system", namespace="toyx/1/graph"))


def test_routine_ops_name_ops_not_callables(toy):
    g = Graph("g", namespace="toy/1/graph")
    x = g.add_input("x")
    g.create_op(targets.ROUTINE, [x], attrs={"target": "some_op_name", "routine": "Tool.observe"})
    graph_from_json(graph_to_json(g))
    assert toy.asked == []


def test_nested_graphs_are_checked(toy):
    body = Graph("body", namespace="toy/1/graph")
    i = body.add_input("i")
    body.set_outputs(body.create_op("bad", [i], attrs={"target": "os.system"}).outputs)
    outer = Graph("outer", namespace="other")
    outer.create_op("loop", [outer.add_input("x")], attrs={"body": body})
    with pytest.raises(IRError, match="os.system"):
        graph_from_json(json.loads(json.dumps(graph_to_json(outer))))


def test_non_string_target_is_refused(toy):
    data = toy_graph()
    data["ops"][0]["attrs"]["target"] = ["os", "system"]
    with pytest.raises(IRError, match="not a string"):
        graph_from_json(data)


def test_a_provider_that_cannot_load_refuses_the_graph():
    from amanda.runtime import backends
    backends.register(backends.Backend("ghost", target_provider="amanda.no_such_module_for_tests"))
    try:
        with pytest.raises(IRError, match="could not be loaded"):
            graph_from_json(toy_graph("ghost.op", namespace="ghost/1/graph"))
    finally:
        backends.unregister("ghost")


def test_importing_the_ir_imports_no_backend():
    code = ("import sys, amanda.ir, amanda.ir.targets; "
            "print(any(m in sys.modules for m in ('torch', 'tensorflow', 'onnx')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- the PyTorch table -----------------------------------------------------------------


@pytest.fixture(scope="module")
def torch_graph():
    """JSON of a small captured PyTorch graph."""
    torch = pytest.importorskip("torch")
    from amanda.runtime.pytorch.capture import capture

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.ReLU()).eval()
    x = torch.randn(2, 4)
    program = capture(model, (x,))
    return program, x, json.loads(json.dumps(graph_to_json(program.graph)))


def edited(data, **attrs):
    data = json.loads(json.dumps(data))
    data["ops"][0]["attrs"].update(attrs)
    return data


REFUSED = [
    "os.system", "builtins.eval", "builtins.exec", "builtins.__import__", "subprocess.run",
    "subprocess.Popen", "subprocess.check_output", "posix.system", "importlib.import_module",
    "torch.load", "torch.save", "torch.hub.load", "torch.hub.download_url_to_file", "torch.compile",
    "torch.jit.script", "torch.jit.load", "torch.serialization.load", "torch.from_file",
    "torch.ops.load_library", "torch.utils.cpp_extension.load", "torch._dynamo.optimize",
    "torch.nn.functional.handle_torch_function", "torch.Tensor.apply_", "torch.Tensor.map_",
    "torch.Tensor.register_hook", "torch.Tensor.backward", "torch.Tensor.__reduce_ex__",
    "torch.Tensor.__setstate__", "operator.attrgetter", "operator.methodcaller", "operator.call",
    "aten.from_file.default", "aten._print.default", "load_library.x.y", "higher_order.no_such_op",
    "torch.ops.aten.add.Tensor", "aten.add", "aten.add.Tensor.extra", "aten.__class__.x",
    "os.path.join", "", ".", "torch.", "torch..relu",
]


@pytest.mark.parametrize("name", REFUSED)
def test_torch_graph_edited_to_call_anything_else_is_refused_at_read(torch_graph, name):
    _, _, data = torch_graph
    with pytest.raises(IRError, match="names call target") as info:
        graph_from_json(edited(data, target=name))
    assert repr(name) in str(info.value)


ALLOWED = ["aten.add.Tensor", "aten.conv2d.default", "aten._native_batch_norm_legit_no_training.default",
           "torch.relu", "torch.einsum", "torch.sym_int", "torch.nn.functional.relu",
           "torch.nn.functional.linear", "torch.Tensor.add", "torch.Tensor.__getitem__",
           "torch.linalg.norm", "torch._C._nn.linear", "operator.getitem", "operator.add", "math.ceil",
           "torch._VariableFunctionsClass.conv2d"]


@pytest.mark.parametrize("name", ALLOWED)
def test_operators_of_the_table_resolve(torch_graph, name):
    from amanda.frontends.pytorch.targets import RESOLVER, is_allowed

    assert is_allowed(RESOLVER.resolve(name))


def test_target_names_of_native_functions_are_in_the_table(torch_graph):
    import operator

    import torch

    from amanda.frontends.pytorch.graph import resolve_target, target_name

    for fn in (torch.ops.aten.mul.Tensor, torch.relu, torch.Tensor.add, torch.Tensor.__getitem__,
               torch.nn.functional.gelu, operator.getitem, torch.sym_int):
        assert resolve_target(target_name(fn)) is fn, target_name(fn)


def test_lowering_resolves_through_the_table(torch_graph):
    from amanda.errors import BackendError
    from amanda.runtime.pytorch.capture import lower_to_graph_module

    program, _, _ = torch_graph
    graph = program.graph.copy()
    next(iter(graph)).attrs["target"] = "os.system"  # an in-memory edit, never read from a file
    with pytest.raises(BackendError, match="os.system"):
        lower_to_graph_module(graph)


@pytest.mark.parametrize("marker", [{"$dtype": "load"}, {"$layout": "save"}, {"$memory_format": "hub"},
                                    {"$dtype": "__builtins__"}, {"$input": 99}, {"$device": "nowhere"}])
def test_argument_markers_name_only_values_of_their_kind(torch_graph, marker):
    _, _, data = torch_graph
    data = edited(data)
    data["ops"][0]["attrs"]["args"].append({"$dict": marker})  # how graph_to_json escapes "$" keys
    with pytest.raises(IRError, match="do not decode"):
        graph_from_json(data)


@pytest.mark.parametrize("path", ["forward.__globals__", "__class__.__init__", "a..b", "x.__dict__"])
def test_attribute_paths_are_plain_names(torch_graph, path):
    _, _, data = torch_graph
    data = json.loads(json.dumps(data))
    data["inputs"][0]["attrs"]["target"] = path
    with pytest.raises(IRError, match="not a path of module attribute names"):
        graph_from_json(data)
    data = json.loads(json.dumps(torch_graph[2]))
    data["attrs"]["output_targets"] = [path]
    with pytest.raises(IRError, match="not a path of module attribute names"):
        graph_from_json(data)


def test_attr_inputs_walk_submodules_only(torch_graph):
    from amanda.errors import BackendError
    from amanda.runtime.pytorch.capture import _get_attr

    program, _, _ = torch_graph
    assert _get_attr(program.module, "0.weight") is program.module[0].weight
    for path in ("forward.__globals__", "training", "0.forward"):
        with pytest.raises(BackendError):
            _get_attr(program.module, path)


def test_routine_ops_read_back_refuse_to_lower(torch_graph):
    import amanda
    from amanda.errors import BackendError
    from amanda.runtime.pytorch.capture import lower_to_graph_module

    program, _, _ = torch_graph

    class Observe(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(lambda c: c.insert_after_op(self.seen))

        def seen(self, *tensors):
            return None

    instrumented = program.instrument(Observe())
    back = graph_from_json(json.loads(json.dumps(graph_to_json(instrumented.graph))))
    with pytest.raises(BackendError, match="routines are not restored from graph files"):
        lower_to_graph_module(back)


_part = st.one_of(
    st.sampled_from(["torch", "aten", "os", "system", "load", "hub", "jit", "nn", "functional", "Tensor",
                     "operator", "builtins", "eval", "__globals__", "__class__", "_C", "ops", "default",
                     "higher_order", "subprocess", "Popen", "math", "__import__", "relu", "add"]),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz_.", min_size=0, max_size=12),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_part, min_size=1, max_size=5).map(".".join))
def test_generated_names_never_resolve_outside_the_table(torch_graph, name):
    from amanda.frontends.pytorch.targets import RESOLVER, is_allowed

    try:
        obj = RESOLVER.resolve(name)
    except LookupError:
        return
    assert is_allowed(obj), (name, obj)


def test_graphs_naming_nothing_need_no_table():
    # an eager trace has no call targets: it reads back even where its backend's table cannot load
    from amanda.runtime import backends
    backends.register(backends.Backend("ghost", target_provider="amanda.no_such_module_for_tests"))
    try:
        g = Graph("trace", namespace="ghost/1/eager")
        x = g.add_input("x", kind="parameter")
        g.set_outputs(g.create_op("relu", [x], attrs={"args": [1]}).outputs)
        assert str(graph_from_json(graph_to_json(g))) == str(g)
    finally:
        backends.unregister("ghost")
