"""onnxruntime as users write it, inside `amanda.apply`: every way of running
a session, models read from a path with external data, and the session
options, dtypes and model kinds users meet. Compared by difference against
the same code without amanda (bit for bit), with the analysis cache on and
off, and the user's options as they were afterwards."""

import contextlib
import threading
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.capi import _pybind_state as C

import amanda
import amanda.runtime.onnx
from amanda.runtime.onnx.host import CHECKED_RUNS, run_methods

RNG = np.random.default_rng(0)
WEIGHT = RNG.standard_normal((4, 64)).astype(np.float32)
FEEDS = [{"x": RNG.standard_normal((batch, 4)).astype(np.float32)} for batch in (1, 3, 5)]


def _model(weight=WEIGHT):
    """MatMul -> (Relu, Neg), a symbolic batch."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"], name="fc"),
         helper.make_node("Relu", ["h"], ["y"], name="relu"),
         helper.make_node("Neg", ["h"], ["z"], name="neg")], "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", weight.shape[1]]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", weight.shape[1]])],
        [numpy_helper.from_array(weight, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 10
    return model


class Record(amanda.Tool):
    """Before and after every node: records (op id, copies of the values);
    ``replace`` hands the values back (in the dataflow), ``fail`` raises."""

    def __init__(self, replace=False, fail=False):
        super().__init__()
        self.calls = []
        self.replace = replace
        self.fail = fail
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        routine = self.identity if self.replace else self.look
        context.insert_before_op(routine, op=context.get_op_id())
        context.insert_after_op(routine, op=context.get_op_id())

    def look(self, *arrays, op):
        self.calls.append((op, [None if a is None else np.array(a) for a in arrays]))
        if self.fail:
            raise RuntimeError("routine failed")

    def identity(self, *arrays, op):
        self.calls.append((op, [None if a is None else np.array(a) for a in arrays]))
        if self.fail:
            raise RuntimeError("routine failed")
        return arrays if len(arrays) > 1 else arrays[0]


def _session(source, tool, how, options=None):
    """A session created inside ``apply(tool)``: ``how`` is "fetched" (the
    default for observers), "hosted" (`hosted_observation`) or "dataflow"."""
    scope = (amanda.runtime.onnx.hosted_observation() if how == "hosted"
             else contextlib.nullcontext())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the optimisation-level warning of "dataflow"
        with scope, amanda.apply(tool):
            return ort.InferenceSession(source, options)


def _exact_options():
    """What routines in the dataflow are bit-identical to (docs/onnx.md)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.add_session_config_entry("session.disable_prepacking", "1")
    return options


def _same(got, expected):
    return len(got) == len(expected) and all(
        np.array_equal(np.asarray(g), np.asarray(e)) for g, e in zip(got, expected))


def _ort_values(session, feed):
    return [v.numpy() for v in session.run_with_ort_values(
        None, {k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in feed.items()})]


def _iobinding(session, feed):
    binding = session.io_binding()
    for name, value in feed.items():
        binding.bind_cpu_input(name, value)
    for output in session.get_outputs():
        binding.bind_output(output.name)
    session.run_with_iobinding(binding)
    return binding.copy_outputs_to_cpu()


def _ortvaluevector(session, feed):
    feeds = C.OrtValueVector()
    for value in feed.values():
        feeds.push_back(ort.OrtValue.ortvalue_from_numpy(value)._ortvalue)
    fetches = C.OrtValueVector()
    names = [o.name for o in session.get_outputs()]
    cpu = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
    session.run_with_ortvaluevector(ort.RunOptions(), list(feed), feeds, names, fetches,
                                    [cpu] * len(names))
    return [np.asarray(fetches[i].numpy()) for i in range(len(names))]


RUNS = {"run_with_ort_values": _ort_values, "run_with_iobinding": _iobinding,
        "run_with_ortvaluevector": _ortvaluevector}
assert set(RUNS) == set(CHECKED_RUNS) - {"run"}   # every checked run method is tested


# -- bugs found ---------------------------------------------------------------------------


@pytest.mark.parametrize("method", sorted(RUNS))
@pytest.mark.parametrize("how", ["hosted", "dataflow"])
def test_every_run_method_of_a_hosting_session_runs_its_routines_and_raises_their_errors(
        method, how):
    """Routines hosted inside onnxruntime ran from run_with_ort_values and
    run_with_iobinding too, but their errors were kept for the next
    session.run (of any session on the thread) and never raised by the call
    that met them: the failure was silent."""
    source = _model().SerializeToString()
    options = _exact_options() if how == "dataflow" else None
    expected = ort.InferenceSession(source, options).run(None, FEEDS[1])
    tool = Record(replace=how == "dataflow")
    session = _session(source, tool, how, options)
    assert _same(RUNS[method](session, FEEDS[1]), expected)
    assert [op for op, _ in tool.calls] == ["fc", "fc", "relu", "relu", "neg", "neg"]
    failing = _session(source, Record(replace=how == "dataflow", fail=True), how, options)
    with pytest.raises(amanda.ToolError, match="routine failed"):
        RUNS[method](failing, FEEDS[1])
    assert _same(session.run(None, FEEDS[1]), expected)   # nothing left for the next run


@pytest.mark.parametrize("how", ["hosted", "dataflow"])
def test_run_async_is_refused_where_routines_run_inside_onnxruntime(how):
    """run_async ran hosted routines on onnxruntime's pool: a routine's error
    was not raised to its caller but by the next run that finished on any
    thread, of any session and tool set."""
    source = _model().SerializeToString()
    failing = _session(source, Record(replace=how == "dataflow", fail=True), how)
    done = threading.Event()
    with pytest.raises(amanda.BackendError, match="run_async"):
        failing.run_async(None, FEEDS[0], lambda *args: done.set(), None)
    done.wait(5)
    other = _session(source, Record(), "fetched")
    assert _same(other.run(None, FEEDS[0]), ort.InferenceSession(source).run(None, FEEDS[0]))


@pytest.mark.parametrize("method", [m for m in run_methods()
                                    if m not in ("run", "run_with_ort_values")])
def test_a_fetching_session_refuses_the_run_methods_that_cannot_call_its_routines(method):
    """run_with_ortvaluevector ran the model and called no routine: every
    point was dropped without a word."""
    session = _session(_model().SerializeToString(), Record(), "fetched")
    with pytest.raises(amanda.BackendError, match=method):
        getattr(session, method)(*[None] * 6)


@pytest.mark.parametrize("method", sorted(RUNS))
def test_a_plain_session_is_named_by_every_run_method(method):
    """A session made outside the scope was named only by session.run."""
    source = _model().SerializeToString()
    session = ort.InferenceSession(source)
    expected = session.run(None, FEEDS[0])
    tool = Record()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with amanda.apply(tool):
            got = RUNS[method](session, FEEDS[0])
    said = [w for w in caught if issubclass(w.category, amanda.NotInstrumentedWarning)]
    assert len(said) == 1 and said[0].filename == __file__
    assert _same(got, expected) and tool.calls == []
    assert not any(m in ort.InferenceSession.__dict__ for m in run_methods())


@pytest.mark.parametrize("how", ["fetched", "hosted", "dataflow"])
def test_a_model_read_from_a_path_with_external_data(tmp_path, how):
    """Observers of a model whose weights live in an external data file
    failed at session creation (onnxruntime's optimised copy pointed at a
    data file that does not exist beside it)."""
    path = str(tmp_path / "model.onnx")
    onnx.save(_model(), path, save_as_external_data=True, all_tensors_to_one_file=True,
              location="weights.bin", size_threshold=0)
    options = (lambda: _exact_options()) if how == "dataflow" else (lambda: None)
    expected = [ort.InferenceSession(path, options()).run(None, f) for f in FEEDS]
    seen = []
    for cache in (contextlib.nullcontext, amanda.cache_disabled):
        tool = Record(replace=how == "dataflow")
        with cache():
            session = _session(path, tool, how, options())
        assert all(_same(session.run(None, f), e) for f, e in zip(FEEDS, expected))
        seen.append(tool.calls)
    assert len(seen[0]) == 6 * len(FEEDS)
    assert [op for op, _ in seen[0]] == [op for op, _ in seen[1]]
    assert all(_same(a, b) for (_, a), (_, b) in zip(*seen))
    weights = [arrays[1] for op, arrays in seen[0][:1]]
    assert np.array_equal(weights[0], WEIGHT)


# -- scenarios that work: real APIs the suite does not touch elsewhere -------------------


def _options(kind, tmp_path):
    options = ort.SessionOptions()
    if kind == "profiling":
        options.enable_profiling = True
        options.profile_file_prefix = str(tmp_path / "profile")
    elif kind == "parallel":
        options.execution_mode = ort.ExecutionMode.ORT_PARALLEL
        options.inter_op_num_threads = 2
    elif kind == "basic, one thread":
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        options.intra_op_num_threads = 1
    return options


def _settings(options):
    return (options.graph_optimization_level, options.execution_order,
            options.execution_mode, options.optimized_model_filepath,
            options.log_severity_level, options.enable_profiling, options.intra_op_num_threads)


@pytest.mark.parametrize("kind", ["profiling", "parallel", "basic, one thread"])
def test_observers_with_the_users_session_options_and_changing_batch_sizes(tmp_path, kind):
    source = _model().SerializeToString()
    expected = [ort.InferenceSession(source, _options(kind, tmp_path)).run(None, f)
                for f in FEEDS]
    for how in ("fetched", "hosted"):
        options = _options(kind, tmp_path)
        before = _settings(options)
        tool = Record()
        session = _session(source, tool, how, options)
        assert _settings(options) == before
        for feed, want in zip(FEEDS, expected):
            assert _same(session.run(None, feed), want)
            assert _same(session.run(["z"], feed), want[1:])
        batches = [arrays[0].shape[0] for op, arrays in tool.calls if op == "fc"][::2]
        assert batches == [1, 1, 3, 3, 5, 5]


def test_a_dynamically_quantized_model(tmp_path):
    """onnxruntime.quantization.quantize_dynamic: int8/uint8 tensors reach
    the routines as the plain run computes them."""
    from onnxruntime.quantization import QuantType, quantize_dynamic
    plain, quantized = str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx")
    onnx.save(_model(), plain)
    quantize_dynamic(plain, quantized, weight_type=QuantType.QInt8)
    feed = FEEDS[1]
    model = onnx.load(quantized)
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    names = [o for n in model.graph.node for o in n.output]
    del probe.graph.output[:]
    probe.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names)
    values = dict(zip(names, ort.InferenceSession(probe.SerializeToString(),
                                                  _exact_options()).run(None, feed)))
    expected = ort.InferenceSession(quantized).run(None, feed)
    for how in ("fetched", "hosted"):
        tool = Record()
        session = _session(quantized, tool, how)
        assert _same(session.run(None, feed), expected)
        after = {op: arrays for op, arrays in tool.calls[1::2]}
        dtypes = {a.dtype for arrays in after.values() for a in arrays}
        assert {np.dtype("uint8"), np.dtype("int32")} <= dtypes
        for node in model.graph.node:
            assert _same(after[node.name], [values[o] for o in node.output])


@pytest.mark.parametrize("how", ["fetched", "hosted"])
def test_a_users_subclass_of_inference_session_keeps_its_class_and_its_run(how):
    """A session of a user's own ``InferenceSession`` subclass made inside
    ``apply`` is still of that class, and its overridden ``run`` is what
    amanda's run methods call in the end (host.set_run)."""
    class Counting(ort.InferenceSession):
        runs = 0

        def run(self, *args, **kwargs):
            Counting.runs += 1   # (type(self) is amanda's subclass of Counting)
            return super().run(*args, **kwargs)

    data = _model().SerializeToString()
    want = ort.InferenceSession(data).run(None, FEEDS[0])
    tool = Record()
    scope = (amanda.runtime.onnx.hosted_observation() if how == "hosted"
             else contextlib.nullcontext())
    with scope, amanda.apply(tool):
        session = Counting(data, providers=["CPUExecutionProvider"])
    assert isinstance(session, Counting) and type(session).__name__ == "Counting"
    assert type(session).__bases__ == (Counting,)
    assert _same(session.run(None, FEEDS[0]), want)
    assert Counting.runs == 1 and len(tool.calls) == 2 * 3
