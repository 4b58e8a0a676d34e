"""The tool API's semantics on PyTorch eager: ids, caching, controls,
dependencies, actions, autodiff isolation and failure behaviour."""

import threading

import pytest
import torch
import torch.nn.functional as F

import amanda
from amanda.errors import AmandaError, DependencyError, ToolError


class Recorder(amanda.Tool):
    """Records (op name, op id) of every analysed forward op."""

    def __init__(self, backward=False):
        super().__init__()
        self.seen = []
        self.backward_seen = []
        self.add_inst_for_op(lambda c: self.seen.append((c.get_op_name(), c.get_op_id())))
        if backward:
            self.add_inst_for_op(lambda c: self.backward_seen.append(
                (c.get_backward_op().__name__, c.get_backward_op_id(), c.get_op_id())),
                backward=True)


ORIGINAL_MODULE_CALL = torch.nn.Module.__call__


def backend_is_clean():
    from torch.nn.modules import module
    return (torch._C._len_torch_function_stack() == 0
            and torch.nn.Module.__call__ is ORIGINAL_MODULE_CALL
            and torch._C._len_torch_function_stack() == 0
            and not module._global_forward_hooks and not module._global_forward_pre_hooks)


# -- instrumentation points ---------------------------------------------------

def test_every_kind_of_call_is_a_point_but_queries_are_not():
    x = torch.rand(2, 3)
    tool = Recorder()

    def plain_function(t):
        return torch.sigmoid(t)

    with amanda.apply(tool):
        a = torch.relu(x)           # torch.*
        b = F.softplus(a)           # torch.nn.functional.*
        c = b.exp()                 # Tensor method
        d = c + a                   # operator
        d.add_(1.0)                 # in-place
        e = plain_function(d)       # inside a plain function
        _ = e.shape, e.dtype, e.size(0), e.dim(), e.numel()  # queries
        f = e.T                     # a property that computes a view
    names = [n for n, _ in tool.seen]
    assert names == ["relu", "softplus", "exp", "add", "add_", "sigmoid", "T"]
    expected = torch.sigmoid(F.softplus(torch.relu(x)).exp() + torch.relu(x) + 1).T
    assert torch.equal(f, expected)


def test_running_backward_is_not_a_forward_op():
    tool = Recorder(backward=True)
    x = torch.ones(3, requires_grad=True)
    with amanda.apply(tool):
        (g,) = torch.autograd.grad((x * x).sum(), x)
        (x * 3).sum().backward()
    assert [n for n, _ in tool.seen] == ["mul", "sum", "mul", "sum"]
    assert torch.equal(g, 2 * x.detach())
    assert {name for name, _, _ in tool.backward_seen} >= {"MulBackward0", "SumBackward0"}


def test_calls_inside_an_op_belong_to_it():
    tool = Recorder()
    layer, x = torch.nn.LayerNorm(4), torch.rand(2, 4)
    with amanda.apply(tool):
        layer(x)
    assert [n for n, _ in tool.seen] == ["layer_norm"]


def test_namespace_and_module_path(cnn):
    contexts = []
    tool = amanda.Tool()
    tool.add_inst_for_op(contexts.append)
    with amanda.apply(tool):
        cnn(torch.rand(1, 3, 32, 32))
    assert {c.namespace for c in contexts} == {f"pytorch/{torch.__version__.split('+')[0]}/eager"}
    paths = {}
    for c in contexts:
        paths.setdefault(c.get_op_name(), c.get_module_path())
    assert paths["conv2d"] == "conv_layer1"
    assert paths["relu"] == "relu1"
    assert paths["reshape"] == ""   # in the root module's own forward


def test_module_paths_match_named_modules_through_module_lists():
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    model = BertModel(BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                 intermediate_size=37))
    names = {name for name, _ in model.named_modules()}
    paths = []
    tool = amanda.Tool()
    tool.add_inst_for_op(lambda c: paths.append((c.get_op_name(), c.get_module_path())))
    with amanda.apply(tool):
        model(torch.randint(0, 100, (1, 4)))
    linear_paths = [p for name, p in paths if name == "linear"]
    assert "encoder.layer.1.attention.self.query" in linear_paths
    assert all(p in names for _, p in paths if p is not None)


# -- op ids and caching ---------------------------------------------------------

def test_op_ids_are_stable_across_steps_and_distinct(cnn):
    tool = Recorder(backward=True)
    for _ in range(2):
        with amanda.apply(tool), amanda.cache_disabled():
            y = cnn(torch.rand(1, 3, 32, 32))   # new input tensors every step
            y.sum().backward()
    half = len(tool.seen) // 2
    first, second = tool.seen[:half], tool.seen[half:]
    assert first == second
    assert len({i for _, i in first}) == len(first)
    bhalf = len(tool.backward_seen) // 2
    assert tool.backward_seen[:bhalf] == tool.backward_seen[bhalf:]
    assert len({i for _, i, _ in tool.backward_seen[:bhalf]}) == bhalf


def test_shared_module_called_three_times_gives_three_ids():
    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.act = torch.nn.ReLU()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            for _ in range(3):
                x = self.act(self.lin(x))
            return x

    model, tool = Shared(), Recorder()
    with amanda.apply(tool):
        model(torch.rand(1, 4))
        model(torch.rand(1, 4))   # a root module call starts a new step
    ids = [i for name, i in tool.seen if name != "rand"]
    assert len(ids) == 6 and len(set(ids)) == 6  # analysed once per id


def test_ops_outside_modules_are_identified_by_their_site():
    w = torch.rand(4, 4)
    tool = Recorder()

    def helper(v):
        return torch.tensor(float(v))

    with amanda.apply(tool):
        for _ in range(5):
            [helper(v) for v in range(3)]   # one site run three times (generate's helpers)
            x = torch.rand(1, 4)
            for _ in range(2):
                x = x @ w
    # like a static instruction: one op per site, whatever ran before it in
    # the iteration; later iterations replay the cache
    assert [n for n, _ in tool.seen] == ["tensor", "rand", "matmul"]


def test_cache_disabled_runs_analysis_every_time(cnn):
    tool = Recorder()
    x = torch.rand(1, 3, 32, 32)
    with amanda.apply(tool):
        cnn(x)
        with amanda.cache_disabled():
            cnn(x)
            cnn(x)
            with amanda.cache_enabled():
                cnn(x)
    per_step = len(tool.seen) // 3
    assert len(tool.seen) == 3 * per_step and per_step >= 10


def test_analysis_sees_tensors_actions_replay_each_execution():
    calls = []

    class Tool(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(self.analyse)

        def analyse(self, context):
            if context.get_op_name() == "mul":
                (a,) = context.get_inputs()   # the scalar 2 is not a tensor
                assert a.shape == (3,)
                context.insert_after_op(lambda out, tag: calls.append(tag), tag="seen")

    with amanda.apply(Tool()):
        for _ in range(4):
            torch.ones(3) * 2
    assert calls == ["seen"] * 4


# -- controls -----------------------------------------------------------------------

def test_disabled_and_enabled_scopes():
    tool = Recorder()
    with amanda.apply(tool):
        torch.relu(torch.ones(1))
        with amanda.disabled():
            torch.sigmoid(torch.ones(1))
            with amanda.enabled():
                torch.tanh(torch.ones(1))
    assert [n for n, _ in tool.seen] == ["ones", "relu", "ones", "tanh"]


def test_apply_nests_and_restores_outer_tools():
    outer, inner = Recorder(), Recorder()
    with amanda.apply(outer):
        torch.relu(torch.ones(1))
        with amanda.apply(inner):
            torch.tanh(torch.ones(1))
        torch.exp(torch.ones(1))
    assert [n for n, _ in outer.seen] == ["ones", "relu", "ones", "tanh", "ones", "exp"]
    assert [n for n, _ in inner.seen] == ["ones", "tanh"]
    assert backend_is_clean()


def test_apply_scope_is_per_thread():
    tool = Recorder()
    started, release = threading.Event(), threading.Event()
    other_seen = []

    def other_thread():
        other_tool = Recorder()
        started.set()
        release.wait(5)
        torch.sigmoid(torch.ones(1))           # not inside any apply in this thread
        with amanda.apply(other_tool):
            torch.tanh(torch.ones(1))
        other_seen.extend(other_tool.seen)

    thread = threading.Thread(target=other_thread)
    thread.start()
    started.wait(5)
    with amanda.apply(tool):
        release.set()
        thread.join(10)
        torch.relu(torch.ones(1))
    assert [n for n, _ in tool.seen] == ["ones", "relu"]
    assert [n for n, _ in other_seen] == ["ones", "tanh"]
    assert backend_is_clean()


# -- dependencies ------------------------------------------------------------------------

class Named(amanda.Tool):
    def __init__(self, name, log, *deps):
        super().__init__()
        self.name = name
        self.depends_on(*deps)
        self.add_inst_for_op(lambda c: log.append(name))


def test_dependencies_run_first_and_shared_dependency_runs_once():
    log = []
    base = Named("base", log)
    left, right = Named("left", log, base), Named("right", log, base)
    top = Named("top", log, left, right)
    with amanda.apply(top):
        torch.relu(torch.zeros(1))
    per_op = log[:4]
    assert per_op == ["base", "left", "right", "top"]
    assert len(log) == 8  # zeros and relu, each analysed by four tools once


def test_dependency_cycle_is_named():
    log = []
    a = Named("a", log)
    b = Named("b", log, a)
    a.depends_on(b)
    with pytest.raises(DependencyError, match=r"cycle: Named -> Named -> Named"):
        amanda.apply(a)
    assert backend_is_clean()


def test_dependencies_transform_the_context():
    class Producer(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(lambda c: c.__setitem__("kind", c.get_op_name().upper()))

    class Consumer(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.kinds = []
            self.depends_on(Producer())
            self.add_inst_for_op(lambda c: self.kinds.append(c["kind"]))

    tool = Consumer()
    with amanda.apply(tool):
        torch.relu(torch.zeros(1))
    assert tool.kinds == ["ZEROS", "RELU"]


# -- actions -------------------------------------------------------------------------------

def test_before_and_after_actions_change_values_and_select_positions():
    class Shift(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(self.analyse)

        def analyse(self, context):
            if context.get_op_name() == "sub":
                context.insert_before_op(lambda b: b * 10, inputs=[1])
                context.insert_after_op(lambda out: out + 0.5)

    a, b = torch.tensor([5.0]), torch.tensor([1.0])
    with amanda.apply(Shift()):
        result = a - b
    assert result.item() == pytest.approx(5 - 10 + 0.5)
    assert a.item() == 5.0 and b.item() == 1.0


def test_replace_op_with_identity_removes_it():
    class Drop(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(self.analyse)

        def analyse(self, context):
            if context.get_op_name() == "relu":
                context.replace_op(lambda x: x, inputs=[0])

    x = torch.tensor([-1.0, 2.0])
    with amanda.apply(Drop()):
        assert torch.equal(torch.relu(x), x)


def test_backward_actions_read_and_replace_gradients():
    seen = {}

    class GradTool(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(self.analyse, backward=True)

        def analyse(self, context):
            if context.get_backward_op().__name__ == "MulBackward0":
                seen["incoming"] = context.get_grad_outputs()[0].clone()
                context.insert_before_backward_op(lambda g: g * 3)
                context.insert_after_backward_op(lambda ga, gb: (ga, None))

    x = torch.tensor([2.0], requires_grad=True)
    y = torch.tensor([5.0], requires_grad=True)
    with amanda.apply(GradTool()):
        (x * y).sum().backward()
    assert seen["incoming"].item() == 1.0
    assert x.grad.item() == 15.0 and y.grad.item() == 6.0


def test_replace_backward_op():
    class Replace(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(self.analyse, backward=True)

        def analyse(self, context):
            if context.get_backward_op().__name__ == "ExpBackward0":
                context.replace_backward_op(lambda g: g * 0 + 7)

    x = torch.tensor([1.0], requires_grad=True)
    with amanda.apply(Replace()):
        x.exp().sum().backward()
    assert x.grad.item() == 7.0


def test_gradient_accumulation_is_a_point():
    class Accumulation(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.grads = []
            self.add_inst_for_op(self.analyse, backward=True)

        def analyse(self, context):
            if context.get_backward_op().__name__ == "AccumulateGrad":
                context.insert_before_backward_op(self.halve)

        def halve(self, grad):
            self.grads.append(grad.clone())
            return grad / 2

    w = torch.nn.Parameter(torch.ones(3))
    tool = Accumulation()
    with amanda.apply(tool):
        (w * 4).sum().backward()
    assert len(tool.grads) == 1
    assert torch.equal(w.grad, torch.full((3,), 2.0))


def test_forward_keys_are_visible_in_backward_contexts():
    seen = []

    class Keys(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(lambda c: c.__setitem__("tag", c.get_op_name()))
            self.add_inst_for_op(lambda c: seen.append((c["tag"], c.get_op().__name__)),
                                 backward=True)

    x = torch.ones(2, requires_grad=True)
    with amanda.apply(Keys()):
        x.exp().sum().backward()
    assert ("exp", "exp") in seen and ("sum", "sum") in seen


# -- autodiff isolation ------------------------------------------------------------------------

class Square(amanda.Tool):
    def __init__(self, ad):
        super().__init__()
        self.ad = ad
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        if context.get_op_name() == "sum":
            if self.ad:
                with amanda.ad_enabled():
                    context.insert_before_op(lambda x: x * x)
            else:
                context.insert_before_op(lambda x: x * x)


@pytest.mark.parametrize("ad, expected_grad", [(False, 1.0), (True, 6.0)])
def test_autodiff_isolation_default_and_opt_in(ad, expected_grad):
    x = torch.tensor([3.0], requires_grad=True)
    with amanda.apply(Square(ad)):
        y = x.sum()
    assert y.item() == 9.0
    y.backward()
    # isolated: straight-through, as if the routine were the identity
    assert x.grad.item() == expected_grad


# -- failures ---------------------------------------------------------------------------------------

class Broken(amanda.Tool):
    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        if context.get_op_name() != "relu":
            return
        if self.mode == "raise":
            raise ValueError("boom")
        if self.mode == "count":
            context.insert_before_op(lambda a, b: (a,), inputs=[0, 0])
        if self.mode == "kind":
            context.insert_after_op(lambda out: "not a tensor")
        if self.mode == "position":
            context.insert_before_op(lambda x: x, inputs=[3])
        if self.mode == "outputs":
            context.get_outputs()
        if self.mode == "wrong-side":
            context.insert_after_backward_op(lambda g: g)


@pytest.mark.parametrize("mode, message", [
    ("raise", r"analysis routine raised ValueError: boom"),
    ("count", r"returned 1 values for 2 selected tensors"),
    ("kind", r"returned str; expected None, a tensor or a sequence"),
    ("position", r"selects positions \[3\] but the op has 1"),
    ("outputs", r"outputs are not available at this point: register the routine with "
                r"require_outputs=True"),
    ("wrong-side", r"after_backward_op cannot be recorded from a forward context"),
])
def test_tool_errors_name_tool_routine_op_and_namespace(cnn, mode, message):
    params = [p.detach().clone() for p in cnn.parameters()]
    with pytest.raises(ToolError, match=message) as info:
        with amanda.apply(Broken(mode)):
            cnn(torch.rand(1, 3, 32, 32))
    text = str(info.value)
    assert "tool Broken" in text and "op 'relu' (id " in text and "namespace 'pytorch/" in text
    assert "routine Broken.analyse" in text or "routine " in text
    if mode == "raise":
        assert isinstance(info.value.__cause__, ValueError)
    assert backend_is_clean()
    assert all(torch.equal(a, p) for a, p in zip(params, cnn.parameters()))
    # the model still runs uninstrumented
    assert cnn(torch.rand(1, 3, 32, 32)).shape == (1, 10)


def test_user_exception_inside_apply_restores_backend():
    with pytest.raises(RuntimeError, match="user"):
        with amanda.apply(Recorder()):
            torch.relu(torch.ones(1))
            raise RuntimeError("user")
    assert backend_is_clean()


def test_a_failing_graph_completed_still_restores_backend(cnn):
    from amanda.tools.graph import GraphTracingTool

    class Fails(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.depends_on(GraphTracingTool())
            self.requires_graph = True

        def graph_completed(self, graph):
            raise ValueError("walk failed")

    with pytest.raises(AmandaError, match="graph_completed raised ValueError"):
        with amanda.apply(Fails()):
            cnn(torch.rand(1, 3, 32, 32))
    assert backend_is_clean()


def test_bad_tools_are_rejected():
    with pytest.raises(AmandaError, match="needs amanda.Tool objects"):
        amanda.apply(object())

    class Forgot(amanda.Tool):
        def __init__(self):
            pass

    with pytest.raises(AmandaError, match=r"call super\(\).__init__\(\)"):
        amanda.apply(Forgot())
    with pytest.raises(AmandaError, match="needs a callable"):
        amanda.Tool().add_inst_for_op("nope")


def test_backward_hooks_are_inert_after_apply_exits():
    calls = []

    class Late(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(lambda c: c.insert_after_backward_op(
                lambda *g: calls.append(1)), backward=True)

    x = torch.ones(2, requires_grad=True)
    with amanda.apply(Late()):
        y = x.exp().sum()
    y.backward()   # outside apply: nothing runs
    assert calls == []
    assert torch.equal(x.grad, torch.ones(2).exp())


# -- no fast path skips a point ------------------------------------------------------------

class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.use_b = False
        self.inner = False

    def forward(self, x):
        x = torch.relu(self.a(x))
        if self.inner:          # a branch inside one module's forward, no module call
            x = torch.sigmoid(x)
        if self.use_b:
            x = torch.tanh(self.b(x))
        return x


def test_branches_taken_after_many_clean_steps_are_analysed():
    model, tool = Branchy(), Recorder()
    x = torch.rand(2, 4)
    with amanda.apply(tool):
        for _ in range(4):
            model(x).sum().backward()
        model.inner = True       # used to run vanilla once the driver had "settled"
        model(x).sum().backward()
        model.use_b = True
        model(x).sum().backward()
        torch.exp(x)             # code outside modules, after the model
    names = [n for n, _ in tool.seen]
    assert names.count("sigmoid") == 1 and names.count("tanh") == 1
    assert names.count("linear") == 2 and names.count("exp") == 1
    assert backend_is_clean()


def test_evaluate_reads_values_for_analysis():
    values = []
    tool = amanda.Tool()
    tool.add_inst_for_op(lambda c: values.append(amanda.evaluate(c.get_inputs())))
    x = torch.tensor([1.0, -2.0])
    with amanda.apply(tool):
        torch.relu(x)
    assert len(values) == 1 and values[0][0].tolist() == [1.0, -2.0]
    assert amanda.evaluate(3.0) == 3.0


