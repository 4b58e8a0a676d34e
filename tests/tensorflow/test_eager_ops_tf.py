"""TensorFlow ops executed eagerly (op by op) inside `amanda.apply` get no
points: amanda says so (`NotInstrumentedWarning`, once per scope, at the
user's line) instead of reporting counts that silently leave them out;
functions called eagerly are instrumented and raise nothing of the kind."""

import warnings

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import amanda  # noqa: E402
from tensorflow.python.eager import context as _context  # noqa: E402


class Count(amanda.Tool):
    def __init__(self):
        super().__init__()
        self.calls = 0
        self.add_inst_for_op(lambda context: context.insert_before_op(self.count))

    def count(self, *arrays):
        self.calls += 1


def _said(caught):
    return [w for w in caught if issubclass(w.category, amanda.NotInstrumentedWarning)]


def _run(body):
    tool = Count()
    callbacks = list(_context.context().op_callbacks)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with amanda.apply(tool):
            body()
    assert list(_context.context().op_callbacks) == callbacks   # nothing left behind
    return tool, _said(caught)


def test_eager_ops_inside_apply_are_named_once_per_scope():
    a = tf.constant(np.ones((2, 2), np.float32))

    def body():
        b = tf.matmul(a, a)
        return tf.nn.relu(b + 1)

    for _ in range(2):   # every scope says it again
        tool, said = _run(body)
        assert tool.calls == 0
        assert len(said) == 1
        assert "'MatMul'" in str(said[0].message) and "eagerly" in str(said[0].message)
        assert said[0].filename == __file__


def test_a_tf_function_called_eagerly_is_instrumented_without_the_warning():
    a = tf.constant(np.ones((2, 2), np.float32))
    function = tf.function(lambda x: tf.nn.relu(tf.matmul(x, x) + 1))
    expected = function(a).numpy()
    outputs = []
    tool, said = _run(lambda: outputs.append(function(a).numpy()))
    assert tool.calls > 0 and said == []
    np.testing.assert_array_equal(outputs[0], expected)


def test_eager_ops_under_disabled_are_not_named():
    a = tf.constant(np.ones((2, 2), np.float32))

    def body():
        with amanda.disabled():
            tf.matmul(a, a)

    tool, said = _run(body)
    assert said == []


def test_eager_ops_after_the_scope_are_not_named():
    tool, said = _run(lambda: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", amanda.NotInstrumentedWarning)
        a = tf.constant(np.ones((2, 2), np.float32))
        tf.matmul(a, a)
