"""onnxruntime as users write it, second round (the first is
test_onnx_users.py): outputs asked by name, `If`/`Loop`/`Scan` bodies run by
every run method, static QDQ quantization, IR versions and opsets, string and
bool tensors, initializers that are also graph inputs, explicit providers,
and `amanda.instrument` against a session made inside `apply`. Compared by
difference against the same code without amanda (bit for bit), with the
analysis cache on and off."""

import contextlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

import amanda
import amanda.runtime.onnx
from tests.onnx.test_control_flow_onnx import X as LOOP_X
from tests.onnx.test_control_flow_onnx import control_model, scan_model
from tests.onnx.test_onnx_users import (FEEDS, RUNS, Record, _exact_options, _model, _same,
                                        _session)

HOWS = ["fetched", "hosted", "dataflow"]
RNG = np.random.default_rng(2)


def _options(how):
    return _exact_options() if how == "dataflow" else None


def _every_value(model, feed):
    """Every node output of ``model`` for ``feed``, from a plain session
    with each of them as a graph output."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    names = [o for node in model.graph.node for o in node.output]
    del probe.graph.output[:]
    probe.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names)
    session = ort.InferenceSession(probe.SerializeToString(), _exact_options())
    return dict(zip(names, session.run(None, feed)))


def _calls_by_cache(source, how, run, providers=None):
    """``run(session)`` for a session made inside apply, with the analysis
    cache on and off: the results and the tool's calls of each."""
    seen = []
    for cache in (contextlib.nullcontext, amanda.cache_disabled):
        tool = Record(replace=how == "dataflow")
        with cache():
            session = _session(source, tool, how, _options(how))
        seen.append((run(session), tool.calls))
    (first, calls), (second, again) = seen
    assert _same(first, second)
    assert [op for op, _ in calls] == [op for op, _ in again]
    assert all(_same(a, b) for (_, a), (_, b) in zip(calls, again))
    return first, calls


# -- bugs found ---------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["run", "run_with_ort_values"])
def test_a_fetching_session_refuses_a_name_that_is_not_an_output_like_a_plain_one(method):
    """An observing session fetches the tensors its routines read as extra
    outputs of the model it runs, hidden from get_outputs(). Asked for one by
    name (an intermediate tensor), it answered, where the plain session
    raises onnxruntime's InvalidArgument: code written inside apply broke
    outside it, and a misspelled fetch was not said."""
    source = _model().SerializeToString()
    feed = FEEDS[1]
    calls = {
        "run": lambda s, names: s.run(names, feed),
        "run_with_ort_values": lambda s, names: [v.numpy() for v in s.run_with_ort_values(
            names, {k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in feed.items()})]}[method]
    plain = ort.InferenceSession(source)
    tool = Record()
    session = _session(source, tool, "fetched")
    for names in (["h"], ["y", "h"]):
        with pytest.raises(InvalidArgument, match="Invalid output name:h") as refused:
            calls(plain, names)
        with pytest.raises(InvalidArgument, match="Invalid output name:h") as got:
            calls(session, names)
        assert str(got.value) == str(refused.value)
    assert tool.calls == []
    assert _same(calls(session, ["z", "y"]), plain.run(["z", "y"], feed))


@pytest.mark.parametrize("how", ["fetched", "hosted"])
def test_a_list_fed_reaches_the_routines_as_the_array_onnxruntime_made_of_it(how):
    """onnxruntime makes an array of the input's element type from a list
    it is fed. An observing session's routines got the list as NumPy makes
    it, float64: another dtype and other values than the node computed with
    (0.1 as a double, not the float32 the model read)."""
    source = _model().SerializeToString()
    values = (np.arange(12).reshape(3, 4) / 10).tolist()
    expected = ort.InferenceSession(source).run(None, {"x": np.asarray(values, np.float32)})
    tool = Record()
    session = _session(source, tool, how)
    assert _same(session.run(None, {"x": values}), expected)
    seen = tool.calls[0][1][0]
    assert seen.dtype == np.float32 and np.array_equal(seen, np.asarray(values, np.float32))


# -- scenarios that work: real APIs the suite does not touch elsewhere -------------------


def _loop_feed():
    return {"x_in": LOOP_X}


def _scan_feed():
    return {"init": np.zeros(2, np.float32), "s": RNG.standard_normal((6, 2)).astype(np.float32)}


@pytest.mark.parametrize("method", sorted(RUNS))
@pytest.mark.parametrize("model", ["loop", "scan"])
@pytest.mark.parametrize("how", HOWS)
def test_bodies_through_every_run_method(how, model, method):
    """Body routines (which always run inside onnxruntime) from the run
    methods other than run: the same values and calls as session.run."""
    proto, feed = (control_model(), _loop_feed()) if model == "loop" else (scan_model(),
                                                                          _scan_feed())
    source = proto.SerializeToString()
    expected = ort.InferenceSession(source, _options(how)).run(None, feed)
    _, by_run = _calls_by_cache(source, how, lambda s: s.run(None, feed))
    got, calls = _calls_by_cache(source, how, lambda s: RUNS[method](s, feed))
    assert _same(got, expected)
    assert [op for op, _ in calls] == [op for op, _ in by_run]
    assert all(_same(a, b) for (_, a), (_, b) in zip(calls, by_run))
    assert any("/body/" in op for op, _ in calls)


def _conv_model():
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "W", "B"], ["c"], name="conv", pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c"], ["r"], name="relu"),
         helper.make_node("GlobalAveragePool", ["r"], ["p"], name="pool"),
         helper.make_node("Flatten", ["p"], ["f"], name="flat"),
         helper.make_node("Gemm", ["f", "W2", "B2"], ["y"], name="fc", transB=1)], "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])],
        [numpy_helper.from_array(RNG.standard_normal(shape).astype(np.float32), name)
         for name, shape in (("W", (6, 3, 3, 3)), ("B", (6,)), ("W2", (5, 6)), ("B2", (5,)))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("quant_format", ["QDQ", "QOperator"])
def test_a_statically_quantized_model(tmp_path, quant_format):
    """onnxruntime.quantization.quantize_static with a calibration reader:
    outputs as the plain session's, every node's outputs as a plain run
    computes them, at the default level and at ORT_DISABLE_ALL."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{"x": RNG.standard_normal((2, 3, 8, 8)).astype(np.float32)}
                                 for _ in range(3)])

        def get_next(self):
            return next(self.batches, None)

    plain, quantized = str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx")
    onnx.save(_conv_model(), plain)
    quantize_static(plain, quantized, Reader(), quant_format=getattr(QuantFormat, quant_format))
    model = onnx.load(quantized)
    assert any(n.op_type == "QuantizeLinear" for n in model.graph.node)
    feed = {"x": RNG.standard_normal((3, 3, 8, 8)).astype(np.float32)}
    values = _every_value(model, feed)
    for how in HOWS:
        expected = ort.InferenceSession(quantized, _options(how)).run(None, feed)
        got, calls = _calls_by_cache(quantized, how, lambda s: s.run(None, feed))
        assert _same(got, expected)
        after = dict(calls[1::2])
        assert len(after) == len(model.graph.node)
        for node in model.graph.node:
            assert _same(after[node.name], [values[o] for o in node.output])


@pytest.mark.parametrize("ir_version,opset", [(7, 13), (8, 15), (9, 18), (10, 20), (13, 21)])
def test_ir_versions_and_opsets(ir_version, opset):
    model = _model()
    model.ir_version = ir_version
    model.opset_import[0].version = opset
    source = model.SerializeToString()
    for how in HOWS:
        expected = ort.InferenceSession(source, _options(how)).run(None, FEEDS[2])
        got, calls = _calls_by_cache(source, how, lambda s: s.run(None, FEEDS[2]))
        assert _same(got, expected) and len(calls) == 6
    instrumented = amanda.instrument(model, Record())
    assert instrumented.ir_version == ir_version
    assert [o.version for o in instrumented.opset_import if o.domain == ""] == [opset]


def _strings_and_bools():
    graph = helper.make_graph(
        [helper.make_node("Equal", ["s", "t"], ["eq"], name="eq"),
         helper.make_node("Or", ["eq", "b"], ["o"], name="or"),
         helper.make_node("Not", ["o"], ["n"], name="not"),
         helper.make_node("Cast", ["n"], ["f"], to=TensorProto.FLOAT, name="cast"),
         helper.make_node("Add", ["f", "v"], ["out"], name="add")], "strings",
        [helper.make_tensor_value_info("s", TensorProto.STRING, ["N"]),
         helper.make_tensor_value_info("t", TensorProto.STRING, ["N"]),
         helper.make_tensor_value_info("b", TensorProto.BOOL, ["N"]),
         helper.make_tensor_value_info("v", TensorProto.FLOAT, ["N"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N"]),
         helper.make_tensor_value_info("n", TensorProto.BOOL, ["N"]),
         helper.make_tensor_value_info("eq", TensorProto.BOOL, ["N"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 10
    return model


@pytest.mark.parametrize("outputs", [None, ["n"], ["eq", "out"]])
def test_string_and_bool_tensors_and_some_of_several_outputs(outputs):
    """Strings reach routines as None (documented), bools as arrays."""
    model = _strings_and_bools()
    source = model.SerializeToString()
    feed = {"s": np.array(["a", "b", "c"], object), "t": np.array(["a", "x", "c"], object),
            "b": np.array([False, True, False]), "v": np.array([1, 2, 3], np.float32)}
    values = _every_value(model, feed)
    for how in HOWS:
        expected = ort.InferenceSession(source, _options(how)).run(outputs, feed)
        got, calls = _calls_by_cache(source, how, lambda s: s.run(outputs, feed))
        assert _same(got, expected)
        after = dict(calls[1::2])
        assert after["eq"][0].dtype == bool and _same(after["eq"], [values["eq"]])
        assert _same(after["not"], [values["n"]])
        assert dict(calls[0::2])["eq"] == [None, None]


def _overridable():
    model = _model()
    model.graph.input.append(helper.make_tensor_value_info("W", TensorProto.FLOAT, [4, 64]))
    return model


@pytest.mark.parametrize("fed", [False, True])
def test_an_initializer_that_is_also_a_graph_input(fed):
    """Routines see the weight the run used: the initializer, or the array
    fed in its place."""
    source = _overridable().SerializeToString()
    feed = dict(FEEDS[2])
    if fed:
        feed["W"] = RNG.standard_normal((4, 64)).astype(np.float32)
    for how in HOWS:
        expected = ort.InferenceSession(source, _options(how)).run(None, feed)
        got, calls = _calls_by_cache(source, how, lambda s: s.run(None, feed))
        assert _same(got, expected)
        weight = calls[0][1][1]
        assert np.array_equal(weight, feed["W"] if fed else numpy_helper.to_array(
            _overridable().graph.initializer[0]))


@pytest.mark.parametrize("providers", [["CPUExecutionProvider"],
                                       [("CPUExecutionProvider", {})]])
def test_providers_given_explicitly(providers):
    source = _model().SerializeToString()
    for how in HOWS:
        plain = ort.InferenceSession(source, _options(how), providers=providers)
        scope = (amanda.runtime.onnx.hosted_observation() if how == "hosted"
                 else contextlib.nullcontext())
        tool = Record(replace=how == "dataflow")
        with scope, amanda.apply(tool):
            session = ort.InferenceSession(source, _options(how), providers=providers)
        assert session.get_providers() == plain.get_providers()
        assert _same(session.run(None, FEEDS[1]), plain.run(None, FEEDS[1]))
        assert len(tool.calls) == 6


@pytest.mark.parametrize("replace", [False, True])
def test_amanda_instrument_in_plain_onnxruntime_equals_the_session_path(replace):
    model = _model()
    before = model.SerializeToString()
    by_instrument, by_session = Record(replace=replace), Record(replace=replace)
    instrumented = amanda.instrument(model, by_instrument)
    assert model.SerializeToString() == before
    got = ort.InferenceSession(instrumented.SerializeToString(),
                               amanda.runtime.onnx.session_options()).run(None, FEEDS[1])
    session = _session(before, by_session, "dataflow" if replace else "fetched",
                       _exact_options())
    assert _same(got, session.run(None, FEEDS[1]))
    assert _same(got, ort.InferenceSession(before, _exact_options()).run(None, FEEDS[1]))
    assert [op for op, _ in by_instrument.calls] == [op for op, _ in by_session.calls]
    assert all(_same(a, b) for (_, a), (_, b) in zip(by_instrument.calls, by_session.calls))
