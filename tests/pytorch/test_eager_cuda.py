"""PyTorch eager on an accelerator, compared by difference with the CPU.

On CUDA, autograd runs a backward pass's nodes on a device thread of its
own, not on the thread that called ``backward()``. amanda's switches
(``disabled()``, ``cache_disabled()``, ``ad_enabled()``) and the eager
driver's per-thread state belong to the caller, so the backward points, the
recomputation of checkpointed regions and the Python code autograd runs
there must follow the caller's switches (docs/pytorch-eager.md, "Backward
on other threads"). Every test runs on the CPU too (the reference, and the
check that the test itself holds); the CUDA cases run where a GPU is
present (the CI machine has none: they were run on a lent H100).
"""

import collections
import contextlib
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import amanda
from tests.pytorch.test_eager_features import Counter, Echo, same

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


class Net(nn.Module):
    """Linear, a checkpointed block (optional), layer norm, a functional call."""

    def __init__(self, reentrant=None):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 4)
        self.reentrant = reentrant

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if self.reentrant is None:
            h = self.block(h)
        else:
            h = checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.fc2(self.norm(h)).tanh()


def build(device, reentrant=None):
    torch.manual_seed(0)
    model = Net(reentrant).to(device)
    x = torch.randn(8, 16, device=device, requires_grad=reentrant is True)
    return model, x


def step(model, x):
    out = model(x)
    out.square().sum().backward()
    return [out.detach()] + [p.grad.detach().clone() for p in model.parameters()]


def counted(device, reentrant=None, context=contextlib.nullcontext, strict=True):
    """(op id, point) executions of one training step inside ``apply``;
    ``strict``: a NotInstrumentedWarning is an error (``catch_warnings`` is
    process-wide: threads leave it to their caller)."""
    model, x = build(device, reentrant)
    tool = Counter()
    with warnings.catch_warnings() if strict else contextlib.nullcontext():
        if strict:
            warnings.simplefilter("error", amanda.NotInstrumentedWarning)
        with amanda.apply(tool), context():
            step(model, x)
    return dict(tool.executions)


def backward_points(executions):
    return {key: n for key, n in executions.items() if key[1] in ("bbefore", "bafter")}


@pytest.mark.parametrize("device", DEVICES)
def test_a_backward_pass_inside_disabled_runs_no_backward_routine(device):
    model, x = build(device)
    tool = Counter()
    with amanda.apply(tool):
        loss = model(x).square().sum()
        with amanda.disabled():
            loss.backward()
    assert tool.executions and backward_points(tool.executions) == {}
    # and the next step, enabled again, has its backward points
    again = Counter()
    with amanda.apply(again):
        model(x).square().sum().backward()
    assert backward_points(again.executions)


@pytest.mark.parametrize("device", DEVICES)
def test_a_backward_pass_inside_enabled_within_disabled_is_instrumented(device):
    model, x = build(device)
    tool = Counter()
    with amanda.apply(tool), amanda.disabled():
        loss = model(x).square().sum()     # no forward points, so no backward ops known
        with amanda.enabled():
            loss.backward()
    assert tool.executions == {}
    tool = Counter()
    with amanda.apply(tool):
        loss = model(x).square().sum()
        with amanda.disabled(), amanda.enabled():
            loss.backward()
    assert backward_points(tool.executions)


@pytest.mark.parametrize("reentrant", [None, False, True], ids=["plain", "checkpoint",
                                                                "checkpoint-reentrant"])
@pytest.mark.parametrize("device", DEVICES)
def test_executions_on_the_device_equal_the_cpus(device, reentrant):
    on_device = counted(device, reentrant)
    assert on_device == counted("cpu", reentrant)
    assert backward_points(on_device)
    if reentrant is not None:
        # the block's ops run twice: forward, and recomputed in backward
        recomputed = [n for (key, point), n in on_device.items() if point == "before"]
        assert 2 in recomputed


@pytest.mark.parametrize("reentrant", [None, False, True], ids=["plain", "checkpoint",
                                                                "checkpoint-reentrant"])
@pytest.mark.parametrize("device", DEVICES)
def test_cache_disabled_reaches_the_backward_pass(device, reentrant):
    """Analysis at every execution: a tool that counts its analysis calls
    sees the same calls for the backward ops as on the CPU."""

    class Analyses(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.calls = collections.Counter()
            self.add_inst_for_op(self.forward)
            self.add_inst_for_op(self.backward, backward=True)

        def forward(self, context):
            self.calls[context.get_op_id(), "forward"] += 1

        def backward(self, context):
            self.calls[context.get_backward_op_id(), "backward"] += 1

    def analyses(device):
        model, x = build(device, reentrant)
        tool = Analyses()
        with amanda.apply(tool):
            step(model, x)                      # first step: analysed once
            with amanda.cache_disabled():
                step(model, x)                  # analysed at every execution
                step(model, x)
        return dict(tool.calls)

    calls = analyses(device)
    assert calls == analyses("cpu")
    assert all(n >= 3 for (key, kind), n in calls.items() if kind == "backward")


@pytest.mark.parametrize("clone", [False, True], ids=["same", "clones"])
@pytest.mark.parametrize("reentrant", [None, False], ids=["plain", "checkpoint"])
@pytest.mark.parametrize("device", DEVICES)
def test_identity_routines_leave_a_training_step_bit_identical(device, reentrant, clone):
    plain = step(*build(device, reentrant))
    tool = Echo(clone)
    with amanda.apply(tool):
        instrumented = step(*build(device, reentrant))
    assert all(same(a, b) for a, b in zip(plain, instrumented))
    assert tool.calls["bbefore"] > 0 and tool.calls["bafter"] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_a_backward_routine_error_reaches_the_caller_as_a_tool_error(device):
    class Fails(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(self.analyse, backward=True)

        def analyse(self, context):
            if context.get_backward_op().__name__ == "TanhBackward0":
                context.insert_before_backward_op(self.fail)

        def fail(self, *grads):
            raise ValueError("boom")

    model, x = build(device)
    with pytest.raises(amanda.ToolError, match="boom") as caught:
        with amanda.apply(Fails()):
            step(model, x)
    assert "TanhBackward0" in str(caught.value)
    # nothing is left behind: a plain step equals a fresh one
    model.zero_grad()
    assert all(same(a, b) for a, b in zip(step(model, x), step(*build(device))))


@pytest.mark.parametrize("device", DEVICES)
def test_a_routine_replacing_a_gradient_acts_on_the_device_as_on_the_cpu(device):
    """Halving the gradient that enters the last ``tanh``'s backward op halves
    every parameter's gradient exactly (backward ops are linear in their
    incoming gradients, and halving is exact in floating point)."""

    class Halve(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(self.analyse, backward=True)

        def analyse(self, context):
            if context.get_backward_op().__name__ == "TanhBackward0":
                context.insert_before_backward_op(lambda g: g * 0.5)

    plain = step(*build(device))
    model, x = build(device)
    with amanda.apply(Halve()):
        halved = step(model, x)
    assert same(halved[0], plain[0])
    assert all(torch.equal(a, b * 0.5) for a, b in zip(halved[1:], plain[1:]))


class CloneBefore(amanda.Tool):
    """Replaces every forward op's inputs with clones (a routine that copies)."""

    def __init__(self):
        super().__init__()
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        context.insert_before_op(self.clone)

    def clone(self, *tensors):
        return [None if t is None else t.clone() for t in tensors]


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("device", DEVICES)
def test_optimizer_steps_under_clone_routines_equal_plain_ones(device, fused):
    if fused and device == "cpu" and not hasattr(torch._C._VariableFunctions, "_fused_adam_"):
        pytest.skip("no fused Adam on this build")

    def train(tool):
        model, x = build(device)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=fused,
                                     foreach=None if fused else True)
        scope = amanda.apply(tool) if tool is not None else contextlib.nullcontext()
        with scope:
            for _ in range(3):
                optimizer.zero_grad()
                model(x).square().sum().backward()
                optimizer.step()
        return [p.detach().clone() for p in model.parameters()]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", amanda.NotBitExactWarning)
        instrumented = train(CloneBefore())
    assert all(same(a, b) for a, b in zip(train(None), instrumented))


@CUDA
def test_a_grad_scaler_step_under_clone_routines_equals_a_plain_one():
    def train(tool):
        model, x = build("cuda")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cuda")
        scope = amanda.apply(tool) if tool is not None else contextlib.nullcontext()
        with scope:
            for _ in range(3):
                optimizer.zero_grad()
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = model(x).square().sum()
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
        return [p.detach().clone() for p in model.parameters()] + [
            torch.tensor(scaler.get_scale())]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", amanda.NotBitExactWarning)
        instrumented = train(CloneBefore())
    assert all(same(a, b) for a, b in zip(train(None), instrumented))


def _transformer(name, device):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "bert":
        config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, intermediate_size=128,
                                         hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0)
        model = transformers.BertModel(config)
    else:
        config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2Model(config)
    ids = torch.randint(0, 100, (2, 12))
    return model.to(device), ids.to(device)


def _lm_step(model, ids):
    out = model(ids).last_hidden_state
    out.square().mean().backward()
    return [out.detach()] + [p.grad.detach().clone() for p in model.parameters()
                             if p.grad is not None]


@pytest.mark.parametrize("name", ["bert", "gpt2"])
@pytest.mark.parametrize("device", DEVICES)
def test_transformers_count_and_train_on_the_device_as_on_the_cpu(device, name):
    def executions(device, context=contextlib.nullcontext):
        tool = Counter()
        model, ids = _transformer(name, device)
        with amanda.apply(tool), context():
            _lm_step(model, ids)
        return dict(tool.executions)

    on_device = executions(device)
    assert backward_points(on_device)
    assert executions(device, amanda.cache_disabled) == on_device
    # forward points are the CPU's; backward ops may differ by kernel
    # (attention's backward node is named after the kernel torch picked)
    forward = {key: n for key, n in on_device.items() if key not in backward_points(on_device)}
    cpu = executions("cpu")
    assert forward == {key: n for key, n in cpu.items() if key not in backward_points(cpu)}
    plain = _lm_step(*_transformer(name, device))
    model, ids = _transformer(name, device)
    tool = Echo(True)
    with amanda.apply(tool):
        instrumented = _lm_step(model, ids)
    assert all(same(a, b) for a, b in zip(plain, instrumented))
    assert tool.calls["bbefore"] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_threads_training_in_scopes_of_their_own_count_as_one_alone(device):
    """Each thread's backward pass runs its own tool's routines only."""
    import threading
    alone = counted(device, reentrant=False)
    found, errors = [], []

    def train():
        try:
            found.append(counted(device, reentrant=False, strict=False))
        except BaseException as error:       # noqa: BLE001 (reported below)
            errors.append(error)

    threads = [threading.Thread(target=train) for _ in range(3)]
    with warnings.catch_warnings():          # one filter change for all threads
        warnings.simplefilter("error", amanda.NotInstrumentedWarning)
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors and found == [alone] * 3


#: amanda's compiled path is built for torch 2.13 (constraints.txt); on
#: another release Dynamo may skip its frames, which amanda reports with an
#: EagerFallbackWarning (seen with the lent GPU's torch 2.11)
COMPILED = pytest.mark.skipif(not torch.__version__.startswith("2.13."),
                              reason="the compiled path is built for torch 2.13")


@COMPILED
@pytest.mark.parametrize("device", DEVICES)
def test_a_compiled_model_counts_and_computes_as_eagerly(device):
    """torch.compile (inductor) inside apply: forward points run in the
    compiled graph on the device, with eager's op ids and counts."""

    eager, eager_out = _forward_counts(device, None)
    compiled, compiled_out = _forward_counts(device, "default")
    assert compiled == eager and eager
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(eager_out, compiled_out))


class Forward(amanda.Tool):
    """Counts (op id, op name) executions with a routine that reads no tensor."""

    def __init__(self):
        super().__init__()
        self.executions = collections.Counter()
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        context.insert_before_op(self.count, inputs=[],
                                 key=(context.get_op_id(), context.get_op_name()))

    def count(self, key):
        self.executions[key] += 1


def _forward_counts(device, mode, calls=3):
    model, x = build(device)
    torch._dynamo.reset()
    if mode is not None:
        model = torch.compile(model, backend="inductor", mode=mode)
    tool = Forward()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", amanda.EagerFallbackWarning)
            with amanda.apply(tool), torch.no_grad():
                outputs = [model(x).clone() for _ in range(calls)]
    finally:
        torch._dynamo.reset()
    return dict(tool.executions), outputs


@COMPILED
@CUDA
def test_reduce_overhead_replays_run_every_routine():
    """``mode="reduce-overhead"`` replays CUDA graphs: a routine captured
    into one would run once, at capture. Every call must run the routines."""
    eager, eager_out = _forward_counts("cuda", None, calls=6)
    compiled, compiled_out = _forward_counts("cuda", "reduce-overhead", calls=6)
    assert compiled == eager and set(eager.values()) == {6}
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(eager_out, compiled_out))


@CUDA
def test_a_cuda_graph_captured_inside_apply_is_said_to_replay_without_routines():
    model, x = build("cuda")
    tool = Forward()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        model(x)                                    # warm-up outside any scope
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with pytest.warns(amanda.NotInstrumentedWarning, match="CUDA graph"):
        with amanda.apply(tool), torch.no_grad():
            with torch.cuda.graph(graph):
                out = model(x)
            captured = dict(tool.executions)
            graph.replay()
            graph.replay()
    assert captured and dict(tool.executions) == captured     # replays run no routine
    plain = model(x)
    assert torch.allclose(out, plain)
