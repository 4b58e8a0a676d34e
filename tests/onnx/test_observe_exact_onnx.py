"""Observing never changes the numbers; replacements are checked.

A tool whose routines only look (return None) must leave a session's
outputs bit-identical to the plain session at onnxruntime's default
optimisation level: its routines are side branches of the graph onnxruntime
optimised itself (docs/onnx.md).
"""

import os
import warnings

import numpy as np
import pytest

import amanda
from amanda.runtime.onnx import returns_only_none
from tests.onnx.conftest import DATA, light_feeds, mlp, onnx, ort, same, x24  # noqa: F401


class Observe(amanda.Tool):
    """A Python routine before and after every op that only looks."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.seen = {}
        self.add_inst_for_op(self.analyse, require_outputs=True)

    def analyse(self, context):
        context.insert_before_op(self.look, op=context.get_op_id())
        context.insert_after_op(self.look, op=context.get_op_id())

    def look(self, *arrays, op):
        self.calls += 1
        self.seen[op] = [None if a is None else a.shape for a in arrays]


@pytest.mark.parametrize("name", ["light_densenet121.onnx", "light_squeezenet.onnx",
                                  "light_inception_v2.onnx"])
def test_observe_only_tool_is_bit_identical_at_the_default_level(name):
    path = os.path.join(DATA, "light", name)
    model = onnx.load(path)
    feeds = light_feeds(model)
    plain = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)
    tool = Observe()
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # observing needs no caveat
        with amanda.apply(tool):
            instrumented = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    for _ in range(2):
        got = instrumented.run(None, feeds)
        assert all(same(a, b) for a, b in zip(plain, got))
    # every node's routines ran, fused or not, each run
    assert tool.calls == 2 * 2 * len(model.graph.node)
    assert len(tool.seen) == len(model.graph.node)


def test_returns_only_none_reads_the_code():
    def look(x):
        print(x)

    def maybe(x):
        if x is None:
            return None
        return

    def give(x):
        return x

    def choose(x):
        return x if x.size else None

    assert returns_only_none(look) and returns_only_none(maybe)
    assert not returns_only_none(give) and not returns_only_none(choose)
    assert not returns_only_none(lambda x: x) and returns_only_none(lambda x: None)
    assert not returns_only_none(print)   # no code to read: may replace


class Replace(amanda.Tool):
    def __init__(self, routine):
        super().__init__()
        self.routine = routine
        self.add_inst_for_op(self.analyse, require_outputs=True)

    def analyse(self, context):
        if context.get_op_id() == "fc":
            context.insert_after_op(self.routine)


def test_replacement_of_another_shape_or_dtype_is_a_tool_error(x24):
    model = mlp()
    for routine, message in [(lambda h: h[:1], r"shape \[1, 3\].*replacing one of shape \[2, 3\]"),
                             (lambda h: h.astype(np.float64), "dtype float64")]:
        with amanda.apply(Replace(routine)):
            instrumented = ort.InferenceSession(model.SerializeToString(),
                                                providers=["CPUExecutionProvider"])
        with pytest.raises(amanda.ToolError, match=message) as caught:
            instrumented.run(None, {"x": x24})
        assert "fc" in str(caught.value) and "after_op" in str(caught.value)


def test_a_routine_error_reaches_the_user_chained(x24):
    def broken(h):
        raise KeyError("no such thing")

    with amanda.apply(Replace(broken)):
        instrumented = ort.InferenceSession(mlp().SerializeToString(),
                                            providers=["CPUExecutionProvider"])
    with pytest.raises(amanda.AmandaError, match="KeyError") as caught:
        instrumented.run(None, {"x": x24})
    assert isinstance(caught.value.__cause__, KeyError)
    # the session stays usable
    with pytest.raises(amanda.AmandaError):
        instrumented.run(None, {"x": x24})


def test_routines_that_may_replace_warn_above_disable_all(x24):
    model = mlp().SerializeToString()
    with pytest.warns(UserWarning, match="bit-identical at ORT_DISABLE_ALL"):
        with amanda.apply(Replace(amanda.portable.hosted(lambda h: h * 1))):
            ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with amanda.apply(Replace(amanda.portable.hosted(lambda h: h * 1))):
            instrumented = ort.InferenceSession(model, options,
                                                providers=["CPUExecutionProvider"])
    plain = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    assert same(instrumented.run(None, {"x": x24})[0], plain.run(None, {"x": x24})[0])
