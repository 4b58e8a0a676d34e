"""Routines that receive no tensor, called after the run (``_FetchPlan``'s
direct calls, amanda/runtime/onnx/observe.py): a counter's ``inputs=[]``.

Checked: such a routine is called once per node in program order; one that
raises in the middle of the loop is reported by ``session.run`` as the
ToolError naming the tool, that routine, its op and point, with the
exception as ``__cause__``; the routines before it ran and those after it
did not; the session keeps working for the next run. Routines receiving
tensors keep their own read-only views.
"""

import numpy as np
import pytest

import amanda
from amanda.errors import ToolError
from tests.onnx.conftest import TensorProto, helper, ort

NAMES = [f"n{i}" for i in range(6)]


def chain():
    """x -> Neg n0 -> Neg n1 -> ... -> Neg n5 -> y."""
    names = ["x"] + [f"t{i}" for i in range(len(NAMES) - 1)] + ["y"]
    nodes = [helper.make_node("Neg", [names[i]], [names[i + 1]], name=n)
             for i, n in enumerate(NAMES)]
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model.SerializeToString()


class Count(amanda.Tool):
    """``inputs=[]`` before every node; raises before ``fail`` while armed.
    With ``look``, a second routine before every node receives its input."""

    def __init__(self, fail=None, look=False):
        super().__init__()
        self.fail = fail
        self.calls = []
        self.arrays = []
        self.look = look
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        op = context.get_op_id()
        context.insert_before_op(self.count, inputs=[], op=op)
        if self.look:
            context.insert_before_op(self.see)

    def count(self, op):
        self.calls.append(op)
        if op == self.fail:
            raise RuntimeError(f"stop at {op}")

    def see(self, *arrays):
        self.arrays.append(arrays)


def session_for(tool):
    with amanda.apply(tool):
        return ort.InferenceSession(chain(), providers=["CPUExecutionProvider"])


def test_no_tensor_routines_run_after_the_run_once_per_node_in_order():
    tool = Count()
    session = session_for(tool)
    assert hasattr(session.run, "__wrapped__")    # the fetching path, not hosted nodes
    x = np.ones((2, 3), np.float32)
    (y,) = session.run(None, {"x": x})
    np.testing.assert_array_equal(y, x)
    assert tool.calls == NAMES
    session.run(None, {"x": x})
    assert tool.calls == NAMES * 2


def test_a_raising_no_tensor_routine_mid_loop_is_the_tool_error_naming_it():
    tool = Count(fail="n3")
    session = session_for(tool)
    x = np.ones((2, 3), np.float32)
    with pytest.raises(ToolError) as info:
        session.run(None, {"x": x})
    error = info.value
    assert error.tool is tool
    assert error.routine == tool.count
    assert error.op_id == "n3" and error.op_name == "Neg"
    assert "before_op" in str(error) and "stop at n3" in str(error)
    assert isinstance(error.__cause__, RuntimeError)
    assert str(error.__cause__) == "stop at n3"
    assert tool.calls == NAMES[:4]     # those before it ran, those after it did not
    tool.fail = None                   # the session works on
    tool.calls.clear()
    (y,) = session.run(None, {"x": x})
    np.testing.assert_array_equal(y, x)
    assert tool.calls == NAMES


def test_mixed_routines_keep_order_and_own_views():
    tool = Count(look=True)
    session = session_for(tool)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    session.run(None, {"x": x})
    assert tool.calls == NAMES
    inputs = [a[0] for a in tool.arrays]
    assert all(not a.flags.writeable for a in inputs)
    for i, a in enumerate(inputs):
        np.testing.assert_array_equal(a, x * (-1) ** i)
    assert np.shares_memory(inputs[0], x)          # the feed itself, no copy
    assert len({id(a) for a in inputs}) == len(inputs)


def test_a_raising_tensor_routine_after_no_tensor_ones_stops_the_loop():
    class Both(Count):
        def see(self, *arrays):
            super().see(*arrays)
            if len(self.arrays) == 2:
                raise ValueError("second look")

    tool = Both(look=True)
    session = session_for(tool)
    with pytest.raises(ToolError) as info:
        session.run(None, {"x": np.ones((2, 3), np.float32)})
    assert info.value.op_id == "n1" and info.value.routine == tool.see
    assert isinstance(info.value.__cause__, ValueError)
    # program order: count(n0), see(n0), count(n1), see(n1) raised
    assert tool.calls == NAMES[:2] and len(tool.arrays) == 2
