"""An observe-only session writes no model before its side branches.

When every routine only observes, a session runs them as side branches on
onnxruntime's optimised model, so the lowering of the user's model with host
nodes is not written at all: `observes_only` decides that from the
routines before anything is written (`_instrument(..., apart=True)`). Its
answer must be the one writing the model gives (`_Lowering.side_only and
uses_callbacks`): checked here on tools of every kind, at top level and in
If/Loop bodies, and by difference on what the sessions compute.
"""

import numpy as np
import pytest

import amanda
from amanda import portable
from amanda.runtime.onnx import hosted_observation
from amanda.runtime.onnx.instrument import _instrument
from amanda.runtime.onnx.routine_nodes import observes_only
from amanda.tool import session_for
from tests.onnx.conftest import mlp, ort, same
from tests.onnx.test_control_flow_onnx import control_model


class Kind(amanda.Tool):
    """Routines of one kind before (or after, or instead of) every op."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.calls = 0
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        if self.kind == "observe":
            context.insert_before_op(self.look)
        elif self.kind == "counter":
            context.insert_after_op(self.count, outputs=[])
        elif self.kind == "returns":
            context.insert_after_op(self.maybe)
        elif self.kind == "portable":
            context.insert_before_op(_portable_look)
        elif self.kind == "replace" and context.get_op_name() == "Relu":
            context.replace_op(self.relu)

    def look(self, *arrays):
        self.calls += 1

    def count(self):
        self.calls += 1

    def maybe(self, *arrays):
        self.calls += 1
        return arrays if self.calls < 0 else None

    def relu(self, x):
        return np.maximum(x, 0)


@portable.routine
def _portable_look(*tensors):
    return None


KINDS = ["observe", "counter", "returns", "portable", "replace"]


@pytest.mark.parametrize("model", [mlp, control_model], ids=["mlp", "control_flow"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_early_decision_is_the_one_writing_the_model_gives(model, kind):
    user = model()
    session = session_for([Kind(kind)])
    written, lowering = _instrument(user, session, callbacks=True)
    apart, observing = _instrument(user, session, callbacks=True, apart=True)
    if lowering is None:
        assert observing is None
        return
    side = lowering.side_only and lowering.uses_callbacks
    assert observes_only(lowering.top) is side
    if side:
        assert apart is None and observing.side_only and observing.uses_callbacks
        assert not observing.inline
    else:
        # the same model (each writing registers callbacks under keys of its own)
        assert apart is not None
        assert [(n.op_type, list(n.input)) for n in apart.graph.node] == \
            [(n.op_type, list(n.input)) for n in written.graph.node]
    assert side is (kind in ("observe", "counter")), kind


@pytest.mark.parametrize("kind", ["observe", "counter"])
def test_an_observing_session_sees_what_a_hosted_one_sees(kind):
    """The side-branch session (no model written first) calls each routine as
    often as a session that hosts them in the model's dataflow, and its
    outputs are the plain model's."""
    user = mlp()
    x = np.random.default_rng(3).standard_normal((2, 4)).astype(np.float32)
    plain = ort.InferenceSession(user.SerializeToString(), providers=["CPUExecutionProvider"])
    want = plain.run(None, {"x": x})
    counts = []
    for hosted in (False, True):
        tool = Kind(kind)
        with amanda.apply(tool):
            if hosted:
                with hosted_observation():
                    made = ort.InferenceSession(user.SerializeToString(),
                                                providers=["CPUExecutionProvider"])
            else:
                made = ort.InferenceSession(user.SerializeToString(),
                                            providers=["CPUExecutionProvider"])
        got = made.run(None, {"x": x})
        assert all(same(a, b) for a, b in zip(want, got))
        counts.append(tool.calls)
    assert counts[0] == counts[1] > 0
