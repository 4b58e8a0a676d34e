"""The one cache rule on onnxruntime: inside ``amanda.cache_disabled()`` the
tools' analysis runs at every execution — every run of an
``InferenceSession`` made inside ``apply`` — and the executions of (op id,
point), their values and the outputs are those of the cached runs. Before,
the analysis ran once per session creation however the session was run.

Each way amanda runs routines (fetched after the run, hosted in
onnxruntime, in the dataflow), each run method, and a session made with the
cache on and run inside ``cache_disabled()`` (and the reverse)."""

import collections
import contextlib

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")

import amanda  # noqa: E402
from tests.onnx.test_onnx_users import (FEEDS, RUNS, Record, _exact_options, _model,  # noqa: E402
                                        _same, _session)

TIMES = 3
METHODS = {"run": lambda session, feed: session.run(None, feed), **RUNS}


class Analysing(Record):
    """`Record`, counting its analyses per op."""

    def __init__(self, replace=False):
        super().__init__(replace=replace)
        self.analyses = collections.Counter()

    def analyse(self, context):
        self.analyses[context.get_op_id()] += 1
        super().analyse(context)


def _runs(how, method, cached):
    source = _model().SerializeToString()
    options = _exact_options() if how == "dataflow" else None
    tool = Analysing(replace=how == "dataflow")
    session = _session(source, tool, how, options)
    with amanda.apply(tool), (contextlib.nullcontext() if cached else amanda.cache_disabled()):
        outputs = [METHODS[method](session, FEEDS[i % len(FEEDS)]) for i in range(TIMES)]
    return outputs, tool


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("how", ["fetched", "hosted", "dataflow"])
def test_cache_disabled_analyses_every_run_and_changes_nothing_else(how, method):
    if how == "fetched" and method != "run" and method != "run_with_ort_values":
        pytest.skip("sessions that fetch observed tensors run by run and run_with_ort_values")
    plain = ort.InferenceSession(_model().SerializeToString(),
                                 _exact_options() if how == "dataflow" else None)
    expected = [METHODS[method](plain, FEEDS[i % len(FEEDS)]) for i in range(TIMES)]
    (got, cached), (again, uncached) = _runs(how, method, True), _runs(how, method, False)
    for a, b, c in zip(expected, got, again):
        assert _same(b, a) and _same(c, a)
    assert [op for op, _ in cached.calls] == [op for op, _ in uncached.calls]
    assert all(_same(a, b) for (_, a), (_, b) in zip(cached.calls, uncached.calls))
    assert len(cached.calls) == TIMES * 6
    assert set(cached.analyses) == {"fc", "relu", "neg"}
    assert set(cached.analyses.values()) == {1}, "cached: one analysis per op"
    # uncached: the one at creation, then one per run
    assert uncached.analyses == {op: 1 + TIMES for op in cached.analyses}


class Choosing(amanda.Tool):
    """An analysis that decides anew each time: it instruments only the op
    whose turn it is (the use cache_disabled() is for)."""

    def __init__(self):
        super().__init__()
        self.turn = 0
        self.seen = []
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        if context.get_op_id() == "fc":
            self.turn += 1
        if context.get_op_id() == ("relu" if self.turn % 2 else "neg"):
            context.insert_after_op(self.look, op=context.get_op_id())

    def look(self, *arrays, op):
        self.seen.append(op)


def test_a_session_runs_the_routines_its_analysis_chose_for_that_run():
    tool = Choosing()
    session = _session(_model().SerializeToString(), tool, "fetched")   # turn 1: relu
    with amanda.apply(tool):
        session.run(None, FEEDS[0])
        with amanda.cache_disabled():
            session.run(None, FEEDS[0])     # turn 2: neg
            session.run(None, FEEDS[0])     # turn 3: relu
        session.run(None, FEEDS[0])         # cached again: the plan of turn 3
    assert tool.seen == ["relu", "neg", "relu", "relu"]
