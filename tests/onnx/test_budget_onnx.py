"""Observation over budget: routines hosted in the run, right after their tensors.

A session whose observed tensors exceed ``observation_budget`` (estimated
when it is created) runs its observe-only routines inside onnxruntime, as
``hosted_observation()`` sessions do, listed right after the node producing
their tensors and run in that order (docs/onnx.md, "Memory"). Checked by
difference: the routines see the plain values in program order at every
optimisation level, outputs stay bit-identical, the choice follows the
estimate, and, in fresh processes, a hosted session's step peak stays near
the plain one's where fetching (or hosting in onnxruntime's default order)
keeps every observed tensor alive.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import amanda
from amanda.runtime.onnx import observation_budget
from tests.onnx.conftest import TensorProto, helper, ort, session
from tests.onnx.test_routine_values_onnx import LEVELS, MODELS, Record, check, squeezenet

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def created(model, tool, level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL, budget=None):
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    with amanda.apply(tool):
        if budget is None:
            return ort.InferenceSession(model.SerializeToString(), options,
                                        providers=["CPUExecutionProvider"])
        with observation_budget(budget):
            return ort.InferenceSession(model.SerializeToString(), options,
                                        providers=["CPUExecutionProvider"])


def fetches(instrumented):
    """Whether routines are called after the run (the fetch path refuses io binding)."""
    try:
        instrumented.run_with_iobinding(instrumented.io_binding())
    except amanda.BackendError:
        return True
    except Exception:   # noqa: BLE001 - onnxruntime: nothing bound
        return False
    return False


@pytest.mark.parametrize("level", LEVELS, ids=lambda level: level.name)
@pytest.mark.parametrize("build", sorted(MODELS))
def test_over_budget_routines_see_the_plain_values_in_program_order(build, level):
    model, feeds = MODELS[build]()
    tool, fetched = Record(), Record()
    instrumented = created(model, tool, level, budget=0)
    reference = created(model, fetched, level)
    assert not fetches(instrumented) and fetches(reference)
    for _ in range(2):
        got = instrumented.run(None, feeds)
        reference.run(None, feeds)
    plain = session(model, level).run(None, feeds)
    assert all(np.array_equal(a, b) for a, b in zip(plain, got))
    check(tool, model, feeds, 2, exact=level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
          plain=plain)
    # the same values as the fetch path, bit for bit, in the same order
    assert [entry[:3] for entry in tool.log] == [entry[:3] for entry in fetched.log]
    assert all(np.array_equal(a, b) for mine, theirs in zip(tool.log, fetched.log)
               for a, b in zip(mine[3], theirs[3]))


def test_light_squeezenet_over_budget_sees_the_plain_values():
    model, feeds = squeezenet()
    tool = Record()
    instrumented = created(model, tool, budget=0)
    assert not fetches(instrumented)
    got = instrumented.run(None, feeds)
    plain = session(model).run(None, feeds)
    assert all(np.array_equal(a, b) for a, b in zip(plain, got))
    check(tool, model, feeds, 1, exact=False, plain=plain)


def chain(n=4, elements=1 << 10):
    """x -> Neg -> ... -> y: ``n`` float32 tensors of ``elements`` each."""
    nodes = [helper.make_node("Neg", [f"t{k}"], [f"t{k + 1}"], name=f"neg{k}")
             for k in range(n)]
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("t0", TensorProto.FLOAT, [elements])],
        [helper.make_tensor_value_info(f"t{n}", TensorProto.FLOAT, [elements])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def test_the_choice_follows_the_estimated_bytes():
    # before every Neg: t0 (a graph input, never fetched) and t1..t3 computed,
    # 4 KiB each; after: t1..t4
    model = chain()
    computed = 4 * 4096
    assert fetches(created(model, Record(), budget=computed))
    assert not fetches(created(model, Record(), budget=computed - 1))
    assert fetches(created(model, Record()))   # the default budget is far above


_MEASURE = textwrap.dedent("""
    import json, sys
    import numpy as np, onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    import amanda
    from amanda.runtime.onnx import hosted_observation

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith(field + ":"))

    # 12 blocks MatMul -> Add -> Relu on 4 MiB activations; onnxruntime fuses
    # MatMul and Add, so the MatMul outputs routines observe are recomputed
    n, rows, width = 12, 4096, 256
    rng = np.random.default_rng(0)
    nodes, weights = [], []
    for k in range(n):
        weights += [numpy_helper.from_array(
                        (rng.standard_normal((width, width)) / 16).astype(np.float32), f"W{k}"),
                    numpy_helper.from_array(rng.standard_normal(width).astype(np.float32),
                                            f"b{k}")]
        nodes += [helper.make_node("MatMul", [f"t{k}", f"W{k}"], [f"m{k}"], name=f"mm{k}"),
                  helper.make_node("Add", [f"m{k}", f"b{k}"], [f"a{k}"], name=f"add{k}"),
                  helper.make_node("Relu", [f"a{k}"], [f"t{k + 1}"], name=f"relu{k}")]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("t0", TensorProto.FLOAT, [rows, width])],
        [helper.make_tensor_value_info(f"t{n}", TensorProto.FLOAT, [rows, width])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8

    class Look(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.calls = 0
            self.add_inst_for_op(self.analyse)
        def analyse(self, context):
            context.insert_before_op(self.look)
            context.insert_after_op(self.look)
        def look(self, *arrays):
            self.calls += 1

    x = np.ones((rows, width), np.float32)
    tool = Look()
    if sys.argv[1] == "hosted":
        with amanda.apply(tool), hosted_observation():
            s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    else:
        s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    s.run(None, {"t0": x})
    built = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    for _ in range(2):
        s.run(None, {"t0": x})
    print(json.dumps([(status("VmHWM") - built) / 1024, tool.calls]))
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="resets VmHWM")
def test_hosted_observers_release_each_tensor_as_the_plain_run_does():
    """36 nodes, 4 MiB activations, observers before and after every node:
    hosted observers run right after the node producing their tensors, so
    the step peak stays within a few activations of the plain one's (before,
    onnxruntime ran the routines and the recomputed MatMul outputs late:
    about 150 MiB above the plain step)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=ROOT)
    peaks = {}
    for how in ("plain", "hosted"):
        done = subprocess.run([sys.executable, "-c", _MEASURE, how], capture_output=True,
                              text=True, env=env, cwd=ROOT, check=True)
        peaks[how] = json.loads(done.stdout.strip().splitlines()[-1])
    assert peaks["hosted"][1] == 3 * 2 * 36
    assert peaks["hosted"][0] - peaks["plain"][0] < 6 * 4, peaks
