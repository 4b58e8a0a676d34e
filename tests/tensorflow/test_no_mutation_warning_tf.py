"""amanda never mutates an op a session already ran.

TensorFlow warns ("Operation ... was changed by setting attribute after it
was run by a session ... will trigger an error in the future") when an op is
changed after a run. The instrumented copy grows lazily: fetching a tensor for
the first time may add an identity that waits on after-routines which already
ran in an earlier ``Session.run``. The edge must go on the new op only.
"""

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("tensorflow")

PROGRAM = textwrap.dedent("""
    import numpy as np
    import tensorflow as tf
    import amanda

    class Observe(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.calls = 0
            self.add_inst_for_op(self.analyse)

        def analyse(self, context):
            if context.get_op().type == "Relu":
                context.insert_after_op(self.observe, outputs=[])   # a bare callback

        def observe(self, *outputs):
            self.calls += 1

    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [1, 2], name="x")
        h = tf.nn.relu(tf.matmul(x, tf.constant([[1.0], [-1.0]])), name="h")
        y = tf.identity(h * 3.0, name="y")
    tool = Observe()
    feed = {x: np.array([[2.0, 1.0]], np.float32)}
    with amanda.apply(tool), tf.compat.v1.Session(graph=graph) as session:
        first = session.run(y, feed)       # runs the routine after h
        second = session.run(h, feed)      # first fetch of h: waits on that routine
    print("RESULT", first.tolist(), second.tolist(), tool.calls)
""")


def test_fetching_a_new_tensor_after_a_run_changes_no_op_that_ran():
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                          env={**__import__("os").environ, "TF_CPP_MIN_LOG_LEVEL": "0"},
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RESULT [[3.0]] [[1.0]] 2" in done.stdout
    assert "after it was run" not in done.stderr
