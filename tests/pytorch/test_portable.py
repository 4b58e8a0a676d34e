"""amanda.portable: one routine, the same values in NumPy, PyTorch, TF and traced IR."""

import numpy as np
import pytest
import torch

import amanda
from amanda import portable as P

RNG = np.random.default_rng(0)
X = (RNG.standard_normal((4, 6)) * 3).astype(np.float32)
X[0, :4] = [0.5, 1.5, 2.5, -0.5]          # ties: rounding is half to even everywhere
MASK = RNG.random((4, 6)) > 0.5
SCALE = np.array([0.1, 0.2, 0.05, 0.3], np.float32)
ZERO = np.array([0, 3, -2, 1], np.int32)


@P.routine
def everything(x, mask, c):
    y = P.where(x > 0, x * mask, P.clip(x, -c, c)) + 1
    y = P.maximum(P.minimum(y, 2.0), -2.0) - P.abs(x) / 4
    y = y + P.round(x) * P.sign(x) - P.floor(x) + P.ceil(x) ** 2
    y = y + P.sqrt(P.abs(x) + 1) + P.exp(-P.abs(x)) + P.log(P.abs(x) + 1)
    both = (x > -1) & (x < 1) | ~(x != 0)
    return P.where(both, -y, P.cast(P.cast(y * 10, "int32"), "float32"))


@P.routine
def quant(x, scale, zero):
    return [P.fake_quant(x, scale, zero, -128, 127, axis=0),
            P.fake_quant(x, 0.25, 2, -8, 7),
            P.dequantize(P.quantize(x, scale, zero, "int8", axis=0), scale, zero, axis=0)]


def reference_fake_quant(x, scale, zero, qmin, qmax):
    q = np.clip(np.round(x / scale) + zero, qmin, qmax)
    return ((q - zero) * scale).astype(np.float32)


def backends():
    import tensorflow as tf
    return {"numpy": (lambda a: a, np.asarray),
            "torch": (torch.from_numpy, lambda t: t.numpy()),
            "tensorflow": (tf.constant, lambda t: t.numpy())}


@pytest.mark.parametrize("backend", ["numpy", "torch", "tensorflow"])
def test_every_backend_and_the_trace_compute_the_same_values(backend):
    to, back = backends()[backend]
    graph = P.trace(everything, [("float32", [4, 6])], {"mask": MASK, "c": 0.5})
    traced = P.evaluate(graph, [X])[0]
    direct = back(everything(to(X), mask=MASK, c=0.5))
    np.testing.assert_array_equal(direct, traced)
    assert graph.namespace == "amanda/portable"
    assert {op.type for op in graph.ops} >= {"where", "clip", "round", "cast", "and", "or", "not"}


@pytest.mark.parametrize("backend", ["numpy", "torch", "tensorflow"])
def test_quantization_matches_the_formula_per_channel_and_at_4_bits(backend):
    to, back = backends()[backend]
    per_channel, four_bit, round_trip = [back(v) for v in quant(to(X), SCALE, ZERO)]
    expected = reference_fake_quant(X, SCALE[:, None], ZERO[:, None], -128, 127)
    np.testing.assert_allclose(per_channel, expected, rtol=0, atol=1e-6)
    np.testing.assert_allclose(four_bit, reference_fake_quant(X, 0.25, 2, -8, 7), rtol=0, atol=1e-6)
    np.testing.assert_allclose(round_trip, expected, rtol=0, atol=1e-6)
    assert len(np.unique(four_bit)) <= 16
    graph = P.trace(quant, [("float32", [4, 6])], {"scale": SCALE, "zero": ZERO})
    for traced, value in zip(P.evaluate(graph, [X]), (per_channel, four_bit, round_trip)):
        np.testing.assert_allclose(traced, value, rtol=0, atol=1e-6)
    fake = [op for op in graph.ops if op.type == "fake_quant"]
    assert [(op.attrs["qmin"], op.attrs["qmax"], op.attrs["axis"]) for op in fake] == \
        [(-128, 127, 0), (-8, 7, None)]


def test_trace_records_dtypes_shapes_and_identity_outputs():
    graph = P.trace(lambda x, y: (x, P.cast(x > y, "int8") * 2), [("float32", [2, 3]),
                                                                   ("float32", [3])])
    assert graph.outputs[0] is graph.inputs[0]
    out = graph.outputs[1]
    assert out.attrs["dtype"] == "int8" and out.attrs["shape"] == [2, 3]
    constant = next(op for op in graph.ops if op.type == "constant")
    assert constant.outputs[0].attrs["dtype"] == "int8"   # scalars take the tensor's dtype
    assert P.trace(lambda x: None, [("float32", None)]).outputs == ()


@pytest.mark.parametrize("routine, message", [
    (lambda x: x.numpy(), "no attribute 'numpy'"),
    (lambda x: x if x > 0 else -x, "control flow"),
    (lambda x: torch.relu(x), "raised TypeError"),
    (lambda x: 3, "returned int"),
])
def test_leaving_the_vocabulary_is_a_portable_error_naming_the_routine(routine, message):
    with pytest.raises(P.PortableError, match=message) as info:
        P.trace(routine, [("float32", [2])])
    assert "<lambda>" in str(info.value)
    assert isinstance(info.value, amanda.AmandaError)


def test_marking_works_on_functions_and_methods():
    class Tool:
        @P.routine
        def mask(self, w, mask):
            return w * mask

        def other(self, w):
            return w

    assert P.is_portable(Tool().mask) and P.is_portable(everything)
    assert not P.is_portable(print)
    # unmarked: inferred portable (amanda.portable_infer), unless inference is off
    assert P.is_portable(Tool().other) and P.explain(Tool().other).how == "inferred"
    with P.inference(False):
        assert not P.is_portable(Tool().other) and P.is_portable(Tool().mask)


def test_a_portable_routine_runs_unchanged_in_pytorch_eager():
    from tests.models import build_model

    class Prune(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(self.analysis)

        def analysis(self, context):
            if context.get_op().__name__ == "conv2d":
                weight = context.get_inputs()[1]
                context.insert_before_op(self.mask, inputs=[1], mask=weight.abs() > 0.1)

        @P.routine
        def mask(self, weight, mask):
            return P.where(mask, weight, 0.0)

    model, x = build_model("cnn")
    with torch.no_grad():
        plain = model(x)
        with amanda.apply(Prune()):
            pruned = model(x)
        for conv in [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]:
            conv.weight[conv.weight.abs() <= 0.1] = 0
        expected = model(x)
    assert not torch.equal(plain, pruned)
    torch.testing.assert_close(pruned, expected)


def test_the_docs_page_examples_run():
    from tests.markdown import examples, run_examples
    assert len(examples("docs/portable.md")) >= 2
    run_examples("docs/portable.md")
