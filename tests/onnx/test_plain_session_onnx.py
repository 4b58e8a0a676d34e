"""An onnxruntime session created outside `amanda.apply` runs the plain
model: run inside a scope, amanda says so (`NotInstrumentedWarning`, once
per tool set, at the user's line) instead of silently reporting no points; its
results are unchanged and nothing stays patched after the scope."""

import warnings

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import amanda


def _model():
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["h"]), helper.make_node("Neg", ["h"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 10
    return model.SerializeToString()


class Count(amanda.Tool):
    def __init__(self):
        super().__init__()
        self.calls = 0
        self.add_inst_for_op(lambda context: context.insert_before_op(self.count))

    def count(self, *arrays):
        self.calls += 1


def _said(caught):
    return [w for w in caught if issubclass(w.category, amanda.NotInstrumentedWarning)]


FEED = {"x": np.float32([-1, 0, 2])}


def test_a_session_made_before_the_scope_is_named_once_per_tool_set():
    session = ort.InferenceSession(_model())
    expected = session.run(None, FEED)
    for tool in (Count(), Count()):     # each its own amanda session
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with amanda.apply(tool):
                got = [session.run(None, FEED) for _ in range(3)]
        said = _said(caught)
        assert len(said) == 1 and "created outside amanda.apply" in str(said[0].message)
        assert said[0].filename == __file__
        assert all(np.array_equal(g[0], expected[0]) for g in got)
        assert tool.calls == 0
    assert "run" not in ort.InferenceSession.__dict__      # nothing left patched


@pytest.mark.parametrize("made", ["inside", "disabled"])
def test_sessions_made_inside_the_scope_are_not_named(made):
    tool = Count()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with amanda.apply(tool):
            if made == "disabled":
                with amanda.disabled():
                    session = ort.InferenceSession(_model())
            else:
                session = ort.InferenceSession(_model())
            session.run(None, FEED)
    assert _said(caught) == []
    assert tool.calls == (2 if made == "inside" else 0)
