"""PyTorch code as users write it, inside `amanda.apply`, compared by
difference with the same code outside it (eager runtime).

Each scenario is checked as in ``tests/pytorch/test_eager_features.py`` (whose
harness this file reuses): identity routines at all four points, returning
their tensors or clones of them, leave every result bit-identical; a
counting tool's (op id, point) executions are the same on a cache hit and
under ``amanda.cache_disabled()``; afterwards torch's mode stack, the global
module hooks and the model's hooks are as before. The tests below the
scenarios each failed before the fix they name.
"""

import contextlib
import copy
import io
import os
import pickle
import threading
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn as nn
from torch.autograd.function import once_differentiable
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import amanda
from tests.pytorch.test_eager_features import Counter, Echo, _run, grads, module_state, same, said
from tests.pytorch.test_eager_features import assert_cache_agrees, torch_state


# -- scenarios --------------------------------------------------------------------------

SCENARIOS = {}


def scenario(name):
    def register(fn):
        SCENARIOS[name] = fn
        return fn
    return register


class MulAdd(torch.autograd.Function):
    """forward and setup_context apart, as torch.func wants them."""

    @staticmethod
    def forward(x, y):
        return x * y + 1

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        return g * y, g * x


class Exp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = x.exp()
        ctx.save_for_backward(out)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        out, = ctx.saved_tensors
        return g * out


@scenario("autograd_function_setup_context")
def _():
    def step(m):
        h = m(torch.randn(3, 4))
        out = Exp.apply(MulAdd.apply(h, h.tanh()))
        out.sum().backward()
        return [out, grads(m)]
    return lambda: nn.Linear(4, 2), step


def _fused_optimizers(m):
    return [torch.optim.Adam(m.parameters(), lr=0.1, fused=True),
            torch.optim.AdamW(m.parameters(), lr=0.1, fused=True),
            torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=True),
            torch.optim.Adagrad(m.parameters(), lr=0.1, fused=True)]


@scenario("fused_optimizers_clip_scheduler")
def _():
    def build():
        m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        optimizers = _fused_optimizers(m)
        return m, optimizers, torch.optim.lr_scheduler.OneCycleLR(optimizers[0], 0.1, 10)

    def step(objects):
        m, optimizers, scheduler = objects
        norms = []
        for opt in optimizers:
            m(torch.randn(3, 4)).pow(2).sum().backward()
            norms.append(nn.utils.clip_grad_norm_(m.parameters(), 0.5))
            opt.step()
            opt.zero_grad()
        scheduler.step()
        return norms + list(m.parameters()) + [opt.state_dict()["state"] for opt in optimizers]
    return build, step


@scenario("batch_and_instance_norm_running_stats")
def _():
    def build():
        return nn.Sequential(nn.Conv2d(3, 3, 3), nn.BatchNorm2d(3, momentum=None),
                             nn.InstanceNorm2d(3, track_running_stats=True), nn.Flatten(),
                             nn.BatchNorm1d(27))

    def step(m):
        outs = [m(torch.randn(4, 3, 5, 5)) for _ in range(2)]
        outs[-1].pow(2).sum().backward()   # (a clone of sum's expanded gradient
        # is contiguous: batch norm's backward kernel then rounds otherwise)
        m.eval()
        outs.append(m(torch.randn(2, 3, 5, 5)))
        m.train()
        return outs + list(m.buffers()) + grads(m)
    return build, step


@scenario("embedding_max_norm")
def _():
    def build():
        m = nn.Embedding(6, 4, max_norm=1.0)
        with torch.no_grad():
            m.weight.mul_(3)      # rows longer than max_norm: renormalised in place
        return m

    def step(m):
        out = m(torch.tensor([[0, 2, 4], [1, 2, 3]]))
        out.sum().backward()
        return [out, m.weight, grads(m)]
    return build, step


class Passing(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class Dispatching(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@scenario("user_modes_inside_apply")
def _():
    def step(m):
        with Passing():
            a = m(torch.randn(3, 4)).relu()
        with Dispatching():
            b = m(torch.randn(3, 4)).tanh()
            (a + b).sum().backward()
        return [a, b, grads(m)]
    return lambda: nn.Linear(4, 2), step


class Logged(torch.Tensor):
    """A user tensor subclass with its own __torch_function__."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


class MyParameter(nn.Parameter):
    pass


@scenario("subclasses_sparse_quantized_complex")
def _():
    def build():
        m = nn.Linear(4, 2)
        m.weight = MyParameter(m.weight.detach().clone())
        return m

    def step(m):
        out = m(torch.randn(3, 4).as_subclass(Logged)).as_subclass(torch.Tensor)
        out.sum().backward()
        s = torch.sparse_coo_tensor(torch.tensor([[0, 1, 2], [1, 0, 3]]), torch.randn(3),
                                    (3, 4), requires_grad=True)
        sparse = torch.sparse.mm(s, m.weight.t())
        sparse.sum().backward()
        q = torch.quantize_per_tensor(torch.randn(3, 4), 0.1, 0, torch.quint8)
        z = torch.randn(3, 4, dtype=torch.cfloat, requires_grad=True)
        (z * z.conj()).real.sum().backward()
        return [out, sparse, s.grad, q.int_repr(), m(q.dequantize()), z.grad, grads(m)]
    return build, step


@scenario("save_load_deepcopy_to_dtype")
def _():
    def step(m):
        out = m(torch.randn(3, 4))
        buffer = io.BytesIO()
        torch.save({"out": out, "state": m.state_dict()}, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer)
        twin = copy.deepcopy(m)
        twin.load_state_dict(loaded["state"])
        pickled = pickle.loads(pickle.dumps(m))
        double = copy.deepcopy(m).double()
        x = torch.ones(1, 4)
        return [out, loaded["out"], twin(x), pickled(x), double(x.double())]
    return lambda: nn.Linear(4, 2), step


def halve_grad(p):
    p.grad.mul_(0.5)


@scenario("inference_mode_decorators_hooks_inside")
def _():
    @torch.inference_mode()
    def infer(m, x):
        return m(x)

    @torch.no_grad()
    def evaluate(m, x):
        return m(x)

    def step(m):
        x = torch.randn(3, 4)
        handle = m.register_forward_hook(lambda mod, args, out: out * 2)
        a, b = infer(m, x), evaluate(m, x)
        handles = [p.register_post_accumulate_grad_hook(halve_grad) for p in m.parameters()]
        c = m(x)
        c.sum().backward()
        for h in [handle, *handles]:
            h.remove()
        return [a, b, c, a.clone(), grads(m)]
    return lambda: nn.Linear(4, 2), step


@scenario("forward_mode_ad")
def _():
    def step(m):
        x, t = torch.randn(3, 4), torch.randn(3, 4)
        with fwAD.dual_level():
            primal, tangent = fwAD.unpack_dual(m(fwAD.make_dual(x, t)).tanh())
        jvp = torch.func.jvp(lambda x: m(x).sin(), (x,), (t,))
        return [primal, tangent, *jvp, torch.func.jacfwd(m)(x[0])]
    return lambda: nn.Linear(4, 2), step


@scenario("saved_tensors_hooks")
def _():
    def step(m):
        with torch.autograd.graph.save_on_cpu():
            a = m(torch.randn(3, 4)).tanh()
            a.sum().backward()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t * 2, lambda t: t / 2):
            b = m(torch.randn(3, 4)).sigmoid()
        b.sum().backward()
        return [a, b, grads(m)]
    return lambda: nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 2)), step


@scenario("thread_inside_apply")
def _():
    def step(m):
        found = {}

        def work():     # documented: another thread runs plain PyTorch
            found["out"] = m(torch.randn(3, 4))
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
        out = m(torch.randn(3, 4))
        out.sum().backward()
        return [found["out"], out, grads(m)]
    return lambda: nn.Linear(4, 2), step


NAMES = sorted(SCENARIOS)
# what amanda says in a scenario (none elsewhere)
SAID = {"thread_inside_apply": [amanda.NotInstrumentedWarning]}
# routines under torch.func transforms receive functorch-wrapped tensors
# (documented); user subclasses are what the program computes
STRANGE = {"forward_mode_ad": {"functorch"},
           "subclasses_sparse_quantized_complex": {"Logged", "MyParameter"}}


@pytest.mark.parametrize("clone", [False, True], ids=["same", "clones"])
@pytest.mark.parametrize("name", NAMES)
def test_identity_routines_leave_user_code_bit_identical(name, clone):
    build, step = SCENARIOS[name]()
    plain = _run(build, step)
    said.clear()
    tool = Echo(clone)
    instrumented = _run(build, step, tool)
    assert [type(w.message) for w in said] == SAID.get(name, [])
    assert len(plain) == len(instrumented)
    assert [i for i, (a, b) in enumerate(zip(plain, instrumented)) if not same(a, b)] == []
    assert tool.calls["before"] > 0
    assert {kind for _, _, kind in tool.strange} == STRANGE.get(name, set())


@pytest.mark.parametrize("name", NAMES)
def test_user_code_counts_the_same_on_a_cache_hit_and_without_the_cache(name):
    assert_cache_agrees(*SCENARIOS[name]())


# -- forward-mode AD: replacements pass the tangent straight through ----------------------

class Fresh(amanda.Tool):
    """Routines before and after every op that return new tensors (detached
    copies, or scaled ones): the values a quantizer or a mask would give."""

    def __init__(self, scale=1.0):
        super().__init__()
        self.scale = scale
        self.add_inst_for_op(self._fwd)

    def _fwd(self, context):
        context.insert_before_op(self._fresh)
        context.insert_after_op(self._fresh)

    def _fresh(self, *tensors):
        return [t.detach() * self.scale for t in tensors]


def _forward_ad_results(fn, x, t):
    with fwAD.dual_level():
        primal, tangent = fwAD.unpack_dual(fn(fwAD.make_dual(x, t)))
    return [primal, tangent, *torch.func.jvp(fn, (x,), (t,)), torch.func.jacfwd(fn)(x)]


def test_forward_mode_tangents_pass_straight_through_a_replacement():
    """Before: a routine's replacement of a tensor carrying a tangent kept
    the routine's tangent (none for a detached value: jvp returned None or
    zeros), or, where the tensor also required grad, failed in torch
    ("You must implement the jvp function")."""
    w = torch.randn(3, requires_grad=True)

    def fn(x):
        return (x.sin() * 3).exp().sum(0) * w

    x, t = torch.linspace(0, 1, 6).reshape(2, 3), torch.ones(2, 3)
    plain = _forward_ad_results(fn, x, t)
    with amanda.apply(Fresh()):
        instrumented = _forward_ad_results(fn, x, t)
    assert all(b is not None and same(a, b) for a, b in zip(plain, instrumented))


def test_forward_and_reverse_mode_agree_under_a_replacing_routine():
    """Straight-through is one rule for both modes: with a routine that
    doubles every tensor, jacfwd equals jacrev (the tangent is not doubled
    where the gradient is not)."""
    def fn(x):
        return x.sin().exp() * 2

    x = torch.linspace(0, 1, 4)
    with amanda.apply(Fresh(scale=2.0)):
        forward = torch.func.jacfwd(fn)(x)
        reverse = torch.func.jacrev(fn)(x)
    assert torch.allclose(forward, reverse)


# -- ops that write arguments without bumping their version counters ----------------------

class CloneBefore(amanda.Tool):
    """Replaces every input of ops named ``names`` by a clone."""

    def __init__(self, *names):
        super().__init__()
        self.names = names
        self.add_inst_for_op(self._fwd)

    def _fwd(self, context):
        if context.get_op_name() in self.names:
            context.insert_before_op(lambda *ts: [t.clone() for t in ts])


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.Adam(p, lr=0.1, fused=True),
    lambda p: torch.optim.AdamW(p, lr=0.1, fused=True, amsgrad=True),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    lambda p: torch.optim.Adagrad(p, lr=0.1, fused=True),
], ids=["adam", "adamw_amsgrad", "sgd_momentum", "adagrad"])
def test_a_fused_optimizer_step_on_replaced_arguments_updates_the_parameters(make):
    """Before: the fused kernels (``_fused_adam_``...) write parameters and
    state without bumping version counters, so the write-back rule missed
    them: the parameters of a fused optimizer never moved."""
    results = []
    for tool in (None, CloneBefore("_fused_adam_", "_fused_adamw_", "_fused_sgd_",
                                   "_fused_adagrad_")):
        torch.manual_seed(0)
        m = nn.Linear(4, 2)
        opt = make(m.parameters())
        for _ in range(3):
            m(torch.ones(3, 4)).sum().backward()
            with amanda.apply(tool) if tool else contextlib.nullcontext():
                opt.step()
            opt.zero_grad()
        results.append(list(m.parameters()) + [
            s for state in opt.state.values() for s in state.values()])
    assert all(same(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("module", [nn.BatchNorm1d(3), nn.BatchNorm1d(3, momentum=None),
                                    nn.InstanceNorm1d(3, track_running_stats=True)],
                         ids=["batch_norm", "cumulative", "instance_norm"])
def test_replaced_running_statistics_are_updated(module):
    """Before: batch and instance norm write their running statistics
    without bumping version counters: replaced by a before-routine, the
    buffers stayed at their initial values."""
    results = []
    for tool in (None, CloneBefore("batch_norm", "instance_norm")):
        torch.manual_seed(0)
        m = copy.deepcopy(module)
        with amanda.apply(tool) if tool else contextlib.nullcontext():
            for _ in range(3):
                m(torch.randn(4, 3, 5))
            m.eval()
            out = m(torch.randn(2, 3, 5))
        results.append(list(m.buffers()) + [out])
    assert all(same(a, b) for a, b in zip(*results))


def test_embedding_max_norm_on_a_replaced_weight_renormalises_the_parameter():
    """Before: ``F.embedding`` renormalises its weight in place under
    ``no_grad``; written back into the parameter with autograd on, it
    raised "a leaf Variable that requires grad is being used in an in-place
    operation"."""
    build, step = SCENARIOS["embedding_max_norm"]()
    plain = _run(build, step)
    instrumented = _run(build, step, CloneBefore("embedding"))
    assert all(same(a, b) for a, b in zip(plain, instrumented))


# -- loud limits ---------------------------------------------------------------------------

def test_replacing_a_strided_nested_tensor_that_requires_grad_is_a_tool_error():
    """torch's autograd functions refuse strided nested tensors; before,
    torch's internal error ("NestedTensorImpl doesn't support sizes") came
    out of amanda's straight-through. The jagged layout works."""
    m = nn.Linear(4, 2)
    parts = [torch.randn(2, 4), torch.randn(3, 4)]
    before = torch_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)      # torch: strided is a prototype
        strided = torch.nested.nested_tensor(parts)
        with pytest.raises(amanda.ToolError, match="strided layout.*jagged"):
            with amanda.apply(Echo(clone=True)):
                m(strided)
    assert torch_state() == before
    jagged = torch.nested.nested_tensor(parts, layout=torch.jagged)
    plain = m(jagged).values()
    with amanda.apply(Echo(clone=True)):
        assert torch.equal(m(jagged).values(), plain)


# -- exits and the module stack --------------------------------------------------------

class Interruptible(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)
        self.interrupt = None

    def forward(self, x):
        h = self.a(x).relu()
        if self.interrupt is not None:
            raise self.interrupt
        return self.b(h)


def _steps_after(interruptions):
    torch.manual_seed(0)
    m = Interruptible()
    tool = Counter()
    before, hooks = torch_state(), module_state(m)
    with amanda.apply(tool):
        for interrupt in interruptions:
            m.interrupt = interrupt
            with contextlib.suppress(BaseException):
                m(torch.randn(3, 4)).sum().backward()
        m.interrupt = None
        tool.executions.clear()
        x = torch.randn(3, 4)          # an op outside modules first
        m(x).sum().backward()
    assert torch_state() == before and module_state(m) == hooks
    return dict(tool.executions)


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit, ValueError])
def test_a_step_after_an_interrupted_one_keeps_its_ids(interrupt):
    """Before: torch pops a module from amanda's stack on an ``Exception``
    only (``always_call`` hooks); after a ``KeyboardInterrupt`` caught
    inside ``apply`` the next ops were taken for ops inside the interrupted
    module: other ids for every op of the following steps."""
    assert _steps_after([interrupt(), interrupt()]) == _steps_after([])


@pytest.mark.parametrize("mode", [Passing, Dispatching])
def test_a_user_mode_around_apply_adds_no_points(mode):
    """Before: with a user's TorchDispatchMode entered outside ``apply``,
    the ATen ops its handler calls in the backward pass (which runs under
    amanda's mode) were counted as forward ops."""
    def run(outer):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        tool = Counter()
        with outer:
            with amanda.apply(tool):
                m(torch.randn(3, 4)).sum().backward()
        return dict(tool.executions)
    assert run(mode()) == run(contextlib.nullcontext())


def test_a_user_dispatch_mode_inside_apply_adds_no_points():
    def run(inner):
        torch.manual_seed(0)
        m = nn.Linear(4, 2)
        tool = Counter()
        with amanda.apply(tool):
            with inner:
                m(torch.randn(3, 4)).sum().backward()
        return dict(tool.executions)
    assert run(Dispatching()) == run(contextlib.nullcontext())


# -- forked processes -------------------------------------------------------------------

class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.full((4,), float(i)).sin() * 2


class PidWriter(amanda.Tool):
    """Writes the id of the process each routine runs in to a file."""

    def __init__(self, path):
        super().__init__()
        self.path = path
        self.add_inst_for_op(lambda context: context.insert_before_op(self._write))

    def _write(self, *tensors):
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()}\n")


@pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="no fork")
def test_dataloader_workers_forked_inside_apply_run_plain_and_amanda_says_so(tmp_path):
    """Before: a forked DataLoader worker inherited amanda's mode and ran
    the routines of its copy of the tools on the dataset's torch calls,
    unseen by the parent (its counts, traces and state are lost), silently."""
    def load():
        loader = torch.utils.data.DataLoader(Squares(), batch_size=4, num_workers=2,
                                             multiprocessing_context="fork")
        return [batch for batch in loader]
    plain = load()
    path = tmp_path / "pids"
    before = torch_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with amanda.apply(PidWriter(path)):
            batches = load()
            torch.ones(2).sum()
    assert torch_state() == before
    assert all(same(a, b) for a, b in zip(plain, batches)) and len(plain) == len(batches)
    assert set(path.read_text().split()) == {str(os.getpid())}
    said_here = [w for w in caught if issubclass(w.category, amanda.NotInstrumentedWarning)]
    assert len(said_here) == 1 and "forked" in str(said_here[0].message)
    assert said_here[0].filename == __file__


def test_a_module_called_in_a_thread_outside_apply_is_said_to_run_plain():
    """Scopes are per thread (the contract); before, a model run by another
    thread while one thread was inside apply got no points, silently."""
    m = nn.Linear(4, 2)
    tool = Counter()
    found = []

    def work():
        for _ in range(3):
            found.append(m(torch.ones(1, 4)))      # the user's line, warned once

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with amanda.apply(tool):
            thread = threading.Thread(target=work, name="worker")
            thread.start()
            thread.join()
        work()                                      # no scope anywhere: nothing said
    said_here = [w for w in caught if issubclass(w.category, amanda.NotInstrumentedWarning)]
    assert len(said_here) == 1 and "'worker'" in str(said_here[0].message)
    assert said_here[0].filename == __file__
    assert not tool.executions                      # the thread ran plain PyTorch
    assert all(torch.equal(out, found[0]) for out in found)


class Ids(amanda.Tool):
    def __init__(self):
        super().__init__()
        self.ids = []
        self.add_inst_for_op(lambda c: self.ids.append((c.get_op_name(), c.get_op_id())))


@pytest.mark.parametrize("inner", [Passing, Dispatching])
def test_a_user_mode_inside_apply_keeps_the_op_ids_of_the_model(inner):
    """Before: a user's TorchFunctionMode inside apply made its handler the
    site of every op it passed on: other ids than without the mode, and the
    two distinct ``sum`` ops below (two lines) merged into one op, analysed
    once."""
    def run(mode):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        tool = Ids()
        with amanda.apply(tool), mode:
            x = torch.randn(3, 4)
            m(x).sum()
            m(x).mean().sum()
        return tool.ids
    plain = run(contextlib.nullcontext())
    assert len({op_id for _, op_id in plain}) == 7
    assert run(inner()) == plain


def test_a_write_through_a_view_of_a_replacement_is_said():
    """A known limit made loud: torch.autograd.functional.jacobian with
    ``vectorize=True`` fills its basis with ``chunk.diagonal().fill_(1)``;
    with routines returning clones, the view is a view of a clone and the
    write misses ``chunk``: the Jacobian was wrong, silently. Routines that
    return the tensors they receive keep it right, and nothing is said."""
    m = nn.Linear(4, 2)
    x = torch.randn(4)

    def jacobian():
        return torch.autograd.functional.jacobian(lambda x: m(x).tanh(), x, vectorize=True)
    plain = jacobian()
    for clone in (False, True):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with amanda.apply(Echo(clone)):
                result = jacobian()
        said_here = [w for w in caught if issubclass(w.category, amanda.NotBitExactWarning)]
        if clone:
            assert len(said_here) == 1 and "view" in str(said_here[0].message)
            assert said_here[0].filename == __file__
        else:
            assert said_here == [] and torch.equal(result, plain)


class ReplaceSin(amanda.Tool):
    def __init__(self):
        super().__init__()
        self.add_inst_for_op(lambda c: c.get_op_name() == "sin" and c.replace_op(
            lambda x: x.sin() * 1))


def test_replace_op_outputs_have_no_history_in_forward_mode_either():
    """Under isolation a replace_op's outputs have no autograd history;
    before, forward mode (jvp, dual tensors) differentiated the routine
    where reverse mode saw no gradient: jacfwd and jacrev disagreed."""
    def fn(x):
        return x.sin().exp()

    x = torch.linspace(0, 1, 3)
    with amanda.apply(ReplaceSin()):
        forward = torch.func.jacfwd(fn)(x)
        reverse = torch.func.jacrev(fn)(x)
        with fwAD.dual_level():
            tangent = fwAD.unpack_dual(fn(fwAD.make_dual(x, torch.ones(3)))).tangent
    assert torch.equal(forward, reverse) and not reverse.any()
    assert tangent is None or not tangent.any()
