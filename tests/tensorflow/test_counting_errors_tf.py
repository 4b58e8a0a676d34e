"""Fetched observers that receive no tensor (before-points of ops without
inputs), called after ``Session.run`` (amanda/runtime/tensorflow/observe.py).

Checked: they are called in program order with the other fetched routines,
once per run; one raising in the middle of the loop is raised by
``Session.run`` as the ToolError naming the tool, that routine, its op and
point, with the exception as ``__cause__``; the routines before it ran, the
ones after it did not; the session works on afterwards. Nothing is hosted.
"""

import numpy as np
import pytest

import amanda
from amanda.errors import ToolError
from amanda.runtime.tensorflow import current_rewrite

tf = pytest.importorskip("tensorflow")

_CALLBACKS = ("PyFunc", "PyFuncStateless", "EagerPyFunc")


def graph():
    """x, c0, a0 = x + c0, c1, a1 = a0 + c1, c2, a2 = a1 + c2 (graph order)."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2], name="x")
        h = x
        for i in range(3):
            c = tf.constant(np.full(2, i + 1, np.float32), name=f"c{i}")
            h = tf.add(h, c, name=f"a{i}")
    return g, x, h


class Count(amanda.Tool):
    """A routine before every op (default selection: a Const's receives no
    tensor); it records the op, and raises at ``fail`` while armed."""

    def __init__(self, fail=None):
        super().__init__()
        self.fail = fail
        self.calls = []
        self.received = []
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        context.insert_before_op(self.count, op=context.get_op().name)

    def count(self, *arrays, op):
        self.calls.append(op)
        self.received.append(len(arrays))
        if op == self.fail:
            raise RuntimeError(f"stop at {op}")


def test_raising_no_tensor_routine_mid_loop_is_the_tool_error_naming_it():
    g, x, out = graph()
    feed = {x: np.zeros(2, np.float32)}
    tool = Count()
    with tf.compat.v1.Session(graph=g) as session:
        plain = session.run(out, feed)
        with amanda.apply(tool):
            np.testing.assert_array_equal(session.run(out, feed), plain)
            order = list(tool.calls)
            copy = current_rewrite(session).copy.as_graph_def()
            assert not [n.name for n in copy.node if n.op in _CALLBACKS]   # all fetched
            assert set(order) - {"x"} == {"c0", "a0", "c1", "a1", "c2", "a2"}
            assert order.index("c1") < order.index("a1") < order.index("a2")
            assert tool.received[order.index("c1")] == 0   # a Const: no tensor
            tool.calls.clear()
            tool.fail = "c1"
            with pytest.raises(ToolError) as info:
                session.run(out, feed)
            error = info.value
            assert error.tool is tool and error.routine == tool.count
            assert error.op_name == "Const" and error.op_id == "c1"
            assert "c1" in str(error) and "before_op" in str(error)
            assert isinstance(error.__cause__, RuntimeError)
            assert str(error.__cause__) == "stop at c1"
            # those before it in program order ran, those after it did not
            assert tool.calls == order[:order.index("c1") + 1]
            tool.fail = None
            tool.calls.clear()
            np.testing.assert_array_equal(session.run(out, feed), plain)
            assert tool.calls == order
