"""What creating an observing session costs besides onnxruntime's own work.

The ONNX path imports no torch: onnxruntime-extensions' package ``__init__``
imports its converters, transformers and torch, so amanda loads only its
Python-op module (``amanda.runtime.onnx.host.extensions``). And a small
model is not followed by a full ``gc.collect()`` (it walks every object of
the process; ``PROMPT_FREE_BYTES`` in ``amanda/runtime/onnx/session.py``).
Measured in a fresh process, where nothing else loaded torch.
"""

import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CREATE = textwrap.dedent("""
    import gc, json, sys
    import numpy as np, onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    import amanda

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
         helper.make_node("Relu", ["h"], ["y"], name="relu")], "small",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])],
        [numpy_helper.from_array(np.ones((16, 16), np.float32), "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    data = model.SerializeToString()

    class Look(amanda.Tool):
        def __init__(self, hosted):
            super().__init__()
            self.hosted = hosted
            self.seen = 0
            self.add_inst_for_op(self.analyse, require_outputs=True)
        def analyse(self, context):
            context.insert_after_op(self.look)
            if self.hosted:
                context.insert_before_op(self.twice)
        def look(self, *arrays):
            self.seen += 1
        def twice(self, *arrays):
            return [a * 2 for a in arrays]

    full = []
    gc.disable()   # only collections someone asks for
    gc.callbacks.append(lambda phase, info: full.append(1)
                        if phase == "start" and info["generation"] == 2 else None)
    out = {}
    for hosted in (False, True):
        tool = Look(hosted)
        with amanda.apply(tool):
            session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
            y = session.run(None, {"x": np.ones((1, 16), np.float32)})[0]
        out[str(hosted)] = {"seen": tool.seen, "y": float(y[0, 0])}
    out["full_collections"] = len(full)
    out["loaded"] = sorted(m for m in ("torch", "transformers", "tensorflow") if m in sys.modules)
    # the user's own import of the package runs its __init__, which reuses
    # the module amanda loaded (one op table): hosting still works
    import onnxruntime_extensions
    from amanda.runtime.onnx.host import extensions
    out["same"] = onnxruntime_extensions.PyCustomOpDef is extensions().PyCustomOpDef
    with amanda.apply(Look(True)):
        session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
        out["again"] = float(session.run(None, {"x": np.ones((1, 16), np.float32)})[0][0, 0])
    print(json.dumps(out))
""")


def test_an_observing_session_imports_no_torch_and_collects_nothing():
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", _CREATE], capture_output=True, text=True,
                          env=env, cwd=ROOT, check=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["loaded"] == [], out
    assert out["full_collections"] == 0, out
    # the routines ran: observe-only (after the run), and hosted inside it
    assert out["False"] == {"seen": 2, "y": 16.0}, out
    assert out["True"] == {"seen": 2, "y": 128.0}, out   # (2x * 2W) * 2
    assert out["same"] and out["again"] == 128.0, out


def _long_chain(length=60):
    """x -> (Relu -> Add 1) * length -> y: enough ops that instrumenting it
    allocates thousands of objects."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper
    nodes, last = [], "x"
    for k in range(length):
        nodes.append(helper.make_node("Relu", [last], [f"r{k}"], name=f"relu{k}"))
        nodes.append(helper.make_node("Add", [f"r{k}", "one"], [f"a{k}"], name=f"add{k}"))
        last = f"a{k}"
    nodes.append(helper.make_node("Identity", [last], ["y"], name="out"))
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(np.ones(3, np.float32), "one")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model.SerializeToString()


def test_the_collector_is_paused_while_a_session_is_instrumented():
    """Python's cyclic collector is off while amanda instruments the model
    (`amanda.runtime.collector`): no collection runs inside the creation
    but young ones: one while onnxruntime optimises the model, once the IR
    graph is dropped (`collect_young`), and one when the pause ends; the
    collector is on again after it; a collector the user turned off stays
    off, and amanda collects nothing then."""
    import gc

    import numpy as np
    import onnxruntime as ort

    import amanda

    class Look(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.enabled = set()
            self.seen = 0
            self.add_inst_for_op(self.analyse, require_outputs=True)

        def analyse(self, context):
            self.enabled.add(gc.isenabled())
            context.insert_before_op(self.look)
            context.insert_after_op(self.look)

        def look(self, *arrays):
            self.seen += 1

    data = _long_chain()
    x = np.full((2, 3), -1.0, np.float32)
    want = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    started = []

    def note(phase, info):
        if phase == "start":
            started.append(info["generation"])

    assert gc.isenabled()
    gc.callbacks.append(note)
    try:
        for _ in range(3):
            tool = Look()
            with amanda.apply(tool):
                gc.collect(0)
                del started[:]
                session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
                made = list(started)
                got = session.run(None, {"x": x})
            assert made in ([0], [0, 0]), made
            assert tool.enabled == {False} and gc.isenabled()
            assert np.array_equal(got[0], want[0]) and tool.seen == 2 * 121
        gc.disable()
        try:
            tool = Look()
            del started[:]
            with amanda.apply(tool):
                ort.InferenceSession(data, providers=["CPUExecutionProvider"])
            assert tool.enabled == {False} and not gc.isenabled()
            assert started == []
        finally:
            gc.enable()
    finally:
        gc.callbacks.remove(note)


_SCRATCH = textwrap.dedent("""
    import json, os, sys
    import numpy as np, onnxruntime as ort
    import amanda
    from amanda.runtime.onnx import scratch
    sys.path.insert(0, sys.argv[1])
    from tests.onnx.test_session_cost_onnx import _long_chain

    class Look(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.seen = 0
            self.add_inst_for_op(self.analyse)
        def analyse(self, context):
            context.insert_after_op(self.look)
        def look(self, *arrays):
            self.seen += 1

    data = _long_chain(8)
    lists = []
    for options in (None, ort.SessionOptions()):
        tool = Look()
        with amanda.apply(tool):
            session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
        session.run(None, {"x": np.ones((2, 3), np.float32)})
        lists.append(sorted(os.listdir(scratch.folder())))
    print(json.dumps({"folder": scratch.folder(), "lists": lists, "seen": tool.seen}))
""")


def test_the_scratch_folder_keeps_no_files_and_goes_with_the_process():
    """The files onnxruntime writes while amanda creates a session (the
    optimised model, its weights) live in one scratch folder per process
    (`amanda.runtime.onnx.scratch`): after each creation only the empty
    stub a lean model names is left, and the folder is removed when the
    process exits."""
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", _SCRATCH, ROOT], capture_output=True,
                          text=True, env=env, cwd=ROOT, check=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["seen"] == 17, out
    for listed in out["lists"]:
        assert set(listed) <= {"amanda-shared.bin"}, out
    assert not os.path.exists(out["folder"]), out
