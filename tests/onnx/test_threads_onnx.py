"""One instrumented InferenceSession run from several threads at once.

onnxruntime documents ``InferenceSession.run`` as thread-safe; hosted
Python routines must keep it so: each run hands its tensors to its own
routines, never to another run's.
"""

import threading

import numpy as np

import amanda
from tests.onnx.conftest import TensorProto, helper, numpy_helper, ort, same, session


def chain(depth=6, width=16, seed=0):
    """x[n, width] -> (MatMul, Relu) * depth -> y, random weights."""
    rng = np.random.default_rng(seed)
    nodes, inits, last = [], [], "x"
    for i in range(depth):
        inits.append(numpy_helper.from_array(
            rng.standard_normal((width, width)).astype(np.float32) / 4, f"W{i}"))
        nodes.append(helper.make_node("MatMul", [last, f"W{i}"], [f"h{i}"], name=f"mm{i}"))
        out = "y" if i == depth - 1 else f"r{i}"
        nodes.append(helper.make_node("Relu", [f"h{i}"], [out], name=f"relu{i}"))
        last = out
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


class Scale(amanda.Tool):
    """Observes every op's inputs and replaces every Relu output by 2x
    (a Python routine: the values travel through the host)."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.lock = threading.Lock()
        self.add_inst_for_op(self.analyse, require_outputs=True)

    def analyse(self, context):
        context.insert_before_op(self.look)
        if context.get_op().op_type == "Relu":
            context.insert_after_op(self.double)

    def look(self, *arrays):
        with self.lock:
            self.calls += 1

    def double(self, y):
        return y * np.float32(2)


def reference(model, x):
    rng_free = session(model).run(None, {"x": x})[0]
    return rng_free * np.float32(2 ** 6)


def test_one_session_many_threads_gives_each_run_its_own_values():
    model = chain()
    tool = Scale()
    with amanda.apply(tool):
        instrumented = ort.InferenceSession(model.SerializeToString(),
                                            providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    feeds = [rng.standard_normal((1 + i % 3, 16)).astype(np.float32) for i in range(24)]
    expected = [instrumented.run(None, {"x": x})[0] for x in feeds]   # one thread
    for x, want in zip(feeds, expected):
        np.testing.assert_allclose(want, reference(model, x), rtol=1e-5, atol=1e-5)
    runs, threads, wrong, errors = 60, 6, [], []

    def worker(k):
        try:
            for r in range(runs):
                i = (k * 7 + r) % len(feeds)
                got = instrumented.run(None, {"x": feeds[i]})[0]
                if not same(got, expected[i]):
                    wrong.append((k, r, i))
        except Exception as exc:   # noqa: BLE001 - reported below
            errors.append(exc)

    workers = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors[:3]
    assert not wrong, f"{len(wrong)} of {runs * threads} runs gave another run's values"
    assert tool.calls == (len(feeds) + runs * threads) * 12


def test_a_routine_error_is_raised_by_the_run_that_met_it():
    model = chain(depth=2)

    class FailOnNegativeFirst(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(self.analyse)

        def analyse(self, context):
            if context.get_op_id() == "mm0":
                context.insert_before_op(self.check, inputs=[0])

        def check(self, x):
            if x.flat[0] < 0:
                raise ValueError("negative first element")

    with amanda.apply(FailOnNegativeFirst()):
        instrumented = ort.InferenceSession(model.SerializeToString(),
                                            providers=["CPUExecutionProvider"])
    good = np.ones((2, 16), np.float32)
    bad = -good
    outcomes = {}

    def worker(k):
        results = []
        for r in range(40):
            x = bad if (k + r) % 5 == 0 else good
            try:
                instrumented.run(None, {"x": x})
                results.append((x is bad, None))
            except amanda.AmandaError as exc:
                results.append((x is bad, exc))
        outcomes[k] = results

    workers = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for results in outcomes.values():
        for was_bad, error in results:
            assert (error is not None) == was_bad
            if error is not None:
                assert "negative first element" in str(error)
                assert isinstance(error.__cause__, ValueError) or "ValueError" in str(error)
