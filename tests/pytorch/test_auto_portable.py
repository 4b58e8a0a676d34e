"""amanda.portable's verdict on unmarked routines (amanda.portable_infer).

Pure tensor arithmetic over the arguments and captured NumPy arrays or
numbers is inferred portable; every kind of side effect, Python state,
framework call, attribute read, branch or captured framework tensor is
refused. Verdicts are cached per code object and captured values, and the
switch turns inference off.
"""

import gc

import numpy as np
import pytest
import torch

import amanda
from amanda import portable
from amanda import portable_infer

MASK = np.random.default_rng(0).random((4, 6)) > 0.5


def closure(mask):
    def apply(w):
        return w * mask
    return apply


def pure_helper(x, c):
    return portable.clip(x, -c, c)


def calls_helper(x):
    return pure_helper(x, 1.5) * 2


def keyword(w, mask, scale=0.5):
    return w * mask * scale


def quantise(x, scale, zero):
    return portable.fake_quant(x, scale, zero, -128, 127)


def temporary(x):
    y = x * 3
    z = portable.where(y > 1, y, -y)
    return z - 1


class Tool:
    def __init__(self):
        self.calls = 0
        self.log = []
        self.scale = 2.0

    def pure(self, x):
        return x + 1

    def counts(self, x):
        self.calls += 1

    def reads_state(self, x):
        return x * self.scale

    def logs(self, x):
        self.log.append(x)


counter = 0


def global_counter(x):
    global counter
    counter += 1
    return x


def nonlocal_counter():
    seen = 0

    def count(x):
        nonlocal seen
        seen += 1
        return x
    return count


def printing(x):
    print(x)
    return x


def branching(x):
    if x > 0:
        return x
    return -x


def looping(x):
    for _ in range(2):
        x = x * 2
    return x


def numpy_call(x):
    return np.abs(x)


def in_place(x):
    x *= 2
    return x


def make_torch_closure():
    t = torch.ones(6)
    return lambda x: x * t


def make_list_closure():
    log = []
    return lambda x: log.append(x)


PORTABLE = {
    "lambda y: y * 2": lambda y: y * 2,
    "closure over a NumPy mask": closure(MASK),
    "closure over a number": closure(0.25),
    "helper function": calls_helper,
    "keyword mask": keyword,
    "fake_quant": quantise,
    "locals": temporary,
    "abs builtin": lambda x: abs(x) - 1,
    "amanda.portable attribute": lambda x: amanda.portable.sign(x) * x,
    "returns None": lambda x: None,
    "returns its inputs": lambda *xs: xs,
    "pure method": Tool().pure,
    "vocabulary function": portable.identity,
}

HOSTED = {
    "counter on self": Tool().counts,
    "reads self": Tool().reads_state,
    "appends to self.log": Tool().logs,
    "global counter": global_counter,
    "nonlocal counter": nonlocal_counter(),
    "prints": printing,
    "branches": branching,
    "loops": looping,
    "calls numpy": numpy_call,
    "in-place operator": in_place,
    "reads .numpy()": lambda x: x.numpy() * 2,
    "torch call": lambda x: torch.relu(x),
    "captured torch tensor": make_torch_closure(),
    "captured list": make_list_closure(),
    "list default": lambda x, seen=[]: seen.append(x),
    "built-in": print,
    "callable object": type("C", (), {"__call__": lambda self, x: x})(),
    "comprehension": lambda *xs: [x * 2 for x in xs],
    "floor division": lambda x: x // 2,
    "subscript": lambda x: x[0],
    # pass the code check, fail the trial trace
    "returns a string": lambda x: "not a tensor",
    "unknown dtype name": lambda x: portable.cast(x, "no-such-type"),
}


@pytest.mark.parametrize("name", PORTABLE)
def test_pure_arithmetic_is_inferred_portable(name):
    routine = PORTABLE[name]
    verdict = portable.explain(routine)
    assert verdict.portable and verdict.how in ("inferred", "vocabulary"), verdict
    assert portable.is_portable(routine)
    with portable.inference(False):
        assert not portable.is_portable(routine)
        assert portable.explain(routine).how == "off"
    assert portable.is_portable(routine)


@pytest.mark.parametrize("name", HOSTED)
def test_side_effects_and_python_state_stay_hosted(name):
    routine = HOSTED[name]
    verdict = portable.explain(routine)
    assert not verdict.portable and verdict.how == "refused", verdict
    assert verdict.reason and str(verdict).startswith("hosted")
    assert not portable.is_portable(routine)


def test_each_verdict_is_logged_once_at_debug(caplog):
    portable_infer.clear_cache()
    routine = closure(np.ones(3, np.float32))
    with caplog.at_level("DEBUG", logger="amanda.portable"):
        for _ in range(3):
            portable.is_portable(routine)
            portable.is_portable(printing)
    lines = [r.getMessage() for r in caplog.records if r.name == "amanda.portable"]
    assert len(lines) == 2
    assert "closure.<locals>.apply: lowered natively [inferred]" in lines[0]
    assert "printing: hosted (Python callback) [refused]" in lines[1]


def test_checking_a_counter_does_not_run_it():
    tool = Tool()
    for routine in (tool.counts, tool.logs, global_counter):
        assert not portable.is_portable(routine)
    assert tool.calls == 0 and tool.log == [] and counter == 0


def test_the_difference_test_refuses_what_the_trace_gets_wrong(monkeypatch):
    # a trace that disagrees with a direct NumPy call is refused, whatever the code says
    routine = lambda x: x * 3   # noqa: E731
    assert portable.is_portable(routine)
    portable_infer.clear_cache()
    real = portable.evaluate
    monkeypatch.setattr(portable, "evaluate", lambda graph, values: [
        v + 1e-3 for v in real(graph, values)])
    verdict = portable.explain(routine)
    assert not verdict.portable and "differs" in verdict.reason
    portable_infer.clear_cache()


def test_marks_win_over_inference():
    @portable.hosted
    def forced(x):
        return x * 2

    @portable.routine
    def marked(x):
        return x.anything()   # a promise the user made: not examined

    assert not portable.is_portable(forced) and portable.explain(forced).how == "marked hosted"
    assert portable.is_portable(marked) and portable.explain(marked).how == "marked"
    with portable.inference(False):
        assert portable.is_portable(marked)


def test_verdicts_are_cached_per_code_and_captured_values():
    portable_infer.clear_cache()
    first = closure(np.ones((2, 3), np.float32))
    assert portable.explain(first) is portable.explain(first)
    same_code = closure(first.__closure__[0].cell_contents)
    assert portable.explain(same_code) is portable.explain(first)      # same code and mask
    other = closure(np.ones((5, 5), np.float32))
    assert portable.explain(other) is not portable.explain(first)      # another mask
    assert portable.explain(other).portable
    # a captured value of another kind gets its own verdict
    assert not portable.explain(closure(torch.ones(2))).portable
    assert not portable.explain(closure([1, 2])).portable
    # the entry holds its arrays weakly: once they die, a closure whose new
    # array reuses the id is examined afresh instead of taking the old verdict
    key, _ = portable_infer._key(other, False)
    refs = portable_infer._cache[key][1]
    assert refs and all(r() is not None for r in refs)
    del other
    gc.collect()
    assert all(r() is None for r in refs)


def test_rebinding_a_global_helper_changes_the_verdict(monkeypatch):
    assert portable.is_portable(calls_helper)
    monkeypatch.setitem(globals(), "pure_helper", printing)
    assert not portable.is_portable(calls_helper)


def test_inference_switch_restores_the_setting():
    assert portable.infer is True
    with portable.inference(False):
        assert portable.infer is False
        with portable.inference(True):
            assert portable.is_portable(lambda y: y * 2)
        assert portable.infer is False
    assert portable.infer is True
    with pytest.raises(RuntimeError):
        with portable.inference(False):
            raise RuntimeError
    assert portable.infer is True


class MaskLinear(amanda.Tool):
    """An unmarked closure over a NumPy mask on every linear/conv weight."""

    def __init__(self, marked=False):
        super().__init__()
        self.marked = marked
        self.rng = np.random.default_rng(0)
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        if context.get_op_name() in ("linear", "conv2d"):
            shape = tuple(context.get_inputs()[1].shape)
            mask = (self.rng.random(shape) > 0.5).astype(np.float32)
            routine = closure(mask)
            context.insert_before_op(portable.routine(routine) if self.marked else routine,
                                     inputs=[1])


def test_export_takes_inferred_routines_like_marked_ones():
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 6 * 6, 5))
    x = torch.rand(2, 3, 8, 8)
    proto = amanda.export(model, (x,), MaskLinear())   # was: "not portable" ToolError
    marked = amanda.export(model, (x,), MaskLinear(marked=True))
    assert sorted(n.op_type for n in proto.graph.node) == \
        sorted(n.op_type for n in marked.graph.node)
    with torch.no_grad(), amanda.apply(MaskLinear()):
        expected = model(x).numpy()
    got = ort.InferenceSession(proto.SerializeToString()).run(None, {
        proto.graph.input[0].name: x.numpy()})[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        assert not np.allclose(got, model(x).numpy(), rtol=1e-3)
    assert isinstance(proto, onnx.ModelProto)
    with portable.inference(False), pytest.raises(amanda.ToolError, match="not portable"):
        amanda.export(model, (x,), MaskLinear())
