"""OpProfiler in TensorFlow graph mode: a Keras CNN training step in a
tf.compat.v1 session; every executed op is timed, gradient ops included."""

import json
import time

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import amanda  # noqa: E402
from amanda.tools.profiler import OpProfiler  # noqa: E402


def executed_ops(fetches, fed):
    """Names of the ops a ``Session.run`` of ``fetches`` executes: their
    ancestors through data and control inputs, less the fed placeholders."""
    seen, stack = set(), list(fetches)
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return seen - {t.op.name for t in fed}


@pytest.fixture
def trained(keras_cnn_graph):
    """Two training steps of the Keras CNN under the profiler (the first
    one rewrites the graph); the events are those of the second."""
    model = keras_cnn_graph()
    with model.graph.as_default():
        train = tf.compat.v1.train.GradientDescentOptimizer(0.01).apply_gradients(
            zip(model.grads, model.variables))
    image = np.random.default_rng(0).random((2, 16, 16, 3), np.float32)
    profiler = OpProfiler()
    with tf.compat.v1.Session(graph=model.graph) as session:
        session.run(model.init)
        with amanda.apply(profiler):
            session.run([model.loss, train], {model.x: image})
            profiler.reset()
            start = time.perf_counter_ns()
            session.run([model.loss, train], {model.x: image})
            window = (start, time.perf_counter_ns())
    # the fed placeholder is timed too: its after-routine runs (it reads the
    # fed value), and an op's before-routines run whenever its after-routines do
    return profiler, window, executed_ops([model.loss.op, train], [])


def test_every_executed_op_is_timed_once(trained):
    profiler, _, expected = trained
    timed = [info.key for info, _, _ in profiler.events]
    assert sorted(timed) == sorted(expected)
    phases = {info.phase for info, _, _ in profiler.events}
    assert phases == {"forward", "backward"}
    backward = {info.name for info, _, _ in profiler.events if info.phase == "backward"}
    assert {"Conv2DBackpropFilter", "Conv2DBackpropInput", "MatMul", "ReluGrad"} <= backward
    owners = {info.type for info, _, _ in profiler.events if info.name == "Conv2DBackpropFilter"}
    assert owners == {"conv2d"}


def test_events_lie_within_the_step(trained):
    profiler, (start, end), _ = trained
    assert all(start <= s <= e <= end for _, s, e in profiler.events)
    # graph-mode events may overlap (parallel executor); their union cannot
    assert 0 < profiler.busy_us() <= (end - start) / 1e3
    assert profiler.busy_us() <= profiler.total_us() + 1e-6
    by_type = profiler.by_type()
    assert by_type["conv2d"]["forward_us"] > 0 and by_type["conv2d"]["backward_us"] > 0
    # modules are listed in the order their first op ran; TF's parallel
    # executor may run a gradient op (module "gradients/...") first
    assert any("sequential" in k for k in profiler.by_module() if k)
    assert "conv2d" in profiler.table()


def test_chrome_trace_lanes_never_overlap(trained, tmp_path):
    profiler, _, _ = trained
    trace = json.loads(open(profiler.save_chrome_trace(tmp_path / "tf.json")).read())
    ops = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] != "module"]
    assert len(ops) == len(profiler.events)
    assert {e["tid"] for e in ops if e["cat"] == "forward"} & {1}
    assert {e["tid"] for e in ops if e["cat"] == "backward"} & {2}
    for tid in {e["tid"] for e in ops}:
        lane = sorted((e["ts"], e["ts"] + e["dur"]) for e in ops if e["tid"] == tid)
        assert all(a[1] <= b[0] + 1e-6 for a, b in zip(lane, lane[1:]))
    assert "tensorflow" in trace["traceEvents"][0]["args"]["name"]


def test_after_routines_wait_on_the_ops_before_routines(keras_cnn_graph):
    """Routines that pass no tensor are ordered by control edges; an op's
    after-routine waits on its before-routine directly, so the order holds
    even where TF's graph optimiser removes the op itself (a no-op Reshape)."""
    from amanda.runtime.tensorflow import current_rewrite
    model = keras_cnn_graph()
    image = np.random.default_rng(0).random((2, 16, 16, 3), np.float32)
    with tf.compat.v1.Session(graph=model.graph) as session:
        session.run(model.init)
        with amanda.apply(OpProfiler()):
            session.run(model.loss, {model.x: image})
            copy = current_rewrite(session).copy
    def waits_on(op):
        """``op``'s control inputs, through amanda's gates (NoOps that carry
        control edges: Grappler keeps what they order)."""
        found = set()
        for control in op.control_inputs:
            if control.name.startswith("amanda/gate"):
                found |= waits_on(control)
            else:
                found.add(control)
        return found

    checked = 0
    for op in copy.get_operations():
        befores = [c for c in waits_on(op) if c.name.startswith("amanda/before")]
        afters = [a for a in copy.get_operations()
                  if a.name.startswith("amanda/after") and op in waits_on(a)]
        for after in afters:
            assert set(befores) <= waits_on(after), (op.name, after.name)
            checked += bool(befores)
    assert checked > 20
