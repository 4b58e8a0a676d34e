"""ONNX model sweep (issue 13): tiny ``transformers`` models, exported with
``torch.onnx.export`` (TorchScript exporter, opset 17), run in onnxruntime
inside ``amanda.apply(tool)``.

For every case of :mod:`tests.onnx.onnx_sweep_models` (``COVERED_FAMILIES``
lists the families):

* ``test_observe_only_is_bit_identical_at_the_default_level``: a Python
  routine before and after every node that provably only observes (its code
  has no return but the implicit ``return None``:
  ``amanda.runtime.onnx.returns_only_none``) leaves the outputs bit-identical
  to a plain session at the default session options (optimisation level
  ALL), creates the session without a warning, and runs exactly once per
  node and point on every run (docs/onnx.md, "Observe-only routines never
  change outputs");
* ``test_identity_is_bit_identical_at_disable_all``:
  :class:`amanda.tools.identity.IdentityTool` (routines that hand their
  inputs back, so they sit in the dataflow) leaves the outputs bit-identical
  to a plain session at ``ORT_DISABLE_ALL`` without weight prepacking — what
  docs/onnx.md promises ("Routines that may replace") — without a warning, and
  runs once per node and point on every run.

Each model is exported once per test session (a module-scoped cache of the
model's bytes). A model that fails to export, or to run in a plain
onnxruntime session, is skipped with the reason, never dropped. Marked slow.
"""

import collections
import warnings

import numpy as np
import pytest

import amanda
from amanda.runtime.onnx import returns_only_none
from amanda.tools.identity import IdentityTool
from tests.onnx.conftest import onnx, ort, same  # noqa: F401  (skips without onnx/ort)

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.onnx.onnx_sweep_models import CASES, FAMILIES, export  # noqa: E402

#: The model families this sweep covers.
COVERED_FAMILIES = FAMILIES

_CASES = {case.name: case for case in CASES}
NAMES = list(_CASES)
RUNS = 2          # the first run and one more: routines run on every run
PROVIDERS = ["CPUExecutionProvider"]


# -- tools -------------------------------------------------------------------------------

class ObserveTool(amanda.Tool):
    """A Python routine before and after every node that only looks: it
    counts its calls per (node, point) and records the shapes it saw, and
    returns nothing (so it is a side branch, off the model's dataflow)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self.shapes = {}
        self.add_inst_for_op(self.analyse, require_outputs=True)

    def analyse(self, context):
        op = context.get_op_id()
        context.insert_before_op(self.look, key=(op, "before_op"))
        context.insert_after_op(self.look, key=(op, "after_op"))

    def look(self, *arrays, key):
        self.counts[key] += 1
        self.shapes[key] = [None if a is None else a.shape for a in arrays]


# -- helpers -----------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """Tracing tiny models on a shared machine: intra-op threads only contend."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def exported():
    """name -> (model bytes, feeds, node names) or the reason it cannot run
    without amanda; filled on first use, so each model is exported once."""
    return {}


def _options(level=None):
    options = ort.SessionOptions()
    if level is not None:
        options.graph_optimization_level = level
    return options


def _model(exported, name):
    """The exported case; skips (with the reason) a model that cannot be
    exported or run in a plain onnxruntime session."""
    if name not in exported:
        case = _CASES[name]
        try:
            data, feeds, _ = export(case)
        except Exception as error:  # noqa: BLE001  (fails without amanda: skip, say why)
            exported[name] = f"{name} does not export: {type(error).__name__}: {error}"
        else:
            nodes = [node.name for node in onnx.load_from_string(data).graph.node]
            try:
                for level in (None, ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
                    ort.InferenceSession(data, _options(level),
                                         providers=PROVIDERS).run(None, feeds)
            except Exception as error:  # noqa: BLE001
                exported[name] = (f"{name} does not run in plain onnxruntime: "
                                  f"{type(error).__name__}: {error}")
            else:
                exported[name] = (data, feeds, nodes)
    if isinstance(exported[name], str):
        pytest.skip(exported[name][:500])
    return exported[name]


def _first_difference(got, want):
    """None if the output lists are bit-identical, else the first difference."""
    if len(got) != len(want):
        return f"{len(got)} outputs vs {len(want)}"
    for i, (a, b) in enumerate(zip(got, want)):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"output {i}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        if not same(a, b):
            diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
            return (f"output {i} differs: max abs diff {np.nanmax(diff):.3g} "
                    f"at {int(np.count_nonzero(a != b))} of {a.size} elements")
    return None


def _instrumented_session(tool, data, options):
    """A session created inside ``apply(tool)``; a warning is an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with amanda.apply(tool):
            return ort.InferenceSession(data, options, providers=PROVIDERS)


def _prepacking_note(data, feeds, got):
    """Diagnosis for a failure: whether the instrumented outputs are those of
    a plain session that does not prepack constant weights (onnxruntime
    prepacks a MatMul/Gemm weight that is an initializer at every
    optimisation level, and cannot when the weight comes from a routine)."""
    options = _options(ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    options.add_session_config_entry("session.disable_prepacking", "1")
    unpacked = ort.InferenceSession(data, options, providers=PROVIDERS).run(None, feeds)
    return ("; bit-identical to a plain ORT_DISABLE_ALL session with "
            f"session.disable_prepacking=1: {_first_difference(got, unpacked) is None}")


# -- tests -------------------------------------------------------------------------------

def test_the_sweep_covers_at_least_15_families():
    assert len(COVERED_FAMILIES) >= 15, COVERED_FAMILIES


@pytest.mark.parametrize("name", NAMES)
def test_observe_only_is_bit_identical_at_the_default_level(exported, name):
    data, feeds, nodes = _model(exported, name)
    tool = ObserveTool()
    assert returns_only_none(tool.look)          # observe-only, read from its code
    plain = ort.InferenceSession(data, _options(), providers=PROVIDERS)
    want = plain.run(None, feeds)
    session = _instrumented_session(tool, data, _options())
    for run in range(1, RUNS + 1):
        got = session.run(None, feeds)
        difference = _first_difference(got, want)
        assert difference is None, f"{name}, observe-only at the default level, run {run}: " \
                                   f"{difference}"
        # every node's routines ran once per point and run, fused away or not
        assert sum(tool.counts.values()) == run * 2 * len(nodes) > 0
    expected = {(node, point): RUNS for node in nodes for point in ("before_op", "after_op")}
    assert dict(tool.counts) == expected


@pytest.mark.parametrize("name", NAMES)
def test_identity_is_bit_identical_at_disable_all(exported, name):
    data, feeds, nodes = _model(exported, name)
    level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    # docs/onnx.md: a weight that passes through a routine is not prepacked,
    # so the promise is against a plain session that does not prepack either
    unpacked = _options(level)
    unpacked.add_session_config_entry("session.disable_prepacking", "1")
    plain = ort.InferenceSession(data, unpacked, providers=PROVIDERS)
    want = plain.run(None, feeds)
    tool = IdentityTool()
    assert not returns_only_none(tool.identity)  # it may replace: it sits in the dataflow
    session = _instrumented_session(tool, data, _options(level))
    for run in range(1, RUNS + 1):
        got = session.run(None, feeds)
        difference = _first_difference(got, want)
        assert difference is None, f"{name}, IdentityTool at ORT_DISABLE_ALL, run {run}: " \
                                   f"{difference}{_prepacking_note(data, feeds, got)}"
        assert tool.calls["before_op"] == tool.calls["after_op"] == run * len(nodes) > 0
    # ONNX has no backward ops
    assert tool.calls["before_backward_op"] == tool.calls["after_backward_op"] == 0
