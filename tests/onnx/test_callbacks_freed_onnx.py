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
from tests.onnx.test_onnx_users import _iobinding  # noqa: E402


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


@pytest.mark.parametrize("mode", ["fetched", "hosted", "cache_disabled"])
def test_a_dropped_session_is_freed_at_once(mode):
    """A session amanda made holds no reference to itself (host.set_run): the
    user dropping it frees it, and onnxruntime's buffers, without waiting
    for the cyclic collector (which is off here). Before, its run methods
    were closures over it in its own ``__dict__``: a loop making sessions
    kept every one of them until a collection."""
    data, feeds = onnx_export("bert")
    want = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)
    tool = _Counter()
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        refs = []
        for _ in range(3):
            with amanda.apply(tool):
                if mode == "hosted":
                    with amanda.runtime.onnx.hosted_observation():
                        session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
                else:
                    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
            calls = tool.calls
            if mode == "cache_disabled":
                with amanda.cache_disabled():
                    got = session.run(None, feeds)
            else:
                got = session.run(None, feeds)
            assert tool.calls > calls
            assert all((a == b).all() for a, b in zip(want, got))
            # an instrumented session is still an InferenceSession, named as one
            assert isinstance(session, ort.InferenceSession)
            assert type(session).__name__ == "InferenceSession"
            assert repr(session).startswith("<onnxruntime.capi.onnxruntime_inference_collection"
                                            ".InferenceSession object")
            refs.append(weakref.ref(session))
            del session
            assert refs[-1]() is None
        # a run method held keeps its session, as a plain session's does
        with amanda.apply(tool):
            run = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run
        calls = tool.calls
        assert all((a == b).all() for a, b in zip(want, run(None, feeds)))
        assert tool.calls > calls
        ref = weakref.ref(run.__self__)
        del run
        assert ref() is None
    finally:
        if enabled:
            gc.enable()


def test_io_binding_of_a_made_session_runs_the_routines():
    data, feeds = onnx_export("bert")
    tool = _Counter()
    with amanda.apply(tool):
        with amanda.runtime.onnx.hosted_observation():
            session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    want = session.run(None, feeds)
    calls = tool.calls
    got = _iobinding(session, feeds)   # (io_binding() and run_with_iobinding)
    assert tool.calls == 2 * calls
    assert all((a == b).all() for a, b in zip(want, got))
