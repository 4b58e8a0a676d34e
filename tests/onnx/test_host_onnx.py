"""The routine host's contract on ONNX (amanda.runtime.host, shared with TF).

A hosted replace routine receives the op's inputs and returns one array per
output of the op, as on TensorFlow: an op with two inputs and one output is
replaced by a routine returning one array (it used to be checked against the
number of *inputs*, so no such op could be replaced by a hosted routine).
The reference is NumPy's answer for the routine itself.
"""

import numpy as np
import pytest

import amanda
from tests.onnx.conftest import helper, ort
from onnx import TensorProto


def add_model():
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["c"]), helper.make_node("Relu", ["c"], ["d"])],
        "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in "ab"],
        [helper.make_tensor_value_info("d", TensorProto.FLOAT, [4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


class ReplaceAdd(amanda.Tool):
    def __init__(self, routine):
        super().__init__()
        self.routine = routine
        self.calls = 0
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        if context.get_op().op_type == "Add":
            context.replace_op(self.hosted)

    def hosted(self, a, b):
        self.calls += 1   # a side effect: not portable, so hosted by onnxruntime-extensions
        return self.routine(a, b)


FEEDS = {"a": np.array([1, -2, 3, -4], np.float32), "b": np.array([2, 5, -1, 1], np.float32)}


def run(tool):
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    with amanda.apply(tool):
        session = ort.InferenceSession(add_model().SerializeToString(), options,
                                       providers=["CPUExecutionProvider"])
        return session.run(None, FEEDS)[0]


@pytest.mark.parametrize("form", ["array", "list", "tuple"])
def test_a_replace_routine_returns_one_array_per_output(form):
    wrap = {"array": lambda r: r, "list": lambda r: [r], "tuple": lambda r: (r,)}[form]
    tool = ReplaceAdd(lambda a, b: wrap(a - b))
    out = run(tool)
    assert tool.calls == 1
    np.testing.assert_array_equal(out, np.maximum(FEEDS["a"] - FEEDS["b"], 0))
    plain = ort.InferenceSession(add_model().SerializeToString(),
                                 providers=["CPUExecutionProvider"]).run(None, FEEDS)[0]
    assert not np.array_equal(out, plain)   # the routine did replace the op


@pytest.mark.parametrize("routine, words", [
    (lambda a, b: (a - b).astype(np.float64), "dtype float64 for output 0"),
    (lambda a, b: [a - b, a + b], "must return 1 arrays"),
    (lambda a, b: None, "must return 1 arrays"),
])
def test_a_wrong_replacement_is_a_tool_error_naming_the_op(routine, words):
    with pytest.raises(amanda.ToolError, match=words) as info:
        run(ReplaceAdd(routine))
    assert info.value.op_name == "Add"
