"""Memory of observe-only sessions: what the session cache keeps, and
whether routines get views of weights rather than copies (docs/onnx.md,
"Memory").

Checked by difference: the views `initializer_views` makes equal
``numpy_helper.to_array`` for every plain element type and share memory
with the serialized model; the weights routines observe are views over the
bytes the session cache keeps (no copy per session); and, in fresh
processes, the resident memory a session inside ``apply`` adds above a
plain session on a model with one large weight.
"""

import contextlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import amanda
from amanda import controls
from amanda.runtime.onnx import hosted_observation
from amanda.runtime.onnx_wire import initializer_views
from tests.onnx.conftest import TensorProto, helper, numpy_helper, onnx, ort, same  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PLAIN = [np.float32, np.float64, np.float16, np.int8, np.uint8, np.int16, np.uint16,
         np.int32, np.uint32, np.int64, np.uint64, np.bool_, np.complex64]


def typed_model():
    """One initializer per plain element type (raw data), a scalar, one stored
    in ``float_data`` and a string tensor; an Identity per initializer."""
    rng = np.random.default_rng(0)
    initializers = []
    for k, dtype in enumerate(PLAIN):
        values = (rng.standard_normal((3, k + 1)) * 50)
        initializers.append(numpy_helper.from_array(values.astype(dtype), f"w{k}"))
    initializers.append(numpy_helper.from_array(np.array(7, np.int64), "scalar"))
    initializers.append(helper.make_tensor("typed", TensorProto.FLOAT, [2, 2],
                                           [1.0, 2.0, 3.0, 4.0]))
    initializers.append(helper.make_tensor("text", TensorProto.STRING, [1], [b"x"]))
    nodes = [helper.make_node("Identity", [i.name], [i.name + "_out"]) for i in initializers]
    outputs = [helper.make_tensor_value_info(i.name + "_out", i.data_type, list(i.dims))
               for i in initializers]
    graph = helper.make_graph(nodes, "typed", [], outputs, initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_views_equal_to_array_and_share_the_bytes():
    model = typed_model()
    data = model.SerializeToString()
    names = [i.name for i in model.graph.initializer]
    views = initializer_views(data, names)
    stored_raw = {i.name for i in model.graph.initializer if i.HasField("raw_data")
                  and i.data_type != TensorProto.STRING}
    assert set(views) == stored_raw and "typed" not in views and "text" not in views
    for initializer in model.graph.initializer:
        if initializer.name not in views:
            continue
        view, copy = views[initializer.name], numpy_helper.to_array(initializer)
        assert view.dtype == copy.dtype and view.shape == copy.shape, initializer.name
        assert same(view, copy), initializer.name
        assert np.shares_memory(view, np.frombuffer(data, np.uint8))
        assert not view.flags.writeable


def test_truncated_or_foreign_bytes_give_no_views():
    data = typed_model().SerializeToString()
    assert initializer_views(data[:len(data) // 2], ["w0", "w1"]) == {}
    assert initializer_views(b"\xff" * 64, ["w0"]) == {}
    assert initializer_views(data, []) == {}


class Weights(amanda.Tool):
    """Keeps what the before-routine of every node receives."""

    def __init__(self):
        super().__init__()
        self.seen = []
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        context.insert_before_op(self.look, op=context.get_op_id())

    def look(self, *arrays, op):
        self.seen.append((op, arrays))


def matmul_model(rows=64, cols=32):
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((rows, cols)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
         helper.make_node("Relu", ["h"], ["y"], name="relu")], "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, rows])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, cols])],
        [numpy_helper.from_array(weight, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model, weight


@pytest.mark.parametrize("hosted", [False, True], ids=["fetched", "hosted"])
@pytest.mark.parametrize("level", [ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
                                   ort.GraphOptimizationLevel.ORT_ENABLE_ALL],
                         ids=lambda level: level.name)
def test_observed_weights_are_views_of_the_cached_model(level, hosted):
    """Fetched after the run or hosted inside it (where they used to be
    copied by an AmandaPut every run), routines see weights as views."""
    model, weight = matmul_model()
    x = np.random.default_rng(2).standard_normal((2, 64)).astype(np.float32)
    tool = Weights()
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    with amanda.apply(tool), (hosted_observation() if hosted else contextlib.nullcontext()):
        first = ort.InferenceSession(model.SerializeToString(), options,
                                     providers=["CPUExecutionProvider"])
        second = ort.InferenceSession(model.SerializeToString(), options,
                                      providers=["CPUExecutionProvider"])   # a cache hit
        kept = [data for hit in controls.state.sessions[-1].caches["onnx"].values()
                for data, *_ in hit.optimised.values()]
    assert all(n.domain != "ai.onnx.contrib" or "AmandaPut" not in n.op_type
               or n.input[0] != "W"
               for n in onnx.ModelProto.FromString(kept[0]).graph.node)
    first.run(None, {"x": x})
    second.run(None, {"x": x})
    (op1, (x1, w1)), _, (op2, (x2, w2)), _ = tool.seen
    assert op1 == op2 == "mm" and same(w1, weight) and same(w2, weight)
    assert not w1.flags.writeable
    # no copy of the weight per plan or session: a view of the kept bytes
    assert len(kept) == 1 and np.shares_memory(w1, np.frombuffer(kept[0], np.uint8))
    assert np.shares_memory(w1, w2)


_MEASURE = textwrap.dedent("""
    import json, sys
    import numpy as np, onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    import amanda, amanda.runtime.onnx

    def rss():
        with open("/proc/self/status") as status:
            return next(int(l.split()[1]) for l in status if l.startswith("VmRSS:"))

    n = 4096   # a 64 MiB weight
    weight = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
         helper.make_node("Relu", ["h"], ["h2"], name="relu"),
         helper.make_node("Neg", ["h2"], ["y"], name="neg")], "big",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
        [numpy_helper.from_array(weight, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path = sys.argv[1]
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    del model, graph, weight

    class Look(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(self.analyse, require_outputs=True)
        def analyse(self, context):
            context.insert_before_op(self.look)
            context.insert_after_op(self.look)
        def look(self, *arrays):
            pass

    before = rss()
    x = np.ones((1, n), np.float32)
    if sys.argv[2] == "hosted":
        with amanda.apply(Look()), amanda.runtime.onnx.hosted_observation():
            session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
            session.run(None, {"x": x})
            built = rss()
    elif sys.argv[2] == "amanda":
        with amanda.apply(Look()):
            session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
            session.run(None, {"x": x})
            built = rss()
    else:
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        session.run(None, {"x": x})
        built = rss()
    print(json.dumps((built - before) / 1024))
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
def test_an_observing_session_keeps_two_copies_of_the_weights_at_most(tmp_path):
    """A plain session holds the 64 MiB weight once; amanda's cache keeps the
    user's model and the optimised one with the side branches (the
    routines' views of the weight point into the latter), fetched or hosted.
    Before, it also kept the lowered model's bytes, a copy of the weight for
    the routines (fetched) or onnxruntime kept the weight beside its
    prepacked copy for an AmandaPut (hosted), and the model onnx's shape
    inference returned stayed alive: five copies or more."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=ROOT)
    grown = {}
    for how in ("plain", "amanda", "hosted"):
        done = subprocess.run([sys.executable, "-c", _MEASURE, str(tmp_path / "m.onnx"), how],
                              capture_output=True, text=True, env=env, cwd=ROOT, check=True)
        grown[how] = json.loads(done.stdout.strip().splitlines()[-1])
    for how in ("amanda", "hosted"):
        assert grown[how] - grown["plain"] < 2.6 * 64, (how, grown)
