"""A tool applied to onnxruntime sessions is not kept by amanda once nobody
holds it (amanda/runtime/onnx/host.py, ``owned_by``): its hosted callbacks
live as long as its amanda session, which each InferenceSession amanda made
keeps; a session kept after the tool is dropped still calls its routines."""

import gc
import weakref

import pytest

import amanda

ort = pytest.importorskip("onnxruntime")

from benchmarks.counting import onnx_export  # noqa: E402
from amanda.runtime.onnx import host as onnx_host  # noqa: E402


class _Counter(amanda.Tool):
    def __init__(self):
        super().__init__()
        self.calls = 0
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        context.insert_before_op(self.count, inputs=[])
        context.insert_after_op(self.look)

    def count(self):
        self.calls += 1

    def look(self, *arrays):
        self.calls += 1


def _session(data, feeds, tool):
    with amanda.apply(tool):
        session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
        session.run(None, feeds)
    return session


@pytest.mark.parametrize("cached", [True, False])
def test_a_dropped_tool_and_its_sessions_are_freed(cached):
    data, feeds = onnx_export("bert")
    before = set(onnx_host._CALLBACKS)   # (earlier tests' may be freed meanwhile)
    refs = []
    for _ in range(3):
        tool = _Counter()
        if cached:
            session = _session(data, feeds, tool)
        else:
            with amanda.cache_disabled():
                session = _session(data, feeds, tool)
        assert tool.calls > 0
        refs.append(weakref.ref(tool))
        del session, tool
        gc.collect()
    assert all(ref() is None for ref in refs)
    assert not set(onnx_host._CALLBACKS) - before   # every callback this test made is gone


def test_a_kept_session_still_calls_its_dropped_tool():
    data, feeds = onnx_export("bert")
    tool = _Counter()
    session = _session(data, feeds, tool)
    first = tool.calls
    ref = weakref.ref(tool)
    del tool
    gc.collect()
    session.run(None, feeds)   # outside any scope: the instrumented session's routines run
    assert ref() is not None and ref().calls == 2 * first
    del session
    gc.collect()
    assert ref() is None
