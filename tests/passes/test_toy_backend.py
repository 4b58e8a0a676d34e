"""A backend is its packages and one descriptor: a toy backend registered
from this file alone (programs of NumPy functions) is lifted into the IR,
instrumented by the one pipeline, lowered, run through the kernel's routine
host, entered by ``apply`` and reached by ``amanda.instrument`` and
``amanda.runtime.evaluate``, with no line of amanda changed. Imports no
framework."""

from __future__ import annotations

import collections
import subprocess
import sys

import numpy as np
import pytest

import amanda
from amanda.ir import Graph
from amanda.passes.instrumentation import GraphBackend
from amanda.passes.lower_actions import ROUTINE
from amanda.passes.pipeline import instrument_graph
from amanda.runtime import backends, evaluate
from amanda.runtime.driver import Driver
from amanda.runtime.routines import call_routine

NAMESPACE = "toynumpy/1/graph"


class ToyArray:
    """The toy framework's tensor: a NumPy array in a box of its own type."""

    def __init__(self, data):
        self.data = np.asarray(data)


class Program:
    """The toy framework's program: NumPy functions applied in order to named
    values; ``run`` is what a user calls."""

    def __init__(self, inputs, steps, outputs):
        self.inputs, self.steps, self.outputs = inputs, steps, outputs

    def run(self, **feeds):
        values = {name: np.asarray(value) for name, value in feeds.items()}
        for func, args, out in self.steps:
            values[out] = func(*[values[a] for a in args])
        return [values[name] for name in self.outputs]


# -- the backend: lift, lower, driver, descriptor ----------------------------------

def lift(program):
    graph = Graph("toy", namespace=NAMESPACE)
    tensors = {name: graph.add_input(name) for name in program.inputs}
    for func, args, out in program.steps:
        op = graph.create_op(func.__name__, [tensors[a] for a in args],
                             attrs={"func": func}, name=out)
        tensors[out] = op.outputs[0]
    graph.set_outputs([tensors[name] for name in program.outputs])
    return graph


class Lowered:
    """The instrumented program: the lowered IR graph, interpreted."""

    def __init__(self, graph):
        self.graph = graph

    def run(self, **feeds):
        values = {id(t): np.asarray(feeds[t.name]) for t in self.graph.inputs}
        for op in self.graph.ops:
            args = [values[id(t)] for t in op.inputs]
            if op.type == ROUTINE:
                action = op.attrs["action"]
                where = (op.attrs["target"], op.attrs["target"], NAMESPACE)
                new = call_routine(action, args, lambda v: isinstance(v, np.ndarray), where)
                results = args if new is None else [a if n is None else n
                                                    for a, n in zip(args, new)]
                if action.kind == "replace_op":
                    results = new
            else:
                results = [op.attrs["func"](*args)]
            for tensor, value in zip(op.outputs, results):
                values[id(tensor)] = value
        return [values[id(t)] for t in self.graph.outputs]


def instrument(program, session):
    """``amanda.instrument`` for a toy program: lift, the one pipeline, lower."""
    _, lowered = instrument_graph(lift(program), session, GraphBackend(NAMESPACE),
                                  name="toy")
    return Lowered(lowered)


class ToyDriver(Driver):
    """``apply`` on the toy framework: ``Program.run`` runs the instrumented
    program of the innermost scope's tools while the patch is installed."""

    def __init__(self):
        super().__init__()
        self.sessions = []
        self.plain_run = None

    def install(self):
        self.plain_run = Program.run
        driver = self

        def run(program, **feeds):
            session = driver.sessions[-1]
            lowered = session.caches.get(("toy", id(program)))
            if lowered is None:
                lowered = session.caches[("toy", id(program))] = instrument(program, session)
            return lowered.run(**feeds)

        Program.run = run

    def uninstall(self):
        Program.run = self.plain_run

    def begin(self, session):
        self.sessions.append(session)

    def end(self, session):
        self.sessions.pop()

    def nested_enter(self, session):
        self.sessions.append(session)

    def nested_exit(self, session, restored):
        self.sessions.pop()


DRIVER = ToyDriver()

DESCRIPTOR = backends.Backend(
    name="toynumpy",
    frameworks=(__name__,),                  # "imported" as soon as this module is
    value_modules=(__name__.split(".")[0],),
    program_modules=(__name__.split(".")[0],),
    driver=DRIVER,
    evaluate=lambda values: [v.data for v in values] if isinstance(values, list)
    else values.data,
    instrument=instrument,
)


@pytest.fixture
def toy_backend():
    backends.register(DESCRIPTOR)
    yield DESCRIPTOR
    backends.unregister("toynumpy")
    assert Program.run is PLAIN_RUN


PLAIN_RUN = Program.run


def _program():
    return Program(["x", "w"], [(np.matmul, ["x", "w"], "mm"), (np.tanh, ["mm"], "act"),
                                (np.negative, ["act"], "out")], ["out"])


class Counter(amanda.Tool):
    def __init__(self):
        super().__init__()
        self.seen = collections.Counter()
        self.types = []
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        self.types.append((context.namespace, context["type"] if "type" in context
                           else context.get_op().type))
        context.insert_before_op(self.count, key=(context.get_op_id(), "before"))
        context.insert_after_op(self.count, key=(context.get_op_id(), "after"))

    def count(self, *arrays, key):
        self.seen[key] += 1


class Doubler(amanda.Tool):
    def __init__(self):
        super().__init__()
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        if context.get_op().type == "tanh":
            context.insert_before_op(lambda x: x * 2, inputs=[0])


def _feeds():
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((2, 3)), "w": rng.standard_normal((3, 4))}


def test_the_toy_backend_is_found_by_the_registry(toy_backend):
    assert backends.get("toynumpy") is toy_backend
    assert backends.for_namespace(NAMESPACE) is toy_backend
    assert backends.for_program(_program()) is toy_backend
    assert toy_backend in backends.active()     # its "framework" (this module) is imported
    assert np.array_equal(evaluate(ToyArray([1, 2])), [1, 2])


def test_apply_runs_the_tools_on_the_toy_backend_through_the_pipeline(toy_backend):
    program, feeds = _program(), _feeds()
    plain = program.run(**feeds)
    tool = Counter()
    with amanda.apply(tool):
        for _ in range(3):
            got = program.run(**feeds)
            assert np.array_equal(got[0], plain[0])
    assert Program.run is PLAIN_RUN            # leaving apply restored the framework
    assert {ns for ns, _ in tool.types} == {NAMESPACE}
    assert [t for _, t in tool.types] == ["matmul", "tanh", "negative"]   # analysed once
    assert set(tool.seen.values()) == {3} and len(tool.seen) == 6


def test_a_replacing_routine_changes_the_toy_program_and_instrument_leaves_it_alone(toy_backend):
    program, feeds = _program(), _feeds()
    lowered = amanda.instrument(program, Doubler())
    want = -np.tanh(2 * (feeds["x"] @ feeds["w"]))
    assert np.allclose(lowered.run(**feeds)[0], want)
    assert np.allclose(program.run(**feeds)[0], -np.tanh(feeds["x"] @ feeds["w"]))


def test_an_unregistered_backend_is_gone(toy_backend):
    backends.unregister("toynumpy")
    assert backends.get("toynumpy") is None
    with pytest.raises(amanda.AmandaError):
        amanda.instrument(_program(), Counter())
    backends.register(toy_backend)


def test_resolving_every_builtin_backend_imports_no_framework():
    code = ("import sys; from amanda.runtime import backends; "
            "names = [b.name for b in backends.all_backends()]; "
            "print(names, sorted({'torch', 'tensorflow', 'onnx', 'onnxruntime'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "['pytorch', 'tensorflow', 'onnx'] []", done.stdout + done.stderr
