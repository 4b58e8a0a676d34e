"""Observe-only routines read onnxruntime's own buffers, after the run.

When every routine of a session only returns None, the tensors they read
are fetched as extra outputs of ``session.run`` and the routines are called
after it, in program order, on read-only views (docs/onnx.md, "Observing
without copies"). Checked here: the views share memory (no copy per point),
a write into one is a ToolError naming tool, routine and op, the values and
order equal those of the copying path (``hosted_observation``) and of a
plain run, the extra outputs stay hidden, and concurrent runs keep their own
values.
"""

import threading

import numpy as np
import pytest

import amanda
from amanda.runtime.onnx import hosted_observation
from tests.onnx.conftest import TensorProto, helper, mlp, numpy_helper, ort, same, x24  # noqa: F401


class Record(amanda.Tool):
    """Records (op, point, copies of the arrays, the arrays) at every point."""

    def __init__(self, keep=False):
        super().__init__()
        self.keep = keep
        self.seen = []
        self.add_inst_for_op(self.analyse, require_outputs=True)

    def analyse(self, context):
        op = context.get_op_id()
        context.insert_before_op(self.look, op=op, point="before")
        context.insert_after_op(self.look, op=op, point="after")

    def look(self, *arrays, op, point):
        self.seen.append((op, point, [None if a is None else np.array(a) for a in arrays],
                          arrays if self.keep else None))


def two_outputs():
    """x -> Gemm "fc" -> h -> Relu "relu" -> y, and h -> Neg "neg" -> z (two outputs)."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W", "B"], ["h"], name="fc"),
         helper.make_node("Relu", ["h"], ["y"], name="relu"),
         helper.make_node("Neg", ["h"], ["z"], name="neg")], "two",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "W"),
         numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def instrumented(model, tool, hosted=False):
    with amanda.apply(tool):
        if hosted:
            with hosted_observation():
                return ort.InferenceSession(model.SerializeToString(),
                                            providers=["CPUExecutionProvider"])
        return ort.InferenceSession(model.SerializeToString(),
                                    providers=["CPUExecutionProvider"])


def test_routines_get_read_only_views_of_the_runs_buffers(x24):
    tool = Record(keep=True)
    session = instrumented(two_outputs(), tool)
    session.run(None, {"x": x24})
    views = {(op, point): arrays for op, point, _, arrays in tool.seen}
    assert all(not a.flags.writeable for arrays in views.values() for a in arrays)
    # fc's output, relu's input and neg's input are one buffer: no copy per point
    h = views["fc", "after"][0]
    assert np.shares_memory(h, views["relu", "before"][0])
    assert np.shares_memory(h, views["neg", "before"][0])
    assert np.shares_memory(views["fc", "before"][0], x24)     # the feed itself
    assert x24.flags.writeable                                 # the user's array is untouched


def test_a_write_into_a_view_names_tool_routine_and_op(x24):
    class Scribble(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(self.analyse)

        def analyse(self, context):
            if context.get_op_id() == "relu":
                context.insert_before_op(self.scribble)

        def scribble(self, h):
            h[0, 0] = 1.0

    session = instrumented(mlp(), Scribble())
    with pytest.raises(amanda.ToolError) as info:
        session.run(None, {"x": x24})
    message = str(info.value)
    assert "read-only" in message and "scribble" in message and "relu" in message
    assert "Scribble" in message
    assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.parametrize("level", [ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
                                   ort.GraphOptimizationLevel.ORT_ENABLE_ALL],
                         ids=lambda level: level.name)
def test_values_and_order_equal_the_copying_path_and_a_plain_run(x24, level):
    model = two_outputs()
    fetched, hosted = Record(), Record()
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    with amanda.apply(fetched):
        a = ort.InferenceSession(model.SerializeToString(), options,
                                 providers=["CPUExecutionProvider"])
    with amanda.apply(hosted), hosted_observation():
        b = ort.InferenceSession(model.SerializeToString(), options,
                                 providers=["CPUExecutionProvider"])
    outputs = [a.run(None, {"x": x24}), b.run(None, {"x": x24})]
    # by difference against a plain run with every tensor as an output
    everything = two_outputs()
    everything.graph.output.append(helper.make_tensor_value_info("h", TensorProto.FLOAT,
                                                                 [2, 3]))
    plain = ort.InferenceSession(everything.SerializeToString(),
                                 providers=["CPUExecutionProvider"])
    x, h = x24, None
    y, z, h = plain.run(None, {"x": x})
    init = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    expected = [("fc", "before", [x, init["W"], init["B"]]), ("fc", "after", [h]),
                ("relu", "before", [h]), ("relu", "after", [y]),
                ("neg", "before", [h]), ("neg", "after", [z])]
    for tool, out in zip((fetched, hosted), outputs):
        assert [(op, p) for op, p, _, _ in tool.seen] == [(op, p) for op, p, _ in expected]
        for (_, _, got, _), (_, _, want) in zip(tool.seen, expected):
            assert all(same(g, w) for g, w in zip(got, want))
        assert same(out[0], y) and same(out[1], z)


def test_extra_outputs_stay_hidden(x24):
    tool = Record()
    session = instrumented(two_outputs(), tool)
    assert [o.name for o in session.get_outputs()] == ["y", "z"]
    assert len(session.run(None, {"x": x24})) == 2
    tool.seen.clear()
    (y,) = session.run(["y"], {"x": x24})       # neg's routines still see z
    assert [p for op, p, _, _ in tool.seen if op == "neg"] == ["before", "after"]
    assert same(y, np.maximum(tool.seen[2][2][0], 0))


def test_run_with_ort_values_calls_routines_and_iobinding_refuses(x24):
    tool = Record()
    session = instrumented(mlp(), tool)
    values = session.run_with_ort_values(None, {"x": ort.OrtValue.ortvalue_from_numpy(x24)})
    assert len(values) == 1 and len(tool.seen) == 4
    assert same(tool.seen[0][2][0], x24)
    with pytest.raises(amanda.BackendError, match="hosted_observation"):
        session.run_with_iobinding(session.io_binding())


def test_hosted_observation_runs_routines_inside_onnxruntime_on_copies(x24):
    tool = Record(keep=True)
    session = instrumented(mlp(), tool, hosted=True)
    session.run(None, {"x": x24})
    assert len(tool.seen) == 4
    assert not np.shares_memory(tool.seen[0][3][0], x24)


def test_concurrent_runs_see_their_own_values():
    model = mlp()
    lock = threading.Lock()

    class PerThread(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.seen = {}
            self.add_inst_for_op(self.analyse, require_outputs=True)

        def analyse(self, context):
            context.insert_after_op(self.look, op=context.get_op_id())

        def look(self, out, op):
            with lock:
                name = threading.current_thread().name
                self.seen.setdefault(name, []).append((op, np.array(out)))

    tool = PerThread()
    session = instrumented(model, tool)
    plain = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(2)
    feeds = [rng.standard_normal((2, 4)).astype(np.float32) for _ in range(8)]
    expected = [plain.run(None, {"x": x})[0] for x in feeds]
    errors, order = [], {}

    def worker(k):
        order[k] = [(k + r) % len(feeds) for r in range(40)]
        try:
            for i in order[k]:
                assert same(session.run(None, {"x": feeds[i]})[0], expected[i])
        except Exception as exc:   # noqa: BLE001 - reported below
            errors.append(exc)

    workers = [threading.Thread(target=worker, args=(k,), name=f"worker-{k}") for k in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors[:3]
    for k, indices in order.items():
        seen = tool.seen[f"worker-{k}"]
        assert [op for op, _ in seen] == ["fc", "relu"] * len(indices)
        for i, (_, y) in zip(indices, seen[1::2]):
            assert same(y, expected[i])


@pytest.mark.parametrize("hosted", [False, True])
def test_a_routines_own_sessions_are_not_instrumented(x24, hosted):
    """amanda never instruments itself: a routine that builds and runs its own
    onnxruntime session (a reference model, say) runs it plainly, on the
    after-run path and in the callback alike."""
    reference = mlp(seed=3).SerializeToString()
    calls = []

    class Nested(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(self.analyse)

        def analyse(self, context):
            context.insert_before_op(self.look, op=context.get_op_id())

        def look(self, *arrays, op):
            calls.append(op)
            inner = ort.InferenceSession(reference, providers=["CPUExecutionProvider"])
            inner.run(None, {"x": x24})

    tool = Nested()
    with amanda.apply(tool):
        if hosted:
            with hosted_observation():
                session = ort.InferenceSession(mlp().SerializeToString(),
                                               providers=["CPUExecutionProvider"])
        else:
            session = ort.InferenceSession(mlp().SerializeToString(),
                                           providers=["CPUExecutionProvider"])
        session.run(None, {"x": x24})
    assert calls == ["fc", "relu"]   # the inner sessions' Gemm and Relu were not instrumented
