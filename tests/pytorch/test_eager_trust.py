"""The eager runtime never loses, doubles or corrupts instrumentation.

One test (at least) per case of the issue "Trust the eager runtime"; each
failed before the fix. Checks are by difference where possible: cached vs
``cache_disabled()``, instrumented vs vanilla.
"""

import collections
import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import amanda
from amanda.tools.identity import IdentityTool


def backend_state():
    from torch.nn.modules import module
    return (torch._C._len_torch_function_stack(), len(module._global_forward_hooks),
            len(module._global_forward_pre_hooks), len(module._global_backward_hooks),
            len(module._global_backward_pre_hooks))


CLEAN = (0, 0, 0, 0, 0)


class Counter(amanda.Tool):
    """Counts executions of (op id, point) at all four points."""

    def __init__(self):
        super().__init__()
        self.executions = collections.Counter()
        self.names = {}
        self.contexts = []
        self.add_inst_for_op(self._fwd)
        self.add_inst_for_op(self._fwd_after, require_outputs=True)
        self.add_inst_for_op(self._bwd, backward=True)
        self.add_inst_for_op(self._bwd_after, backward=True, require_outputs=True)

    def _fwd(self, context):
        self.names[context.get_op_id()] = context.get_op_name()
        self.contexts.append(context)
        context.insert_before_op(self._count, key=(context.get_op_id(), "before"))

    def _fwd_after(self, context):
        context.insert_after_op(self._count, key=(context.get_op_id(), "after"))

    def _bwd(self, context):
        context.insert_before_backward_op(self._count,
                                          key=(context.get_backward_op_id(), "bbefore"))

    def _bwd_after(self, context):
        context.insert_after_backward_op(self._count,
                                         key=(context.get_backward_op_id(), "bafter"))

    def _count(self, *tensors, key):
        self.executions[key] += 1

    def per_point(self):
        return collections.Counter(point for _, point in self.executions.elements())


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


# -- 1. disabled() --------------------------------------------------------------------------

def run_epochs(model, tool, validate):
    calls = []
    with amanda.apply(tool):
        for _ in range(3):
            before = sum(tool.executions.values())
            for _ in range(5):
                model(torch.rand(2, 8)).sum().backward()
            if validate:
                with amanda.disabled(), torch.no_grad():
                    model(torch.rand(2, 8))
            calls.append(sum(tool.executions.values()) - before)
    return calls


def test_a_validation_pass_under_disabled_leaves_later_epochs_instrumented():
    model = mlp()
    with_validation = run_epochs(model, Counter(), validate=True)
    without = run_epochs(model, Counter(), validate=False)
    assert with_validation == without and with_validation[0] > 0
    assert len(set(with_validation)) == 1
    assert backend_state() == CLEAN


def test_enabled_inside_disabled_instruments():
    tool = Counter()
    x = torch.rand(3)
    with amanda.apply(tool):
        for _ in range(3):
            torch.relu(x)
        with amanda.disabled():
            torch.relu(x)
            with amanda.enabled():
                torch.sigmoid(x)
    names = [tool.names[op] for (op, point) in tool.executions if point == "before"]
    assert "sigmoid" in names
    assert sum(n for (op, p), n in tool.executions.items()
               if p == "before" and tool.names[op] == "relu") == 3


# -- 2. activation checkpointing ---------------------------------------------------------------

class Blocks(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(3))
        self.head = nn.Linear(8, 1)
        self.reentrant = reentrant
        self.use_checkpoint = True

    def forward(self, x):
        for block in self.blocks:
            if self.use_checkpoint:
                x = checkpoint(block, x, use_reentrant=self.reentrant)
            else:
                x = block(x)
        return self.head(x)


def train_steps(model, x, tool, steps=2):
    with amanda.apply(tool):
        for _ in range(steps):
            model(x).sum().backward()
    return tool


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_runs_with_the_ids_of_the_first_execution(reentrant):
    model = Blocks(reentrant)
    x = torch.rand(2, 8, requires_grad=True)
    model.use_checkpoint = False
    plain = train_steps(model, x, Counter())
    model.use_checkpoint = True
    tool = train_steps(model, x, Counter())
    assert backend_state() == CLEAN
    # no new op id: recomputed ops are the ops of the forward pass
    forward_ops = {op for op, point in tool.executions if point == "before"}
    assert forward_ops == {op for op, point in plain.executions if point == "before"}
    # every block op ran twice per step (forward and recomputation), the head once
    linear = [op for op in forward_ops if tool.names[op] == "linear"]
    assert sorted(tool.executions[(op, "before")] for op in linear) == [2, 4, 4, 4]
    assert sorted(tool.executions[(op, "after")] for op in linear) == [2, 4, 4, 4]
    # ... and the backward points are the same as without checkpointing
    backward = {k: v for k, v in tool.executions.items() if k[1].startswith("b")}
    plain_backward = {k: v for k, v in plain.executions.items() if k[1].startswith("b")}
    if not reentrant:
        assert backward.keys() == plain_backward.keys()
    else:
        # reentrant checkpointing accumulates the gradient of the segment's
        # input x through its own node, which no op of the model owns
        assert backward.keys() <= plain_backward.keys()
        assert len({op for op, _ in plain_backward.keys() - backward.keys()}) == 1
    # the tool can tell a recomputation apart
    with amanda.apply(tool), amanda.cache_disabled():
        tool.contexts.clear()
        model(x).sum().backward()
    flags = collections.Counter(c.is_recomputation() for c in tool.contexts)
    assert flags[True] == 3 * 2 and flags[False] > 0   # linear + gelu per block


def test_checkpointing_gives_the_gradients_of_vanilla():
    model = Blocks(reentrant=False)
    x = torch.rand(2, 8)
    model(x).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with amanda.apply(IdentityTool()):
        model(x).sum().backward()
    assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected))
    assert backend_state() == CLEAN


class Nested(nn.Module):
    """An outer checkpoint whose function checkpoints an inner module: the
    inner segment's inputs are recomputed by the outer one, in new storage
    (``keep`` holds the first ones, so that storage is never reused)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8))
        self.outer = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        self.keep = []

    def block(self, x):
        h = torch.tanh(self.outer(x))
        self.keep.append(h)
        return checkpoint(self.inner, h, use_reentrant=False)

    def forward(self, x):
        return self.head(checkpoint(self.block, x, use_reentrant=False))


def test_a_checkpoint_nested_in_another_is_recomputed_instrumented():
    model, x = Nested(), torch.rand(2, 8)
    runs = []
    for cached in (True, False):
        tool = Counter()
        with amanda.apply(tool), (amanda.cache_disabled() if not cached
                                  else contextlib.nullcontext()):
            for _ in range(3):
                model(x).sum().backward()
        runs.append(tool)
    cached, uncached = runs
    assert cached.executions == uncached.executions
    recomputed = {c.get_op_id() for c in uncached.contexts if c.is_recomputation()}
    inner = {op for op, name in uncached.names.items() if name in ("layer_norm", "linear")}
    # the inner segment's ops ran in its recomputation too, with their forward ids
    assert {op for op in recomputed if uncached.names[op] == "layer_norm"}
    assert recomputed <= set(uncached.names)
    layer_norm = [op for op in inner if uncached.names[op] == "layer_norm"]
    # per step: the forward, the outer segment's recomputation (which runs the
    # inner checkpoint's forward) and the inner segment's own recomputation;
    # segments are recomputed whole inside apply (no early stop)
    assert [cached.executions[(op, "before")] for op in layer_norm] == [9]
    assert [cached.executions[(op, "after")] for op in layer_norm] == [9]
    assert backend_state() == CLEAN


def test_a_segment_checkpointed_inside_disabled_stays_muted():
    """One module checkpointed twice in a step, once inside ``disabled()``:
    the muted segment's recomputation is not instrumented, the other is."""
    torch.manual_seed(0)
    layer = nn.Linear(8, 8)
    x = torch.rand(2, 8)

    def step():
        a = checkpoint(layer, x, use_reentrant=False)
        with amanda.disabled():
            b = checkpoint(layer, torch.tanh(x), use_reentrant=False)
        (a + b).sum().backward()

    tool = Counter()
    with amanda.apply(tool):
        step()
    linear = [op for op, name in tool.names.items() if name == "linear"]
    assert len(linear) == 1
    assert tool.executions[(linear[0], "before")] == 2   # forward + one recomputation
    assert backend_state() == CLEAN


@pytest.mark.parametrize("reentrant", [False, True])
def test_segments_on_one_input_are_told_apart_by_their_checkpoint(reentrant):
    """The same module checkpointed on the same input tensor twice in a step,
    the second time in a validation call under ``disabled()``: backward
    recomputes the first segment, instrumented, and never the muted one."""
    torch.manual_seed(0)
    layer = nn.Linear(8, 8)
    x = torch.rand(2, 8, requires_grad=True)
    tool = Counter()
    with amanda.apply(tool):
        out = checkpoint(layer, x, use_reentrant=reentrant)
        with amanda.disabled():
            checkpoint(layer, x, use_reentrant=reentrant)
        out.sum().backward()
    linear = [op for op, name in tool.names.items() if name == "linear"]
    assert len(linear) == 1
    assert tool.executions[(linear[0], "before")] == 2   # forward + its recomputation
    assert backend_state() == CLEAN


# -- 3. torch.compile ------------------------------------------------------------------------------

def test_compiled_model_runs_eagerly_with_the_ops_of_eager():
    model = mlp()
    compiled = torch.compile(model, backend="eager")
    x = torch.rand(2, 8)
    expected = compiled(x)
    def step(module, tool):
        with amanda.apply(tool):
            out = module(x)
            out.sum().backward()
        return out
    eager_tool, compiled_tool = Counter(), Counter()
    step(model, eager_tool)
    out = step(compiled, compiled_tool)
    assert torch.equal(out, expected)
    assert compiled_tool.executions == eager_tool.executions
    assert backend_state() == CLEAN
    from torch._dynamo import eval_frame
    assert eval_frame._stance.stance == "default"


def test_model_compiled_inside_apply():
    model = mlp()
    x = torch.rand(2, 8)
    tool = Counter()
    with amanda.apply(tool):
        compiled = torch.compile(model, backend="aot_eager")
        compiled(x)
    assert {tool.names[op] for op, _ in tool.executions} == {"linear", "relu"}
    from torch._dynamo import eval_frame
    assert eval_frame._stance.stance == "default"


# -- 4. op ids ---------------------------------------------------------------------------------------

def test_op_ids_do_not_depend_on_the_line_that_calls_the_model():
    model = mlp()
    tool = Counter()
    x, y = torch.rand(2, 8), torch.rand(2, 8)
    with amanda.apply(tool):
        model(x)                         # a "training" line
        train = set(tool.executions)
        tool.executions.clear()
        with torch.no_grad():
            model(y)                     # an "evaluation" line
        evaluation = set(tool.executions)
    assert train == evaluation and len({op for op, _ in train}) == 3


# -- 5. calls that compute no tensor ---------------------------------------------------------------

def test_grad_mode_and_profiler_ranges_are_not_ops():
    tool = Counter()
    with amanda.apply(tool):
        x = torch.ones(2)                 # a factory is an op
        with torch.no_grad():
            y = x + 1
        with torch.autograd.profiler.record_function("range"):
            z = y * 2
        torch.zeros(2)
    names = sorted(tool.names.values())
    assert len(names) == 4 and names[2:] == ["ones", "zeros"], names
    assert torch.equal(z, torch.full((2,), 4.0))


# -- 6. replace_op results ----------------------------------------------------------------------------

class Replace(amanda.Tool):
    def __init__(self, op_name, routine):
        super().__init__()
        self.op_name, self.routine = op_name, routine
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        if context.get_op_name() == self.op_name:
            context.replace_op(self.routine)


@pytest.mark.parametrize("routine, message", [
    (lambda x: (x, x), "the op returns one tensor"),
    (lambda x: None, "returned None"),
    (lambda x: "relu", "returned str"),
    (lambda x: (x,), "the op returns one tensor"),
    (lambda x: x[:1], "shape"),
    (lambda x: x.long(), "dtype"),
])
def test_bad_replace_op_results_are_named(routine, message):
    with pytest.raises(amanda.ToolError, match=message) as info:
        with amanda.apply(Replace("relu", routine)):
            torch.relu(torch.rand(3))
    assert "relu" in str(info.value) and "Replace" in str(info.value)
    assert backend_state() == CLEAN


def test_good_replace_op_results_are_used():
    with amanda.apply(Replace("relu", lambda x: x * 0)):
        assert torch.equal(torch.relu(torch.ones(3)), torch.zeros(3))
    with amanda.apply(Replace("max", lambda x: (x.max(0).values, x.argmax(0)))):
        values, indices = torch.rand(4, 3).max(0)
    assert values.shape == indices.shape == (3,)


# -- 7. routines that change shape or dtype ---------------------------------------------------------

class Returns(amanda.Tool):
    def __init__(self, point, op_name, routine):
        super().__init__()
        self.point, self.op_name, self.routine = point, op_name, routine
        backward = point.endswith("backward")
        self.add_inst_for_op(self.analyse, backward=backward, require_outputs=True)

    def analyse(self, context):
        if context.get_op_name() != self.op_name:
            return
        getattr(context, f"insert_{self.point}_op")(self.routine)


@pytest.mark.parametrize("point", ["before", "after", "before_backward", "after_backward"])
@pytest.mark.parametrize("change, word", [
    (lambda t: t[:1] if t.dim() else t.reshape(1), "shape"),
    (lambda t: t.double(), "dtype"),
])
def test_a_routine_changing_shape_or_dtype_is_named(point, change, word):
    def routine(*tensors):
        return [change(t) if t is not None else None for t in tensors]
    weight = torch.rand(4, 4, requires_grad=True)
    with pytest.raises(amanda.ToolError, match=word) as info:
        with amanda.apply(Returns(point, "matmul", routine)):
            for _ in range(2):   # "before" actions recorded after the op apply next time
                torch.matmul(torch.rand(4, 4), weight).sum().backward()
    text = str(info.value)
    assert "Returns.routine" in text or "routine" in text
    assert "matmul" in text or "MmBackward0" in text
    assert backend_state() == CLEAN


# -- 8. recording on a finished context ---------------------------------------------------------------

def test_recording_after_analysis_is_an_error():
    kept = []

    class Keeper(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(kept.append)

    with amanda.apply(Keeper()):
        torch.relu(torch.rand(2))
    with pytest.raises(amanda.ToolError, match="analysis is over"):
        kept[0].insert_before_op(lambda *t: None)


# -- 9. ops that return None ------------------------------------------------------------------------------

def test_after_routines_run_on_ops_that_return_none():
    tool = Counter()
    x = torch.zeros(3)
    with amanda.apply(tool):
        for _ in range(2):
            x[0] = torch.ones(())
    points = collections.Counter((tool.names[op], point) for (op, point), n
                                 in tool.executions.items() for _ in range(n))
    assert points[("__setitem__", "before")] == points[("__setitem__", "after")] == 2


def test_after_routines_see_the_tensor_setitem_modified():
    seen = []

    class Look(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(self.analyse, require_outputs=True)

        def analyse(self, context):
            if context.get_op_name() == "__setitem__":
                context.insert_after_op(lambda t: seen.append(t.clone()))

    x = torch.zeros(3)
    with amanda.apply(Look()):
        x[1] = 5.0
    assert len(seen) == 1 and seen[0].tolist() == [0.0, 5.0, 0.0]


# -- the cache rule on the cases above ------------------------------------------------------------------

def program(model, x):
    for step in range(4):
        out = model(x)
        if step % 2:
            out = F.softplus(out)           # a branch outside modules
        with amanda.disabled():
            model(x)
        out.sum().backward()
        x[0, 0] = float(step)


def test_cached_and_uncached_runs_execute_the_same_points():
    model = Blocks(reentrant=False)
    cached, uncached = Counter(), Counter()
    x, y = torch.rand(2, 8), torch.rand(2, 8)
    with amanda.apply(cached):
        program(model, x)
    with amanda.apply(uncached), amanda.cache_disabled():
        program(model, y)
    assert cached.executions == uncached.executions
    assert cached.per_point()["bafter"] > 0
    assert backend_state() == CLEAN


def test_a_backward_op_appearing_later_is_analysed():
    model = mlp()
    for p in model[0].parameters():
        p.requires_grad_(False)
    tool = Counter()
    x = torch.rand(2, 8)
    with amanda.apply(tool):
        for _ in range(2):
            model(x).sum().backward()
        before = dict(tool.executions)
        for p in model[0].parameters():
            p.requires_grad_(True)     # unfreeze: the first linear gets backward ops
        model(x).sum().backward()
    new = set(tool.executions) - set(before)
    assert any(point.startswith("b") for _, point in new)


class BackwardCounter(amanda.Tool):
    """Backward points only: forward ops take the fast path once analysed."""

    def __init__(self):
        super().__init__()
        self.executions = collections.Counter()
        self.add_inst_for_op(self._bwd, backward=True)

    def _bwd(self, context):
        key = (context.get_op_name(), context.get_backward_op().name())
        context.insert_before_backward_op(self._count, key=key)

    def _count(self, *tensors, key):
        self.executions[key] += 1


def test_an_in_place_op_returning_none_gets_its_backward_op_when_grad_appears_later():
    """``h[0] = ...`` (``Tensor.__setitem__`` returns None) first runs on a
    tensor that needs no grad, then on one that does: its ``CopySlices``
    node is found from the tensor it modified, cached as without the cache."""
    def run(cache):
        tool = BackwardCounter()
        with amanda.apply(tool), (contextlib.nullcontext() if cache
                                  else amanda.cache_disabled()):
            for step in range(3):
                x = torch.rand(3, 4, requires_grad=step > 0)
                h = x.clone()
                h[0] = torch.tanh(h[1])
                if h.requires_grad:
                    h.sum().backward()
        return tool.executions
    cached, uncached = run(True), run(False)
    assert cached == uncached
    assert uncached[("__setitem__", "CopySlices")] == 2
    assert backend_state() == CLEAN


class Cloner(amanda.Tool):
    """Replaces every forward op's inputs by clones (straight-through)."""

    def __init__(self):
        super().__init__()
        self.add_inst_for_op(self._fwd)

    def _fwd(self, context):
        context.insert_before_op(self._clone)

    def _clone(self, *tensors):
        return [t.clone() if isinstance(t, torch.Tensor) else t for t in tensors]


class CutSegment(nn.Module):
    """A reentrant checkpoint whose segment's graph is cut by no_grad: torch
    runs the nodes before it with no gradient."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4)

    def segment(self, h):
        with torch.no_grad():
            h = h * 2
        return self.inner(h)

    def forward(self, x):
        h = x.clone()
        return self.head(checkpoint(self.segment, h, use_reentrant=True))


def test_a_replaced_input_that_gets_no_gradient_stays_without_one():
    model = CutSegment()
    x = torch.rand(2, 4, requires_grad=True)
    model(x).sum().backward()
    vanilla = [p.grad for p in model.parameters()] + [x.grad]
    model.zero_grad(set_to_none=True)
    y = x.detach().clone().requires_grad_()
    with amanda.apply(Cloner()):
        model(y).sum().backward()
    got = [p.grad for p in model.parameters()] + [y.grad]
    assert [g is None for g in got] == [v is None for v in vanilla]
    assert y.grad is None
    assert all(torch.equal(g, v) for g, v in zip(got, vanilla) if v is not None)
    assert backend_state() == CLEAN


def test_node_hooks_go_without_handles_and_user_hooks_keep_theirs():
    """amanda's node hooks are registered without a ``RemovableHandle``
    while it is applied (docs/pytorch-eager.md); a user's hooks on the same
    nodes keep torch's handles, which still remove them, and torch's
    registration is back once the scope ends."""
    torch_register = torch.autograd.Function._register_hook
    assert "_register_hook" not in torch.autograd.Function.__dict__
    x = torch.randn(3, requires_grad=True)
    seen = []
    tool = Counter()
    for step in range(2):          # analysed, then replayed from the cache
        seen.clear()
        with amanda.apply(tool):
            y = torch.neg(x)
            kept = y.grad_fn.register_prehook(lambda g: seen.append("pre"))
            removed = y.grad_fn.register_hook(lambda gi, go: seen.append("removed"))
            y.grad_fn.register_hook(lambda gi, go: seen.append("post"))
            removed.remove()
            assert type(kept).__name__ == "RemovableHandle"
            y.sum().backward()
        assert seen == ["pre", "post"]
        assert sum(n for (_, point), n in tool.executions.items() if point == "bbefore") \
            == 3 * (step + 1)      # NegBackward0, SumBackward0, AccumulateGrad
    assert "_register_hook" not in torch.autograd.Function.__dict__
    assert torch.autograd.Function._register_hook is torch_register
