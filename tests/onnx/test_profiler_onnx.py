"""OpProfiler on onnxruntime: durations fit in the run, one lane per thread."""

import os
import threading
import time

import pytest

import amanda
from amanda.tools.profiler import OpProfiler
from tests.onnx.conftest import DATA, light_feeds, onnx, ort

pytestmark = pytest.mark.filterwarnings("ignore:amanda. Python routines")


def profiled_session(path, profiler):
    options = ort.SessionOptions()
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    with amanda.apply(profiler):
        return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def test_durations_fit_in_the_run_and_share_one_lane():
    path = os.path.join(DATA, "light", "light_squeezenet.onnx")
    model = onnx.load(path)
    feeds = light_feeds(model)
    profiler = OpProfiler()
    session = profiled_session(path, profiler)
    session.run(None, feeds)
    profiler.events.clear()
    start = time.perf_counter_ns()
    session.run(None, feeds)
    wall = time.perf_counter_ns() - start
    assert len(profiler.events) == len(model.graph.node)
    assert sum(end - begin for _, begin, end in profiler.events) <= wall
    spans = [e for e in profiler.chrome_trace()["traceEvents"]
             if e["ph"] == "X" and e["cat"] == "forward"]
    assert {e["tid"] for e in spans} == {1}


def test_runs_on_several_threads_pair_within_each_run():
    path = os.path.join(DATA, "light", "light_squeezenet.onnx")
    feeds = light_feeds(onnx.load(path))
    profiler = OpProfiler()
    session = profiled_session(path, profiler)
    walls = []

    def worker():
        for _ in range(3):
            begin = time.perf_counter_ns()
            session.run(None, feeds)
            walls.append(time.perf_counter_ns() - begin)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    longest = max(walls)
    assert all(end - begin <= longest for _, begin, end in profiler.events)
    assert sum(end - begin for _, begin, end in profiler.events) <= sum(walls)
