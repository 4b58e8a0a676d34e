"""Generated programs that read and update variables in one run, under
routines of every kind: the instrumented copy keeps every read on its side
of every write, so values equal plain TensorFlow bit for bit.

Each program (a seeded random sequence) interleaves reads of three resource
variables, updates of them (``assign_add``/``assign_sub``/``assign`` of
values read earlier), and calls of a function TensorFlow compiles with XLA
that reads a variable inside (and, in some, updates it there); it returns
every value it read and the variables' final values. It runs as one
``tf.function`` (ordered by TensorFlow's automatic control dependencies)
and as one ``Session.run`` (ordered by explicit control dependencies, in
program order). A tool puts at the points of every op one of: a hosted
routine that returns None (one callback beside the data path), a hosted
routine returning its tensors (on the data path), a portable identity (TF
ops), or nothing, chosen by the op's name. Variables are reset before every
run; each instrumented run is compared with the plain one.
"""

import zlib

import numpy as np
import pytest

import amanda
from amanda import portable

tf = pytest.importorskip("tensorflow")

N_VARIABLES = 3
SHAPE = (4,)
STEPS = 14
SEEDS = range(6)


@portable.routine
def _portable_identity(*tensors):
    return [portable.identity(t) for t in tensors]


class Mixed(amanda.Tool):
    """Routines of four kinds at the four points of every op (by name)."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.add_inst_for_op(self.forward)
        self.add_inst_for_op(self.backward, backward=True, require_outputs=True)

    def _kind(self, name, point):
        return zlib.crc32(f"{name}/{point}".encode()) % 4

    def _insert(self, insert, name, point):
        kind = self._kind(name, point)
        if kind == 0:
            insert(self.observe)
        elif kind == 1:
            insert(self.identity)
        elif kind == 2:
            insert(_portable_identity)

    def forward(self, context):
        name = context.get_op().name
        self._insert(context.insert_before_op, name, "before")
        self._insert(context.insert_after_op, name, "after")

    def backward(self, context):
        name = context.get_backward_op().name
        self._insert(context.insert_before_backward_op, name, "before")
        self._insert(context.insert_after_backward_op, name, "after")

    def observe(self, *tensors):
        self.calls += 1

    def identity(self, *tensors):
        self.calls += 1
        return tensors


def _program(seed):
    """A list of steps ``(kind, variable, operand)``: operand indexes an
    earlier read value (or -1: a constant)."""
    rng = np.random.RandomState(seed)
    steps, reads = [], 0
    for _ in range(STEPS):
        kind = rng.choice(["read", "read", "update", "xla_read", "xla_update"])
        variable = int(rng.randint(N_VARIABLES))
        operand = int(rng.randint(-1, reads)) if reads else -1
        steps.append((str(kind), variable, operand, str(rng.choice(["add", "sub", "set"]))))
        if kind in ("read", "xla_read", "xla_update"):
            reads += 1
    return steps


def _initial():
    rng = np.random.RandomState(100)
    return [rng.rand(*SHAPE).astype(np.float32) for _ in range(N_VARIABLES)]


def _xla_functions(variables):
    @tf.function(jit_compile=True)
    def xla_read(which, a):
        return tf.tanh(variables[which] * 1.5 + a)

    @tf.function(jit_compile=True)
    def xla_update(which, a):
        variables[which].assign_add(tf.sin(a))
        return variables[which].read_value() * 0.5

    return ({i: (lambda a, i=i: xla_read(i, a)) for i in range(N_VARIABLES)},
            {i: (lambda a, i=i: xla_update(i, a)) for i in range(N_VARIABLES)})


def _emit(steps, variables, xla, after=None):
    """The program's ops; ``after``: the op each stateful step waits on
    (Session: the previous one), or None (tf.function orders them)."""
    xla_read, xla_update = xla
    values, last = [], None

    def operand(index):
        return values[index] if index >= 0 else tf.constant(0.25, tf.float32, SHAPE)

    for kind, which, index, how in steps:
        deps = [last] if (after and last is not None) else []
        with tf.control_dependencies(deps):
            if kind == "read":
                value = variables[which].read_value() * 2.0 + 1.0
                values.append(value)
                last = value.op
            elif kind == "update":
                delta = tf.cos(operand(index))
                method = {"add": variables[which].assign_add,
                          "sub": variables[which].assign_sub,
                          "set": variables[which].assign}[how]
                last = method(delta, read_value=False)
                if last is None:   # eagerly (never here): keep the order
                    last = tf.no_op()
            elif kind == "xla_read":
                value = xla_read[which](operand(index))
                values.append(value)
                last = value.op
            else:
                value = xla_update[which](operand(index))
                values.append(value)
                last = value.op
    deps = [last] if (after and last is not None) else []
    with tf.control_dependencies(deps):
        finals = [v.read_value() for v in variables]
    return values + finals


@pytest.mark.parametrize("seed", SEEDS)
def test_generated_reads_and_updates_tf_function(seed):
    steps = _program(seed)
    initial = _initial()
    variables = [tf.Variable(v) for v in initial]
    xla = _xla_functions(variables)

    @tf.function
    def program():
        return _emit(steps, variables, xla)

    def run():
        for variable, value in zip(variables, initial):
            variable.assign(value)
        return [t.numpy() for t in program()]

    expected = run()
    for _ in range(2):
        tool = Mixed()
        with amanda.apply(tool):
            actual = run()
        assert tool.calls
        for i, (a, b) in enumerate(zip(expected, actual)):
            assert np.array_equal(a, b), (seed, steps, i, a, b)


@pytest.mark.parametrize("seed", SEEDS)
def test_generated_reads_and_updates_session(seed):
    steps = _program(seed)
    initial = _initial()
    graph = tf.Graph()
    with graph.as_default():
        variables = [tf.Variable(v, use_resource=True) for v in initial]
        results = _emit(steps, variables, _xla_functions(variables), after=True)
        init = tf.compat.v1.variables_initializer(variables)
    with tf.compat.v1.Session(graph=graph) as session:
        def run():
            session.run(init)
            return session.run(results)

        expected = run()
        for _ in range(2):
            tool = Mixed()
            with amanda.apply(tool):
                actual = run()
            assert tool.calls
            for i, (a, b) in enumerate(zip(expected, actual)):
                assert np.array_equal(a, b), (seed, steps, i, a, b)
