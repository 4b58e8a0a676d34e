"""Variables TensorFlow updates in place (sparse updates of an embedding: in
copy-on-read mode TF writes the buffer without copying) must still move
between the user's session and amanda's shadow: a scope per training step,
plain training steps and plain runs between them, by difference against
plain training."""

import contextlib

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import amanda  # noqa: E402

v1 = tf.compat.v1


def _graph(optimizer):
    graph = tf.Graph()
    with graph.as_default():
        ids = v1.placeholder(tf.int32, [3], name="ids")
        table = v1.get_variable("table", initializer=np.arange(20, dtype=np.float32)
                                .reshape(10, 2) / 10, use_resource=True)
        dense = v1.get_variable("dense", initializer=np.float32([[0.5], [-0.25]]),
                                use_resource=True)
        rows = tf.gather(table, ids)
        loss = tf.reduce_sum(tf.tanh(tf.matmul(rows, dense)))
        train = optimizer().minimize(loss)
        init = v1.global_variables_initializer()
    return graph, ids, loss, train, init, table, dense


class Observe(amanda.Tool):
    def __init__(self):
        super().__init__()
        self.calls = 0
        self.add_inst_for_op(self.analysis)

    def analysis(self, context):
        context.insert_before_op(self.observe)

    def observe(self, *arrays):
        self.calls += 1


@pytest.mark.parametrize("optimizer", [lambda: v1.train.GradientDescentOptimizer(0.1),
                                       lambda: v1.train.AdagradOptimizer(0.1),
                                       lambda: v1.train.AdamOptimizer(0.1)],
                         ids=["sgd", "adagrad", "adam"])
def test_sparse_updates_in_scopes_per_step_equal_plain_training(optimizer):
    batches = [np.int32([1, 2, 1]), np.int32([3, 1, 4]), np.int32([2, 2, 9])]

    def run(tool):
        graph, ids, loss, train, init, table, dense = _graph(optimizer)
        seen = []
        with v1.Session(graph=graph) as session:
            session.run(init)
            for step, batch in enumerate(batches * 2):
                if tool is None or step % 2:          # plain training between scopes
                    session.run(train, {ids: batch})
                else:
                    with amanda.apply(tool):
                        session.run(train, {ids: batch})
                seen.append(session.run([table, dense]))        # plain, after the scope
                with amanda.apply(tool) if tool is not None else contextlib.nullcontext():
                    seen.append(session.run(loss, {ids: batch}))  # inside a new scope
        return seen

    expected = run(None)
    tool = Observe()
    got = run(tool)
    assert tool.calls > 0
    for a, b in zip(expected, got):
        for p, q in zip(np.atleast_1d(a) if np.isscalar(a) else a,
                        np.atleast_1d(b) if np.isscalar(b) else b):
            np.testing.assert_array_equal(p, q)



def _array_at(offset, values):
    """A float32 copy of ``values`` whose data starts ``offset`` bytes past a
    64-byte boundary. Plain TensorFlow adopts a fed array aligned so into a
    resource variable without copying it (the caller's later writes to the
    array then show in the variable) and copies any other: the test fixes the
    alignment so that plain and instrumented runs see the same TF behaviour."""
    values = np.asarray(values, np.float32)
    raw = np.empty(values.nbytes + 128, np.uint8)
    start = (-raw.ctypes.data) % 64 + offset
    array = raw[start:start + values.nbytes].view(np.float32)
    array[:] = values
    return array


@pytest.mark.parametrize("offset", [0, 4], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("inside", [True, False])
def test_a_fed_value_assigned_to_a_variable_is_shared_with_the_callers_array_as_plain(
        inside, offset):
    """A variable assigned from a feed holds what a plain session's would
    when the caller later changes the array it fed, inside and after scopes:
    amanda's buffer sharing between the user's session and its shadow neither
    adds nor removes an alias (the aligned case aliases in plain TF, the
    other does not)."""
    def run(tool):
        graph = tf.Graph()
        with graph.as_default():
            value = v1.placeholder(tf.float32, [4])
            var = v1.get_variable("v", initializer=np.zeros(4, np.float32), use_resource=True)
            assign = var.assign(value)
            doubled = var * 2
            init = v1.global_variables_initializer()
        fed = _array_at(offset, np.arange(4))
        seen = []
        with v1.Session(graph=graph) as session:
            session.run(init)
            for step in range(3):
                scoped = tool is not None and (inside or step % 2)
                with amanda.apply(tool) if scoped else contextlib.nullcontext():
                    session.run(assign, {value: fed})
                fed += 100                     # the caller reuses its array
                with amanda.apply(tool) if tool is not None else contextlib.nullcontext():
                    seen.append(session.run(doubled))
                seen.append(session.run(var))
        return seen

    expected = run(None)
    got = run(Observe())
    for a, b in zip(expected, got):
        np.testing.assert_array_equal(b, a)
