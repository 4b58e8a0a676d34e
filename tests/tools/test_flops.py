"""FlopsProfiler on PyTorch: per-execution counts, and agreement with
torch.utils.flop_counter.FlopCounterMode on real transformers models."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

torch = pytest.importorskip("torch")
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

import amanda  # noqa: E402
from amanda.tools.flops import FlopsProfiler  # noqa: E402

# amanda types whose FLOPs FlopCounterMode also counts (convolutions and
# matrix products; CPU scaled_dot_product_attention is not counted by it)
COMPARABLE = {"conv2d", "linear", "matmul", "mm", "bmm", "addmm", "baddbmm"}


def profile(model, x, runs=1):
    profiler = FlopsProfiler()
    with torch.no_grad(), amanda.apply(profiler):
        for _ in range(runs):
            model(x)
    return profiler


def reference(model, x):
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(x)
    return counter.get_total_flops()


def comparable(profiler):
    return sum(v for t, v in profiler.by_type("forward").items() if t in COMPARABLE)


def test_linear_counts_per_execution_and_reports():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x = torch.rand(3, 16)
    profiler = profile(model, x, runs=3)
    per_run = 2 * 3 * 16 * 32 + 2 * 3 * 32 * 4
    assert profiler.by_type("forward")["linear"] == 3 * per_run
    assert profiler.by_type("forward")["relu"] == 3 * 3 * 32
    assert profiler.total("forward") == 3 * (per_run + 3 * 32)
    assert profiler.by_module("forward")["0"] == 3 * 2 * 3 * 16 * 32
    assert not profiler.unknown
    assert "linear" in profiler.table() and "total" in profiler.table()


def backward_reference(loss):
    """FlopCounterMode's count of ``loss.backward()`` alone (its convolution
    and matrix-product gradients: torch computes those some input needs)."""
    counter = FlopCounterMode(display=False)
    with counter:
        loss.backward()
    return counter.get_total_flops()


def test_backward_matches_flop_counter_mode(cnn):
    """Each operand gradient of a convolution or matrix product costs the
    forward FLOPs, and autograd computes only those some input needs: the
    first convolution (its input needs no gradient) is charged once, the
    others twice, as torch's own counter charges them."""
    x = torch.rand(2, 3, 32, 32)
    profiler = FlopsProfiler()
    with amanda.apply(profiler):
        loss = cnn(x).sum()
        expected = backward_reference(loss)
    forward, backward = profiler.by_type("forward"), profiler.by_type("backward")
    assert forward["conv2d"] > 0 and forward["linear"] > 0
    assert sum(backward.values()) == expected
    assert forward["conv2d"] < backward["conv2d"] < 2 * forward["conv2d"]
    assert backward["linear"] == 2 * forward["linear"]
    assert profiler.total() == profiler.total("forward") + profiler.total("backward")


def test_backward_follows_which_gradients_each_step_needs():
    """A weight frozen, then an input that needs a gradient, at one call
    site: each step's backward count is torch's for that step, on a cache
    hit as without the cache."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4),
                                torch.nn.Unflatten(1, (1, 4)), torch.nn.Conv1d(1, 2, 3))

    def steps(profiler, *contexts):
        import contextlib
        counts, expected = [], []
        for p in model.parameters():
            p.requires_grad_(True)
        with amanda.apply(profiler), contextlib.ExitStack() as stack:
            for c in contexts:
                stack.enter_context(c)
            for step in range(3):
                if step == 1:
                    model[2].weight.requires_grad_(False)
                    model[4].weight.requires_grad_(False)
                x = torch.rand(5, 8, requires_grad=step == 2)
                before = profiler.total("backward")
                loss = model(x).sum()
                expected.append(backward_reference(loss))
                counts.append(profiler.total("backward") - before)
        return counts, expected

    counts, expected = steps(FlopsProfiler())
    assert counts == expected and len(set(expected)) == 3
    assert steps(FlopsProfiler(), amanda.cache_disabled()) == (counts, expected)


def test_unknown_ops_are_listed_not_zero():
    def f(x):
        return torch.special.bessel_j0(x)

    profiler = FlopsProfiler()
    with amanda.apply(profiler):
        f(torch.rand(4))
    assert profiler.total() == 0
    assert profiler.unknown == {"special_bessel_j0": 1}
    assert "unknown" in profiler.table()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_transformers_match_flop_counter_mode(name):
    transformers = pytest.importorskip("transformers")
    x = torch.ones(1, 8, dtype=torch.long)
    if name == "bert":
        build = lambda **kw: transformers.BertModel(transformers.BertConfig(**kw)).eval()  # noqa: E731
    else:
        build = lambda **kw: transformers.GPT2Model(transformers.GPT2Config(**kw)).eval()  # noqa: E731
    # eager attention: its matmuls are counted by both
    model = build(attn_implementation="eager")
    profiler = profile(model, x, runs=2)
    expected = reference(model, x)
    assert comparable(profiler) == pytest.approx(2 * expected, rel=0.01)
    assert not profiler.unknown or set(profiler.unknown) <= {"le"}
    # default (sdpa) attention: the same FLOPs, under scaled_dot_product_attention
    sdpa = profile(build(), x)
    eager = profiler.by_type("forward")
    assert sdpa.by_type("forward")["scaled_dot_product_attention"] == eager["matmul"] // 2
    assert comparable(sdpa) + sdpa.by_type("forward")["scaled_dot_product_attention"] \
        == pytest.approx(expected, rel=0.01)


@pytest.mark.slow
def test_resnet50_matches_flop_counter_mode():
    transformers = pytest.importorskip("transformers")
    model = transformers.ResNetModel(transformers.ResNetConfig()).eval()
    x = torch.rand(1, 3, 224, 224)
    profiler = profile(model, x)
    expected = reference(model, x)
    assert comparable(profiler) == pytest.approx(expected, rel=0.01)
    assert profiler.by_type("forward")["conv2d"] == expected  # exact
    assert sum(r["type"] == "conv2d" for r in profiler.records.values()) == 53
    assert not profiler.unknown


def test_shapes_changing_at_one_call_site():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU()).eval()
    per_sample = 2 * 8 * 16 * 16 * 3 * 3 * 3
    # cached analysis: the second batch size is listed, never counted stale
    cached = FlopsProfiler()
    with torch.no_grad(), amanda.apply(cached):
        for n in (2, 5, 2):
            model(torch.rand(n, 3, 16, 16))
    assert cached.by_type("forward")["conv2d"] == 2 * 2 * per_sample
    assert cached.unknown == {"conv2d (shape changed)": 1, "relu (shape changed)": 1}
    # analysis at every execution: all counted
    fresh = FlopsProfiler()
    with torch.no_grad(), amanda.apply(fresh), amanda.cache_disabled():
        for n in (2, 5, 2):
            model(torch.rand(n, 3, 16, 16))
    assert fresh.by_type("forward")["conv2d"] == 9 * per_sample
    assert not fresh.unknown


def test_backward_counts_are_never_stale_when_shapes_change():
    """Training on two batch sizes at one call site: the second size's
    backward convolutions are listed like its forward ones, not counted with
    the first size's FLOPs; fresh analysis counts both exactly."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 8 * 8, 4))
    conv = 2 * 8 * 8 * 8 * 3 * 3 * 3            # per sample, forward
    linear = 2 * 8 * 8 * 8 * 4

    def steps(profiler, *contexts):
        import contextlib
        with amanda.apply(profiler), contextlib.ExitStack() as stack:
            for c in contexts:
                stack.enter_context(c)
            for n in (2, 3):
                model(torch.rand(n, 3, 8, 8)).sum().backward()

    cached = FlopsProfiler()
    steps(cached)
    # each computed operand gradient = forward: the convolution's input needs
    # none (it is the first layer), so it is charged once, the linear twice
    assert cached.by_type("backward") == {"conv2d": 2 * conv, "linear": 2 * 2 * linear}
    assert cached.unknown["conv2d backward (shape changed)"] == 1
    assert cached.unknown["linear backward (shape changed)"] == 1
    fresh = FlopsProfiler()
    steps(fresh, amanda.cache_disabled())
    assert fresh.by_type("backward") == {"conv2d": 5 * conv, "linear": 2 * 5 * linear}
    assert not fresh.unknown
