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
import gc
import io
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
from amanda.runtime.onnx.wire import _initializer_spans, initializer_views, write_model
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


def test_write_model_parses_to_the_same_model_and_views_walk_it():
    model = typed_model()
    model.doc_string = "typed"
    model.metadata_props.add(key="k", value="v")
    file = io.BytesIO()
    spans = write_model(model, file)
    data = file.getvalue()
    assert onnx.ModelProto.FromString(data) == model
    assert len(data) == len(model.SerializeToString())
    expected = initializer_views(model.SerializeToString(), [i.name for i in model.graph.initializer])
    views = initializer_views(data, list(expected))
    assert set(views) == set(expected)
    assert all(same(views[n], expected[n]) for n in views)
    # the spans write_model reports are where the walk finds the initializers
    assert spans == _initializer_spans(data) and len(spans) == len(model.graph.initializer)
    given = initializer_views(data, list(expected), spans)
    assert set(given) == set(expected) and all(same(given[n], expected[n]) for n in given)


def test_write_model_reads_external_data_from_its_folder(tmp_path):
    """How the optimised model onnxruntime wrote with its weights beside it
    becomes the kept bytes: the external weights are written inline."""
    model, weight = matmul_model()
    onnx.save(model, str(tmp_path / "m.onnx"), save_as_external_data=True,
              all_tensors_to_one_file=True, location="m.weights", size_threshold=0)
    lean = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    assert lean.graph.initializer[0].data_location == TensorProto.EXTERNAL
    file = io.BytesIO()
    file.write(b"offset")   # spans count from where the model starts
    spans = write_model(lean, file, str(tmp_path))
    data = file.getvalue()[len(b"offset"):]
    written = onnx.ModelProto.FromString(data)
    assert same(numpy_helper.to_array(written.graph.initializer[0]), weight)
    assert same(initializer_views(data, ["W"])["W"], weight)
    assert spans == _initializer_spans(data)
    assert same(initializer_views(data, ["W"], spans)["W"], weight)
    file = io.BytesIO()
    write_model(lean, file)   # no folder: left external
    assert onnx.ModelProto.FromString(file.getvalue()) == lean


@pytest.mark.parametrize("hosted", [False, True], ids=["fetched", "hosted"])
def test_weights_no_view_reaches_are_copied(hosted):
    """Weights stored in typed fields (no raw data) reach the routines as
    copies, the others as views; all equal to ``numpy_helper.to_array``."""
    initializers = [numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4), "raw"),
                    helper.make_tensor("typed", TensorProto.FLOAT, [2, 2], [1.0, 2.0, 3.0, 4.0]),
                    helper.make_tensor("ints", TensorProto.INT32, [3], [7, 8, 9])]
    nodes = [helper.make_node("Identity", [i.name], [i.name + "_out"], name=i.name)
             for i in initializers]
    outputs = [helper.make_tensor_value_info(i.name + "_out", i.data_type, list(i.dims))
               for i in initializers]
    model = helper.make_model(helper.make_graph(nodes, "typed", [], outputs, initializers),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    tool = Weights()
    with amanda.apply(tool), (hosted_observation() if hosted else contextlib.nullcontext()):
        session = ort.InferenceSession(model.SerializeToString(),
                                       providers=["CPUExecutionProvider"])
    session.run(None, {})
    seen = {op: arrays for op, arrays in tool.seen}
    assert set(seen) == {"raw", "typed", "ints"}
    for initializer in initializers:
        (observed,) = seen[initializer.name]
        assert same(observed, numpy_helper.to_array(initializer)), initializer.name
        assert not observed.flags.writeable


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
    amanda.runtime.onnx.DRIVER   # the package loads its modules on first use: load them before measuring

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
            self.calls = getattr(self, "calls", 0) + 1   # a routine that does something

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
def test_an_observing_session_keeps_one_copy_of_the_weights_at_most(tmp_path):
    """A plain session holds the 64 MiB weight once (packed for its MatMul);
    an observing one holds that and the cache's serialized optimised model
    (the routines' views point into it, and onnxruntime uses its
    initializers instead of copies of its own where its kernels do not pack
    them), fetched or hosted. Before, the cache also kept the user's model
    (and the IR graph referring to it): 2.2 weights more (211 MiB against
    74). Earlier still, the lowered model's bytes, a copy of the weight for
    the routines (fetched) or onnxruntime's unpacked copy for an AmandaPut
    (hosted) and the model onnx's shape inference returned: five copies or
    more."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=ROOT)
    grown = {}
    for how in ("plain", "amanda", "hosted"):
        done = subprocess.run([sys.executable, "-c", _MEASURE, str(tmp_path / "m.onnx"), how],
                              capture_output=True, text=True, env=env, cwd=ROOT, check=True)
        grown[how] = json.loads(done.stdout.strip().splitlines()[-1])
    for how in ("amanda", "hosted"):
        assert grown[how] - grown["plain"] < 1.5 * 64, (how, grown)


class Values(amanda.Tool):
    """Keeps a copy of what every routine (before and after every node) receives."""

    def __init__(self):
        super().__init__()
        self.seen = []
        self.add_inst_for_op(self.analyse, require_outputs=True)

    def analyse(self, context):
        op = context.get_op_id()
        context.insert_before_op(self.look, where=(op, "before"))
        context.insert_after_op(self.look, where=(op, "after"))

    def look(self, *arrays, where):
        self.seen.append((where, [np.array(a) for a in arrays]))


def _seen_equal(first, second):
    return len(first) == len(second) and all(
        w1 == w2 and len(a1) == len(a2) and all(same(x, y) for x, y in zip(a1, a2))
        for (w1, a1), (w2, a2) in zip(first, second))


def _options(level):
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    return options


LEVELS = [ort.GraphOptimizationLevel.ORT_ENABLE_ALL, ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
          ort.GraphOptimizationLevel.ORT_ENABLE_BASIC]


@pytest.mark.parametrize("hosted", [False, True], ids=["fetched", "hosted"])
def test_the_cache_keeps_no_user_model_and_other_levels_see_the_same_values(tmp_path, hosted):
    """Once a session is built the cache entry holds neither the user's model
    nor the IR graph; a session at another optimisation level (the model
    instrumented again from that call's model, from a file or bytes) and one
    from the cache see exactly what sessions with the cache disabled see."""
    model, _ = matmul_model()
    path = str(tmp_path / "mm.onnx")
    onnx.save(model, path)
    x = np.random.default_rng(3).standard_normal((2, 64)).astype(np.float32)
    runs = {}
    for cache in (contextlib.nullcontext, amanda.cache_disabled):
        tool = Values()
        with cache(), amanda.apply(tool), \
                (hosted_observation() if hosted else contextlib.nullcontext()):
            for source in (path, model.SerializeToString()):
                for level in LEVELS + LEVELS[:1]:    # the last one from the cache
                    session = ort.InferenceSession(source, _options(level),
                                                   providers=["CPUExecutionProvider"])
                    session.run(None, {"x": x})
            if cache is contextlib.nullcontext:
                (hit,) = controls.state.sessions[-1].caches["onnx"].values()
                assert hit.side is None and hit.sides and len(hit.optimised) == 3
        runs[cache] = tool.seen
    assert len(runs[contextlib.nullcontext]) == 2 * 4 * 4   # 2 nodes, before and after
    assert _seen_equal(runs[contextlib.nullcontext], runs[amanda.cache_disabled])
    plain = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert same(runs[contextlib.nullcontext][-1][1][0], plain[0])


def test_shared_weights_outlive_the_scope_and_stay_out_of_the_users_options():
    """Without options of the user's, onnxruntime uses the cached model's
    large initializers (read-only views) instead of copies; the session keeps
    them, so it runs right after the scope and its cache are gone. With the
    user's options nothing is added to them: a later plain session on
    another model with a weight of the same name reads its own."""
    model, weight = matmul_model(rows=256, cols=128)   # 128 KiB: shared
    x = np.random.default_rng(4).standard_normal((2, 256)).astype(np.float32)
    plain = ort.InferenceSession(model.SerializeToString(),
                                 providers=["CPUExecutionProvider"]).run(None, {"x": x})
    tool = Values()
    mine = _options(ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    with amanda.apply(tool):
        shared = ort.InferenceSession(model.SerializeToString(),
                                      providers=["CPUExecutionProvider"])
        theirs = ort.InferenceSession(model.SerializeToString(), mine,
                                      providers=["CPUExecutionProvider"])
        (hit,) = controls.state.sessions[-1].caches["onnx"].values()
        # one entry for amanda's own options (key ends with own=True), one
        # for the user's, which shares nothing
        (data, _, _, views, lean, _), = [v for k, v in hit.optimised.items() if k[-1]]
        (_, _, _, none, no_lean, _), = [v for k, v in hit.optimised.items() if not k[-1]]
    assert none == {} and no_lean is None
    assert set(views) == {"W"} and same(views["W"], weight)
    # the model the session was created from holds no copy of the weight
    assert lean is not None and len(lean[0]) < weight.nbytes // 4
    kept = np.frombuffer(data, np.uint8)
    assert any(np.shares_memory(v.numpy(), kept) for v in shared._amanda_shared)
    assert not hasattr(theirs, "_amanda_shared")
    del hit, data, views, kept, none
    gc.collect()
    assert same(shared.run(None, {"x": x})[0], plain[0])
    assert same(theirs.run(None, {"x": x})[0], plain[0])
    other, other_weight = matmul_model(rows=256, cols=128)
    other.graph.initializer[0].CopyFrom(numpy_helper.from_array(-other_weight, "W"))
    again = ort.InferenceSession(other.SerializeToString(), mine,
                                 providers=["CPUExecutionProvider"]).run(None, {"x": x})
    expected = ort.InferenceSession(other.SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert same(again[0], expected[0]) and not same(again[0], plain[0])
