"""PyTorch features inside `amanda.apply`, each compared with the same code
outside it (eager runtime).

For every feature (a small program: ``build()`` makes its objects outside any
scope, ``step(objects)`` runs it and returns the tensors to compare):

(a) identity routines before/after every forward and backward op, returning
    their tensors or clones of them, leave the results bit-identical;
(b) a counting tool's (op id, point) executions are the same in a second scope
    (cache hit) and under ``amanda.cache_disabled()``;
(c) after the scope the modules and torch's state are as before (no hook,
    mode or patched function left);
(d) routines receive plain tensors (or ``None`` where a gradient is absent),
    never a fake, functorch-wrapped or subclass tensor.
"""

import collections
import contextlib
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize, prune
from torch.nn.utils import parametrizations
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils.checkpoint import checkpoint

import amanda


# -- tools --------------------------------------------------------------------------------

def _kind(t):
    """'plain' for a tensor (or None), 'functorch' for a tensor a torch.func
    transform wraps (documented), else the type's name."""
    if t is None:
        return "plain"
    if type(t) not in (torch.Tensor, nn.Parameter):
        return type(t).__name__
    return "functorch" if torch._C._functorch.is_functorch_wrapped_tensor(t) else "plain"


class Echo(amanda.Tool):
    """Routines at all four points returning their tensors (or clones)."""

    def __init__(self, clone):
        super().__init__()
        self.clone = clone
        self.calls = collections.Counter()
        self.strange = []
        self.add_inst_for_op(self._fwd)
        self.add_inst_for_op(self._bwd, backward=True)

    def _fwd(self, context):
        name = context.get_op_name()
        context.insert_before_op(self.echo, point="before", name=name)
        context.insert_after_op(self.echo, point="after", name=name)

    def _bwd(self, context):
        name = context.get_backward_op().__name__
        context.insert_before_backward_op(self.echo, point="bbefore", name=name)
        context.insert_after_backward_op(self.echo, point="bafter", name=name)

    def echo(self, *tensors, point, name):
        self.calls[point] += 1
        for t in tensors:
            if _kind(t) != "plain":
                self.strange.append((name, point, _kind(t)))
        if not self.clone:
            return tensors
        return [None if t is None else t.clone() for t in tensors]


class Counter(amanda.Tool):
    """Counts executions of (op id, point) at all four points."""

    def __init__(self):
        super().__init__()
        self.executions = collections.Counter()
        self.add_inst_for_op(self._fwd)
        self.add_inst_for_op(self._fwd_after, require_outputs=True)
        self.add_inst_for_op(self._bwd, backward=True)
        self.add_inst_for_op(self._bwd_after, backward=True, require_outputs=True)

    def _fwd(self, context):
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


# -- torch state ---------------------------------------------------------------------------

def torch_state():
    from torch.nn.modules import module
    from torch._dynamo import eval_frame
    return (torch._C._len_torch_function_stack(),
            torch._C._is_torch_function_mode_enabled(),
            len(module._global_forward_hooks), len(module._global_forward_pre_hooks),
            len(module._global_backward_hooks), len(module._global_backward_pre_hooks),
            len(module._global_module_registration_hooks),
            torch.autograd.backward, torch.autograd.grad,
            torch.autograd.Variable._execution_engine.run_backward,
            torch.Tensor.backward, nn.Module.__call__, nn.Module._call_impl,
            eval_frame._stance.stance, torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cpu"),
            torch._C._is_multithreading_enabled(), torch.cuda.CUDAGraph.capture_begin,
            "_register_hook" in torch.autograd.Function.__dict__,
            torch._C._get_cpu_allow_fp16_reduced_precision_reduction()
            if hasattr(torch._C, "_get_cpu_allow_fp16_reduced_precision_reduction") else None)


def module_state(objects):
    found = []

    def visit(obj):
        if isinstance(obj, nn.Module):
            for name, m in obj.named_modules(remove_duplicate=False):
                found.append((name, type(m).__name__,
                              tuple(m._forward_hooks), tuple(m._forward_pre_hooks),
                              tuple(m._backward_hooks), tuple(m._backward_pre_hooks),
                              tuple(m._state_dict_hooks), tuple(m._load_state_dict_pre_hooks),
                              tuple(m.__dict__.get("_forward_hooks_with_kwargs", {})),
                              "forward" in m.__dict__))
                for pname, p in m.named_parameters(recurse=False):
                    found.append((name, pname, p._backward_hooks and tuple(p._backward_hooks)))
        elif isinstance(obj, (list, tuple)):
            for o in obj:
                visit(o)
        elif isinstance(obj, dict):
            for o in obj.values():
                visit(o)
    visit(objects)
    return found


def flat(value):
    if value is None:
        return []
    if isinstance(value, (bool, int, float)):
        return [torch.tensor(value)]
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in flat(v)]
    if isinstance(value, dict):
        return [t for k in sorted(value) for t in flat(value[k])]
    if hasattr(value, "_fields") or hasattr(value, "__dataclass_fields__"):
        return flat(tuple(value))
    raise TypeError(type(value))


def same(a, b):
    if type(a) is not type(b) or a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_sparse:
        return torch.equal(a.coalesce().to_dense(), b.coalesce().to_dense())
    if a.is_nested:
        return all(torch.equal(x, y, ) for x, y in zip(a.unbind(), b.unbind()))
    return torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                 and torch.equal(a.nan_to_num(), b.nan_to_num()))


# -- features ------------------------------------------------------------------------------

FEATURES = {}


def feature(name, skip=None):
    def register(fn):
        FEATURES[name] = (fn, skip)
        return fn
    return register


def grads(module):
    return [p.grad for p in module.parameters()]


def train_step(m, *inputs):
    out = m(*inputs)
    loss = sum(t.float().sum() for t in flat(out))
    loss.backward()
    return [out, grads(m)]


class Symmetric(nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).transpose(0, 1)


@feature("parametrize_orthogonal")
def _():
    def build():
        return parametrizations.orthogonal(nn.Linear(4, 4))
    return build, lambda m: train_step(m, torch.randn(3, 4)) + [m.weight]


@feature("parametrize_custom_cached")
def _():
    def build():
        m = nn.Linear(4, 4)
        parametrize.register_parametrization(m, "weight", Symmetric())
        return m

    def step(m):
        with parametrize.cached():
            out = m(torch.randn(3, 4)) + m(torch.randn(3, 4))
        out.sum().backward()
        return [out, grads(m)]
    return build, step


@feature("weight_norm_parametrization")
def _():
    return (lambda: parametrizations.weight_norm(nn.Linear(4, 3)),
            lambda m: train_step(m, torch.randn(2, 4)))


@feature("weight_norm_hook")
def _():
    def build():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return nn.utils.weight_norm(nn.Linear(4, 3))
    return build, lambda m: train_step(m, torch.randn(2, 4))


@feature("spectral_norm_hook")
def _():
    def step(m):
        a = train_step(m, torch.randn(2, 4))
        b = train_step(m, torch.randn(2, 4))
        return a + b + [m.weight_u, m.weight_v]
    return lambda: nn.utils.spectral_norm(nn.Linear(4, 3)), step


@feature("spectral_norm_parametrization")
def _():
    def step(m):
        return (train_step(m, torch.randn(2, 4)) + train_step(m, torch.randn(2, 4))
                + [m.parametrizations.weight[0]._u])
    return lambda: parametrizations.spectral_norm(nn.Linear(4, 3)), step


@feature("prune_l1_unstructured")
def _():
    def build():
        m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        prune.l1_unstructured(m[0], "weight", amount=0.5)
        prune.random_unstructured(m[2], "bias", amount=0.5)
        return m
    return build, lambda m: train_step(m, torch.randn(3, 4))


@feature("multihead_attention_train")
def _():
    def step(m):
        x = torch.randn(2, 5, 8)
        out, weights = m(x, x, x, need_weights=True)
        (out.sum() + weights.sum()).backward()
        return [out, weights, grads(m)]
    return lambda: nn.MultiheadAttention(8, 2, batch_first=True), step


PADDING = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])


@feature("multihead_attention_fast_path")
def _():
    def step(m):
        x = torch.randn(2, 5, 8)
        mask = PADDING
        with torch.no_grad():
            out, weights = m(x, x, x, need_weights=False, key_padding_mask=mask)
        return [out, weights]
    return lambda: nn.MultiheadAttention(8, 2, batch_first=True).eval(), step


@feature("transformer_encoder_nested_tensor")
def _():
    def build():
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()

    def step(m):
        x = torch.randn(2, 5, 8)
        mask = PADDING
        with torch.no_grad():
            return [m(x, src_key_padding_mask=mask)]
    return build, step


@feature("transformer_train")
def _():
    def build():
        return nn.Transformer(8, 2, 1, 1, 16, dropout=0.0, batch_first=True)
    return build, lambda m: train_step(m, torch.randn(2, 5, 8), torch.randn(2, 3, 8))


@feature("lstm_packed_sequence")
def _():
    def step(m):
        x = torch.randn(3, 5, 4)
        packed = pack_padded_sequence(x, torch.tensor([5, 3, 2]), batch_first=True)
        out, (h, c) = m(packed)
        padded, lengths = pad_packed_sequence(out, batch_first=True)
        (padded.sum() + h.sum() + c.sum()).backward()
        return [padded, lengths, h, c, grads(m)]
    return lambda: nn.LSTM(4, 6, num_layers=2, batch_first=True), step


@feature("gru")
def _():
    return (lambda: nn.GRU(4, 6, bidirectional=True),
            lambda m: train_step(m, torch.randn(5, 2, 4)))


@feature("embedding_bag")
def _():
    def step(m):
        out = m(torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 4]),
                per_sample_weights=torch.rand(8))
        out.sum().backward()
        return [out, grads(m)]
    return lambda: nn.EmbeddingBag(10, 3, mode="sum"), step


@feature("sparse_embedding_sgd")
def _():
    def build():
        m = nn.Embedding(10, 3, sparse=True)
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    def step(objects):
        m, opt = objects
        out = m(torch.tensor([[1, 2], [4, 1]]))
        out.sum().backward()
        g = m.weight.grad.clone()
        opt.step()
        opt.zero_grad()
        return [out, g, m.weight]
    return build, step


@feature("complex_fft")
def _():
    def step(m):
        x = torch.randn(2, 8)
        spec = torch.fft.rfft(m(x), dim=-1)
        spec = spec * torch.exp(1j * torch.arange(spec.shape[-1]))
        z = torch.complex(x, x.flip(-1))
        out = torch.fft.irfft(spec, n=8).abs().sum() + torch.fft.fft(z).abs().sum()
        out.backward()
        return [spec, out, grads(m)]
    return lambda: nn.Linear(8, 8), step


@feature("distributions_rsample")
def _():
    def step(m):
        loc, scale = m(torch.randn(3, 4)).chunk(2, dim=-1)
        d = torch.distributions.Normal(loc, F.softplus(scale))
        torch.manual_seed(1)
        sample = d.rsample()
        c = torch.distributions.Categorical(logits=loc)
        loss = d.log_prob(sample).sum() + sample.sum() + c.entropy().sum()
        loss.backward()
        return [sample, loss, grads(m)]
    return lambda: nn.Linear(4, 4), step


@feature("func_vmap")
def _():
    def step(m):
        return [torch.func.vmap(m)(torch.randn(5, 3, 4)),
                torch.func.vmap(torch.dot)(torch.randn(3, 4), torch.randn(3, 4))]
    return lambda: nn.Linear(4, 2), step


@feature("func_grad_functional_call")
def _():
    def step(m):
        params = dict(m.named_parameters())
        x = torch.randn(3, 4)

        def loss(p, x):
            return torch.func.functional_call(m, p, (x,)).pow(2).sum()
        g = torch.func.grad(loss)(params, x)
        per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(
            params, x.unsqueeze(1))
        return [g, per_sample]
    return lambda: nn.Linear(4, 2), step


@feature("func_jacrev")
def _():
    def step(m):
        x = torch.randn(4)
        return [torch.func.jacrev(m)(x), torch.func.jacfwd(torch.sin)(x)]
    return lambda: nn.Linear(4, 2), step


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        x, = ctx.saved_tensors
        return 2 * x * g


class AddOneInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.add_(1)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


@feature("autograd_function")
def _():
    def step(m):
        h = Square.apply(m(torch.randn(3, 4)))
        h = AddOneInPlace.apply(h * 1)
        h.sum().backward()
        return [h, grads(m)]
    return lambda: nn.Linear(4, 2), step


@feature("user_hooks")
def _():
    def build():
        m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
        m[0].register_forward_hook(lambda mod, args, out: out * 2)
        m[0].register_forward_pre_hook(lambda mod, args: (args[0] + 1,))
        m[2].register_full_backward_hook(lambda mod, gi, go: (gi[0] * 3,))
        m[1].register_full_backward_pre_hook(lambda mod, go: (go[0] + 1,))
        return m

    def step(m):
        x = torch.randn(3, 4, requires_grad=True)
        h = m[0](x)
        h.register_hook(lambda g: g * 0.5)
        out = m[2](m[1](h))
        out.sum().backward()
        return [out, x.grad, grads(m)]
    return build, step


def _optimizer_feature(make):
    def build():
        m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        return m, make(m.parameters())

    def step(objects):
        m, opt = objects
        outs = []
        for _ in range(2):
            out = m(torch.randn(3, 4))
            out.sum().backward()
            opt.step()
            opt.zero_grad()
            outs.append(out)
        return outs + list(m.parameters()) + [opt.state_dict()["state"]]
    return build, step


feature("adam_foreach")(lambda: _optimizer_feature(
    lambda p: torch.optim.Adam(p, lr=0.1, foreach=True)))
feature("adam_for_loop")(lambda: _optimizer_feature(
    lambda p: torch.optim.Adam(p, lr=0.1, foreach=False, fused=False)))
feature("adamw")(lambda: _optimizer_feature(lambda p: torch.optim.AdamW(p, lr=0.1)))
feature("sgd_momentum")(lambda: _optimizer_feature(
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True)))


@feature("swa_averaged_model")
def _():
    def build():
        m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        return m, torch.optim.swa_utils.AveragedModel(m)

    def step(objects):
        m, avg = objects
        for _ in range(2):
            m(torch.randn(3, 4)).sum().backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
            avg.update_parameters(m)
        return list(avg.parameters()) + [avg.n_averaged, avg(torch.randn(3, 4))]
    return build, step


def _grad_scaler():
    try:
        torch.amp.GradScaler("cpu")
    except Exception:   # noqa: BLE001 - no CPU scaler in this torch
        return "no GradScaler on CPU"
    return None


@feature("grad_scaler_cpu", skip=_grad_scaler)
def _():
    def build():
        m = nn.Linear(4, 2)
        return m, torch.optim.SGD(m.parameters(), lr=0.1), torch.amp.GradScaler("cpu")

    def step(objects):
        m, opt, scaler = objects
        out = m(torch.randn(3, 4))
        scaler.scale(out.sum()).backward()
        scaler.step(opt)
        scaler.update()
        return [out, scaler.get_scale(), list(m.parameters())]
    return build, step


@feature("autocast_cpu_bfloat16")
def _():
    def step(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(torch.randn(3, 4))
        out.float().sum().backward()
        return [out, grads(m)]
    return lambda: nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 2)), step


@feature("inplace_views_and_data")
def _():
    def step(m):
        h = m(torch.randn(3, 4))
        v = h[:, :2]
        v.mul_(2)
        h.t()[0].add_(1)
        h[1] = torch.zeros(4)
        y = h.view(-1)
        y[3:5] += 1
        loss = h.sum()
        loss.backward()
        g = grads(m)
        m.weight.data = m.weight.data * 0.5
        m.bias.data.zero_()
        return [h, g, m(torch.randn(3, 4))]
    return lambda: nn.Linear(4, 4), step


@feature("grad_mode_nesting")
def _():
    def step(m):
        x = torch.randn(3, 4)
        outs = []
        with torch.no_grad():
            a = m(x)
            with torch.enable_grad():
                b = m(x)
                with torch.inference_mode():
                    c = m(x)
                    with torch.inference_mode(False):
                        d = m(x)
        with torch.set_grad_enabled(False):
            e = m(x)
        b.sum().backward()
        outs += [a, b, c, d, e, a.requires_grad, b.requires_grad, c.is_inference()]
        return [t if isinstance(t, torch.Tensor) else torch.tensor(t) for t in outs] + grads(m)
    return lambda: nn.Linear(4, 2), step


@feature("retain_graph_twice")
def _():
    def step(m):
        out = m(torch.randn(3, 4)).tanh().sum()
        out.backward(retain_graph=True)
        first = [g.clone() for g in grads(m)]
        out.backward()
        return [first, grads(m)]
    return lambda: nn.Linear(4, 2), step


@feature("double_backward")
def _():
    def step(m):
        x = torch.randn(3, 4, requires_grad=True)
        y = m(x).tanh().sum()
        gx, = torch.autograd.grad(y, x, create_graph=True)
        gx.pow(2).sum().backward()
        return [gx, x.grad, grads(m)]
    return lambda: nn.Linear(4, 2), step


@feature("gradient_accumulation")
def _():
    def step(m):
        for _ in range(2):
            m(torch.randn(3, 4)).sum().backward()
        return grads(m)
    return lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), step


@feature("data_parallel_cpu")
def _():
    def build():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return nn.DataParallel(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    return build, lambda m: train_step(m, torch.randn(3, 4))


class TupleBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x).relu(), self.b(x).sigmoid()


@feature("checkpoint_tuple_output")
def _():
    def step(m):
        x = torch.randn(3, 4, requires_grad=True)
        outs = []
        for reentrant in (False, True):
            a, b = checkpoint(m, x, use_reentrant=reentrant)
            (a * b).sum().backward()
            outs += [a, b]
        return outs + [x.grad] + grads(m)
    return TupleBlock, step


def _higher_order(name):
    def skip():
        return None if hasattr(torch, name) else f"no torch.{name}"
    return skip


@feature("torch_cond", skip=_higher_order("cond"))
def _():
    def step(m):
        x = torch.randn(3, 4)
        out = torch.cond(x.sum() > 0, lambda x: m(x).relu(), lambda x: m(x).tanh(), (x,))
        out2 = torch.cond(x.sum() <= 0, lambda x: m(x).relu(), lambda x: m(x).tanh(), (x,))
        return [out, out2]
    return lambda: nn.Linear(4, 4), step


@feature("torch_while_loop", skip=_higher_order("_higher_order_ops"))
def _():
    from torch._higher_order_ops.while_loop import while_loop

    def step(m):
        x = torch.randn(3, 4)
        i = torch.tensor(0)
        i, x = while_loop(lambda i, x: i < 3, lambda i, x: (i + 1, m(x).tanh()), (i, x))
        return [i, x]
    return lambda: nn.Linear(4, 4), step


# -- the checks ----------------------------------------------------------------------------

def _case(name):
    make, skip = FEATURES[name]
    if skip is not None and skip() is not None:
        pytest.skip(skip())
    return make()


def _run(build, step, tool=None, context=contextlib.nullcontext):
    torch.manual_seed(0)
    objects = build()
    state = module_state(objects)
    torch_before = torch_state()
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if tool is None:
            results = step(objects)
        else:
            with amanda.apply(tool), context():
                results = step(objects)
    assert torch_state() == torch_before
    assert module_state(objects) == state
    said.extend(w for w in caught if issubclass(w.category, (amanda.NotBitExactWarning,
                                                              amanda.NotInstrumentedWarning)))
    return [t if isinstance(t, torch.Tensor) else torch.tensor(t) for t in flat(results)]


said = []   # amanda's warnings in the last runs


NAMES = sorted(FEATURES)


# torch's fused fast path refuses to run while a torch-function mode is on
# (has_torch_function): inside apply these take the ordinary path, which
# differs by rounding; amanda says so (NotBitExactWarning)
FAST_PATH = {"multihead_attention_fast_path", "transformer_encoder_nested_tensor"}
# routines receive the tensors a torch.func transform wraps (documented)
FUNCTORCH = {"func_vmap", "func_grad_functional_call", "func_jacrev"}
# not fixed (strict: fixing one turns it red); docs/pytorch-eager.md, Limits
VIEW = "a view op's input replaced: in-place writes through the view miss the original"
KNOWN = {
    ("distributions_rsample", True): "a replaced tensor's gradient terms are summed in "
                                     "another order (rounding)",
    # a routine returning a clone per position gives attention distinct
    # query/key/value where the plain call passed one tensor thrice:
    # multi_head_attention_forward then takes its separate-projection path
    # (rounding). Giving one tensor one replacement keeps the path but sums
    # the gradient terms of x * x in another order, which the generated
    # programs of tests/pytorch/test_eager_harness.py catch: distinct clones it is.
    ("multihead_attention_train", True): "clones per position: another attention path",
    ("transformer_train", True): "clones per position: another attention path",
    ("inplace_views_and_data", True): VIEW,
    ("swa_averaged_model", True): VIEW + " (p.detach().copy_(...))",
}


@pytest.mark.parametrize("clone", [False, True], ids=["same", "clones"])
@pytest.mark.parametrize("name", NAMES)
def test_identity_routines_leave_results_bit_identical(name, clone, request):
    if (name, clone) in KNOWN:
        request.applymarker(pytest.mark.xfail(reason=KNOWN[name, clone], strict=True,
                                              raises=AssertionError))
    build, step = _case(name)
    plain = _run(build, step)
    said.clear()
    tool = Echo(clone)
    instrumented = _run(build, step, tool)
    assert len(plain) == len(instrumented)
    if name in FAST_PATH:
        assert [type(w.message) for w in said] == [amanda.NotBitExactWarning]
        assert "fast path" in str(said[0].message) and said[0].filename == __file__
        # the positions the padding mask hides are zeros only on the fast path
        assert all(torch.allclose(a[~PADDING], b[~PADDING], atol=1e-5)
                   for a, b in zip(plain, instrumented))
    else:
        assert said == []
        bad = [i for i, (a, b) in enumerate(zip(plain, instrumented)) if not same(a, b)]
        assert not bad
    assert tool.calls["before"] > 0 and tool.calls["after"] > 0
    if name in FUNCTORCH:
        assert {kind for _, _, kind in tool.strange} == {"functorch"}
    else:
        assert tool.strange == []


def test_no_fast_path_warning_where_torch_takes_no_fast_path():
    build, step = _case("multihead_attention_train")     # training: no fast path
    said.clear()
    _run(build, step, Echo(False))
    assert said == []


@pytest.mark.parametrize("name", NAMES)
def test_counts_are_the_same_on_a_cache_hit_and_without_the_cache(name):
    assert_cache_agrees(*_case(name))


def assert_cache_agrees(build, step):
    """The (op id, point) executions of a program: the first run, a run on a
    cache hit and a run under ``cache_disabled()`` agree (shared by the
    user-code test files)."""
    cached = Counter()
    _run(build, step, cached)
    first = dict(cached.executions)
    cached.executions.clear()
    _run(build, step, cached)
    uncached = Counter()
    _run(build, step, uncached, amanda.cache_disabled)
    assert first and dict(cached.executions) == first
    assert dict(uncached.executions) == first


# -- the rules for replacements, by difference with the same values written by hand -------

class Replace(amanda.Tool):
    """Replaces the tensors at ``point`` of ops named ``name`` with ``fn`` of them."""

    def __init__(self, name, point, fn):
        super().__init__()
        self.add_inst_for_op(lambda c: c.get_op_name() == name and getattr(
            c, f"insert_{point}_op")(lambda *ts: [fn(t) for t in ts]))


def test_an_in_place_op_on_a_replaced_argument_modifies_the_original():
    x = torch.ones(3)
    with amanda.apply(Replace("add_", "before", lambda t: t * 2)):
        y = x.add_(1)
    assert y is x and torch.equal(x, torch.full((3,), 3.0))    # (1 * 2) + 1
    buf = torch.ones(3)
    with amanda.apply(Replace("mul_", "after", lambda t: t + 10)):
        buf.mul_(2).add_(1)                                    # chained on the same tensor
    assert torch.equal(buf, torch.full((3,), 13.0))


def test_an_output_that_merely_is_an_input_is_replaced_not_written_into():
    a, b = torch.ones(2, 3), torch.zeros(2, 3)
    with amanda.apply(Replace("broadcast_tensors", "after", lambda t: t + 5)):
        c, d = torch.broadcast_tensors(a, b)     # nothing to broadcast: may return a, b
    assert torch.equal(a, torch.ones(2, 3)) and torch.equal(b, torch.zeros(2, 3))
    assert torch.equal(c, a + 5) and torch.equal(d, b + 5)


def test_a_replaced_leaf_made_by_a_factory_stays_a_leaf_with_its_gradient():
    with amanda.apply(Replace("randn", "after", lambda t: t * 0 + 2)):
        x = torch.randn(3, requires_grad=True)
        (x * x).sum().backward()
    assert x.is_leaf and torch.equal(x.grad, torch.full((3,), 4.0))


def test_an_in_place_op_on_a_replaced_inference_tensor_modifies_the_original():
    with torch.inference_mode():
        x = torch.ones(3)
        with amanda.apply(Replace("add_", "before", lambda t: t * 2)):
            x.add_(1)
    assert torch.equal(x, torch.full((3,), 3.0))


def test_each_position_gets_its_own_replacement_and_gradients_sum_as_plain():
    """docs/pytorch-eager.md: one tensor at two positions, each replaced by a
    clone, reaches the op as two tensors; the gradient terms of ``x * x``
    (and of another use of ``x``) are summed as in the plain run."""
    seen = []

    def look(*tensors):
        if len(tensors) == 2:
            seen.append(tensors[0] is tensors[1])

    tool = Replace("mul", "before", lambda t: t.clone())
    tool.add_inst_for_op(lambda c: c.get_op_name() == "mul" and c.insert_before_op(look))

    def grad(scoped):
        torch.manual_seed(0)
        x = torch.randn(5, requires_grad=True)
        with amanda.apply(tool) if scoped else contextlib.nullcontext():
            y = (x * x).sum() / 3 + x.mean() * 7
            y.backward()
        return x.grad

    plain = grad(False)
    assert torch.equal(grad(True), plain)
    assert seen == [False]


def test_a_replacement_under_a_torch_func_transform_runs():
    m = nn.Linear(4, 2)
    x = torch.randn(5, 4)
    expected = torch.func.vmap(m)(x) * 2
    expected_grad = torch.func.grad(lambda x: m(x).sum())(x[0])
    with amanda.apply(Replace("linear", "after", lambda t: t * 2)):
        out = torch.func.vmap(m)(x)
        g = torch.func.grad(lambda x: m(x).sum())(x[0])
    assert torch.equal(out, expected)
    assert torch.equal(g, expected_grad)    # straight-through: the gradient is unchanged
