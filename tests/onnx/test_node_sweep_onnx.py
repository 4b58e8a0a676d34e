"""onnx's own backend node tests under amanda, by difference (the harness is
``tests/onnx/node_sweep_cases.py``).

Every case of ``onnx.backend.test.case.node`` that plain onnxruntime (CPU)
runs is run under ``amanda.apply`` with three tools: routines before and
after every node that only observe (default optimisation level), identity
routines that hand their inputs back, and counters with ``inputs=[]`` /
``outputs=[]`` (both at ``ORT_DISABLE_ALL`` without prepacking, as
docs/onnx.md promises). Outputs of two runs are compared with plain
onnxruntime at the same options, bit-exact (only shapes and dtypes where
plain onnxruntime itself differs between two sessions: random ops); every
node is counted once per run at both points (bodies of If/Loop/Scan: at
least the top-level count, as many after- as before-routines). A case plain
onnxruntime cannot load or run is not amanda's and is skipped; a case that
fails under amanda is either fixed or listed in ``EXPECTED_FAILURES`` with
the reason.

``test_node_sweep`` (slow) runs every case; ``test_quick_case`` a fixed
subset on every ``pytest`` run. The other tests are the defects the sweep
found, each failing before its fix.
"""

import os
import time

import numpy as np

import pytest

import amanda
from tests.onnx.conftest import onnx, ort  # noqa: F401  (skips without onnx/ort)
from tests.onnx import node_sweep_cases as sweep
from onnx import TensorProto, helper

#: case name -> (the reason, a text every failure of the case contains).
#: Documented limits of amanda, not bugs (docs/onnx.md, "Conformance").
_SCAN_BODY = ("a routine that may replace a tensor inside a Scan body whose outputs' "
              "shapes onnx cannot infer is refused with a clear error: onnxruntime "
              "runs such a body only when it knows them (docs/onnx.md, Limits)",
              "whose outputs' shapes the model does not declare")
_LOOP_BODY = ("the same refusal for a Loop body (Range's function expansion) whose "
              "outputs' shapes onnx cannot infer",
              "whose outputs' shapes the model does not declare")
EXPECTED_FAILURES = {
    **{f"test_range_{name}_expanded": _LOOP_BODY for name in (
        "bfloat16_type_positive_delta", "float16_type_positive_delta",
        "float_type_positive_delta", "int32_type_negative_delta")},
    **{f"test_linear_attention_{name}_expanded": _SCAN_BODY for name in (
        "decode_step", "delta", "explicit_scale", "fp16", "gated_delta_beta_scalar",
        "gated_delta", "gated_delta_gqa", "gated_delta_mqa", "gated", "gated_per_head_decay",
        "linear", "linear_t1_no_past", "no_past_explicit_zeros", "prefill_with_past")},
}

#: the quick subset: (case module, case names)
QUICK_MODULES = ("abs", "add", "cast", "if_", "loop", "scan", "dropout", "sequenceinsert",
                 "ai_onnx_ml.binarizer", "causal_conv_with_state",
                 "linear_attention", "matmul", "split")
QUICK = ["test_abs", "test_add_bcast", "test_add_uint8", "test_cast_FLOAT_to_BFLOAT16",
         "test_cast_BFLOAT16_to_FLOAT", "test_cast_FLOAT_to_FLOAT8E4M3FN",
         "test_cast_FLOAT8E5M2_to_FLOAT", "test_cast_FLOAT_to_INT4", "test_if", "test_loop11",
         "test_scan9_sum", "test_dropout_default_mask", "test_sequence_insert_at_back",
         "test_add", "test_ai_onnx_ml_binarizer",
         "test_causal_conv_with_state_basic", "test_linear_attention_gated",
         "test_linear_attention_gated_expanded", "test_dropout_default", "test_matmul_2d",
         "test_split_equal_parts_1d_opset18"]


def _outcome(case):
    """None (passed), "skip: why" (plain onnxruntime cannot run it) or the failures."""
    try:
        return sweep.check(case)
    except sweep.NotPlain as why:
        return f"skip: {why}"


def _judge(name, outcome):
    """The failures that are not expected (an expected failure must fail as listed)."""
    if name in EXPECTED_FAILURES:
        marker = EXPECTED_FAILURES[name][1]
        assert isinstance(outcome, list), f"{name} is listed as failing but {outcome or 'passed'}"
        return [f for f in outcome if marker not in f]
    return outcome if isinstance(outcome, list) else []


@pytest.fixture(scope="module")
def quick_cases():
    return sweep.cases(QUICK_MODULES)


@pytest.mark.parametrize("name", QUICK)
def test_quick_case(quick_cases, name):
    outcome = _outcome(quick_cases[name])
    if isinstance(outcome, str):
        pytest.skip(outcome)
    assert not _judge(name, outcome)


#: the slow test runs every SAMPLE-th case (sorted by name), the expected
#: failures and the quick subset: in ``make test`` every 4th (497 cases, ~3
#: minutes on two shared cores, to keep CI within its time); ``make sweep``
#: sets AMANDA_NODE_SWEEP_SAMPLE=1, every case (7.4 minutes alone, ~15 with
#: the cores shared; ``python -m tests.onnx.node_sweep_cases`` runs them too)
SAMPLE = int(os.environ.get("AMANDA_NODE_SWEEP_SAMPLE", "4"))


@pytest.mark.slow
def test_node_sweep():
    start = time.perf_counter()
    every = sweep.cases()
    chosen = {n: c for i, (n, c) in enumerate(every.items())
              if i % SAMPLE == 0 or n in EXPECTED_FAILURES or n in QUICK}
    failures, skipped, passed = {}, [], 0
    for name, case in chosen.items():
        outcome = _outcome(case)
        if isinstance(outcome, str):
            skipped.append(name)
            continue
        unexpected = _judge(name, outcome)
        if unexpected:
            failures[name] = unexpected
        elif outcome is None:
            passed += 1
    print(f"{len(chosen)} of {len(every)} cases, {len(skipped)} not run by plain onnxruntime, "
          f"{passed} passed, {len(chosen) - len(skipped) - passed} expected failures, "
          f"{time.perf_counter() - start:.0f}s")
    assert not failures, failures
    assert not set(EXPECTED_FAILURES) - set(every), "expected failures of unknown cases"


# -- the defects the sweep found (each failed before its fix) ------------------------------

def _model(nodes, inputs, outputs, opsets=(("", 21),), ir_version=10):
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(graph, ir_version=ir_version,
                             opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])


@pytest.mark.parametrize("tool", ["identity"])
@pytest.mark.parametrize("middle", [TensorProto.BFLOAT16, TensorProto.FLOAT8E4M3FN,
                                    TensorProto.INT4])
def test_routines_wait_on_tensors_without_a_size_kernel(tool, middle):
    """A routine that receives no tensor of an op waits for the op through
    ``Size``, which onnxruntime's CPU has no kernel for on bfloat16, float8
    or 4-bit tensors: the session failed to load (NOT_IMPLEMENTED)."""
    model = _model([helper.make_node("Cast", ["x"], ["m"], to=middle),
                    helper.make_node("Cast", ["m"], ["y"], to=TensorProto.FLOAT)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    feed = {"x": np.array([1.5, -2.25, 3.0], np.float32)}
    options = sweep._options(ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    expected = ort.InferenceSession(model.SerializeToString(), options,
                                    providers=sweep.PROVIDERS).run(None, feed)
    counter = sweep.TOOLS[tool]()
    with amanda.apply(counter):
        session = ort.InferenceSession(model.SerializeToString(), options,
                                       providers=sweep.PROVIDERS)
        got = session.run(None, feed)
    assert got[0].tobytes() == expected[0].tobytes()
    assert sorted(counter.counts.values()) == [1, 1, 1, 1]


def test_run_with_ort_values_returns_bfloat16_outputs_while_observing():
    """``run_with_ort_values`` on an observing session converted every
    output to numpy for the routines, also the user's bfloat16 output that
    no routine reads: "No corresponding Numpy type for Tensor Type. bfloat16"."""
    model = _model([helper.make_node("Relu", ["x"], ["r"]),
                    helper.make_node("Cast", ["r"], ["y"], to=TensorProto.BFLOAT16)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                   [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [3])])
    feed = {"x": ort.OrtValue.ortvalue_from_numpy(np.array([1.5, -2.0, 3.0], np.float32))}
    expected = ort.InferenceSession(model.SerializeToString(), providers=sweep.PROVIDERS) \
        .run_with_ort_values(None, feed)
    observer = sweep.ObserveTool()
    with amanda.apply(observer):
        session = ort.InferenceSession(model.SerializeToString(), providers=sweep.PROVIDERS)
        got = session.run_with_ort_values(None, feed)
    assert sweep._ort_canonical(got[0]) == sweep._ort_canonical(expected[0])
    assert len(got) == 1
    assert sorted(observer.counts.values()) == [1, 1, 1, 1]


@pytest.mark.parametrize("tool", list(sweep.TOOLS))
def test_a_model_of_ai_onnx_ml_ops_only(tool):
    """A model that imports only ``ai.onnx.ml`` is valid (plain onnxruntime
    runs it); amanda refused it for importing no default domain. Its
    instrumented model imports one for amanda's own nodes."""
    model = _model([helper.make_node("Binarizer", ["x"], ["y"], domain="ai.onnx.ml",
                                     threshold=0.5)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
                   opsets=(("ai.onnx.ml", 1),), ir_version=8)
    feed = {"x": np.array([0.1, 0.6, -1.0, 2.0], np.float32)}
    level, prepack = sweep.LEVELS[tool]
    options = sweep._options(level, prepack)
    expected = ort.InferenceSession(model.SerializeToString(), options,
                                    providers=sweep.PROVIDERS).run(None, feed)
    counter = sweep.TOOLS[tool]()
    with amanda.apply(counter):
        session = ort.InferenceSession(model.SerializeToString(), options,
                                       providers=sweep.PROVIDERS)
        got = session.run(None, feed)
    assert got[0].tobytes() == expected[0].tobytes()
    assert sorted(counter.counts.values()) == [1, 1]
    exported = amanda.instrument(model, sweep.TOOLS[tool]())
    assert {o.domain for o in exported.opset_import} >= {"", "ai.onnx.ml"}


@pytest.mark.parametrize("name", ["test_causal_conv_with_state_basic",
                                  "test_linear_attention_gated"])
def test_replacing_routines_before_a_function_op_onnxruntime_expands(name):
    """onnxruntime runs ``CausalConvWithState`` and ``LinearAttention`` by
    expanding their function, which needs the types and shapes of the node's
    inputs: a routine's results (custom-op outputs) had none, and the session
    failed (NOT_IMPLEMENTED; "Subgraph must have the shape set for all
    outputs"). They are now declared, those of the tensors they replace."""
    case = sweep.cases(("causal_conv_with_state", "linear_attention"))[name]
    assert sweep.check(case, tools=("identity",)) is None


def test_observing_a_model_onnxruntime_inlines_a_function_of_twice():
    """An observe-only session builds on the model onnxruntime optimised and
    saved, which keeps the names onnxruntime gave an inlined function's
    values (``_inlfunc_Softmax_axes``); loading it, onnxruntime inlined the
    float16 ``Softmax`` still left and made them again: "AddInitializedTensor
    already has tensor" (a float16 Attention expansion plain onnxruntime
    loads). Those names are renamed in the optimised model."""
    case = sweep.cases(("attention",))["test_attention_4d_fp16_expanded"]
    assert sweep.check(case, tools=("observe",)) is None
